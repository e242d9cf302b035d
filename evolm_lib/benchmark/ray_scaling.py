"""Ray engines against one: ``python -m evolm_lib.benchmark ray``.

Tokens per second of whole population calls (an ES generation's call: a :class:`Population` of
``--population`` rank-``--rank`` members on ``--prompts`` prompts, ``--new-tokens`` tokens each,
EOS ignored, every call a new generation's seeds) on K = 1 engine and on K engines (Ray actors, one
GPU each, or one CPU slice each without GPUs), with a profile of where a K-engine call's time goes:

- **shard alone**: the K = 1 engine running one engine's share (population / K members), so
  ``ceiling = t(K=1, whole population) / t(K=1, one share)`` is the speed-up K engines could reach
  if each ran its share as fast as one engine alone does (above K where many adapters in one batch
  are slow, below K where a small batch leaves the card idle);
- per call on K engines: the call's wall time in this process, each engine's own time in its actor
  (``engine_call_s``: slot writes from seeds and decoding), the slowest of them, and the rest
  (``transport_s``: splitting, the object store, sending, waiting, putting tables back together);
- ``engines_slowdown = slowest engine / shard alone``: what running side by side costs each engine
  (the host's CPUs, PCIe, scheduling).

So ``speed-up = ceiling / engines_slowdown / (1 + transport share)``, up to rounding: the table
shows which factor loses. Medians of ``--repeats`` calls after one warm-up call.

GPU (4 cards, vLLM and Ray staged)::

    python -m evolm_lib.benchmark ray --model "$(python scripts/qwen_shape.py | tail -n 1)" \
        --engines 1,2,4 --population 64,128 --json ray.json

CPU check (tiny-random, each engine one CPU)::

    python -m evolm_lib.benchmark ray --model tiny-random --population 4 --prompts 2 --new-tokens 4 \
        --engines 1,2 --repeats 1 --kv-cache-gb 0.25 --max-model-len 256
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from ..env import apply_engine_defaults
from . import int_list
from ..throughput import ThroughputSpec, bench_prompts, machine_info, mean_adapter, population_of, start_engine


def profile_calls(engine, spec: ThroughputSpec) -> dict[str, Any]:
    """Median wall time and tokens/s of ``spec.repeats`` population calls after a short warm-up, and
    (Ray engines) each call's split into the engines' own time and the rest."""
    from ..engines import SamplingSettings

    prompts = bench_prompts(spec.prompts)
    mean = mean_adapter(spec)
    sampling = SamplingSettings(max_new_tokens=spec.new_tokens, ignore_eos=True)
    warmup = SamplingSettings(max_new_tokens=min(spec.warmup_tokens, spec.new_tokens), ignore_eos=True)
    engine.generate(prompts, population_of(spec, mean, 0), warmup)
    calls = []
    for generation in range(1, spec.repeats + 1):
        started = time.perf_counter()
        table = engine.generate(prompts, population_of(spec, mean, generation), sampling)
        wall = time.perf_counter() - started
        call = {"wall_s": wall, "tokens": table.num_tokens}
        last = engine.last_call
        if last:
            engines = [timing.get("engine_call_s", 0.0) for timing in last["engines"].values()]
            call.update(engines_s=engines, slowest_engine_s=max(engines), mean_engine_s=statistics.fmean(engines),
                        put_s=last["put_s"], transport_s=max(wall - max(engines), 0.0),
                        slowest_adapters_s=max(t.get("adapters_s", 0.0) for t in last["engines"].values()))
        calls.append(call)
    wall = statistics.median(c["wall_s"] for c in calls)
    tokens = statistics.median_low(c["tokens"] for c in calls)
    row: dict[str, Any] = {"population": spec.population, "seconds": wall, "tokens": tokens, "tok_s": tokens / wall,
                           "calls": calls}
    for key in ("slowest_engine_s", "mean_engine_s", "transport_s", "put_s", "slowest_adapters_s"):
        if all(key in c for c in calls):
            row[key] = statistics.median(c[key] for c in calls)
    return row


def scaling_rows(measured: dict[tuple[int, int], dict], shards: dict[tuple[int, int], dict]) -> list[dict[str, Any]]:
    """One row per (population, K) measured: tokens/s, the speed-up over K = 1 and its factors (the
    module docstring). ``measured[(population, K)]``: the K-engine call's profile;
    ``shards[(population, K)]``: the K = 1 engine on one share of that population."""
    rows = []
    for (population, k), row in sorted(measured.items()):
        one = measured.get((population, 1))
        out = {"population": population, "engines": k, "tok_s": row["tok_s"], "seconds": row["seconds"]}
        if one is not None:
            out["speedup"] = row["tok_s"] / one["tok_s"]
        shard = shards.get((population, k))
        if one is not None and shard is not None:
            out["shard_alone_s"] = shard["seconds"]
            out["ceiling"] = one["seconds"] / shard["seconds"]
        if "slowest_engine_s" in row:
            out["slowest_engine_s"] = row["slowest_engine_s"]
            out["transport_s"] = row["transport_s"]
            out["transport_share"] = row["transport_s"] / row["slowest_engine_s"] if row["slowest_engine_s"] else None
            out["imbalance_s"] = row["slowest_engine_s"] - row["mean_engine_s"]
            if shard is not None:
                out["engines_slowdown"] = row["slowest_engine_s"] / shard["seconds"]
        rows.append(out)
    return rows


def format_scaling(rows: Sequence[dict[str, Any]]) -> str:
    """The table: per population and K, tokens/s, speed-up, ceiling and the losses."""
    def num(value, form):
        return "-" if value is None else format(value, form)

    lines = [f"{'population':>10} {'K':>2} {'tok/s':>10} {'speed-up':>9} {'ceiling':>8} {'engines slower':>15} "
             f"{'transport':>10} {'imbalance':>10}"]
    for r in rows:
        lines.append(f"{r['population']:>10} {r['engines']:>2} {r['tok_s']:>10,.0f} {num(r.get('speedup'), '.2f'):>9} "
                     f"{num(r.get('ceiling'), '.2f'):>8} {num(r.get('engines_slowdown'), '.2f'):>15} "
                     f"{num(r.get('transport_share'), '.1%'):>10} {num(r.get('imbalance_s'), '.3f'):>10}")
    lines.append("(speed-up over K=1; ceiling: K=1 on the whole population / K=1 on one share; engines slower: the "
                 "slowest engine's own time / one share alone; transport: the call's time beyond the slowest engine, "
                 "as a share of it; imbalance: slowest - mean engine, seconds)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure, print the table, optionally write JSON; returns the results."""
    parser = argparse.ArgumentParser(prog="python -m evolm_lib.benchmark ray", description=__doc__.split("\n\n")[0],
                                     epilog="See the module docstring (docs: Measurements) for the profile's terms.")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name or folder (every engine resolves it)")
    parser.add_argument("--engines", default="1,2,4", help="engine counts (those beyond the cluster are skipped)")
    parser.add_argument("--population", default="64", help="members per call, comma-separated (e.g. 64,128)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--sigma", type=float, default=1e-3)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per setting, after one warm-up call")
    parser.add_argument("--dtype", default=None, help="engine dtype (default: bfloat16 with GPUs, float32 without)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gb", type=float, default=None, help="per engine (default: vLLM's share on a GPU)")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--noise-device", default=None, choices=["cpu", "cuda"],
                        help="where each engine draws its members' noise (default: cuda with GPUs)")
    parser.add_argument("--ray-address", default=None, help="a running cluster (default: a local one)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    counts = int_list(parser, args.engines, "engines")
    populations = int_list(parser, args.population, "population")
    for name in ("prompts", "new_tokens", "rank", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")

    apply_engine_defaults()
    import ray

    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=False)
    try:
        resources = ray.cluster_resources()
        gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
        capacity = gpus or cpus
        skipped = sorted(k for k in counts if k > capacity)
        for k in skipped:
            print(f"skipped K={k}: the cluster holds {capacity} {'GPUs' if gpus else 'CPUs'}", flush=True)
        counts = sorted({1, *(k for k in counts if k <= capacity)})
        bad = [(p, k) for p in populations for k in counts if p % k]
        if bad:
            parser.error(f"--population must split evenly over every engine count (shares of equal size); not {bad}")
        noise_device = args.noise_device or ("cuda" if gpus else "cpu")
        options = dict(dtype=args.dtype or ("bfloat16" if gpus else "float32"), max_model_len=args.max_model_len,
                       kv_cache_gb=args.kv_cache_gb, **({"enforce_eager": True} if args.eager else {}))

        def spec(population: int) -> ThroughputSpec:
            return ThroughputSpec(model=args.model, population=population, prompts=args.prompts,
                                  new_tokens=args.new_tokens, rank=args.rank, sigma=args.sigma,
                                  noise_device=noise_device, repeats=args.repeats)

        measured: dict[tuple[int, int], dict] = {}
        shards: dict[tuple[int, int], dict] = {}
        starts: dict[int, float] = {}
        cards: dict[int, list[str]] = {}
        for k in counts:
            engine = start_engine(spec(max(populations)), "ray", num_engines=k, **options)
            try:
                starts[k] = engine.start_seconds
                cards[k] = [f"{i['device']}@{i['host']}" for i in engine.engine_info]
                for population in populations:
                    measured[(population, k)] = profile_calls(engine, spec(population))
                    print(f"population {population}, K={k}: {measured[(population, k)]['tok_s']:,.0f} tok/s", flush=True)
                    if k == 1:  # one engine on each share the larger counts give their engines
                        for other in counts[1:]:
                            shards[(population, other)] = profile_calls(engine, spec(population // other))
            finally:
                engine.close()
    finally:
        ray.shutdown()
    rows = scaling_rows(measured, shards)
    print(f"\n{args.model}: population x {args.prompts} prompts x {args.new_tokens} new tokens, rank {args.rank}, "
          f"noise on {noise_device}, median of {args.repeats} calls; engines started in "
          f"{', '.join(f'K={k}: {s:.0f} s' for k, s in starts.items())}; cards {sorted({c for v in cards.values() for c in v})}")
    print(format_scaling(rows))
    result = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "machine": machine_info(), "skipped": skipped, "start_s": starts, "cards": cards, "rows": rows,
              "measured": [{"engines": k, **row} for (p, k), row in sorted(measured.items())],
              "shards_alone": [{"engines": k, **row} for (p, k), row in sorted(shards.items())]}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return result
