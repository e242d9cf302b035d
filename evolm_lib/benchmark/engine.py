"""The engine and ES benchmark in one run: ``python -m evolm_lib.benchmark engine`` (the default).

1. Throughput on one vLLM engine (``evolm_lib.throughput``, the measurement ``evolm bench`` makes,
   HF paths left out): the base model, a population of N rank-r members written in place into
   resident slots, and the same members as adapter files; tokens/s and the ratios to the base model.
2. ES generations (``ESRun`` on the conciseness task, the demo's settings): through resident slots
   with the mean's greedy scoring riding in the population call (the default), with a scoring call of
   its own, and through adapter files. Each generation's time is split into noise + slot writes (or
   adapter files), engine, reward and update (medians after the first generation, which sets the
   slots up); the ES overhead is noise + slot writes + update as a share of the generation.

Examples::

    python -m evolm_lib.benchmark                                   # SmolLM2; population 32 on a GPU, 8 on a CPU
    python -m evolm_lib.benchmark --model tiny-random --population 4 --generations 3 --prompts 2 --new-tokens 8
    python -m evolm_lib.benchmark --json results/benchmark.json

Speed targets are read from these ratios on a named machine (the README), never asserted by tests.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any, Sequence

from ..env import apply_engine_defaults
from . import add_population_options, check_population_options
from ..throughput import KNOWN_PATHS, ThroughputSpec, format_throughput, throughput_report

VARIANTS = {  # label -> ESConfig changes
    "in_place": {"adapter_transfer": "in_place"},
    "in_place_own_scoring_call": {"adapter_transfer": "in_place", "score_in_population": False},
    "files": {"adapter_transfer": "files"},
}
PHASES = ("adapters_s", "adapters/slots_write_s", "generate_s", "reward_s", "update_s", "eval_s", "generation_s")


def es_generations(model: str, population: int, generations: int, variants: Sequence[str] = tuple(VARIANTS),
                   new_tokens: int = 64, workdir: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """Median phase times of ES generations per variant, on one shared engine (see the module docstring)."""
    import torch

    from ..config import ESConfig
    from ..engines import make_engine
    from ..train.es import ESRun

    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if generations < 2:
        raise ValueError(f"generations must be >= 2 (the first sets the slots up), got {generations}")
    gpu = torch.cuda.is_available()
    # the demo's settings (papermill_runs/conciseness_smollm2_cpu.yaml) at this population
    config = ESConfig(model=model, task="conciseness", population_size=population, sigma=0.05, learning_rate=0.4,
                      lora_rank=1, max_new_tokens=new_tokens, max_model_len=512, num_generations=generations,
                      dtype="bfloat16" if gpu else "float32", noise_device="cuda" if gpu else "cpu",
                      kv_cache_gb=None if gpu else 0.25, eval_every=1)
    engine = make_engine(config)  # in_place: the variants switch the transfer on the engine below
    folder = Path(tempfile.mkdtemp(prefix="evolm-benchmark-", dir=workdir))
    result: dict[str, dict[str, Any]] = {}
    try:
        for label in variants:
            changes = VARIANTS[label]
            engine.adapter_transfer = changes["adapter_transfer"]
            run = ESRun.create(config.replace(**changes), folder / label, engine=engine)
            rows = run.run()[1:]  # the first generation sets the slots up and warms the engine
            median = {key.split("/")[-1]: statistics.median(r.get(f"time/{key}", 0.0) for r in rows) for key in PHASES}
            median["es_overhead_s"] = median["adapters_s"] + median["update_s"]
            median["es_overhead_of_generation"] = median["es_overhead_s"] / median["generation_s"]
            median["tokens_per_generation"] = statistics.median(
                b["samples/tokens"] - a["samples/tokens"] for a, b in zip(rows, rows[1:])) if len(rows) > 1 else None
            median["train_reward"] = [rows[0].get("policy/train_reward"), rows[-1].get("policy/train_reward")]
            result[label] = median
    finally:
        engine.close()
        shutil.rmtree(folder, ignore_errors=True)
    return result


def format_es_generations(result: dict[str, dict[str, Any]]) -> str:
    """One line per variant: the phases in milliseconds and the ES overhead share."""
    lines = [f"{'ES generation':<27}{'total':>8}{'slots/files':>12}{'engine':>8}{'reward':>8}{'update':>8}"
             f"{'scoring':>9}{'overhead':>10}"]
    for label, m in result.items():
        lines.append(f"{label:<27}{m['generation_s'] * 1e3:8.0f}{m['adapters_s'] * 1e3:12.1f}{m['generate_s'] * 1e3:8.0f}"
                     f"{m['reward_s'] * 1e3:8.1f}{m['update_s'] * 1e3:8.1f}{m['eval_s'] * 1e3:9.0f}"
                     f"{100 * m['es_overhead_of_generation']:9.2f}%")
    lines.append("(milliseconds, medians; overhead = noise + slot writes or files + update, over the generation)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run both parts, print them, optionally write JSON; returns the results."""
    import torch

    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="python -m evolm_lib.benchmark engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="known name or model folder")
    add_population_options(parser, gpu, (8, 4, 32), "throughput: LoRA rank")
    parser.add_argument("--generations", type=int, default=10 if gpu else 4, help="ES generations per variant")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"ES variants, from {list(VARIANTS)}")
    parser.add_argument("--paths", default="in_place,files,base",
                        help="throughput paths, from in_place, files, base, eggroll, full (es_mode eggroll's and full's populations)")
    parser.add_argument("--weight-modes", action="store_true",
                        help="also time es_mode full's member write and restore and EGGROLL's update on the engine")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    check_population_options(parser, args)
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        parser.error(f"--variants must name some of {list(VARIANTS)}")
    paths = [p for p in args.paths.split(",") if p]
    if not paths or any(p not in KNOWN_PATHS for p in paths):
        parser.error(f"--paths must name some of {list(KNOWN_PATHS)}, got {args.paths!r}")
    apply_engine_defaults()
    spec = ThroughputSpec(model=args.model, population=args.population, prompts=args.prompts, new_tokens=args.new_tokens,
                          rank=args.rank, noise_device="cuda" if gpu else "cpu")
    throughput = throughput_report(spec, paths, max_model_len=512, weight_modes=args.weight_modes)
    print(format_throughput(throughput), flush=True)
    generations = es_generations(args.model, args.population, args.generations, variants)
    print(format_es_generations(generations))
    result = {"throughput": throughput, "es_generations": generations}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return result

