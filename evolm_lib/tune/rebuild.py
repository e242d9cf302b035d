"""Reruns' weights rebuilt where a pack left them behind: ``python -m evolm_lib.tune.rebuild STUDY_DIR``.

A pack carries a study's rows and held-out scores, never its weights, so reruns finished on an
earlier machine have nothing here for the geometry to read. Each such rerun of the chosen seeds
(``--seeds``, default the first three, the geometry's) is run again from its folder's config.yaml
into STUDY/rebuilt/<stage>/<method>/seedS, a folder of its own: the finished rerun is never
written. Its rows are then compared with the rerun's, time columns aside. Under ``deterministic``
they are the same, and so are the weights; where they differ the rebuilt folder is kept and
reported, and the geometry does not read it (``solution_folder``). A rerun whose weights are here,
and a rebuilt one already finished, are left as they are, so running the command again only
finishes what a kill cut short. Each rebuild's comparison (rows identical, or the first row that
differs) is a line of STUDY/rebuilt/rebuilt.jsonl.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Sequence

from ..metrics import without_times
from ..runs import load_run_config, read_config_kind, read_jsonl, read_metrics
from ..sweep import HELDOUT, PlannedRun, make_shared_evaluator, run_budget, run_one
from .final import STAGES

REBUILT = "rebuilt"
RECORD = "rebuilt.jsonl"


def has_weights(folder: Path) -> bool:
    """Whether a run folder holds what the geometry reads its solution from (``geometry.solution_on_disk``:
    a packed ES checkpoint on the model's own weights, without its snapshots, does not)."""
    from ..geometry import solution_on_disk

    return solution_on_disk(folder)


def rebuilt_folder(study: Path, stage: str, method: str, seed: int) -> Path:
    """Where a rerun of ``stage`` is rebuilt: STUDY/rebuilt/<stage>/<method>/seedS."""
    return Path(study) / REBUILT / stage / method / f"seed{seed}"


def _records(study: Path) -> dict[str, dict]:
    return {entry["folder"]: entry for entry in read_jsonl(Path(study) / REBUILT / RECORD)}


def solution_folder(study: str | Path, stage: str, method: str, seed: int) -> Path:
    """Where the geometry reads a rerun's solution: its own folder where it holds weights, else its
    rebuilt copy when that one's rows matched the rerun's; else its own folder (whose missing weights
    the geometry then names)."""
    study = Path(study)
    folder = study / stage / method / f"seed{seed}"
    if has_weights(folder):
        return folder
    copy = rebuilt_folder(study, stage, method, seed)
    entry = _records(study).get(str(copy.relative_to(study)))
    return copy if entry is not None and entry["rows_identical"] and has_weights(copy) else folder


def planned_rebuild(source: Path, copy: Path, method: str) -> PlannedRun:
    """The rerun at ``source`` planned again, to run into ``copy``."""
    kind = read_config_kind(source)
    config = load_run_config(source)
    return PlannedRun(copy.name, method, kind, config, run_budget(kind, config))


def stage_methods(study: str | Path, stage: str) -> list[str]:
    """The methods with runs in a stage's folder (STUDY/<stage>/<method>), sorted."""
    root = Path(study) / stage
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def chosen_seeds(study: str | Path, stage: str, methods: Sequence[str], seeds: Sequence[int] | None) -> list[int]:
    """``seeds``, else the first three seeds any of ``methods`` has in the stage: the solutions the
    geometry reads, and so the reruns rebuilt for it."""
    root = Path(study) / stage
    available = sorted({int(p.name.removeprefix("seed")) for m in methods for p in (root / m).glob("seed*")})
    return list(seeds) if seeds else available[:3]


def to_rebuild(study: Path, seeds: Sequence[int] | None, stage: str = "final",
               methods: Sequence[str] | None = None) -> list[tuple[Path, Path, str]]:
    """(finished rerun, its rebuilt folder, method) for each chosen rerun without weights here (a rerun
    still running is left for later)."""
    root = Path(study) / stage
    found = stage_methods(study, stage)
    wanted = [m for m in found if methods is None or m in methods]
    if methods is not None and (missing := sorted(set(methods) - set(found))):
        raise FileNotFoundError(f"{root}: no reruns of {missing} (found {found})")
    work, chosen = [], chosen_seeds(study, stage, wanted, seeds)
    for method in wanted:
        for seed in chosen:
            source = root / method / f"seed{seed}"
            # a rerun still running (no held-out scores yet) is not a solution to rebuild
            if (source / HELDOUT).is_file() and not has_weights(source):
                work.append((source, rebuilt_folder(study, stage, method, seed), method))
    return work


def rebuild(study: str | Path, seeds: Sequence[int] | None = None, stage: str = "final",
            methods: Sequence[str] | None = None, evaluator=None, log: Callable[[str], None] = print) -> list[dict]:
    """Run each chosen rerun that has no weights here again (``to_rebuild``) on one engine (``evaluator``,
    else one sized for them), compare its rows with the rerun's, and record the result; returns the
    records of this call."""
    study = Path(study)
    work = to_rebuild(study, seeds, stage, methods)
    done = _records(study)
    work = [(source, copy, method) for source, copy, method in work
            if str(copy.relative_to(study)) not in done or not has_weights(copy)]
    if not work:
        log("rebuild: every chosen rerun has its weights here")
        return []
    plans = [(source, copy, planned_rebuild(source, copy, method)) for source, copy, method in work]
    own = evaluator is None
    evaluator = evaluator or make_shared_evaluator([planned for _, _, planned in plans])
    records = []
    try:
        for source, copy, planned in plans:
            copy.parent.mkdir(parents=True, exist_ok=True)
            run_one(planned, copy.parent, evaluator)
            rows, expected = without_times(read_metrics(copy)), without_times(read_metrics(source))
            differ = next((i for i, (a, b) in enumerate(zip(rows, expected)) if a != b), None)
            identical = differ is None and len(rows) == len(expected)
            entry = {"folder": str(copy.relative_to(study)), "from": str(source.relative_to(study)),
                     "rows_identical": identical, "rows": len(rows), "first_different_row": differ}
            records.append(entry)
            with open(study / REBUILT / RECORD, "a") as handle:
                handle.write(json.dumps(entry) + "\n")
            log(f"rebuilt {entry['from']}: {'rows identical' if identical else f'rows differ from row {differ}'}"
                f" ({len(rows)} rows against {len(expected)})")
    finally:
        if own:
            evaluator.close()
    return records


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evolm_lib.tune.rebuild", description=__doc__.split("\n\n")[0])
    parser.add_argument("study", type=Path, help="the study's folder (tune.out)")
    parser.add_argument("--seeds", help="comma-separated final seeds (default: the first three, as the geometry)")
    parser.add_argument("--stage", choices=STAGES, default="final", help="the reruns (final) or their continuations (long)")
    parser.add_argument("--methods", help="comma-separated methods (default: every method with reruns); "
                                          "one process per method can share the cards")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    methods = [m for m in args.methods.split(",") if m] if args.methods else None
    try:
        records = rebuild(args.study, seeds, args.stage, methods)
    except FileNotFoundError as error:
        print(f"rebuild: {error}", file=sys.stderr)
        return 1
    return 0 if all(entry["rows_identical"] for entry in records) else 3


if __name__ == "__main__":
    sys.exit(main())
