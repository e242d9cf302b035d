"""`evolm batch SPEC`: run a notebook once per grid point of a batch file (papermill); a rerun continues."""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import yaml

from .. import batch
from ..env import apply_engine_defaults

ALL = "\0all"  # --overwrite without a point name


def main(argv: list[str] | None = None) -> int:
    """Command line: run or continue a batch; exit 0 when every point finished or was busy (another
    process holds it: reported, left as it is), 1 if any failed or was left as it was because its folder
    holds other settings (with --dry-run: would fail its checks or be left so), 2 on a bad batch file."""
    parser = argparse.ArgumentParser(prog="evolm batch", description=batch.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", help="batch YAML file")
    parser.add_argument("--out", help="output folder (default: runs/batch/<yaml name>)")
    parser.add_argument("--notebook", help="run this notebook instead of the YAML's `notebook`")
    parser.add_argument("--dry-run", action="store_true",
                        help="check every point's settings and list what would run, resume or be skipped; run nothing")
    parser.add_argument("--retry-failed", action="store_true", help="run failed points again (default: skip them)")
    parser.add_argument("--overwrite", nargs="?", action="append", const=ALL, metavar="POINT",
                        help="run POINT from scratch, replacing its folder (once the new attempt succeeds); "
                             "repeat for several points; without POINT: every point")
    parser.add_argument("--log-output", action="store_true", help="stream notebook output")
    args = parser.parse_args(argv)
    apply_engine_defaults()  # the kernels inherit the engine's environment (threads, quiet logs)

    try:
        spec = batch.load_batch_spec(args.spec)
        if args.notebook:
            spec = replace(spec, notebook=batch.resolve_notebook(args.notebook, None))
        out_dir = Path(args.out) if args.out else Path("runs") / "batch" / Path(args.spec).stem
        overwrite = True if ALL in (args.overwrite or []) else list(args.overwrite or [])
        results = batch.run_batch(spec, out_dir, overwrite=overwrite, dry_run=args.dry_run,
                                  log_output=args.log_output, retry_failed=args.retry_failed)
    except (ValueError, FileNotFoundError, FileExistsError, yaml.YAMLError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    where = Path(out_dir).resolve()
    stale = batch.stale_folders(spec, out_dir)
    if args.dry_run:
        counts = _counts(r.action for r in results)
        print(f"{len(results)} point(s) of {spec.notebook} in {where}: {counts}")
        print(batch.format_plan(results))
        _print_stale(stale)
        return 1 if any(r.action in ("invalid", "conflict") for r in results) else 0
    print(batch.format_summary(results))
    failed = [r for r in results if r.status == batch.FAILED or r.attempt_error]
    busy = [r for r in results if r.status == batch.BUSY]
    done = _counts(r.action for r in results)
    print(f"\n{len(results) - len(failed) - len(busy)} ok, {len(failed)} failed ({done}); "
          f"summary in {where / 'summary.csv'}")
    for r in busy:
        print(f"busy, left as it is: {r.name}, {r.reason}")
    skipped_failures = [r.name for r in failed if r.action == "skip"]
    if skipped_failures:
        print(f"skipped {len(skipped_failures)} point(s) that failed before: --retry-failed runs them again")
    conflicts = [r for r in results if r.action == "conflict"]
    if conflicts:  # the same lines as the dry run's
        print(f"left {len(conflicts)} point(s) as they were, their folders holding other settings:")
        print(batch.format_plan(conflicts))
    _print_stale(stale)
    return 1 if failed or conflicts else 0


def _counts(actions) -> str:
    tally: dict[str, int] = {}
    for action in actions:
        tally[action] = tally.get(action, 0) + 1
    return ", ".join(f"{n} {action}" for action, n in tally.items())


def _print_stale(stale: list[Path]) -> None:
    if stale:
        print(f"{len(stale)} folder(s) in the output are no longer points of this grid (left as they are): "
              + ", ".join(p.name for p in stale))
