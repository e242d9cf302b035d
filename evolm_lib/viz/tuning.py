"""Figures of a tuning study (`evolm tune`): the best validation score so far against the trials counted,
one line per method, and each searched setting's effect, Optuna's own slice and importance plots
(``optuna.visualization``, plotly figures like the others, exported by ``figures.export_figure``)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from .labels import axis_title, integer_ticks
from .plots import method_color


def best_so_far(trials: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[float]]:
    """(trial number, best value so far) at each counted trial (``counted_trials``) from the first with
    a score on (pruned and failed trials have no final score: the best carries over). A trial is
    numbered as `evolm tune` logs it and as its folder trial_NNNN is: a retry by the trial it retries."""
    from ..tune.report import counted_trials  # the tune package is heavy to import; figures alone need not pay

    counts, best, top = [], [], None
    for count, trial in _numbered(trials, counted_trials(trials)):
        if trial["state"] == "complete" and trial["value"] is not None:
            top = trial["value"] if top is None else max(top, trial["value"])
        if top is not None:
            counts.append(count)
            best.append(float(top))
    return counts, best


def _numbered(trials, counted) -> list[tuple[int, Mapping[str, Any]]]:
    """(number as logged, trial) for each counted trial, a retry numbered by its first attempt."""
    from ..tune.report import first_attempt

    by_number = {t["number"]: t for t in trials}
    return [(first_attempt(t, by_number), t) for t in counted]


def plot_best_so_far(trials_by_method: Mapping[str, Sequence[Mapping[str, Any]]], select: str = "validation/reward",
                     title: str = "Best score so far, per method (dots: each trial)") -> go.Figure:
    """One line per method: the best selection score among its first k counted trials
    (``counted_trials``: a killed trial's retry in its place), against the trial's number as the log
    and the trial folders give it, with every complete trial's own score as a marker of its colour (one legend entry
    a method: a paper's legend of two entries a method would take the plot's room)."""
    from ..tune.report import counted_trials

    fig = go.Figure()
    last = 1
    for index, (method, trials) in enumerate(trials_by_method.items()):
        color = method_color(method, index)
        counts, best = best_so_far(trials)
        fig.add_trace(go.Scatter(x=counts, y=best, mode="lines", name=method, legendgroup=method,
                                 line={"color": color, "shape": "hv"}))
        counted = counted_trials(trials)
        done = [(count, t["value"]) for count, t in _numbered(trials, counted)
                if t["state"] == "complete" and t["value"] is not None]
        fig.add_trace(go.Scatter(x=[c for c, _ in done], y=[v for _, v in done], mode="markers",
                                 name=f"{method}, each trial", legendgroup=method, showlegend=False,
                                 marker={"color": color, "size": 7, "opacity": 0.5}))
        last = max([last, *(count for count, _ in _numbered(trials, counted))])
    fig.update_layout(title=title, xaxis_title="trial (its number in the log)", yaxis_title=axis_title(select), template="plotly_white")
    fig.update_xaxes(**integer_ticks(last))
    return fig


def plot_parameter_slices(study) -> go.Figure:
    """Each searched setting's value against the trial's score (Optuna's slice plot)."""
    import optuna

    return optuna.visualization.plot_slice(study)


def plot_parameter_importances(study) -> go.Figure:
    """How much of the score's variation each searched setting explains (Optuna's fANOVA importances;
    it needs two or more complete trials)."""
    import optuna

    return optuna.visualization.plot_param_importances(study)


FEW_TRIALS = 10
"""Below this many complete trials, a slice or importance plot says it is too few to read an effect from."""


def export_tuning_figures(trials_by_method: Mapping[str, Sequence[Mapping[str, Any]]], studies: Mapping[str, Any],
                          out_dir: str | Path, select: str = "validation/reward",
                          formats: Sequence[str] = ("png", "svg")) -> list[Path]:
    """The best-so-far figure and every method's slice and importance plots as out_dir/tune_*.{png,svg};
    returns the paths (a method with fewer than two complete trials has no importance plot)."""
    from .figures import export_figure

    paths = export_figure(plot_best_so_far(trials_by_method, select), "tune_best_so_far", out_dir, formats=formats)
    for method, study in studies.items():
        complete = [t for t in trials_by_method.get(method, ()) if t["state"] == "complete"]
        if not complete:
            continue
        few = f"{method}, {len(complete)} complete trials" + (
            ": too few to read an effect from" if len(complete) < FEW_TRIALS else "")
        slices = plot_parameter_slices(study)
        slices.update_layout(title=f"Each setting against the score ({few})")
        paths += export_figure(slices, f"tune_{method}_slices", out_dir, formats=formats,
                               style=None, width=300 * max(1, len(complete[0]["params"])), height=400)
        if len(complete) >= 2:
            importances = plot_parameter_importances(study)
            importances.update_layout(title=f"Share of the score's variation each setting explains ({few})")
            paths += export_figure(importances, f"tune_{method}_importances", out_dir, formats=formats, style=None)
    return paths
