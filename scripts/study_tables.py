"""The studies' tables and figures, for the repository's figures/study/.

The tuned study, from its compacted files (python -m evolm_lib.tune.compact), on any machine:
each method's tuning and winner, the winners' held-out score over the final seeds (BCa and t
intervals), the declared comparisons Holm-corrected and the rest exploratory, the continued reruns,
the shuffled-fitness control, and the figures (best score against trials; held-out score against
training completions, generated tokens and wall-clock seconds; the winners' geometry where
python -m evolm_lib.tune.geometry wrote geometry.json beside the compacted files):

    python scripts/study_tables.py figures/study/summaries/tune_study_addition figures/study/tuned_addition
    python scripts/study_tables.py figures/study/summaries/tune_study_conciseness figures/study/tuned_conciseness
    python scripts/study_tables.py figures/study/summaries/qiu_protocol_addition figures/study/qiu_protocol
    python scripts/study_tables.py figures/study/summaries/tune_study_addition figures/study/tuned_addition --measure success --no-figures

The untuned five-seed study, from its run folders (a folder without runs.jsonl.gz): per task the
study table, the pairwise tests against seed noise, and the equal-budget table and tests:

    python scripts/study_tables.py runs/study_addition success figures/study/addition
    python scripts/study_tables.py runs/study_conciseness reward figures/study/conciseness
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from evolm_lib.analysis import (equal_budget_comparisons, equal_budget_table, load_runs, method_comparisons,
                                method_globs, study_table)
from evolm_lib.tune.compact import RUNS


def untuned(folder: str, measure: str, prefix: str) -> None:
    """Write PREFIX_study.csv, PREFIX_comparisons.csv, PREFIX_equal_budget.csv, PREFIX_equal_budget_tests.csv."""
    groups = load_runs(list(method_globs(folder).values()))  # the ES forms alone (runs/study_addition_long): no grpo_*
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    tables = {"study": study_table(groups, measure=measure), "comparisons": method_comparisons(groups, measure=measure),
              "equal_budget": equal_budget_table(groups), "equal_budget_tests": equal_budget_comparisons(groups)}
    for name, table in tables.items():
        table.to_csv(f"{prefix}_{name}.csv", float_format="%.6g")
        print(f"{prefix}_{name}.csv", table.attrs.get("note") or "")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # FOLDER MEASURE PREFIX has no options; a compacted study's folder holds runs.jsonl.gz
    if len(argv) == 3 and not any(arg.startswith("-") for arg in argv) and not (Path(argv[0]) / RUNS).is_file():
        untuned(*argv)
        return 0
    parser = argparse.ArgumentParser(prog="scripts/study_tables.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("compact", help="a compacted study's folder (runs.jsonl.gz, trials.jsonl.gz, tune_summary.json)")
    parser.add_argument("out", help="the folder for the CSV tables and the figures")
    parser.add_argument("--measure", choices=("success", "reward"), help="held-out measure (default: the summary's)")
    parser.add_argument("--no-figures", action="store_true", help="tables only (figures need chromium)")
    args = parser.parse_args(argv)
    from evolm_lib.tune.report import write_study_tables

    paths = write_study_tables(args.compact, args.out, measure=args.measure)
    if not args.no_figures:
        from evolm_lib.viz.figures import chromium_available
        from evolm_lib.viz.study import export_study_figures

        if not chromium_available():
            print("no figures: chromium is missing (apt-get install -y chromium), or pass --no-figures", file=sys.stderr)
            return 1
        paths += export_study_figures(args.compact, args.out)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
