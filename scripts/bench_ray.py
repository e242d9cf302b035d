"""Throughput of an ES population sharded over K vLLM engines (Ray actors, one GPU each) against one
engine: tokens per second of whole population calls, for K = 1, 2, 4 (those the cluster holds).

Each call is what an ES generation asks of the engines: a Population (mean adapter + seeds) of
`--population` rank-`--rank` LoRA members on `--prompts` prompts, `--new-tokens` tokens each with EOS
ignored, greedy; the engines regenerate the members' noise themselves. A call's time is measured in
this process, from submission to the last shard's completions (noise, adapter loading, decoding,
transport). Every call uses a new generation's seeds, as ES does. `--in-process` also measures one
engine in this process without Ray (last, once the actors have released their GPUs).

GPU (the lent multi-GPU machine, vLLM and Ray staged as GPU.md says):
    python scripts/bench_ray.py --engines 1,2,4 [--qwen-shape] [--eager] [--json ray.json]
CPU check (tiny-random, a few seconds of decoding; each engine takes one CPU):
    python scripts/bench_ray.py --model tiny-random --population 8 --prompts 2 --new-tokens 8 \
        --engines 1,2 --repeats 1 --kv-cache-gb 0.25 --max-model-len 256
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from evolm_lib.env import apply_engine_defaults

QWEN25_15B = dict(  # Qwen2.5-1.5B's shapes; the vocabulary is SmolLM2's tokenizer's
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
)


def build_qwen_shape(out: Path) -> Path:
    """A Qwen2-architecture model with Qwen2.5-1.5B's shapes, random bfloat16 weights and SmolLM2's tokenizer."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from evolm_lib.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    config = Qwen2Config(**QWEN25_15B, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def make_population(model_dir: Path, rank: int, size: int, generation: int, sigma: float, noise_device: str = "cpu"):
    """A generation's population around a PEFT-initialised mean adapter (B = 0), as ES makes it."""
    from evolm_lib import es
    from evolm_lib.engines import Population
    from evolm_lib.lora import LoraSpec, adapter_shapes, init_adapter

    spec = LoraSpec(rank=rank, alpha=float(rank))
    mean = init_adapter(spec, adapter_shapes(model_dir, spec), "peft_default", seed=0)
    return Population(mean, tuple(es.population(0, generation, size, antithetic=True)), sigma, noise_device)


def measure(evaluator, model_dir: Path, args) -> dict:
    """Tokens/s of `--repeats` population calls after one warm-up call."""
    from evolm_lib.engines import SamplingSettings
    from evolm_lib.types import Prompt

    prompts = [Prompt.user(f"Tell me a long story about the number {i}.") for i in range(args.prompts)]
    sampling = SamplingSettings(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    calls = []
    for generation in range(args.repeats + 1):
        population = make_population(model_dir, args.rank, args.population, generation + 1, args.sigma, args.noise_device)
        started = time.perf_counter()
        table = evaluator.generate(prompts, population, sampling)
        seconds = time.perf_counter() - started
        tokens = sum(c.num_tokens for row in table for c in row)
        calls.append({"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds,
                      "adapters_s": table.timing.get("adapters_s", 0.0)})
    timed = calls[1:]  # the first call warms caches and allocators up
    return {"tok_s": statistics.median(c["tok_s"] for c in timed), "calls": calls,
            "tokens_per_call": timed[0]["tokens"], "adapters_s": statistics.median(c["adapters_s"] for c in timed)}


def save(args, driver_card: str, results: list[dict]) -> None:
    """Write the results so far to `--json`, if asked."""
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "driver_card": driver_card, "results": results}, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="model name or folder (every node resolves it); qwen-shape: only the Qwen2.5-1.5B-shaped model")
    parser.add_argument("--qwen-shape", action="store_true", help="also a random model with Qwen2.5-1.5B's shapes")
    parser.add_argument("--engines", default="1,2,4", help="engine counts to measure (those beyond the cluster's GPUs are skipped)")
    parser.add_argument("--population", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--sigma", type=float, default=1e-3)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per setting, after one warm-up call")
    parser.add_argument("--dtype", default=None, help="engine dtype (default: bfloat16 with GPUs, float32 without)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gb", type=float, default=None, help="per engine (default: vLLM's share of GPU memory; 1 GiB on CPU)")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (default: the engine's, CUDA graphs on a GPU)")
    parser.add_argument("--adapter-transfer", default="in_place", choices=["in_place", "files"],
                        help="members written into resident LoRA slots from their seeds (ES's default) or as adapter files")
    parser.add_argument("--noise-device", default=None, choices=["cpu", "cuda"],
                        help="where each engine regenerates its members' noise (default: cuda with GPUs)")
    parser.add_argument("--in-process", action="store_true", help="also one engine in this process, without Ray")
    parser.add_argument("--ray-address", default=None, help="a running cluster (default: a local one)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    apply_engine_defaults()
    import ray
    import torch

    from evolm_lib.engines.ray_engine import RayEvaluator
    from evolm_lib.models import cache_dir, resolve_model

    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=False)
    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    capacity = gpus or cpus
    dtype = args.dtype or ("bfloat16" if gpus else "float32")
    args.noise_device = args.noise_device or ("cuda" if gpus else "cpu")
    driver_card = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU in this process"
    print(f"cluster: {gpus} GPUs, {cpus} CPUs; this process: {driver_card}; dtype {dtype}", flush=True)
    wanted = [int(k) for k in args.engines.split(",")]
    counts = [k for k in wanted if k <= capacity]
    for k in sorted(set(wanted) - set(counts)):
        print(f"skipped K={k}: the cluster holds {capacity} {'GPUs' if gpus else 'CPUs'}", flush=True)

    qwen = [str(build_qwen_shape(cache_dir() / "qwen2.5-1.5b-shape-random"))] if args.qwen_shape or args.model == "qwen-shape" else []
    models = ([] if args.model == "qwen-shape" else [args.model]) + qwen
    engine_kwargs = {"adapter_transfer": args.adapter_transfer, **({"enforce_eager": True} if args.eager else {})}
    results = []
    for model in models:
        model_dir = resolve_model(model)
        for k in counts:
            evaluator = RayEvaluator(model, num_engines=k, max_lora_rank=args.rank, max_loras=args.population,
                                     max_model_len=args.max_model_len, dtype=dtype, kv_cache_gb=args.kv_cache_gb,
                                     adapter_transfer=args.adapter_transfer,
                                     vllm_options={"enforce_eager": True} if args.eager else None)
            try:
                row = {"model": model, "path": "ray", "engines": k, "start_s": evaluator.start_seconds,
                       "cards": [f"{i['device']}@{i['host']}" for i in evaluator.engine_info], **measure(evaluator, model_dir, args)}
            finally:
                evaluator.close()
            results.append(row)
            save(args, driver_card, results)  # a later setting that runs out of time keeps this one
            print(f"{Path(model).name} K={k}: {row['tok_s']:,.0f} tok/s ({row['tokens_per_call']} tokens a call, "
                  f"engines started in {row['start_s']:.0f} s) on {', '.join(row['cards'])}", flush=True)
        if args.in_process:
            from evolm_lib.engines.vllm_engine import VLLMEvaluator

            evaluator = VLLMEvaluator(model, max_lora_rank=args.rank, max_loras=args.population, max_model_len=args.max_model_len,
                                      dtype=dtype, kv_cache_gb=args.kv_cache_gb, **engine_kwargs)
            try:
                row = {"model": model, "path": "in-process", "engines": 1, "start_s": evaluator.start_seconds,
                       "cards": [driver_card], **measure(evaluator, model_dir, args)}
            finally:
                evaluator.close()
            results.append(row)
            print(f"{Path(model).name} in-process: {row['tok_s']:,.0f} tok/s", flush=True)

    print(f"\npopulation {args.population} x {args.prompts} prompts x {args.new_tokens} new tokens, rank {args.rank}, "
          f"median of {args.repeats} calls; cards: {sorted({c for r in results for c in r['cards']})}")
    print(f"{'model':<32} {'path':<11} {'K':>2} {'tok/s':>10} {'vs K=1':>7} {'vs in-process':>13}")
    for row in results:
        same = [r for r in results if r["model"] == row["model"]]
        one = next((r["tok_s"] for r in same if r["path"] == "ray" and r["engines"] == 1), None)
        local = next((r["tok_s"] for r in same if r["path"] == "in-process"), None)
        ratio = lambda base: f"{row['tok_s'] / base:.2f}" if base else "-"
        print(f"{Path(row['model']).name:<32} {row['path']:<11} {row['engines']:>2} {row['tok_s']:>10,.0f} "
              f"{ratio(one):>7} {ratio(local):>13}")
    save(args, driver_card, results)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
