"""Full-parameter ES on a large model: the memory plan of a card against what the card holds, and a
generation's time: ``python -m evolm_lib.benchmark full-memory``.

One vLLM engine in this process serves the model (``--model``: a folder, e.g. one that
``scripts/qwen_shape.py --shape 7b`` builds with random weights); the run's resident weights keep
the float32 master beside it (``noise_scheme`` tiled: members written and the update applied weight
by weight). It prints the plan's terms (``engines.memory_plan``) beside what the busiest card holds after
the engine starts, after the master is made, and at the peak of ``--generations`` generations of
``--population`` members (each written in place, its prompts decoded, the mean restored; then the
update), and each generation's seconds split into writes, decoding, restores and the update.

Memory is read from the card (``torch.cuda.mem_get_info``: every process's use, this one's CUDA
context included) and from torch's allocator (``max_memory_allocated``: the engine's weights, KV
cache and activations, and the master), so the plan's allowance shows against both.

Examples::

    python -m evolm_lib.benchmark full-memory --model tiny-random --population 2 --prompts 1 --new-tokens 4
    python -m evolm_lib.benchmark full-memory --model DIR --gpu-memory-utilization 0.35 --json full_memory.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Sequence

GIB = 2**30


def _card_used() -> int | None:
    """Bytes in use on the busiest visible card (every process: a tensor-parallel engine's ranks
    each hold their card), or None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return max(total - free for free, total in (torch.cuda.mem_get_info(i) for i in range(torch.cuda.device_count())))


def _allocated_peak() -> int | None:
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the engine, make the master, run the generations; returns what was measured."""
    from .. import es
    from ..engines.base import SamplingSettings
    from ..engines.memory_plan import ModelShape, PlanSettings, memory_plan
    from ..engines.sizing import EngineSizing
    from ..engines.vllm.engine import VLLMEngine
    from ..engines.weights.vllm import EngineWeights
    from ..models import resolve_model
    from ..throughput import machine_info

    model_dir = resolve_model(args.model)
    sequences = args.prompts
    settings = PlanSettings(mode="full", dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
                            population=args.population, optimizer=args.optimizer, noise_scheme=args.noise_scheme,
                            sequences=sequences, max_model_len=args.max_model_len, target_modules="all")
    plan = memory_plan(ModelShape.of(model_dir), settings)
    if args.kv_cache_gb is not None:  # the engine's KV cache is the size asked for, not the sequences' need
        plan = dataclasses.replace(plan, kv_cache=int(args.kv_cache_gb * GIB))
    report: dict[str, Any] = {"machine": machine_info(), "model": str(model_dir), "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
                              | {"model": str(model_dir)},
                              "plan": {**plan.terms(), "total": plan.total}, "measured": {}, "generations": []}
    measured = report["measured"]
    measured["before_engine"] = _card_used()
    sizing = EngineSizing(max_loras=1, max_lora_rank=1, max_model_len=args.max_model_len, dtype=args.dtype,
                          gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_gb=args.kv_cache_gb,
                          adapter_transfer="in_place", es_mode="full", largest_batch=sequences,
                          tensor_parallel_size=args.tensor_parallel_size)
    started = time.perf_counter()
    engine = VLLMEngine(str(model_dir), sizing)
    try:
        measured["engine_start_s"] = time.perf_counter() - started
        measured["after_engine"], measured["allocated_after_engine"] = _card_used(), _allocated_peak()
        weights = EngineWeights(engine.llm, model_dir, "all", noise="full", noise_scheme=args.noise_scheme)
        measured["after_master"], measured["allocated_after_master"] = _card_used(), _allocated_peak()
        measured["moved_values"] = weights.info["values"]
        prompts = [f"Problem {i}: add {i} and {2 * i + 1}." for i in range(args.prompts)]
        sampling = SamplingSettings(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        optimizer = es.AdamConfig(1e-4) if args.optimizer == "adam" else es.SGDConfig(1e-4)
        peak = 0
        for generation in range(args.generations):
            members = es.population(0, generation, args.population)
            times = {"write_s": 0.0, "generate_s": 0.0, "restore_s": 0.0}
            started = time.perf_counter()
            for member in members:
                times["write_s"] += weights.write_member(member, args.sigma)
                began = time.perf_counter()
                engine.generate(prompts, [None], sampling)
                times["generate_s"] += time.perf_counter() - began
                times["restore_s"] += weights.restore()
                peak = max(peak, _card_used() or 0)
            step = weights.step(optimizer, members, [float(i % 3) - 1.0 for i in range(len(members))], args.sigma)
            peak = max(peak, _card_used() or 0)
            times.update(update_s=step["update_s"], generation_s=time.perf_counter() - started,
                         tokens=len(members) * len(prompts) * args.new_tokens)
            report["generations"].append(times)
            if args.json:  # after every generation: a command stopped early keeps what it measured
                _write(args.json, report)
        measured["peak"], measured["allocated_peak"] = peak or None, _allocated_peak()
        weights.close()
    finally:
        engine.close()
    if args.json:
        _write(args.json, report)
    return report


def _write(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))


def format_full_memory(report: dict[str, Any]) -> str:
    """The plan's terms, the card's memory at each point, and each generation's seconds."""
    def gib(value):
        return "-" if value is None else f"{value / GIB:.2f}"
    plan, measured = report["plan"], report["measured"]
    lines = [f"model {report['model']}: full-parameter ES, {measured.get('moved_values', 0):,} moved values held "
             "(over the cards, a slice held by several counted on each), "
             f"tensor_parallel_size {report['settings']['tensor_parallel_size']}, noise_scheme {report['settings']['noise_scheme']}",
             "plan a card (GiB): " + ", ".join(f"{name} {gib(value)}" for name, value in plan.items())]
    lines.append("card in use (GiB): " + ", ".join(
        f"{name} {gib(measured.get(name))}" for name in ("before_engine", "after_engine", "after_master", "peak")))
    lines.append("torch's allocator (GiB): " + ", ".join(
        f"{name} {gib(measured.get(name))}" for name in ("allocated_after_engine", "allocated_after_master", "allocated_peak")))
    if measured.get("peak") and measured.get("before_engine") is not None:
        lines.append(f"peak over the plan: {(measured['peak'] - measured['before_engine']) / plan['total']:.3f}")
    for index, times in enumerate(report["generations"]):
        lines.append(f"generation {index}: {times['generation_s']:.2f} s (writes {times['write_s']:.2f}, decoding "
                     f"{times['generate_s']:.2f}, restores {times['restore_s']:.2f}, update {times['update_s']:.2f}), "
                     f"{times['tokens'] / times['generate_s']:.0f} tok/s while decoding")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse the options, measure, print; returns the report."""
    parser = argparse.ArgumentParser(prog="python -m evolm_lib.benchmark full-memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-random", help="known name or model folder")
    parser.add_argument("--population", type=int, default=8, help="members of a generation (antithetic pairs)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts each member decodes")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per prompt (EOS ignored)")
    parser.add_argument("--generations", type=int, default=2, help="generations timed")
    parser.add_argument("--sigma", type=float, default=1e-3, help="noise scale")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--noise-scheme", choices=("tiled", "flat", "per_tensor"), default="tiled")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="the engine's share of the card (weights, KV cache); the master comes beside it")
    parser.add_argument("--kv-cache-gb", type=float, default=None, help="a fixed KV cache instead of a share")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    for name in ("population", "prompts", "new_tokens", "generations", "tensor_parallel_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.population % 2:
        parser.error("--population must be even (antithetic pairs)")
    report = run(args)
    print(format_full_memory(report), flush=True)
    return report
