"""The study's summary, OUT/tune_summary.json: per method its trials and winner, the reruns'
held-out table with its comparisons (the declared family Holm-corrected), the continued reruns and
the control; and the few lines `evolm tune` prints of it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .final import SUMMARY, finished_rerun, resolve_best, resolved_primary
from .spec import TuneSpec
from .study import best_trial, study_trials

PLUMBING_MODELS = ("tiny-random",)
"""Models whose scores mean nothing (random weights): a study on them checks the plumbing only."""


def plumbing_check(spec: TuneSpec) -> bool:
    """Whether the spec's runs use a model of random weights (``PLUMBING_MODELS``)."""
    return any(str(planned.config.model) in PLUMBING_MODELS for runs in spec.tuning_runs.values() for planned in runs)


def final_groups(spec: TuneSpec, methods: list[str] | None = None, stage: str = "final"):
    """A stage's finished runs (``STAGES``: final, long, control) grouped by method (``analysis.load_runs``),
    for the methods that have some. A run another worker is writing, or one a kill cut short, is
    left out until it finishes: its folder may hold no rows yet, and never a held-out score."""
    from ..analysis import load_runs

    folders = {m: found for m in (methods or spec.methods)
               if (found := [str(f) for f in sorted((spec.out / stage / m).glob("seed*")) if finished_rerun(f)])}
    return load_runs(folders, allow_mixed=True) if folders else {}


def _records(frame) -> list:
    return [] if frame is None else json.loads(frame.reset_index().to_json(orient="records"))


def _extras_summary(spec: TuneSpec, groups, measure: str) -> dict[str, Any]:
    """The long and control stages' tables: held-out per method at the longer budget (its pairs
    exploratory), and the control against its method's reruns."""
    from ..analysis import method_comparisons, study_table

    extras: dict[str, Any] = {}
    if spec.settings.long > 1:
        long_groups = final_groups(spec, spec.study_methods, stage="long")
        extras["long"] = {"factor": spec.settings.long, "budget": spec.budget * spec.settings.long,
                          "final": _records(study_table(long_groups, measure=measure)) if long_groups else [],
                          "comparisons": _records(method_comparisons(long_groups, measure=measure))
                          if len(long_groups) > 1 else []}
    if spec.settings.control != "none":
        method = resolve_best(spec, spec.settings.control)
        control = final_groups(spec, [method], stage="control") if method else {}
        entry: dict[str, Any] = {"declared": spec.settings.control, "method": method, "final": [], "comparison": []}
        if control:
            pair = {method: groups[method], f"{method} shuffled": control[method]} if method in groups else {
                f"{method} shuffled": control[method]}
            entry["final"] = _records(study_table({f"{method} shuffled": control[method]}, measure=measure))
            entry["comparison"] = _records(method_comparisons(pair, measure=measure)) if len(pair) > 1 else []
        extras["control"] = entry
    return extras


def summarize(spec: TuneSpec) -> dict[str, Any]:
    """OUT/tune_summary.json, the study's one summary (every tuned method, whichever worker writes
    it): per method its trials (complete, pruned, failed, retried), the winning setting and its
    selection score; the reruns' held-out table (t and BCa intervals across final seeds,
    interquartile mean) and the comparisons (primary ones Holm-corrected). Returns it."""
    from ..analysis import method_comparisons, study_table

    measure = spec.settings.measure
    methods = {}
    for method in spec.study_methods:
        trials = study_trials(spec, method)
        states = [t["state"] for t in trials]
        try:
            best = best_trial(spec, method)
            winner = {"trial": best.number, "value": best.value, "params": best.params,
                      "config": best.user_attrs.get("config")}
        except ValueError:
            winner = None
        methods[method] = {
            "trials": sum(s in ("complete", "pruned") for s in states),
            "complete": states.count("complete"), "pruned": states.count("pruned"),
            "failed": sum(t["state"] == "fail" and t["error"] is not None for t in trials),
            "killed_and_retried": sum(t["retries"] is not None for t in trials),
            "winner": winner, "trial_list": trials,
        }
    groups = final_groups(spec, spec.study_methods)
    declared, resolved, notes = resolved_primary(spec)
    primary = [pair for pair in declared if all(m in groups for m in pair)]
    table = study_table(groups, measure=measure) if groups else None
    comparisons = method_comparisons(groups, measure=measure, primary=primary) if len(groups) > 1 else None
    summary = {
        "spec": str(spec.path), "model": str(next(iter(spec.tuning_runs.values()))[0].config.model),
        "plumbing_check": plumbing_check(spec), "select": spec.settings.select, "budget": spec.budget,
        "tuning_seeds": list(spec.settings.seeds), "final_seeds": list(spec.settings.final_seeds),
        "trials_per_method": spec.settings.trials, "methods": methods,
        "final": [] if table is None else json.loads(table.reset_index().to_json(orient="records")),
        "comparisons": [] if comparisons is None else json.loads(comparisons.to_json(orient="records")),
        "measure": measure,
        "primary": {"declared": [list(pair) for pair in spec.settings.primary], "resolved": resolved,
                    "family": [list(pair) for pair in primary], "notes": notes},
        **_extras_summary(spec, groups, measure),
    }
    spec.out.mkdir(parents=True, exist_ok=True)
    Path(spec.out / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary in a few printed lines: trials, winner and held-out result per method."""
    lines = []
    if summary.get("plumbing_check"):
        lines.append(f"model {summary['model']}: random weights, so these scores mean nothing; this run checks "
                     "the plumbing (trials, reruns, summary), not the methods")
    final = {row["method"]: row for row in summary["final"]}
    for method, entry in summary["methods"].items():
        winner = entry["winner"]
        won = (f"winner trial {winner['trial']} ({summary['select']} {winner['value']:.4g}): {winner['params']}"
               if winner else "no complete trial")
        lines.append(f"{method}: {entry['trials']} trials ({entry['complete']} complete, {entry['pruned']} pruned, "
                     f"{entry['failed']} failed on their setting, {entry['killed_and_retried']} retries of stopped or killed "
                     f"trials); {won}")
        if method in final:
            row = final[method]
            lines.append(f"  held-out {summary['measure']} on {row['seeds']} final seeds: {row['mean']:.4g} "
                         f"(BCa {row['ci_low']:.4g} to {row['ci_high']:.4g}; t {row['t_low']:.4g} to {row['t_high']:.4g})")
    resolved = {k: v for k, v in summary.get("primary", {}).get("resolved", {}).items() if v}
    if resolved:
        lines.append("decided by the tuning: " + ", ".join(f"{k} = {v}" for k, v in resolved.items()))
    for row in summary["comparisons"]:
        p = row["holm_p"] if row["family"] == "primary" else row["permutation_p"]
        lines.append(f"{row['method_a']} - {row['method_b']} ({row['family']}): {row['difference']:.4g}, "
                     f"p {p:.3g}{' (Holm)' if row['family'] == 'primary' else ''}")
    for stage in ("long", "control"):
        for row in summary.get(stage, {}).get("final", []):
            lines.append(f"{stage}: {row['method']} held-out {summary['measure']} on {row['seeds']} seeds: {row['mean']:.4g}")
    return lines
