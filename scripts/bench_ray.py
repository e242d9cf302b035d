"""Throughput of an ES population sharded over K vLLM engines (Ray actors, one GPU each) against one
engine: tokens per second of whole population calls, for K = 1, 2, 4 (those the cluster holds).

Each call is what an ES generation asks of the engines: a Population (mean adapter + seeds) of
`--population` rank-`--rank` LoRA members on `--prompts` prompts, `--new-tokens` tokens each with EOS
ignored, greedy; the engines regenerate the members' noise themselves. The measurement is
``evolm_lib.throughput``'s ``in_place`` path: a call's time is measured in this process, from
submission to the last shard's completions (noise, adapter loading, decoding, transport), median of
`--repeats` calls after a short warm-up, every call a new generation's seeds, as ES does.
`--in-process` also measures one engine in this process without Ray (last, once the actors have
released their GPUs). `--model qwen-shape`: Qwen2.5-1.5B's shapes, random weights (scripts/qwen_shape.py).

GPU (the lent multi-GPU machine, vLLM and Ray staged as GPU.md says):
    python scripts/bench_ray.py --engines 1,2,4 [--qwen-shape] [--eager] [--json ray.json]
CPU check (tiny-random, a few seconds of decoding; each engine takes one CPU):
    python scripts/bench_ray.py --model tiny-random --population 8 --prompts 2 --new-tokens 8 \
        --engines 1,2 --repeats 1 --kv-cache-gb 0.25 --max-model-len 256
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from evolm_lib.env import apply_engine_defaults


def measure(evaluator, model: str, args, engine: str) -> dict:
    """Tokens/s of population calls (the library's ``in_place`` path; see the module docstring)."""
    from evolm_lib.throughput import ThroughputSpec, measure_throughput

    spec = ThroughputSpec(model=model, population=args.population, prompts=args.prompts, new_tokens=args.new_tokens,
                          rank=args.rank, sigma=args.sigma, noise_device=args.noise_device, repeats=args.repeats)
    (row,) = measure_throughput(evaluator, spec, ("in_place",), engine)
    return {"tok_s": row["tokens_per_s"], "tokens_per_call": row["tokens"],
            "adapters_s": row["timing"].get("adapters_s", 0.0), "calls": row["calls"]}


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

    from evolm_lib.throughput import ThroughputSpec, start_engine

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

    if args.qwen_shape or args.model == "qwen-shape":
        from qwen_shape import build_qwen_shape  # scripts/, this script's folder

        qwen = [str(build_qwen_shape())]
    else:
        qwen = []
    models = ([] if args.model == "qwen-shape" else [args.model]) + qwen
    options = dict(dtype=dtype, max_model_len=args.max_model_len, kv_cache_gb=args.kv_cache_gb,
                   adapter_transfer=args.adapter_transfer, **({"enforce_eager": True} if args.eager else {}))
    results = []
    for model in models:
        sizes = ThroughputSpec(model=model, population=args.population, rank=args.rank)  # what the engines are sized for
        for k in counts:
            evaluator = start_engine(sizes, "ray", num_engines=k, **options)
            try:
                row = {"model": model, "path": "ray", "engines": k, "start_s": evaluator.start_seconds,
                       "cards": [f"{i['device']}@{i['host']}" for i in evaluator.engine_info],
                       **measure(evaluator, model, args, "ray")}
            finally:
                evaluator.close()
            results.append(row)
            save(args, driver_card, results)  # a later setting that runs out of time keeps this one
            print(f"{Path(model).name} K={k}: {row['tok_s']:,.0f} tok/s ({row['tokens_per_call']} tokens a call, "
                  f"engines started in {row['start_s']:.0f} s) on {', '.join(row['cards'])}", flush=True)
        if args.in_process:
            evaluator = start_engine(sizes, "local", **options)
            try:
                row = {"model": model, "path": "in-process", "engines": 1, "start_s": evaluator.start_seconds,
                       "cards": [driver_card], **measure(evaluator, model, args, "vllm")}
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
