"""`evolm batch SPEC`: run a notebook once per grid point of a batch file (papermill)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import yaml

from .. import batch


def main(argv: list[str] | None = None) -> int:
    """Command line: run a batch file; exit 1 if any run failed, 2 on a bad batch file."""
    parser = argparse.ArgumentParser(prog="evolm batch", description=batch.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", help="batch YAML file")
    parser.add_argument("--out", help="output folder (default: runs/batch/<yaml name>)")
    parser.add_argument("--notebook", help="run this notebook instead of the YAML's `notebook`")
    parser.add_argument("--dry-run", action="store_true", help="list the runs, execute nothing")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace run folders that already exist")
    parser.add_argument("--log-output", action="store_true", help="stream notebook output")
    args = parser.parse_args(argv)

    try:
        spec = batch.load_batch_spec(args.spec)
        if args.notebook:
            spec = replace(spec, notebook=batch.resolve_notebook(args.notebook, None))
        out_dir = Path(args.out) if args.out else Path("runs") / "batch" / Path(args.spec).stem
        results = batch.run_batch(spec, out_dir, overwrite=args.overwrite, dry_run=args.dry_run,
                            log_output=args.log_output)
    except (ValueError, FileNotFoundError, FileExistsError, yaml.YAMLError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    if args.dry_run:
        print(f"{len(results)} run(s) of {spec.notebook} into {Path(out_dir).resolve()}:")
        for r in results:
            print(f"  {r.name}: {json.dumps(r.parameters, default=str)}")
        return 0
    print(batch.format_summary(results))
    failed = sum(r.status != "ok" for r in results)
    print(f"\n{len(results) - failed} ok, {failed} failed; summary in "
          f"{Path(out_dir).resolve() / 'summary.csv'}")
    return 1 if failed else 0
