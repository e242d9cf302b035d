"""Figures of the synthetic testbed: f against queries with a band over seeds, final f per estimator.

Rows in (the frame `evolm_lib.zo.run.run_comparison` returns), plotly figures out; no I/O (write
them with `evolm_lib.viz.figures.export_figure`).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import hex_to_rgb, qualitative

from evolm_lib.zo.run import runs_of

BANDS = ("minmax", "std")
_PALETTE = qualitative.D3 + ["#000000", "#B68100", "#00A08B", "#FC0080"]  # 14 distinguishable colours
_TINY = 1e-300  # f = 0 exactly (a minimum reached) still has a logarithm


def _rgba(hex_color: str, alpha: float) -> str:
    r, g, b = hex_to_rgb(hex_color)
    return f"rgba({r},{g},{b},{alpha})"


def _describe(history: pd.DataFrame) -> str:
    functions = sorted(set(history["function"]))
    dimensions = sorted(set(history["dimension"]))
    seeds = history["seed"].nunique()
    return f"{', '.join(functions)}, d = {', '.join(f'{d:,}' for d in dimensions)}, {seeds} seed{'s' if seeds != 1 else ''}"


def seed_band(runs: list[pd.DataFrame], band: str = "minmax", points: int = 200) -> pd.DataFrame:
    """Runs of one estimator on a common query grid: columns queries, center, lower, upper (of f).

    Each run's log10 f is interpolated linearly in queries onto the grid (up to the shortest run);
    the centre is the mean of log10 f over seeds (a geometric mean of f), the band its min-max or
    mean +/- one std, all returned as f.
    """
    if band not in BANDS:
        raise ValueError(f"band must be one of {list(BANDS)}, got {band!r}")
    if not runs:
        raise ValueError("no runs to describe")
    end = min(float(run["queries"].max()) for run in runs)
    grid = np.unique(np.concatenate([np.linspace(0.0, end, points), [end]]))
    logs = np.stack([np.interp(grid, run["queries"].to_numpy(float), np.log10(np.maximum(run["f"].to_numpy(float), _TINY)))
                     for run in runs])  # (seeds, points)
    center = logs.mean(axis=0)
    if band == "minmax":
        lower, upper = logs.min(axis=0), logs.max(axis=0)
    else:
        spread = logs.std(axis=0)
        lower, upper = center - spread, center + spread
    return pd.DataFrame({"queries": grid, "center": 10**center, "lower": 10**lower, "upper": 10**upper})


def plot_f_vs_queries(history: pd.DataFrame, band: str = "minmax", log_y: bool = True) -> go.Figure:
    """f at the current point against queries used, one line per estimator (geometric mean over seeds) and its band."""
    figure = go.Figure()
    band_words = "min to max" if band == "minmax" else "mean +/- one std of log f"
    for index, (name, runs) in enumerate(runs_of(history).items()):
        color = _PALETTE[index % len(_PALETTE)]
        stats = seed_band(runs, band)
        if len(runs) > 1:
            figure.add_trace(go.Scatter(
                x=np.concatenate([stats["queries"], stats["queries"][::-1]]),
                y=np.concatenate([stats["upper"], stats["lower"][::-1]]),
                fill="toself", fillcolor=_rgba(color, 0.12), line={"width": 0}, hoverinfo="skip",
                legendgroup=name, showlegend=False, name=f"{name} band"))
        figure.add_trace(go.Scatter(x=stats["queries"], y=stats["center"], mode="lines", name=name,
                                    legendgroup=name, line={"color": color, "width": 2}))
    figure.update_layout(
        title=f"f against function evaluations ({_describe(history)}; band: {band_words} over seeds)",
        xaxis_title="function evaluations (queries)", yaxis_title="f at the current point",
        template="plotly_white", legend_title_text="estimator",
        legend={"tracegroupgap": 0, "font": {"size": 11}})  # 14 estimators fit a 500-pixel-high export
    if log_y:
        figure.update_yaxes(type="log")
    return figure


def plot_final_values(history: pd.DataFrame, log_y: bool = True) -> go.Figure:
    """Final f of every run, one column per estimator (best on the left), one marker per seed."""
    ends = history.sort_values("step").groupby(["estimator", "seed"], sort=False).last().reset_index()
    order = ends.groupby("estimator")["f"].apply(lambda f: float(np.mean(np.log10(np.maximum(f, _TINY))))).sort_values().index
    colors = {name: _PALETTE[i % len(_PALETTE)] for i, name in enumerate(dict.fromkeys(history["estimator"]))}
    start = ends.merge(history[history["step"] == 0][["estimator", "seed", "f"]], on=["estimator", "seed"], suffixes=("", "_start"))
    figure = go.Figure()
    for name in order:
        rows = start[start["estimator"] == name]
        figure.add_trace(go.Scatter(
            x=[name] * len(rows), y=rows["f"], mode="markers", name=name, showlegend=False,
            marker={"color": colors[name], "size": 9},
            customdata=np.stack([rows["seed"], rows["f_start"], rows["queries"]], axis=1),
            hovertemplate="%{x}, seed %{customdata[0]}<br>f %{y:.4g} (from %{customdata[1]:.4g})<br>%{customdata[2]} queries<extra></extra>"))
    start_values = start["f_start"]
    if len(start_values) and math.isfinite(float(start_values.mean())):
        figure.add_hline(y=float(np.exp(np.mean(np.log(np.maximum(start_values, _TINY))))), line_dash="dot",
                         line_color="grey", annotation_text="start (geometric mean)")
    figure.update_layout(
        title=f"Final f at an equal query budget ({_describe(history)}; one marker per seed)",
        xaxis_title="estimator (best geometric mean on the left)", yaxis_title="final f",
        template="plotly_white")
    if log_y:
        figure.update_yaxes(type="log")
    return figure
