"""Figures of the geometry of solutions (``evolm_lib.geometry``): update norms per layer, the straight
path between two solutions, and drift on another task per checkpoint. Each returns a plotly figure."""
from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots


def plot_update_norms(per_layer: Mapping[str, Sequence[dict]], relative: bool = False) -> go.Figure:
    """Each run's update norm per layer (``summarize(rows, by="layer")``), one bar group per layer;
    ``relative``: divided by the base weights' norm. Weights outside the layers are labelled "other"."""
    fig = go.Figure()
    for label, groups in per_layer.items():
        layers = [str(g["layer"]) if g["layer"] is not None else "other" for g in groups]
        values = [g["norm"] / g["base_norm"] if relative and g["base_norm"] else g["norm"] for g in groups]
        fig.add_bar(name=label, x=layers, y=values)
    fig.update_layout(barmode="group", xaxis_title="layer",
                      yaxis_title="||update|| / ||base weights||" if relative else "||update|| (Frobenius)",
                      title="How far each run moved the weights, per layer")
    return fig


def plot_path(rows: Sequence[dict], labels: tuple[str, str], barrier: float | None = None) -> go.Figure:
    """Held-out reward (and KL to the base model, where measured) along (1 - t) theta_A + t theta_B."""
    with_kl = any("policy/kl" in r for r in rows)
    fig = make_subplots(rows=1, cols=2 if with_kl else 1,
                        subplot_titles=["held-out reward", "KL to the base model"] if with_kl else ["held-out reward"])
    ts = [r["t"] for r in rows]
    fig.add_scatter(x=ts, y=[r["eval/reward"] for r in rows], mode="lines+markers", name="held-out reward", row=1, col=1)
    fig.add_scatter(x=[0, 1], y=[rows[0]["eval/reward"], rows[-1]["eval/reward"]], mode="lines", name="line between the ends",
                    line={"dash": "dot"}, row=1, col=1)
    if with_kl:
        fig.add_scatter(x=ts, y=[r.get("policy/kl") for r in rows], mode="lines+markers", name="KL to base", row=1, col=2)
    title = f"The straight path from {labels[0]} (t = 0) to {labels[1]} (t = 1)"
    if barrier is not None:
        title += f": barrier {barrier:.3g}"
    fig.update_layout(title=title)
    fig.update_xaxes(title_text=f"t (0: {labels[0]}, 1: {labels[1]})")  # the ends named where a paper drops the title
    return fig


def plot_drift(drift: Mapping[str, Sequence[dict]], task_name: str) -> go.Figure:
    """Each run's KL to the base model on another task's prompts, per checkpoint."""
    fig = go.Figure()
    for label, rows in drift.items():
        fig.add_scatter(x=[r["generation"] for r in rows], y=[r["off_task/kl"] for r in rows], mode="lines+markers", name=label)
    fig.update_layout(xaxis_title="generation / step", yaxis_title=f"KL to base, {task_name} prompts",
                      title="Drift off the task")
    return fig
