"""Throughput of a LoRA population on one machine: vLLM multi-LoRA vs the base model vs HF + peft.

Measures, in one process and one run, with ``evolm_lib.throughput`` (the library's one throughput
measurement), tokens per second of

(a) vLLM population in place: N members x M prompts in ONE engine call (fixed output length, EOS
    ignored), the members written into resident LoRA slots from their seeds, as ES does;
(b) vLLM population as files: the same members made on the host and loaded as adapter files;
(c) vLLM base model: the same N*M requests without adapters, on the same engine;
(d) HF batched base model: the N*M requests in one batch (optional);
(e) HF + peft member by member: one adapter at a time, its M prompts batched (the paper's reference
    code does this; optional).

Each path is warmed up once (a short call with the same requests) before it is timed; engine start
and model load are reported separately. Members are rank-``--rank`` LoRAs on all 7 projections
around a PEFT-default mean (B = 0), each timed call a new generation's seeds. Prefix caching is
off, so repeated base prompts do not get a prefill discount the population lacks.

``--es-overhead`` instead measures, for one ES generation at population 30: noise generation +
perturbation, writing every adapter (``save_adapter`` to /dev/shm), and an ES update
(``es.es_gradient`` + ``es.apply_update``), against the generation time of one population call.

Examples::

    evolm bench                         # SmolLM2, 8 members x 4 prompts x 32 tokens
    evolm bench --model tiny-random --population 4 --prompts 2 --new-tokens 8 --no-hf
    evolm bench --es-overhead           # population 30 on SmolLM2
    evolm bench --repeats 3 --json results/throughput.json

On a busy machine OpenMP threads that spin while waiting slow HF generation down many times over,
so the command makes them sleep (``OMP_WAIT_POLICY=PASSIVE``, ``evolm_lib.env``) unless the environment
says otherwise.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Sequence

from ..env import apply_engine_defaults
from ..throughput import (
    ThroughputSpec, format_throughput, load_average, measure_es_overhead, measure_throughput, ratios, throughput_report,
)


def spec_of(args: argparse.Namespace) -> ThroughputSpec:
    """The measurement the options describe (members' noise on the GPU where there is one)."""
    import torch

    return ThroughputSpec(model=args.model, population=args.population, prompts=args.prompts, new_tokens=args.new_tokens,
                          rank=args.rank, repeats=args.repeats, noise_device="cuda" if torch.cuda.is_available() else "cpu")


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Measure paths (a)-(e) and return the report (rows, ratios, machine)."""
    from ..engines.hf_engine import HFEvaluator

    spec = spec_of(args)
    report = throughput_report(spec, ("in_place", "files", "base"), max_model_len=args.max_model_len)
    if args.hf and (args.hf_batched_base or args.hf_member_by_member):
        started = time.perf_counter()
        hf = HFEvaluator(spec.model, batch_size=spec.prompts)
        report["hf_load_s"] = time.perf_counter() - started
        try:
            if args.hf_batched_base:  # before any adapter, while the model is not wrapped by peft
                hf.batch_size = spec.requests
                report["rows"] += measure_throughput(hf, spec, ("base",), engine="hf")
            if args.hf_member_by_member:
                hf.batch_size = spec.prompts
                report["rows"] += measure_throughput(hf, spec, ("files",), engine="hf")
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
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="evolm bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="known name, model folder or hub name")
    parser.add_argument("--population", type=int, default=None, help="adapters per call (default 8; 30 with --es-overhead)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per adapter")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request (EOS ignored)")
    parser.add_argument("--rank", type=int, default=1, help="LoRA rank of every adapter")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per path (the median is reported)")
    parser.add_argument("--max-model-len", type=int, default=512, help="vLLM context length")
    parser.add_argument("--hf-member-by-member", action=argparse.BooleanOptionalAction, default=True,
                        help="time HF + peft one adapter at a time")
    parser.add_argument("--hf-batched-base", action=argparse.BooleanOptionalAction, default=True,
                        help="time HF on the base model with all requests in one batch")
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip every HF path")
    parser.add_argument("--es-overhead", action="store_true", help="measure ES bookkeeping vs one generation instead")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.population is None:
        args.population = 30 if args.es_overhead else 8
    for name in ("population", "prompts", "new_tokens", "rank", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, optionally write JSON; returns the result dict."""
    args = parse_args(argv)
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
