"""Figures from data: metrics rows (flat dicts, one per ES generation or GRPO step) in, plotly figures out.

No I/O here; `evolm_lib.viz.figures.export_figure` writes figures to disk. Axis titles come from
`evolm_lib.viz.labels` (words with units, never a raw `a/b` key); pass a task's `reward_label` to
say what a reward measures.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.colors import hex_to_rgb, qualitative

from ..metrics import Row, Runs, aggregate_seeds, final_value, finite, series, x_key, x_values
from .labels import PHASE_NAMES, REWARD, axis_format, axis_title, integer_ticks, label


# Stable trace names: `update_fitness` finds traces by these.
MEAN, BEST, BAND, EVAL, POLICY = "mean", "best", "p20-p80", "eval", "mean adapter (greedy)"
FITNESS_TRACE_NAMES = (BAND, MEAN, BEST, POLICY, EVAL)
TIME_KEYS = tuple(PHASE_NAMES)  # phases of a generation (ES) or step (GRPO), in the order they run
BOX_FROM_SEEDS = 5  # fewer seeds per method: every point and the mean, not a box
MARKERS_UP_TO = 20
"""A line of at most this many points is drawn with a marker on each: plotly draws nothing for a line of
one point (a stepper's first generation), and on a short run each generation stays visible; past it
the markers would crowd the line."""

_PALETTE = qualitative.Plotly
_METHOD_COLORS = {"es": _PALETTE[0], "es lora": _PALETTE[0], "grpo": _PALETTE[1], "grpo lora": _PALETTE[1],
                  "es eggroll": _PALETTE[2], "es full": _PALETTE[3], "grpo full": _PALETTE[4]}
"""One colour a method in every figure: the sweeps' names and the tuned study's (es_lora, ...) alike."""
_OTHER_COLORS = [c for c in _PALETTE if c not in _METHOD_COLORS.values()]  # labels of other names


# --------------------------------------------------------------------------- helpers


def _rgba(hex_color: str, alpha: float) -> str:
    r, g, b = hex_to_rgb(hex_color)
    return f"rgba({r},{g},{b},{alpha})"


def method_color(method: str, index: int) -> str:
    """The colour of ``method`` (the part of a label before a comma: "es_lora, 5 engines/card" is
    es_lora's), or, for a name without one, the ``index``-th of the others."""
    key = str(method).split(",")[0].strip().lower().replace("_", " ")
    return _METHOD_COLORS.get(key, _OTHER_COLORS[index % len(_OTHER_COLORS)])


def _records(table: Any) -> list[Mapping[str, Any]]:
    """Rows of a DataFrame (its index as a column) or a sequence of mappings, as a list of mappings."""
    if hasattr(table, "reset_index"):
        return table.reset_index().to_dict("records")
    return list(table)


def line_mode(points: int) -> str:
    """The scatter mode of a line of ``points`` points: markers on it up to MARKERS_UP_TO points."""
    return "lines+markers" if points <= MARKERS_UP_TO else "lines"


def _axis(key: str, reward_label: str | None = None, values: Sequence[float] = ()) -> dict:
    """Title and tick format of an axis holding ``key``; whole-number ticks for generations and steps."""
    axis = {"title": {"text": axis_title(key, reward_label)}, **axis_format(key)}
    if axis.get("tickformat") == "d" and values:
        axis.update(integer_ticks(max(values)))
    return axis


# --------------------------------------------------------------------------- one run


def _fitness_traces() -> list[go.Scatter]:
    blue, red, green, purple = _PALETTE[0], _PALETTE[1], _PALETTE[2], _PALETTE[3]
    return [
        go.Scatter(name=BAND, x=[], y=[], mode="lines", fill="toself", line=dict(width=0),
                   fillcolor=_rgba(blue, 0.2), hoverinfo="skip"),
        go.Scatter(name=MEAN, x=[], y=[], mode="lines", line=dict(color=blue, width=2), marker=dict(size=6)),
        go.Scatter(name=BEST, x=[], y=[], mode="lines", line=dict(color=green, dash="dot"), marker=dict(size=5)),
        go.Scatter(name=POLICY, x=[], y=[], mode="lines+markers", line=dict(color=purple),
                   marker=dict(size=5)),
        go.Scatter(name=EVAL, x=[], y=[], mode="markers",
                   marker=dict(color=red, size=9, symbol="diamond")),
    ]


def _fitness_layout(fig: go.Figure, title: str, reward_label: str | None = None) -> None:
    fig.update_layout(title=title, xaxis=_axis("generation"), yaxis=_axis(REWARD, reward_label),
                      template="plotly_white", hovermode="x unified",
                      legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0))


def fitness_figure(title: str = "ES fitness", reward_label: str | None = None) -> go.Figure:
    """The fitness plot with no points yet: `update_fitness` fills it (`evolm_lib.viz.live` shows it
    live in a notebook)."""
    fig = go.Figure(_fitness_traces())
    _fitness_layout(fig, title, reward_label)
    return fig


def update_fitness(fig: go.Figure, rows: Sequence[Row]) -> go.Figure:
    """Refresh the fitness traces of `fig` (made by `fitness_figure`) in place from all rows so far."""
    rows = list(rows)
    data: dict[str, tuple[list[float], list[float]]] = {
        MEAN: series(rows, "train/reward_mean"),
        BEST: series(rows, "train/reward_best"),
        POLICY: series(rows, "policy/train_reward"),
        EVAL: series(rows, "eval/reward"),
    }
    lo_x, lo_y = series(rows, "train/reward_p20")
    hi_x, hi_y = series(rows, "train/reward_p80")
    lo = dict(zip(lo_x, lo_y))
    band = [(x, lo[x], y) for x, y in zip(hi_x, hi_y) if x in lo]
    # the band is one closed polygon: along p80, then back along p20
    data[BAND] = ([b[0] for b in band] + [b[0] for b in reversed(band)],
                  [b[2] for b in band] + [b[1] for b in reversed(band)])

    x_axis = _axis(x_key(rows), values=[x for name in (MEAN, POLICY, EVAL) for x in data[name][0]])

    for trace in fig.data:
        if trace.name in data:
            trace.x, trace.y = data[trace.name]
        if trace.name in (MEAN, BEST):
            trace.mode = line_mode(len(trace.x))
    fig.layout.xaxis.update(x_axis)
    return fig


def plot_fitness(rows: Sequence[Row], title: str = "ES fitness", reward_label: str | None = None) -> go.Figure:
    """Population reward per generation: mean, 20-80 percentile band, best, eval and greedy mean adapter
    (``reward_label``: the task's reward in words, e.g. ``task.reward_label``)."""
    fig = update_fitness(fitness_figure(title, reward_label), rows)
    # traces without any data (no eval yet, no greedy reward) stay out of the legend
    fig.data = [t for t in fig.data if t.name in (MEAN, BAND) or len(t.x or ()) > 0]
    return fig


def plot_time_breakdown(rows: Sequence[Row], title: str = "Time per generation") -> go.Figure:
    """Stacked bars of each phase's seconds (adapters, generate or rollouts, reward, update, eval),
    plus whatever of time/generation_s they leave ("other": logging, checkpoints)."""
    rows = list(rows)
    xs = x_values(rows)
    fig = go.Figure()
    parts = {}
    for key in TIME_KEYS:
        if not any(finite(r.get(key)) for r in rows):
            continue  # a phase this method does not have (rollouts in ES, adapters in GRPO)
        parts[key] = [float(r[key]) if finite(r.get(key)) else 0.0 for r in rows]
        fig.add_bar(name=PHASE_NAMES[key], x=xs, y=parts[key])
    other = [max(0.0, float(r["time/generation_s"]) - sum(p[i] for p in parts.values()))
             if finite(r.get("time/generation_s")) else 0.0 for i, r in enumerate(rows)]
    if any(v > 1e-6 for v in other):
        fig.add_bar(name="other", x=xs, y=other)
    fig.update_layout(barmode="stack", title=title, xaxis=_axis(x_key(rows), values=[x for x in xs if finite(x)]),
                      yaxis=_axis("time/generation_s"), template="plotly_white")
    return fig


def plot_reward_distribution(rewards: Iterable[float], title: str = "Reward distribution",
                             nbins: int | None = None, reward_label: str | None = None) -> go.Figure:
    """Histogram of rewards (e.g. one generation's population, or per-prompt eval rewards)."""
    values = [float(r) for r in rewards if finite(r)]
    fig = go.Figure(go.Histogram(x=values, nbinsx=nbins, name="reward"))
    fig.update_layout(title=title, xaxis=_axis(REWARD, reward_label),
                      yaxis=dict(title_text="completions", **integer_ticks(len(values))),
                      template="plotly_white", bargap=0.05)
    return fig


def plot_layer_scales(names: Sequence[str], values: Sequence[float],
                      title: str = "Per-layer scale", y_title: str = "scale") -> go.Figure:
    """Bar chart of one number per layer (LoRA weight magnitude, noise scale, ...)."""
    if len(names) != len(values):
        raise ValueError(f"names and values differ in length: {len(names)} != {len(values)}")
    fig = go.Figure(go.Bar(x=list(names), y=[float(v) for v in values], name=y_title))
    fig.update_layout(title=title, xaxis_title="layer", yaxis=dict(title_text=y_title, tickformat="~g"),
                      template="plotly_white")
    return fig


# --------------------------------------------------------------------------- ES vs GRPO



def plot_runs_curve(runs: Runs, x: str, y: str, band: str = "minmax",
                    title: str | None = None, reward_label: str | None = None) -> go.Figure:
    """Mean curve of `y` over `x` per method, with a min-max (or +-std) band across seeds."""
    if band not in ("minmax", "std"):
        raise ValueError(f"band must be 'minmax' or 'std', got {band!r}")
    fig = go.Figure()
    xs_all: list[float] = []
    for i, (method, seed_rows) in enumerate(runs.items()):
        agg = aggregate_seeds(seed_rows, x, y)
        xs_all += agg["x"]
        color = method_color(method, i)
        if band == "minmax":
            upper, lower, band_name = agg["max"], agg["min"], f"{method} min-max"
        else:
            upper = [m + s for m, s in zip(agg["mean"], agg["std"])]
            lower = [m - s for m, s in zip(agg["mean"], agg["std"])]
            band_name = f"{method} ±std"
        if len(seed_rows) > 1:
            fig.add_scatter(name=band_name, legendgroup=method, showlegend=False,
                            x=agg["x"] + agg["x"][::-1], y=upper + lower[::-1], mode="lines",
                            fill="toself", fillcolor=_rgba(color, 0.2), line=dict(width=0),
                            hoverinfo="skip")
        fig.add_scatter(name=f"{method} (n={len(seed_rows)})", legendgroup=method, x=agg["x"],
                        y=agg["mean"], mode=line_mode(len(agg["x"])), line=dict(color=color, width=2),
                        marker=dict(size=6))
    fig.update_layout(title=title or f"{label(y)} vs {label(x)}", xaxis=_axis(x, values=xs_all),
                      yaxis=_axis(y, reward_label), template="plotly_white", hovermode="x unified")
    return fig


def plot_reward_vs_samples(runs: Runs, x: str = "samples/completions",
                           y: str = "policy/train_reward", band: str = "minmax",
                           title: str | None = None, reward_label: str | None = None) -> go.Figure:
    """Reward against samples used (completions or tokens), mean and band across seeds per method."""
    return plot_runs_curve(runs, x=x, y=y, band=band, title=title or "Reward vs samples",
                           reward_label=reward_label)


def plot_reward_vs_time(runs: Runs, y: str = "policy/train_reward", band: str = "minmax",
                        title: str | None = None, reward_label: str | None = None) -> go.Figure:
    """Reward against wall-clock seconds, mean and band across seeds per method."""
    return plot_runs_curve(runs, x="time/wall_s", y=y, band=band,
                           title=title or "Reward vs wall-clock time", reward_label=reward_label)


def pareto_front(points: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Points not beaten by another with lower-or-equal KL and higher reward, by KL ascending."""
    ordered = sorted((p for p in points if finite(p.get("kl")) and finite(p.get("reward"))),
                     key=lambda p: (float(p["kl"]), -float(p["reward"])))
    front, best = [], -math.inf
    for p in ordered:
        if float(p["reward"]) > best:
            front.append(p)
            best = float(p["reward"])
    return front


LOG_KL_FROM_DECADES = 2
"""The KL axis is logarithmic (``log_kl=None``) when the positive KLs span more than this many decades:
ES moves a model 0.001-0.01 nats a token, a collapsed GRPO run 1-10, and on a linear axis every ES
point sits on zero."""


def plot_reward_vs_kl(points: Sequence[Mapping[str, Any]], title: str = "Reward vs KL to base",
                      reward_key: str = "eval/reward", reward_label: str | None = None,
                      log_kl: bool | None = None) -> go.Figure:
    """Reward (``reward_key``, for the axis title) against KL to the base model: one marker per
    (method, seed) for final points, one path per (method, seed) for checkpoint points (with a
    ``generation``: ``analysis.checkpoint_points``). ``log_kl``: a logarithmic KL axis; None picks it
    when the positive KLs span more than LOG_KL_FROM_DECADES decades. A log axis leaves out points of
    KL 0 (the base model itself, at generation 0) and says so in its title."""
    positive = [float(p["kl"]) for p in points if p.get("kl") is not None and float(p["kl"]) > 0]
    if log_kl is None:
        log_kl = len(positive) > 1 and math.log10(max(positive) / min(positive)) > LOG_KL_FROM_DECADES
    dropped = [p for p in points if log_kl and p.get("kl") is not None and float(p["kl"]) <= 0]
    points = [p for p in points if p not in dropped]
    fig = go.Figure()
    methods = list(dict.fromkeys(str(p.get("method", "?")) for p in points))
    for i, method in enumerate(methods):
        pts = [p for p in points if str(p.get("method", "?")) == method]
        if any("generation" in p for p in pts):  # checkpoints: one path per seed, in generation order
            for n, seed in enumerate(dict.fromkeys(p.get("seed") for p in pts)):
                path = sorted((p for p in pts if p.get("seed") == seed), key=lambda p: p["generation"])
                fig.add_scatter(name=method, legendgroup=method, showlegend=n == 0, mode="lines+markers",
                                x=[p["kl"] for p in path], y=[p["reward"] for p in path],
                                marker=dict(size=7, color=method_color(method, i)),
                                line=dict(width=1, color=method_color(method, i)),
                                text=[f"seed {seed}, generation {p['generation']}" for p in path],
                                hovertemplate="%{text}<br>KL %{x:.4g}<br>reward %{y:.4g}<extra></extra>")
            continue
        fig.add_scatter(name=method, x=[p.get("kl") for p in pts], y=[p.get("reward") for p in pts],
                        mode="markers", marker=dict(size=10, color=method_color(method, i)),
                        text=[f"seed {p.get('seed')}" for p in pts],
                        hovertemplate="%{text}<br>KL %{x:.4g}<br>reward %{y:.4g}<extra></extra>")
    front = pareto_front(points)
    if len(front) > 1:
        fig.add_scatter(name="Pareto front", x=[p["kl"] for p in front],
                        y=[p["reward"] for p in front], mode="lines",
                        line=dict(color="gray", dash="dash", shape="hv"), hoverinfo="skip")
    xaxis = _axis("policy/kl")
    if log_kl:
        xaxis.update(type="log", dtick=1)  # a label a decade: 0.001, 0.01, ... (1-2-5 labels collide)
        text = xaxis["title"]["text"]  # "... (nats per token)": the scale and what it leaves out inside the brackets
        note = f"log scale, KL 0 ({len(dropped)}) left out" if dropped else "log scale"
        xaxis["title"]["text"] = text[:-1] + f"; {note})" if text.endswith(")") else f"{text} ({note})"
    fig.update_layout(title=title, xaxis=xaxis, yaxis=_axis(reward_key, reward_label), template="plotly_white")
    return fig


def plot_seed_spread(runs: Runs, y: str = "policy/train_reward", title: str | None = None,
                     reward_label: str | None = None) -> go.Figure:
    """Every seed's final `y` per method, with the mean; a box (with the points) from
    BOX_FROM_SEEDS seeds up, where quartiles mean something."""
    fig = go.Figure()
    for i, (method, seed_rows) in enumerate(runs.items()):
        finals, seeds = [], []
        for j, rows in enumerate(seed_rows):
            value = final_value(list(rows), y)
            if value is not None:
                finals.append(value)
                seeds.append(next((r["seed"] for r in rows if "seed" in r), j))
        color = method_color(method, i)
        text = [f"seed {s}" for s in seeds]
        if len(finals) >= BOX_FROM_SEEDS:
            fig.add_box(name=method, x=[method] * len(finals), y=finals, boxpoints="all", pointpos=0,
                        jitter=0.3, boxmean=True, marker=dict(color=color, size=8), text=text)
            continue
        fig.add_scatter(name=method, x=[method] * len(finals), y=finals, mode="markers", text=text,
                        marker=dict(color=color, size=10, opacity=0.8),
                        hovertemplate="%{text}: %{y:.4g}<extra></extra>")
        if finals:
            fig.add_scatter(name=f"{method} mean", x=[method], y=[sum(finals) / len(finals)], mode="markers",
                            marker=dict(color=color, size=36, symbol="line-ew", line=dict(width=3, color=color)),
                            hovertemplate=f"mean of {len(finals)} seeds: %{{y:.4g}}<extra></extra>")
    fig.update_layout(title=title or f"Final {label(y)} per seed", xaxis_title="method",
                      yaxis=_axis(y, reward_label), template="plotly_white", showlegend=False)
    return fig


def plot_heldout(runs: Any, methods: Any, y: str = "heldout/accuracy", title: str | None = None,
                 reward_label: str | None = None) -> go.Figure:
    """Held-out score per method: each seed's score as a point with its interval over problems (thin
    bars), and the method's mean across seeds with its interval across seeds (thick bars, beside the
    points). ``runs``: rows with method, seed, value (ci_low, ci_high optional), e.g.
    `analysis.heldout_table`; ``methods``: rows with method, mean, ci_low, ci_high, e.g.
    `analysis.study_table` (DataFrames or sequences of mappings); ``y``: the key that labels the axis."""
    runs, methods = _records(runs), _records(methods)
    names = list(dict.fromkeys([str(m["method"]) for m in methods] + [str(r["method"]) for r in runs]))
    fig = go.Figure()
    for i, method in enumerate(names):
        color = method_color(method, i)
        points = [r for r in runs if str(r["method"]) == method and finite(r.get("value"))]
        if points:
            # seeds spread over [i - 0.3, i - 0.05]; the mean sits at i + 0.15
            offsets = [-0.3 + 0.25 * k / (len(points) - 1) if len(points) > 1 else -0.175 for k in range(len(points))]
            values = [float(p["value"]) for p in points]
            has_bars = all(finite(p.get("ci_low")) and finite(p.get("ci_high")) for p in points)
            fig.add_scatter(
                name=f"{method} seeds", legendgroup=method, showlegend=False, mode="markers",
                x=[i + o for o in offsets], y=values, marker=dict(color=color, size=7, opacity=0.7),
                error_y=dict(type="data", array=[float(p["ci_high"]) - v for p, v in zip(points, values)],
                             arrayminus=[v - float(p["ci_low"]) for p, v in zip(points, values)],
                             thickness=1, width=0, color=color) if has_bars else None,
                text=[f"{method}, seed {p.get('seed')}" for p in points],
                hovertemplate="%{text}: %{y:.4g}<extra></extra>")
        summary = next((m for m in methods if str(m["method"]) == method and finite(m.get("mean"))), None)
        if summary is not None:
            mean = float(summary["mean"])
            fig.add_scatter(
                name=method, legendgroup=method, mode="markers", x=[i + 0.15], y=[mean],
                marker=dict(color=color, size=12, symbol="diamond"),
                error_y=dict(type="data", array=[float(summary["ci_high"]) - mean],
                             arrayminus=[mean - float(summary["ci_low"])], thickness=2.5, width=8, color=color),
                hovertemplate=(f"{method}: mean %{{y:.4g}} [{float(summary['ci_low']):.4g}, "
                               f"{float(summary['ci_high']):.4g}]<extra></extra>"))
    fig.update_layout(title=title or f"{label(y)} per method", template="plotly_white", showlegend=False,
                      xaxis=dict(title_text="method", tickmode="array", tickvals=list(range(len(names))),
                                 ticktext=[name.replace(" ", "<br>", 1) for name in names], tickangle=0,
                                 range=[-0.6, len(names) - 0.4]),  # "grpo<br>lr=0.0005": upright, none dropped
                      yaxis=_axis(y, reward_label))
    return fig
