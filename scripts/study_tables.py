"""The five-seed study's tables from its run folders, for the repository's figures/study/:
per task the study table (held-out score per method with 95 % bootstrap intervals, seed spread, KL,
seconds per generation), the pairwise tests against seed noise, and the equal-budget table and tests.

    python scripts/study_tables.py runs/study_addition success figures/study/addition
    python scripts/study_tables.py runs/study_conciseness reward figures/study/conciseness
    python scripts/study_tables.py runs/study_addition_long success figures/study/addition_long
"""
from __future__ import annotations

import sys
from pathlib import Path

from evolm_lib.analysis import (equal_budget_comparisons, equal_budget_table, load_runs, method_comparisons,
                                method_globs, study_table)


def main(folder: str, measure: str, prefix: str) -> None:
    """Write PREFIX_study.csv, PREFIX_comparisons.csv, PREFIX_equal_budget.csv, PREFIX_equal_budget_tests.csv."""
    groups = load_runs(list(method_globs(folder).values()))  # the ES forms alone (runs/study_addition_long): no grpo_*
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    tables = {"study": study_table(groups, measure=measure), "comparisons": method_comparisons(groups, measure=measure),
              "equal_budget": equal_budget_table(groups), "equal_budget_tests": equal_budget_comparisons(groups)}
    for name, table in tables.items():
        table.to_csv(f"{prefix}_{name}.csv", float_format="%.6g")
        print(f"{prefix}_{name}.csv", table.attrs.get("note") or "")


if __name__ == "__main__":
    main(*sys.argv[1:4])
