"""Figures of the tuned study from its compacted files (``evolm_lib.tune.compact``), on any machine:
the best validation score so far against the trials counted; the held-out score against training
completions, generated tokens and wall-clock seconds (each method labelled with the engines per card
its runs had); and, where ``geometry.json`` lies beside the files (``python -m
evolm_lib.tune.geometry``), the winners' update norms per layer and the straight paths between them."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

CURVES = {"completions": "samples/completions", "tokens": "samples/tokens", "seconds": "time/training_s"}
"""The x axes of the held-out curves: training completions, generated tokens, training seconds
(``metrics.with_training_seconds``: the checkpoints and scoring of a run, whose cadence differs
between ES's generations and GRPO's steps, left out)."""
WORDS = {"completions": "training completions", "tokens": "generated tokens", "seconds": "training seconds"}
HELDOUT_KEY = "eval/reward"
"""The rows' greedy held-out score, drawn against each of ``CURVES``."""


def curve_figures(compact: dict) -> dict[str, Any]:
    """{name: plotly figure}: best_vs_trials, and heldout_vs_completions / _tokens / _seconds: mean and
    min-max band over the final seeds per method, from one stage for all (``curve_stage``), of the
    runs with held-out scores."""
    from ..analysis import reward_label
    from ..metrics import with_training_seconds
    from ..tune.compact import compact_groups
    from ..tune.report import placements
    from .plots import plot_runs_curve
    from .tuning import plot_best_so_far

    # the runs the held-out tables read: those that finished (a run cut short by a lease has no
    # held-out scores, and its rows stop early)
    runs = [run for run in compact["runs"] if run.get("heldout")]
    figures: dict[str, Any] = {}
    if compact["trials"]:
        by_method: dict[str, list] = {}
        for trial in compact["trials"]:
            by_method.setdefault(trial["method"], []).append(trial)
        figures["best_vs_trials"] = plot_best_so_far(by_method, (compact["summary"] or {}).get("select", "validation/reward"))
    stage = curve_stage(runs)
    if stage is None:
        return figures
    groups = compact_groups(runs, stage)
    names = curve_names({method: placements([r for r in runs if r["stage"] == stage and r["method"] == method])
                         for method in groups})
    named = {names[method]: [with_training_seconds(record.rows) for record in records]
             for method, records in groups.items()}
    for name, x in CURVES.items():
        figures[f"heldout_vs_{name}"] = plot_runs_curve(named, x=x, y=HELDOUT_KEY, reward_label=reward_label(groups),
                                                        title=f"Held-out score against {WORDS[name]}")
    return figures


def curve_names(places: dict[str, dict[str, str]]) -> dict[str, str]:
    """{method: legend name} from each method's ``tune.report.placements``: the engines a card beside
    the method, and the card too where the methods ran on different ones, since training seconds
    compare only on like cards."""
    devices = {place.get("device", "") for place in places.values()}
    names = {}
    for method, place in places.items():
        parts = [method]
        if len(devices) > 1 and place.get("device"):
            parts.append(", ".join(d.removeprefix("NVIDIA ").split()[0] for d in place["device"].split(", ")))
        if place.get("engines_per_card"):
            parts.append(f"{place['engines_per_card']} engines/card" + (f" ({place['mps']})" if place.get("mps") else ""))
        names[method] = ", ".join(parts)
    return names


def curve_stage(runs: Sequence[dict]) -> str | None:
    """The stage the held-out curves come from, one for every method: the continued reruns where every
    method has them for each of its reruns' seeds (they hold the reruns' rows and go on), else the
    reruns, else a plain sweep's runs; None where there are none."""
    def seeds(stage: str) -> dict[str, set]:
        found: dict[str, set] = {}
        for run in runs:
            if run["stage"] == stage:
                found.setdefault(run["method"], set()).add(run["seed"])
        return found

    final, long = seeds("final"), seeds("long")
    if final:
        return "long" if long == final else "final"
    return "sweep" if seeds("sweep") else None


def geometry_figures(geometry: dict) -> dict[str, Any]:
    """{name: plotly figure} from geometry.json: the update norms per layer at its first seed, and each path."""
    from .geometry import plot_path, plot_update_norms

    first = [u for u in geometry["updates"] if u["seed"] == geometry["seeds"][0]]
    figures = {"geometry_update_norms": plot_update_norms({u["method"]: u["by_layer"] for u in first})}
    for path in geometry.get("paths", []):
        figures[f"geometry_path_{path['a']}_{path['b']}"] = plot_path(path["rows"], (path["a"], path["b"]), path["barrier"])
    return figures


def export_study_figures(compact_dir: str | Path, out_dir: str | Path,
                         formats: Sequence[str] = ("png", "svg")) -> list[Path]:
    """Every figure of ``curve_figures`` (and ``geometry_figures`` where COMPACT_DIR/geometry.json
    exists) as OUT/<name>.{png,svg}; returns the paths."""
    from ..tune.compact import load_compact
    from .figures import export_figure

    compact = load_compact(compact_dir)
    figures = curve_figures(compact)
    if compact["geometry"]:
        figures.update(geometry_figures(compact["geometry"]))
    return [path for name, figure in figures.items() for path in export_figure(figure, name, out_dir, formats=formats)]
