"""The README's Countdown figure from its stored summary (figures/countdown_gpu_summary.json, written
by scripts/gpu_countdown.py before that script became papermill_runs/es_vs_grpo_countdown_smollm2_gpu.yaml):
held-out accuracy and format rate of the base model and of each method's final adapter. The sweep
draws its own figures with notebook 04.

    python scripts/plot_countdown_gpu.py figures/countdown_gpu_summary.json --out figures
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import plotly.graph_objects as go

from evolm_lib.viz.figures import export_figure

LABELS = {"es_paper": "ES, paper settings", "es_lora": "ES, LoRA-moving settings", "grpo": "GRPO"}


def countdown_figure(summary: dict) -> go.Figure:
    """Grouped bars: accuracy and format rate on the held-out puzzles, before and after training."""
    names = ["base model"] + [LABELS.get(k, k) for k in summary["runs"]]
    scores = [summary["base"]] + [run["after"] for run in summary["runs"].values()]
    fig = go.Figure([
        go.Bar(name="accuracy (answer right)", x=names, y=[s["accuracy"] for s in scores]),
        go.Bar(name="format rate (<think>…</think><answer>…</answer>)", x=names, y=[s["format_rate"] for s in scores]),
    ])
    fig.update_layout(barmode="group", title=f"Countdown, SmolLM2-135M-Instruct, {summary['num_eval']} held-out puzzles<br>"
                      f"{summary['budget_completions']:,} training completions each, {summary['device']}",
                      yaxis=dict(title="share of held-out puzzles", range=[0, 1.05], tickformat=".0%"),
                      legend=dict(orientation="h", y=-0.25))
    return fig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("summary", type=Path)
    parser.add_argument("--out", type=Path, default=Path("figures"))
    args = parser.parse_args()
    summary = json.loads(args.summary.read_text())
    for path in export_figure(countdown_figure(summary), "countdown_gpu", args.out, formats=("png",), style=None):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
