"""Each ES mode against the base model, with the LoRA kernel tiles it picks, and EGGROLL's update:
``python -m evolm_lib.benchmark modes``.

1. Throughput (``evolm_lib.throughput``): the base model and each mode's population on one engine,
   N members x M prompts x T new tokens (EOS ignored), as ratios to the base model of the same engine:
   ``lora`` (rank-r adapters written into resident LoRA slots), ``eggroll`` (rank-r noise on every
   weight of the 7 projections, in LoRA slots) and ``full`` (full-rank noise written into the weights,
   member after member). vLLM reads its LoRA kernel tiles once per process, so ``--tiles`` sets them
   for the process: ``default`` (vLLM's), ``shipped`` (``engines/lora_kernel_configs``) or ``auto``
   (what each mode's run engine picks, ``startup.lora_kernel_folder``; modes that pick other tiles
   than the first mode are measured in a process of their own, one after the other, each against
   the base model on its own engine). Each row names the tiles it ran with and those its mode picks.
2. EGGROLL's update at population N: the gradient of the 7 projections' weights from the members'
   seeds, batched by weight shape (``es.lowrank.lowrank_gradient``) beside the per-matrix path it
   replaced (``lowrank_gradient_per_matrix``), medians of ``--update-repeats``, and whether the two
   give the same bits; the SGD step on a float32 master of that size, whole-vector (the update before)
   against in place (``es.apply_update_in_place``), and the bfloat16 rewrite; then the whole update on
   the engine as a run makes it (factors, gradient, SGD on the float32 master, weights rewritten:
   ``throughput.measure_weight_modes``).
   ``--interleave``: one call of each path a round instead of each path's calls together, and each
   mode's ratio to the base model of its own round (``throughput.paired_ratios``), for a base model
   bound by the host, whose speed drifts with it (docs: Measurements).
3. ``--profile``: one more call of each path under ``torch.profiler``, its kernels by category
   (LoRA kernels, attention, matmuls, sampling, other) and the share of the call the card was busy
   (``benchmark.kernels``): where a mode loses against the base model.

Examples::

    python -m evolm_lib.benchmark modes --model tiny-random --population 4 --prompts 2 --new-tokens 8
    python -m evolm_lib.benchmark modes --model DIR --tiles default --json default.json   # on one card,
    python -m evolm_lib.benchmark modes --model DIR --tiles shipped --json shipped.json   # and on another
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from ..env import apply_engine_defaults
from . import add_population_options, check_population_options, kernels
from ..throughput import (ThroughputSpec, machine_info, measure_throughput, measure_weight_modes, paired_ratios,
                          release_eggroll, start_engine)

MODE_PATHS = {"lora": "in_place", "eggroll": "eggroll", "full": "full"}
"""ES mode -> the throughput path that serves its population."""
TILES = ("auto", "default", "shipped")


def picked_tiles(mode: str, spec: ThroughputSpec, device_name: str | None) -> str | None:
    """The LoRA kernel tiles an engine of a ``mode`` run of the spec's population picks (None: vLLM's)."""
    from ..engines import EngineSizing
    from ..engines.vllm.startup import lora_kernel_folder

    sizing = EngineSizing(max_loras=spec.population + 1, max_lora_rank=spec.rank, es_mode=mode)  # members and their mean
    return lora_kernel_folder("auto", device_name, sizing)


def tile_groups(modes: Sequence[str], picks: dict[str, str | None]) -> list[list[str]]:
    """The modes grouped by the tiles they pick, in the order given (one process per group)."""
    groups: dict[str | None, list[str]] = {}
    for mode in modes:
        groups.setdefault(picks[mode], []).append(mode)
    return list(groups.values())


def time_update(model_dir: str | Path, population: int, rank: int, repeats: int, device: str,
                sigma: float = 1e-3) -> dict[str, Any]:
    """Median seconds of EGGROLL's gradient over the 7 projections' weights, batched by shape and per
    matrix, each generation's members drawn from its seeds on ``device``; and whether they agree bitwise."""
    import torch

    from ..engines.weights.resident import targeted_weight_shapes
    from .. import es
    from ..es.lowrank import lowrank_gradient, lowrank_gradient_per_matrix, shape_groups
    from ..lora import ALL_PROJECTIONS

    shapes = targeted_weight_shapes(model_dir, ALL_PROJECTIONS)
    layout = es.Layout.of(shapes)
    flat = torch.empty(layout.total, dtype=torch.float32, device=device)  # where a run's master update goes
    weights = torch.linspace(-1.0, 1.0, population)  # shaped fitness: distinct, not all zero
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(gradient, generation: int, **out) -> tuple[float, Any]:
        members = es.population(0, generation, population, antithetic=population % 2 == 0)
        sync()
        started = time.perf_counter()
        result = gradient(members, weights, shapes, rank, sigma, device=device, **out)
        sync()
        return time.perf_counter() - started, result

    grouped, per_matrix = [], []
    for generation in range(repeats + 1):  # the first warms the kernels up
        grouped.append(timed(lowrank_gradient, generation, out=layout.split(flat))[0])
        seconds, reference = timed(lowrank_gradient_per_matrix, generation)
        per_matrix.append(seconds)
    batched = layout.split(flat)  # the last generation's, beside its per-matrix reference
    equal = all(torch.equal(batched[name], reference[name]) for name in shapes)
    difference = max(float((batched[name] - reference[name]).abs().max()) for name in shapes)
    result = {"weights_values": layout.total, "matrices": len(shapes), "shape_groups": len(shape_groups(shapes)),
              "population": population, "rank": rank, "repeats": repeats, "device": device,
              "grouped_s": statistics.median(grouped[1:]), "per_matrix_s": statistics.median(per_matrix[1:]),
              "bitwise_equal": equal, "max_abs_difference": difference}
    del reference, batched
    result.update(time_optimizer(flat, layout, repeats, sync))
    del flat
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def time_optimizer(gradient, layout, repeats: int, sync, learning_rate: float = 1e-3) -> dict[str, Any]:
    """Median seconds of the rest of EGGROLL's update on a float32 master of ``layout``'s size, from
    one gradient: SGD as a whole-vector step with the norm of the masters' difference (the update
    before ``apply_update_in_place``) and in place, chunk by chunk: at the chunk runs use
    (``es.IN_PLACE_CHUNK``), a quarter of it and four times it;
    whether their masters have the same bits after the same steps; and the rewrite of bfloat16
    weights from the master."""
    import torch

    from .. import es

    optimizer = es.SGDConfig(learning_rate)
    chunks = (es.IN_PLACE_CHUNK // 4, es.IN_PLACE_CHUNK, es.IN_PLACE_CHUNK * 4)
    start = torch.randn(layout.total, generator=torch.Generator().manual_seed(0)).mul_(0.02).to(gradient.device)
    whole_state = es.init_optimizer_state(optimizer, es.FlatParams(start.clone(), layout))
    in_place_state = es.init_optimizer_state(optimizer, es.FlatParams(start, layout), copy=False)
    live = [torch.empty(shape, dtype=torch.bfloat16, device=gradient.device) for shape in layout.shapes]

    def timed(work) -> float:
        sync()
        started = time.perf_counter()
        work()
        sync()
        return time.perf_counter() - started

    def whole() -> None:
        nonlocal whole_state
        before = whole_state.master
        _, whole_state = es.apply_update(optimizer, whole_state, before, es.FlatParams(gradient, layout))
        float(torch.linalg.vector_norm(whole_state.master.flat.sub(before.flat), dtype=torch.float64))

    def in_place(chunk: int) -> None:
        nonlocal in_place_state
        in_place_state, _ = es.apply_update_in_place(optimizer, in_place_state, gradient, chunk=chunk)

    whole_s, restore_s = [], []
    in_place_s: dict[int, list[float]] = {chunk: [] for chunk in chunks}
    for _ in range(repeats + 1):  # the first warms the allocator and the kernels up
        for chunk in chunks:  # a whole-vector step for each in-place one: the masters stay comparable
            whole_s.append(timed(whole))
            in_place_s[chunk].append(timed(lambda: in_place(chunk)))
        restore_s.append(timed(lambda: torch._foreach_copy_(live, list(in_place_state.master.values()))))
    by_chunk = {str(chunk): statistics.median(seconds[1:]) for chunk, seconds in in_place_s.items()}
    return {"optimizer_whole_s": statistics.median(whole_s[len(chunks):]),
            "optimizer_in_place_s": by_chunk[str(es.IN_PLACE_CHUNK)], "optimizer_in_place_s_by_chunk": by_chunk,
            "optimizer_masters_equal": bool(torch.equal(whole_state.master.flat, in_place_state.master.flat)),
            "restore_s": statistics.median(restore_s[1:])}


def measure_modes(engine, spec: ThroughputSpec, modes: Sequence[str], weight_modes: bool = True,
                  profile: bool = False, interleave: bool = False) -> dict[str, Any]:
    """Rows of the base model and each mode's population on ``engine``, their ratios to the base
    model, and (``weight_modes``) the engine's EGGROLL update and full mode's write and restore;
    ``profile``: each row with one more call's kernels by category (``kernels.profile``);
    ``interleave``: the paths' calls in rounds (``measure_throughput``), and each mode's ratio to the
    base model of its round, every round's and their median (``paired_ratios``)."""
    rows = measure_throughput(engine, spec, ["base", *(MODE_PATHS[m] for m in modes)],
                              profile=kernels.profile if profile else None, interleave=interleave)
    release_eggroll(engine)
    by_path = {row["path"]: row for row in rows}
    ratios = {mode: by_path[MODE_PATHS[mode]]["tokens_per_s"] / by_path["base"]["tokens_per_s"] for mode in modes}
    out = {"rows": [{k: v for k, v in row.items() if k != "calls"} for row in rows], "ratios": ratios}
    if interleave:
        rounds = {mode: paired_ratios(by_path[MODE_PATHS[mode]]["calls"], by_path["base"]["calls"]) for mode in modes}
        out["paired_ratios"] = {mode: {"median": statistics.median(r), "rounds": r} for mode, r in rounds.items()}
    if weight_modes:
        out["engine_update"] = measure_weight_modes(engine, spec, repeats=spec.repeats)
    return out


def _run_group(argv: list[str], modes: list[str]) -> dict[str, Any]:
    """One tile group in a process of its own (vLLM reads the tiles once per process); its results."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "group.json"
        command = [sys.executable, "-m", "evolm_lib.benchmark", "modes", *argv, "--modes", ",".join(modes),
                   "--json", str(path), "--no-update"]
        subprocess.run(command, check=True)
        return json.loads(path.read_text())


def format_modes(result: dict[str, Any]) -> str:
    """The throughput rows with their tiles and ratios, and the update times."""
    def tiles(folder: str | None) -> str:
        return "vLLM's defaults" if folder is None else ("shipped" if folder == result["shipped_folder"] else folder)

    spec = result["spec"]
    lines = [f"model {spec['model']}: {spec['population']} members (rank {spec['rank']}) x {spec['prompts']} prompts x "
             f"{spec['new_tokens']} new tokens (EOS ignored), median of {spec['repeats']} call(s); --tiles {result['tiles']}; "
             f"GPU {result['machine'].get('gpu')}",
             f"{'mode':<10}{'tok/s':>10}{'/ base':>8}  {'tiles it ran with':<20}{'tiles auto picks':<18}engine start"]
    for mode, entry in result["modes"].items():
        rate = entry["tokens_per_s"]
        ratio = "" if mode == "base" else f"{result['ratios'][mode]:8.2f}"
        lines.append(f"{mode:<10}{rate:>10.1f}{ratio:>8}  {tiles(entry['tiles_used']):<20}"
                     f"{'' if mode == 'base' else tiles(entry['tiles_picked']):<18}{entry['engine_start_s']:.1f} s")
    for mode, paired in result.get("paired_ratios", {}).items():
        lines.append(f"{mode}: {paired['median']:.2f} of the base model of its own round, median of "
                     f"{len(paired['rounds'])} (rounds {min(paired['rounds']):.2f}-{max(paired['rounds']):.2f}; --interleave)")
    update = result.get("update")
    if update:
        lines += ["", f"EGGROLL gradient, {update['weights_values']:,} values in {update['matrices']} matrices "
                      f"({update['shape_groups']} shapes), population {update['population']}, on {update['device']}: "
                      f"batched by shape {update['grouped_s'] * 1e3:.1f} ms, per matrix {update['per_matrix_s'] * 1e3:.1f} ms "
                      f"({update['per_matrix_s'] / update['grouped_s']:.2f}x); same bits: "
                      f"{'yes' if update['bitwise_equal'] else 'no, max difference %.3g' % update['max_abs_difference']}",
                  f"EGGROLL optimizer step on the float32 master: whole vector with the difference's norm "
                  f"{update['optimizer_whole_s'] * 1e3:.1f} ms, in place {update['optimizer_in_place_s'] * 1e3:.1f} ms "
                  f"({update['optimizer_whole_s'] / update['optimizer_in_place_s']:.2f}x; by chunk: "
                  + ", ".join(f"{int(c):,} {t * 1e3:.1f} ms" for c, t in update["optimizer_in_place_s_by_chunk"].items())
                  + "); same master: "
                  f"{'yes' if update['optimizer_masters_equal'] else 'NO'}; bfloat16 rewrite {update['restore_s'] * 1e3:.1f} ms"]
    profiled = [row for row in result.get("rows", []) if "profile" in row]
    if profiled:
        lines += ["", "One more call of each path under torch.profiler (--profile):"]
        lines += [kernels.format_breakdown(row["path"], row["profile"]) for row in profiled]
    engine_update = result.get("engine_update")
    if engine_update:
        lines.append(f"EGGROLL update on the engine (factors, gradient, SGD on the float32 master, weights rewritten): "
                     f"{engine_update['eggroll_update_s'] * 1e3:.1f} ms; es_mode full: write a member "
                     f"{engine_update['full_write_s'] * 1e3:.1f} ms, restore {engine_update['full_restore_s'] * 1e3:.1f} ms")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure, print the table, optionally write JSON; returns the results."""
    import torch

    from ..engines.vllm.startup import LORA_KERNEL_CONFIGS
    from ..models import resolve_model

    gpu = torch.cuda.is_available()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m evolm_lib.benchmark modes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="known name or model folder")
    add_population_options(parser, gpu, (4, 2, 8), "LoRA rank of lora's members and EGGROLL's noise")
    parser.add_argument("--repeats", type=int, default=3 if gpu else 1, help="timed calls a path")
    parser.add_argument("--update-repeats", type=int, default=5 if gpu else 2, help="timed EGGROLL gradients a path")
    parser.add_argument("--modes", default=",".join(MODE_PATHS), help=f"ES modes, from {list(MODE_PATHS)}")
    parser.add_argument("--tiles", choices=TILES, default="auto", help="LoRA kernel tiles of this process (see above)")
    parser.add_argument("--no-update", action="store_true", help="leave EGGROLL's update timings out")
    parser.add_argument("--interleave", action="store_true",
                        help="one call of each path a round, --repeats rounds, and each mode's ratio to the base "
                             "model of its own round: for a base model whose speed moves with the host")
    parser.add_argument("--profile", action="store_true",
                        help="one more call of each path under torch.profiler: its kernels by category (lora, "
                             "attention, matmul, sampling, other) and the share of the call the card was busy")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    check_population_options(parser, args, "repeats", "update_repeats")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODE_PATHS for m in modes) or len(set(modes)) != len(modes):
        parser.error(f"--modes must name some of {list(MODE_PATHS)}, each once; got {args.modes!r}")
    apply_engine_defaults()
    model_dir = resolve_model(args.model)
    spec = ThroughputSpec(model=str(model_dir), population=args.population, prompts=args.prompts,
                          new_tokens=args.new_tokens, rank=args.rank, repeats=args.repeats,
                          noise_device="cuda" if gpu else "cpu")
    device_name = torch.cuda.get_device_name() if gpu else None
    picks = {mode: picked_tiles(mode, spec, device_name) for mode in modes}
    groups = tile_groups(modes, picks) if args.tiles == "auto" else [modes]
    folder = {"default": None, "shipped": str(LORA_KERNEL_CONFIGS), "auto": picks[groups[0][0]]}[args.tiles]
    result: dict[str, Any] = {"machine": machine_info(), "spec": {**spec.__dict__}, "tiles": args.tiles,
                              "shipped_folder": str(LORA_KERNEL_CONFIGS), "modes": {}, "ratios": {}}
    def save() -> None:  # after every part: a command stopped at a deadline keeps what it measured
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1))

    if not args.no_update:  # before the engine takes its share of the card
        result["update"] = time_update(model_dir, args.population, args.rank, args.update_repeats,
                                       "cuda" if gpu else "cpu")
        save()
    # Modes that pick other tiles: a process each (GPU only: a CPU has one group), run before this
    # process starts its engine, whose memory a closed vLLM engine does not give back to the card.
    children = []
    for group in groups[1:]:
        children.append((group, _run_group([a for a in _without_modes(argv)], group)))
    # this process: the first tile group, on one engine of the population's size, graphs for its calls
    engine = start_engine(spec, max_model_len=512, lora_kernel_configs=folder, largest_batch=spec.requests)
    try:
        measured = measure_modes(engine, spec, groups[0], weight_modes=not args.no_update and "eggroll" in modes,
                                 profile=args.profile, interleave=args.interleave)
        used, start_s = engine.lora_kernel_configs, engine.start_seconds
        result["cudagraph_capture_sizes"] = engine.cudagraph_capture_sizes
    finally:
        engine.close()
    rows = {row["path"]: row for row in measured["rows"]}
    result["modes"]["base"] = {"tokens_per_s": rows["base"]["tokens_per_s"], "tiles_used": used, "tiles_picked": None,
                               "engine_start_s": start_s}
    for mode in groups[0]:
        result["modes"][mode] = {"tokens_per_s": rows[MODE_PATHS[mode]]["tokens_per_s"], "tiles_used": used,
                                 "tiles_picked": picks[mode], "engine_start_s": start_s,
                                 "base_tokens_per_s": rows["base"]["tokens_per_s"]}
    result["ratios"].update(measured["ratios"])
    if "paired_ratios" in measured:
        result.setdefault("paired_ratios", {}).update(measured["paired_ratios"])
    result["rows"] = measured["rows"]
    for group, child in children:
        for mode in group:
            result["modes"][mode] = child["modes"][mode]
            result["ratios"][mode] = child["ratios"][mode]
            if mode in child.get("paired_ratios", {}):
                result.setdefault("paired_ratios", {})[mode] = child["paired_ratios"][mode]
        result["rows"] += child["rows"]
    if "engine_update" in measured:
        result["engine_update"] = measured["engine_update"]
    save()
    print(format_modes(result), flush=True)
    return result


def _without_modes(argv: Sequence[str]) -> list[str]:
    """The command line without its --modes, --json and --no-update (a tile group's process gets its own)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--modes", "--json"):
            skip = True
            continue
        if arg == "--no-update" or arg.startswith(("--modes=", "--json=")):
            continue
        out.append(arg)
    return out
