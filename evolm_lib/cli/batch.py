"""`evolm batch SPEC`: run a notebook once per grid point of a batch file (papermill); a rerun continues."""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import yaml

from .. import batch
from ..env import apply_engine_defaults
from .help import HelpFormatter
from .interrupt import ignore_stop_signals, kernels_stopped_first, report_interrupt, stop_children

ALL = "\0all"  # --overwrite without a point name

HELP = """Run a notebook once per point of a parameter grid (papermill), one folder per point; a rerun
of the same command continues where the last one stopped.

    evolm batch papermill_runs/ci_tiny.yaml --dry-run        check every point, list what would run; run nothing
    evolm batch papermill_runs/ci_tiny.yaml                  the ES stepper on the tiny test model, one point
    evolm batch papermill_runs/grpo_tiny.yaml --out runs/batch/grpo_check
                                                             the GRPO stepper (notebook 06) on a grid of two seeds

The batch file (YAML):

    notebook: notebooks/03_es_stepper.py   # relative to the YAML file or to the project folder
    name: sigma-sweep                      # run-name prefix (default: the notebook's name)
    parameters: {num_generations: 20, settings: {optimizer: adam}}   # every point's parameters
    grid: {seed: [0, 1, 2], sigma: [0.01, 0.05]}   # the points: the cartesian product

Each point gets OUT/<name>__seed-0__sigma-0.05/ with notebook.ipynb (the executed notebook),
status.json, run/ and figures/. A rerun skips finished points, resumes unfinished ones from their
last checkpoint (a raised budget extends them), skips failed ones unless --retry-failed, and leaves a
point whose folder holds other settings as it is, saying what changed (--overwrite POINT replaces it).
Every point's parameters and settings are checked before any kernel starts. OUT/summary.csv holds one
row per point (status, wall time, settings, rewards at the start and end); a table of it is printed
at the end. Ctrl-C stops the batch; finished points are kept and the same command continues.

The notebooks a batch runs: 03_es_stepper (ES), 06_grpo_stepper (GRPO), 05_zo_synthetic, and any
notebook with a `parameters` cell. More: docs/batch-runs.md.

exit status: 0 every point finished (or was busy in another process), 1 a point failed or was left
as it was, 2 a bad batch file or option, 130 interrupted."""


def build_parser() -> argparse.ArgumentParser:
    """The command line of `evolm batch`."""
    parser = argparse.ArgumentParser(prog="evolm batch", description=HELP, formatter_class=HelpFormatter)
    parser.add_argument("spec", help="batch YAML file")
    parser.add_argument("--out", help="output folder (default: runs/batch/<yaml name>)")
    parser.add_argument("--notebook", help="run this notebook instead of the YAML's `notebook`")
    parser.add_argument("--dry-run", action="store_true",
                        help="check every point's settings and list what would run, resume or be skipped; run nothing")
    parser.add_argument("--retry-failed", action="store_true", help="run failed points again (default: skip them)")
    parser.add_argument("--overwrite", nargs="?", action="append", const=ALL, metavar="POINT",
                        help="run POINT from scratch, replacing its folder (once the new attempt succeeds); "
                             "repeat for several points; without POINT: every point (default: replace none)")
    parser.add_argument("--log-output", action="store_true", help="stream notebook output")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command line: run or continue a batch; exit 0 when every point finished or was busy (another
    process holds it: reported, left as it is), 1 if any failed or was left as it was because its folder
    holds other settings (with --dry-run: would fail its checks or be left so), 2 on a bad batch file."""
    args = build_parser().parse_args(argv)
    apply_engine_defaults()  # the kernels inherit the engine's environment (threads, quiet logs)

    spec = None
    out_dir = Path(args.out) if args.out else Path("runs") / "batch" / Path(args.spec).stem
    try:
        spec = batch.load_batch_spec(args.spec)
        if args.notebook:
            spec = replace(spec, notebook=batch.resolve_notebook(args.notebook, None))
        overwrite = True if ALL in (args.overwrite or []) else list(args.overwrite or [])
        with kernels_stopped_first():
            results = batch.run_batch(spec, out_dir, overwrite=overwrite, dry_run=args.dry_run,
                                      log_output=args.log_output, retry_failed=args.retry_failed)
    except (ValueError, FileNotFoundError, FileExistsError, yaml.YAMLError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted(spec, out_dir)

    where = Path(out_dir).resolve()
    stale = batch.stale_folders(spec, out_dir)
    if args.dry_run:
        counts = _counts(r.action for r in results)
        print(f"{len(results)} point(s) of {spec.notebook} in {where}: {counts}")
        print(batch.format_plan(results))
        _print_stale(stale)
        return 1 if any(r.action in ("invalid", "conflict", "damaged") for r in results) else 0
    print(batch.format_summary(results))
    failed = [r for r in results if r.status == batch.FAILED or r.attempt_error]
    busy = [r for r in results if r.status == batch.BUSY]
    conflicts = [r for r in results if r.action == "conflict"]
    done = _counts(r.action for r in results)
    left = f", {len(conflicts)} left as they were (settings changed)" if conflicts else ""
    summary = f"summary in {where / 'summary.csv'}" if (where / "summary.csv").exists() else "no summary written"
    not_ok = {id(r) for r in [*failed, *busy, *conflicts] + [r for r in results if r.action == "damaged"]}
    print(f"\n{len(results) - len(not_ok)} ok, {len(failed)} failed{left} ({done}); "
          f"{summary}")
    tiny = batch.plumbing_check_note(results)
    if tiny:
        print(tiny)
    for r in busy:
        print(f"busy, left as it is: {r.name}, {r.reason}")
    skipped_failures = [r.name for r in failed if r.action == "skip"]
    if skipped_failures:
        print(f"skipped {len(skipped_failures)} point(s) that failed before: --retry-failed runs them again")
    if conflicts:  # the same lines as the dry run's
        print(f"left {len(conflicts)} point(s) as they were, their folders holding other settings:")
        print(batch.format_plan(conflicts))
    damaged = [r for r in results if r.action == "damaged"]
    if damaged:
        print(f"left {len(damaged)} point(s) as they were, their run folders missing config.yaml:")
        print(batch.format_plan(damaged))
    _print_stale(stale)
    return 1 if failed or conflicts or damaged else 0


def _interrupted(spec: batch.BatchSpec | None, out_dir: Path) -> int:
    """After Ctrl-C or SIGTERM: stop the point's kernel, then one line saying which points are kept and how to go on."""
    ignore_stop_signals()  # a second one must not cut the cleanup short
    stop_children()
    if spec is None:
        return report_interrupt("interrupted while reading the batch file; nothing ran")
    points = batch.plan_points(spec, out_dir, validate=False)
    finished = sum(point.state == "finished" for point in points)
    return report_interrupt(f"interrupted: {finished} of {len(points)} point(s) finished and kept in "
                            f"{Path(out_dir).resolve()}; run the same command again to continue")


def _counts(actions) -> str:
    tally: dict[str, int] = {}
    for action in actions:
        tally[action] = tally.get(action, 0) + 1
    return ", ".join(f"{n} {action}" for action, n in tally.items())


def _print_stale(stale: list[Path]) -> None:
    if stale:
        print(f"{len(stale)} folder(s) in the output are no longer points of this grid (left as they are): "
              + ", ".join(p.name for p in stale))
