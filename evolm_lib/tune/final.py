"""The winners: each method's best setting rerun on ``final_seeds`` (OUT/final/<method>/seedS), scored
on every held-out problem, then compared across seeds (``analysis.study_table``, ``method_comparisons``
with the spec's ``primary`` pairs Holm-corrected). The tuning seeds' runs never enter these tables.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from ..runs import RunFolderBusy
from ..sweep import PlannedRun, run_one
from .spec import TuneSpec, trial_config
from .study import best_trial, finished, study_trials

SUMMARY = "tune_summary.json"


def final_plan(spec: TuneSpec, method: str) -> list[PlannedRun]:
    """The method's reruns: its best trial's setting on every final seed (names method/seedS)."""
    params = best_trial(spec, method).params
    return [replace(planned, name=f"{method}/seed{planned.config.seed}", config=trial_config(spec, planned, params))
            for planned in spec.final_runs[method]]


def run_finals(spec: TuneSpec, evaluator, log: Callable[[str], None] = print) -> dict[str, list[str]]:
    """Rerun every method whose study is finished on the final seeds (a method still being tuned by
    another worker is left for later, a rerun another worker writes is skipped); returns
    {method: rerun folders written or found finished}."""
    done: dict[str, list[str]] = {}
    for method in spec.methods:
        if not finished(spec, method):
            log(f"{method}: tuning not finished; its reruns wait")
            continue
        done[method] = []
        for planned in final_plan(spec, method):
            try:
                run_one(planned, spec.out / "final", evaluator)
            except RunFolderBusy as busy:
                log(f"  {planned.name}: busy, left to its writer ({busy})")
                continue
            done[method].append(str(spec.out / "final" / planned.name))
    return done


def final_groups(spec: TuneSpec, methods: list[str] | None = None):
    """The reruns' run folders grouped by method (``analysis.load_runs``), for the methods that have some."""
    from ..analysis import load_runs

    folders = {m: str(spec.out / "final" / m / "seed*") for m in (methods or spec.methods)
               if any((spec.out / "final" / m).glob("seed*/config.yaml"))}
    return load_runs(folders, allow_mixed=True) if folders else {}


def summarize(spec: TuneSpec) -> dict[str, Any]:
    """OUT/tune_summary.json: per method its trials (complete, pruned, failed, retried), the winning
    setting and its selection score; the reruns' held-out table (t and BCa intervals across final
    seeds, interquartile mean) and the comparisons (primary ones Holm-corrected). Returns it."""
    from ..analysis import method_comparisons, study_table

    measure = spec.settings.measure
    methods = {}
    for method in spec.methods:
        trials = study_trials(spec, method)
        states = [t["state"] for t in trials]
        try:
            best = best_trial(spec, method)
            winner = {"trial": best.number, "value": best.value, "params": best.params,
                      "config": best.user_attrs.get("config")}
        except ValueError:
            winner = None
        methods[method] = {
            "trials": sum(s in ("complete", "pruned") for s in states) + sum(
                t["state"] == "fail" and t["error"] is not None for t in trials),
            "complete": states.count("complete"), "pruned": states.count("pruned"),
            "failed": sum(t["state"] == "fail" and t["error"] is not None for t in trials),
            "killed_and_retried": sum(t["retries"] is not None for t in trials),
            "winner": winner, "trial_list": trials,
        }
    groups = final_groups(spec)
    labels = {m: m for m in groups}
    primary = [pair for pair in spec.settings.primary if all(m in labels for m in pair)]
    table = study_table(groups, measure=measure) if groups else None
    comparisons = method_comparisons(groups, measure=measure, primary=primary) if len(groups) > 1 else None
    summary = {
        "spec": str(spec.path), "select": spec.settings.select, "budget": spec.budget,
        "tuning_seeds": list(spec.settings.seeds), "final_seeds": list(spec.settings.final_seeds),
        "methods": methods,
        "final": [] if table is None else json.loads(table.reset_index().to_json(orient="records")),
        "comparisons": [] if comparisons is None else json.loads(comparisons.to_json(orient="records")),
        "measure": measure,
    }
    spec.out.mkdir(parents=True, exist_ok=True)
    Path(spec.out / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary in a few printed lines: trials, winner and held-out result per method."""
    lines = []
    final = {row["method"]: row for row in summary["final"]}
    for method, entry in summary["methods"].items():
        winner = entry["winner"]
        won = (f"winner trial {winner['trial']} ({summary['select']} {winner['value']:.4g}): {winner['params']}"
               if winner else "no complete trial")
        lines.append(f"{method}: {entry['trials']} trials ({entry['complete']} complete, {entry['pruned']} pruned, "
                     f"{entry['failed']} failed, {entry['killed_and_retried']} retries of killed trials); {won}")
        if method in final:
            row = final[method]
            lines.append(f"  held-out {summary['measure']} on {row['seeds']} final seeds: {row['mean']:.4g} "
                         f"(BCa {row['ci_low']:.4g} to {row['ci_high']:.4g}; t {row['t_low']:.4g} to {row['t_high']:.4g})")
    for row in summary["comparisons"]:
        p = row["holm_p"] if row["family"] == "primary" else row["permutation_p"]
        lines.append(f"{row['method_a']} - {row['method_b']} ({row['family']}): {row['difference']:.4g}, "
                     f"p {p:.3g}{' (Holm)' if row['family'] == 'primary' else ''}")
    return lines
