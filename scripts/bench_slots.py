"""Micro-benchmark: a resident LoRA population written in place vs adapter files.

On one vLLM engine with resident slots, for a population of N rank-r members on every projection
and M prompts (EOS ignored, so every call makes N x M x T tokens):
  1. throughput and its split (``evolm_lib.throughput``: base, in place, files; median of
     ``--repeats`` calls, each a new generation's seeds): moving a generation's weights into the
     engine (slots written in place from the seeds, against member tensors made on the host + N
     adapter files + vLLM's reload) and decoding, and tokens/s against the base model's;
  2. agreement: the share of greedy completions the slots and the files give alike for the same
     members, next to the share two file-path calls with the same adapters give alike (how far the
     engine itself repeats). That slot weights equal the host's ``es.perturb`` tensors bit for bit
     is a test: ``pytest tests/test_vllm_slots.py -k checksums`` (run it on the GPU too).

Usage: python scripts/bench_slots.py --model tiny-random --population 4 --rank 1 --prompts 4 \
           --max-new-tokens 16 [--cuda-graphs] [--dtype bfloat16] [--noise-device cuda] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
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


def agreement(first, second) -> float:
    """Share of completions with the same token ids in two [adapter][prompt] tables."""
    pairs = [(a.token_ids, b.token_ids) for row_a, row_b in zip(first, second) for a, b in zip(row_a, row_b)]
    return sum(a == b for a, b in pairs) / len(pairs)


def main(argv=None) -> dict:
    """Measure, print both tables, optionally write JSON; returns the summary."""
    args = parse_args(argv)
    if args.engine_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # before vLLM is imported
    import torch

    from evolm_lib.engines import SamplingSettings
    from evolm_lib.throughput import (
        ThroughputSpec, bench_prompts, format_throughput, mean_adapter, population_of, start_engine, throughput_report,
    )

    on_gpu = torch.cuda.is_available()
    spec = ThroughputSpec(model=args.model, population=args.population, prompts=args.prompts, new_tokens=args.max_new_tokens,
                          rank=args.rank, alpha=args.alpha if args.alpha is not None else 2.0 * args.rank,
                          sigma=args.sigma, noise_device=args.noise_device, repeats=args.repeats)
    options = dict(dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=args.eager,
                   kv_cache_gb=args.kv_cache_gb if args.kv_cache_gb is not None else (None if on_gpu else 0.25))
    engine = start_engine(spec, **options)
    try:
        report = throughput_report(spec, ("base", "files", "in_place"), engine=engine)
        print(format_throughput(report))
        timing = {row["path"]: row["timing"] for row in report["rows"]}
        print()
        print(f"{'moving one generation of weights into the engine (medians)':<58} {'seconds':>10}")
        print(f"{'  files: member tensors on the host (es.perturb)':<58} {timing['files']['host_adapters_s']:>10.4f}")
        print(f"{'  files: writing N adapter files':<58} {timing['files']['adapters_s']:>10.4f}")
        print(f"{'  files: population generate (reload included)':<58} {timing['files']['generate_s']:>10.4f}")
        if report["adapter_transfer"] == "in_place":
            print(f"{'  slots: N slots written in place (on the worker)':<58} {timing['in_place']['slots_write_s']:>10.4f}")
            print(f"{'  slots: write call (RPC included)':<58} {timing['in_place']['slots_call_s']:>10.4f}")
            print(f"{'  slots: population generate':<58} {timing['in_place']['generate_s']:>10.4f}")
        else:
            print("  resident slots unavailable on this engine: its in-place path wrote files (see the warning)")

        # greedy completions of the same members through both paths
        greedy = SamplingSettings(max_new_tokens=spec.new_tokens)
        prompts = bench_prompts(spec.prompts)
        population = population_of(spec, mean_adapter(spec), 1)
        adapters = population.adapters()
        from_files = engine.generate(prompts, adapters, greedy)
        files_repeat = agreement(from_files, engine.generate(prompts, adapters, greedy))  # new ids, same adapters
        slots_files = agreement(engine.generate(prompts, population, greedy), from_files)
    finally:
        engine.close()
    print(f"\ngreedy completions alike, slots against files: {slots_files:.2f} (files against files, new ids: "
          f"{files_repeat:.2f})")
    summary = {**report, "eager": args.eager, "agreement": slots_files, "files_repeat_agreement": files_repeat}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
