"""An engine's start with vLLM's CUDA-graph sizes against the sizes a run uses: ``python -m
evolm_lib.benchmark engine-start``.

vLLM captures a CUDA graph for every batch size up to 512 (51 sizes, each with and without LoRA) when
it starts; a run's engine asks only for the powers of two below its largest call and the call itself
(``engines.sizing.cudagraph_capture_sizes``). This starts an engine of a population's size each way,
one after the other in this process (the first closed before the second starts; ``--capture``
picks one for a process of its own), and prints the seconds ``vllm.LLM`` took and their ratio, then a
short throughput check on each (the base model and the population in place, N members x M prompts x
T new tokens), so a slower decode would show. The derived engine starts first: a second start in
one process finds the compiled graphs in vLLM's cache, which favours the default sizes.

On a CPU there are no CUDA graphs: both engines start eager and the comparison only exercises the
code path (the output says so).

Examples::

    python -m evolm_lib.benchmark engine-start --model tiny-random --population 4 --prompts 2 --new-tokens 8
    python -m evolm_lib.benchmark engine-start --model DIR --capture default --json default.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

from ..env import apply_engine_defaults
from . import add_population_options, check_population_options
from ..throughput import ThroughputSpec, machine_info, measure_throughput, ratios, start_engine

CAPTURES = ("derived", "default")


def start_and_check(spec: ThroughputSpec, capture: str, max_model_len: int = 512) -> dict[str, Any]:
    """Start an engine for the spec's population with ``capture`` graph sizes, time a short
    throughput check on it, close it; returns its start seconds, capture sizes and rows."""
    largest = spec.requests if capture == "derived" else None  # None: vLLM's default sizes
    engine = start_engine(spec, max_model_len=max_model_len, largest_batch=largest)
    try:
        rows = measure_throughput(engine, spec, ("base", "in_place"))
        return {"capture": capture, "start_s": engine.start_seconds, "cudagraph_capture_sizes": engine.cudagraph_capture_sizes,
                "lora_kernel_configs": engine.lora_kernel_configs,
                "rows": [{k: v for k, v in row.items() if k != "calls"} for row in rows], "ratios": ratios(rows)}
    finally:
        engine.close()


def compare(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Derived over default: start seconds, and each throughput path's tokens/s (where both were measured)."""
    if not all(c in results for c in CAPTURES):
        return {}
    derived, default = results["derived"], results["default"]
    out = {"start_s derived / default": derived["start_s"] / default["start_s"]}
    rates = {c: {row["path"]: row["tokens_per_s"] for row in results[c]["rows"]} for c in CAPTURES}
    out.update({f"{path} tok/s derived / default": rates["derived"][path] / rates["default"][path]
                for path in rates["derived"] if path in rates["default"]})
    return out


def format_engine_start(report: dict[str, Any]) -> str:
    """One line per engine and the ratios."""
    spec = report["spec"]
    lines = [f"model {spec['model']}: engines for {spec['population']} members (rank {spec['rank']}) x {spec['prompts']} "
             f"prompts; throughput check {spec['new_tokens']} new tokens, median of {spec['repeats']} call(s)"]
    if not report["cuda_graphs"]:
        lines.append("no GPU: no CUDA graphs, both engines start eager; this compares the code path, not the start")
    lines.append(f"{'capture':<9}{'start s':>9}{'base tok/s':>12}{'population tok/s':>18}  sizes")
    for capture, entry in report["engines"].items():
        rate = {row["path"]: row["tokens_per_s"] for row in entry["rows"]}
        sizes = entry["cudagraph_capture_sizes"]
        shown = "vLLM's default" if sizes is None else ",".join(map(str, sizes))
        if not report["cuda_graphs"]:
            shown = "(eager)"
        lines.append(f"{capture:<9}{entry['start_s']:>9.1f}{rate['base']:>12.1f}{rate['in_place']:>18.1f}  {shown}")
    lines.extend(f"{name}: {value:.2f}" for name, value in report["ratios"].items())
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Start the engines, print the comparison, optionally write JSON; returns the results."""
    import torch

    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="python -m evolm_lib.benchmark engine-start", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="known name or model folder")
    add_population_options(parser, gpu, (4, 2, 8), "LoRA rank")
    parser.add_argument("--repeats", type=int, default=2 if gpu else 1, help="throughput check: timed calls a path")
    parser.add_argument("--capture", choices=("both", *CAPTURES), default="both",
                        help="both (derived, then default, in this process) or one of them")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    check_population_options(parser, args, "repeats")
    apply_engine_defaults()
    spec = ThroughputSpec(model=args.model, population=args.population, prompts=args.prompts, new_tokens=args.new_tokens,
                          rank=args.rank, repeats=args.repeats, noise_device="cuda" if gpu else "cpu")
    captures = CAPTURES if args.capture == "both" else (args.capture,)
    engines: dict[str, dict[str, Any]] = {}
    report = {"machine": machine_info(), "spec": {**spec.__dict__}, "cuda_graphs": gpu, "engines": engines, "ratios": {}}
    for capture in captures:
        engines[capture] = start_and_check(spec, capture)
        report["ratios"] = compare(engines)
        if args.json:  # after every engine: a command stopped at a deadline keeps what it measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1))
    print(format_engine_start(report), flush=True)
    return report
