"""The geometry of the winners' solutions, on the machine that holds their weights (Hoy, Wang & Pan
2026; the measures of ``evolm_lib.geometry``): ``python -m evolm_lib.tune.geometry STUDY_DIR OUT_DIR``.

For each chosen final seed, every method's rerun (OUT/final/<method>/seedS, or with ``--stage long``
its continuation) is read as a solution: its update's norm and the share of weights it changed, in
all, per layer and per module; the cosine between every two methods' updates at that seed. For the
pairs of the declared family (tune_summary.json's; or ``--pairs a:b,c:d``) whose ends moved the same
form (LoRA with LoRA, the model's own weights with the model's own), the held-out reward along the
straight path between the two solutions at the first chosen seed, served by one engine with the
weights written in place, and its barrier. With ``--drift-spec`` another study's spec (the
conciseness study's for addition runs, and back): each solution's KL to the base model on that
study's held-out prompts, the drift off the task trained on. A rerun whose folder holds no weights
is read from its copy under STUDY/rebuilt/<stage>/<method>/seedS where one was run again and its rows
matched the rerun's (recorded in STUDY/rebuilt/rebuilt.jsonl).
Writes OUT_DIR/geometry.json (small: summaries, no tensors; written beside a study's export,
``evolm tune report`` draws its figures).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from ..runs import read_jsonl
from .final import STAGES, SUMMARY

GEOMETRY = "geometry.json"
REBUILT_RECORD = Path("rebuilt") / "rebuilt.jsonl"


def stage_methods(study: str | Path, stage: str) -> list[str]:
    """The methods with runs in a stage's folder (STUDY/<stage>/<method>), sorted."""
    root = Path(study) / stage
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def chosen_seeds(study: str | Path, stage: str, methods: Sequence[str], seeds: Sequence[int] | None) -> list[int]:
    """``seeds``, else the first three seeds any of ``methods`` has in the stage: the solutions read."""
    root = Path(study) / stage
    available = sorted({int(p.name.removeprefix("seed")) for m in methods for p in (root / m).glob("seed*")})
    return list(seeds) if seeds else available[:3]


def solution_folder(study: str | Path, stage: str, method: str, seed: int) -> Path:
    """Where a rerun's solution is read: its own folder where it holds weights, else its copy run
    again under STUDY/rebuilt/ when that one's rows matched the rerun's; else its own folder (whose
    missing weights are then named)."""
    from ..geometry import solution_on_disk

    study = Path(study)
    folder = study / stage / method / f"seed{seed}"
    if solution_on_disk(folder):
        return folder
    copy = study / "rebuilt" / stage / method / f"seed{seed}"
    entry = {e["folder"]: e for e in read_jsonl(study / REBUILT_RECORD)}.get(str(copy.relative_to(study)))
    return copy if entry is not None and entry["rows_identical"] and solution_on_disk(copy) else folder


def _finite(value: float) -> float | None:
    return value if isinstance(value, float) and math.isfinite(value) else None


def _declared_pairs(study: Path, methods: Sequence[str]) -> list[tuple[str, str]]:
    """The summary's family (best_es / best_grpo already decided), limited to methods with reruns."""
    path = study / SUMMARY
    family = (json.loads(path.read_text()).get("primary") or {}).get("family", []) if path.is_file() else []
    return [(a, b) for a, b in family if a in methods and b in methods]


def _methods_at(study: Path, stage: str, seed: int) -> list[str]:
    """The methods with a rerun (its config.yaml) at ``seed`` in the stage."""
    return [m for m in stage_methods(study, stage) if (study / stage / m / f"seed{seed}" / "config.yaml").is_file()]


def solutions_geometry(study: str | Path, seeds: Sequence[int] | None = None, stage: str = "final",
                       dtype: str = "bfloat16") -> dict[str, Any]:
    """Update summaries of every method's solution at each seed, and the cosines between every two
    methods' updates at the same seed (solutions of one seed in memory at a time)."""
    from ..geometry import load_solution, summarize, update_cosine, update_table

    study = Path(study)
    methods = stage_methods(study, stage)
    if not methods:
        raise FileNotFoundError(f"{study / stage}: no reruns here (OUT/{stage}/<method>/seedS)")
    seeds = chosen_seeds(study, stage, methods, seeds)
    result: dict[str, Any] = {"stage": stage, "dtype": dtype, "seeds": seeds, "updates": [], "cosines": []}
    for seed in seeds:
        solutions = {m: load_solution(solution_folder(study, stage, m, seed)) for m in _methods_at(study, stage, seed)}
        deltas = {}
        for method, solution in solutions.items():
            rows = update_table(solution.weights, solution.base, dtype)
            result["updates"].append({"method": method, "seed": seed, "form": solution.form,
                                      "generation": solution.generation, **summarize(rows),
                                      "by_layer": summarize(rows, by="layer"), "by_module": summarize(rows, by="module")})
            deltas[method] = solution.delta
        names = list(deltas)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                cosine = update_cosine(deltas[a], deltas[b])
                result["cosines"].append({"seed": seed, "a": a, "b": b, "overall": _finite(cosine["overall"]),
                                          "chance": _finite(cosine["chance"]),
                                          "per_layer": {str(k): _finite(v) for k, v in cosine["per_layer"].items()},
                                          "per_module": {k: _finite(v) for k, v in cosine["per_module"].items()}})
        del solutions, deltas
        gc.collect()
    return result


def geometry_engine(study: str | Path, stage: str, method: str, seed: int):
    """One engine for the paths and the drift, sized from one rerun's config, with the worker extension
    that writes weights in place (every solution is served as weights written in place, a LoRA merged)."""
    from ..engines import EngineSizing, make_engine
    from ..runs import load_run_config

    config = load_run_config(solution_folder(study, stage, method, seed))
    return make_engine(config, sizing=EngineSizing.from_config(config).replace(adapter_transfer="in_place"))


def solution_paths(engine, study: str | Path, pairs: Sequence[tuple[str, str]], seed: int, stage: str = "final",
                   points: int = 5, kl_samples: int = 0) -> tuple[list[dict], list[str]]:
    """(the straight path between each pair's solutions at ``seed`` with its barrier, the pairs left
    out and why), served by ``engine``."""
    from ..config import ConfigError
    from ..geometry import check_path_ends, interpolation_path, load_solution, path_barrier
    from ..runs import load_run_config
    from ..tasks import get_task

    study = Path(study)
    paths, skipped = [], []
    for a, b in pairs:
        folders = [solution_folder(study, stage, m, seed) for m in (a, b)]
        ends = [load_solution(folder) for folder in folders]
        try:
            check_path_ends(*ends)
        except ConfigError as error:
            skipped.append(f"{a} vs {b}: {error}")
            continue
        config = load_run_config(folders[0])
        rows = interpolation_path(engine, ends[0], ends[1], get_task(config.task, **config.task_options), points,
                                  max_new_tokens=config.max_new_tokens, kl_samples=kl_samples)
        paths.append({"a": a, "b": b, "seed": seed, "rows": rows,
                      "barrier": path_barrier([r["t"] for r in rows], [r["eval/reward"] for r in rows])})
    return paths, skipped


def drift_source(spec_path: str | Path) -> tuple[str, Any, int]:
    """(task name, task, max_new_tokens) of another study's spec: the held-out prompts, with that
    study's task options, on which the drift off the task trained on is measured."""
    from ..tasks import get_task
    from .spec import load_tune_spec

    config = next(iter(load_tune_spec(spec_path).final_runs.values()))[0].config
    return config.task, get_task(config.task, **config.task_options), config.max_new_tokens


def solution_drifts(engine, study: str | Path, seeds: Sequence[int], source: tuple[str, Any, int], stage: str = "final",
                    samples: int = 2) -> list[dict]:
    """KL to the base model on ``source``'s held-out prompts (``drift_source``) of every method's
    solution at each seed (``geometry.solution_drift``, sampled with the run's seed)."""
    from ..geometry import drift_prompts, load_solution, solution_drift

    study = Path(study)
    name, task, max_new_tokens = source
    prompts, rows = len(drift_prompts(task)), []
    for seed in seeds:
        for method in _methods_at(study, stage, seed):
            solution = load_solution(solution_folder(study, stage, method, seed))
            kl = solution_drift(engine, solution, task, num_samples=samples, max_new_tokens=max_new_tokens, seed=seed)
            rows.append({"method": method, "seed": seed, "task": name, "prompts": prompts,
                         "samples": samples, "kl": _finite(kl)})
            del solution
            gc.collect()
    return rows


def write_geometry(study: str | Path, out: str | Path, seeds: Sequence[int] | None = None, stage: str = "final",
                   pairs: Sequence[tuple[str, str]] | None = None, points: int = 5, kl_samples: int = 0,
                   dtype: str = "bfloat16", drift_spec: str | Path | None = None,
                   drift_samples: int = 2) -> dict[str, Any]:
    """OUT/geometry.json (see the module docstring); returns what it holds. The file is written after
    each part (updates and cosines, paths, drift), so a part that fails or is stopped keeps the ones
    before it."""
    study, out = Path(study), Path(out)
    source = drift_source(drift_spec) if drift_spec else None  # a bad spec fails before any weights are read
    if source:
        from ..runs import load_run_config

        trained = {load_run_config(config.parent).task for config in (study / stage).glob("*/seed*/config.yaml")}
        if source[0] in trained:
            raise ValueError(f"drift_spec: {drift_spec} is a study of {source[0]}, the task these runs trained on; the "
                             "drift off the task needs another study's spec (for addition runs, the conciseness study's)")
    result = solutions_geometry(study, seeds, stage, dtype)
    result.update(paths=[], skipped_paths=[], drift=[])
    out.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        (out / GEOMETRY).write_text(json.dumps(result, indent=1) + "\n")

    write()
    pairs = list(pairs) if pairs is not None else _declared_pairs(study, stage_methods(study, stage))
    if not ((points >= 2 and pairs) or source):
        return result
    first = result["seeds"][0]
    engine = geometry_engine(study, stage, _methods_at(study, stage, first)[0], first)
    try:
        if points >= 2 and pairs:
            result["paths"], result["skipped_paths"] = solution_paths(engine, study, pairs, first, stage, points,
                                                                      kl_samples)
            write()
        if source:
            result["drift"] = solution_drifts(engine, study, result["seeds"], source, stage, drift_samples)
            write()
    finally:
        engine.close()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evolm_lib.tune.geometry", description=__doc__.split("\n\n")[0])
    parser.add_argument("study", type=Path, help="the study's folder (tune.out), with the reruns' weights")
    parser.add_argument("out", type=Path, help="the folder for geometry.json (a study's export: its figures drawn with the tables)")
    parser.add_argument("--seeds", help="comma-separated final seeds (default: the first three)")
    parser.add_argument("--stage", choices=STAGES, default="final", help="the reruns (final) or their continuations (long)")
    parser.add_argument("--pairs", help="a:b,c:d: the paths to measure (default: the summary's declared family)")
    parser.add_argument("--points", type=int, default=5, help="points of each straight path, ends included (0: no paths)")
    parser.add_argument("--kl-samples", type=int, default=0, help="samples per prompt for the KL along each path (0: none)")
    parser.add_argument("--dtype", default="bfloat16", help="dtype in which 'changed at all' is counted (the engine's)")
    parser.add_argument("--drift-spec", help="another study's spec: each solution's KL to the base model on its "
                                             "held-out prompts (the drift off the task trained on; default: none)")
    parser.add_argument("--drift-samples", type=int, default=2, help="samples per prompt for the drift's KL")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    pairs = [tuple(p.split(":")) for p in args.pairs.split(",")] if args.pairs else None
    if pairs and any(len(p) != 2 for p in pairs):
        print(f"geometry: --pairs is a:b,c:d, got {args.pairs!r}", file=sys.stderr)
        return 2
    try:
        result = write_geometry(args.study, args.out, seeds, args.stage, pairs, args.points, args.kl_samples, args.dtype,
                                args.drift_spec, args.drift_samples)
    except (FileNotFoundError, ValueError) as error:  # a missing study or rerun, a bad spec: named
        print(f"geometry: {error}", file=sys.stderr)
        return 1
    for update in result["updates"]:
        print(f"{update['method']} seed {update['seed']}: ||update|| {update['norm']:.4g}, "
              f"changed {update['changed_share']:.3%} of {update['values']} values")
    for cosine in result["cosines"]:
        print(f"cosine({cosine['a']}, {cosine['b']}) seed {cosine['seed']}: {cosine['overall']}")
    for path in result["paths"]:
        print(f"path {path['a']} -> {path['b']}: barrier {path['barrier']:.4g}")
    for line in result["skipped_paths"]:
        print(f"no path: {line}")
    for drift in result["drift"]:
        print(f"{drift['method']} seed {drift['seed']}: KL to the base on {drift['task']}'s held-out prompts {drift['kl']}")
    print(args.out / GEOMETRY)
    return 0


if __name__ == "__main__":
    sys.exit(main())
