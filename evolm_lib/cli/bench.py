"""`evolm bench`: tokens per second of a LoRA population on one machine, vLLM multi-LoRA against the
base model and HF + peft; or what ES bookkeeping adds to one generation."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Sequence

from ..env import apply_engine_defaults
from .help import HelpFormatter
from ..throughput import (
    ThroughputSpec, format_throughput, load_average, measure_es_overhead, measure_throughput, ratios, throughput_report,
)


HELP = """Tokens per second of a LoRA population on this machine, in one process: vLLM generating for N
members x M prompts in one call (members written into resident LoRA slots, and members loaded as
adapter files), the same requests on the base model, and HF transformers (base model batched, and
adapters one at a time, as the paper's reference code does).

    evolm bench --dry-run                      check the settings and list what would be measured; start nothing
    evolm bench --model tiny-random --population 4 --prompts 2 --new-tokens 8 --no-hf
                                               a quick measurement on the tiny test model
    evolm bench --repeats 3 --json runs/throughput.json
                                               SmolLM2, the median of three timed calls, also written as JSON

Every output has a fixed length (EOS ignored) and every path is warmed up once before it is timed;
engine start and model load are reported apart. Prefix caching is off, so repeated base prompts get
no discount the population lacks. --es-overhead instead times one ES generation's bookkeeping
(noise and perturbation, writing every adapter, the update) against its population call, at
population 30 unless --population says otherwise."""


def build_parser() -> argparse.ArgumentParser:
    """The command line of `evolm bench`."""
    parser = argparse.ArgumentParser(prog="evolm bench", description=HELP, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="known name, model folder or hub name")
    parser.add_argument("--population", type=int, default=None,
                        help="adapters per call (default: 8; 30 with --es-overhead)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per adapter")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request (EOS ignored)")
    parser.add_argument("--rank", type=int, default=1, help="LoRA rank of every adapter")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per path (the median is reported)")
    parser.add_argument("--max-model-len", type=int, default=512, help="vLLM context length")
    parser.add_argument("--hf-member-by-member", action=argparse.BooleanOptionalAction, default=True,
                        help="time HF + peft one adapter at a time")
    parser.add_argument("--hf-batched-base", action=argparse.BooleanOptionalAction, default=True,
                        help="time HF on the base model with all requests in one batch")
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip every HF path (default: time them)")
    parser.add_argument("--es-overhead", action="store_true", help="measure ES bookkeeping vs one generation instead")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the settings and print what would be measured; start no engine")
    return parser


def planned_paths(args: argparse.Namespace) -> list[str]:
    """What a run with these options measures, in words, in the order it measures them."""
    if args.es_overhead:
        return ["ES bookkeeping of one generation: noise + perturbation, writing every adapter, the update",
                "vLLM population as adapter files: one generation's engine call"]
    paths = ["vLLM population in place (members written into resident LoRA slots)",
             "vLLM population as adapter files", "vLLM base model (no adapters)"]
    if args.hf and args.hf_batched_base:
        paths.append("HF base model, every request in one batch")
    if args.hf and args.hf_member_by_member:
        paths.append("HF + peft, one adapter at a time")
    return paths


def format_plan(args: argparse.Namespace) -> str:
    """The dry run's report: the model, the requests of one timed call and the paths."""
    requests = args.population * args.prompts
    lines = [f"model {args.model}: population {args.population} (rank {args.rank}) x {args.prompts} prompts x "
             f"{args.new_tokens} new tokens = {requests} requests, {requests * args.new_tokens} tokens per timed call, "
             f"{args.repeats} timed call(s) per path after a warm-up; max_model_len {args.max_model_len}",
             "would measure:"]
    lines += [f"  {path}" for path in planned_paths(args)]
    if args.json:
        lines.append(f"results would also go to {args.json}")
    return "\n".join(lines)


def spec_of(args: argparse.Namespace) -> ThroughputSpec:
    """The measurement the options describe (members' noise on the GPU where there is one)."""
    import torch

    return ThroughputSpec(model=args.model, population=args.population, prompts=args.prompts, new_tokens=args.new_tokens,
                          rank=args.rank, repeats=args.repeats, noise_device="cuda" if torch.cuda.is_available() else "cpu")


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Measure paths (a)-(e) and return the report (rows, ratios, machine)."""
    from ..engines.hf_engine import HFEngine

    spec = spec_of(args)
    report = throughput_report(spec, ("in_place", "files", "base"), max_model_len=args.max_model_len)
    if args.hf and (args.hf_batched_base or args.hf_member_by_member):
        started = time.perf_counter()
        hf = HFEngine(spec.model, batch_size=spec.prompts)
        report["hf_load_s"] = time.perf_counter() - started
        try:
            if args.hf_batched_base:  # before any adapter, while the model is not wrapped by peft
                hf.batch_size = spec.requests
                report["rows"] += measure_throughput(hf, spec, ("base",), label="hf")
            if args.hf_member_by_member:
                hf.batch_size = spec.prompts
                report["rows"] += measure_throughput(hf, spec, ("files",), label="hf")
        finally:
            hf.close()
        report["ratios"] = ratios(report["rows"])
        report["load_after"] = load_average()
    return report


def run_es_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Time one generation's ES bookkeeping against its population generate call (members as files)."""
    spec = spec_of(args)
    overhead = measure_es_overhead(spec)
    report = throughput_report(spec, ("files",), max_model_len=args.max_model_len)
    row = report["rows"][0]
    generation = row["timing"]["generate_s"]  # decoding alone: writing the files is counted in the overhead
    return {**overhead, "machine": report["machine"], "vllm_engine_start_s": report["engine_start_s"],
            "generation_s": generation, "generation_tokens_per_s": row["tokens"] / generation,
            "overhead_percent": 100 * overhead["overhead_s"] / generation, "load_after": load_average()}


def format_es_overhead(result: dict[str, Any]) -> str:
    """The ES bookkeeping times next to the generation time."""
    mach = result["machine"]
    return "\n".join(
        [
            f"model {result['model']}: population {result['population']} (rank {result['rank']}, "
            f"{result['num_adapter_parameters']} adapter parameters) x {result['prompts']} prompts x {result['new_tokens']} tokens",
            f"machine: {mach.get('cpu', '?')}, {mach.get('cpus')} cores; load average after {result['load_after']}",
            f"noise + perturbation     {result['noise_perturb_s']:8.3f} s",
            f"write adapters (/dev/shm){result['write_adapters_s']:8.3f} s",
            f"ES update (grad + Adam)  {result['es_update_s']:8.3f} s",
            f"overhead total           {result['overhead_s']:8.3f} s",
            f"generation (one call)    {result['generation_s']:8.3f} s  ({result['generation_tokens_per_s']:.1f} tok/s)",
            f"overhead / generation    {result['overhead_percent']:8.2f} %",
        ]
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options (see ``HELP``); a bad value or an unknown model name ends with exit status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.population is None:
        args.population = 30 if args.es_overhead else 8
    for name in ("population", "prompts", "new_tokens", "rank", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_model_len < args.new_tokens:
        parser.error(f"--max-model-len {args.max_model_len} leaves no room for --new-tokens {args.new_tokens}")
    from ..models import check_model_name

    try:
        check_model_name(args.model)
    except ValueError as error:
        parser.error(f"--model: {error}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, optionally write JSON; returns the result dict."""
    args = parse_args(argv)
    if args.dry_run:
        print(format_plan(args))
        return {"dry_run": True, "paths": planned_paths(args)}
    apply_engine_defaults()
    if args.es_overhead:
        result = run_es_overhead(args)
        print(format_es_overhead(result))
    else:
        result = run_throughput(args)
        print(format_throughput(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return result
