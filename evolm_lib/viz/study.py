"""Figures of a tuned study, from its folder or its export (``evolm_lib.tune.export``), on any machine:
the best validation score so far against the trials counted; the held-out score against training
completions, generated tokens and wall-clock seconds (each method labelled with the engines per card
its runs had); and, where ``geometry.json`` lies beside the files (``python -m
evolm_lib.tune.geometry``), the winners' update norms per layer and the straight paths between them;
and where the exported runs kept their answers' flags, what each run's held-out answers became
(empty, or holding their target), one point a run."""
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
ANSWER_STAGES = {"final": ("", "circle"), "long": (", 2x budget", "diamond"), "control": (", shuffled fitness", "x")}
"""The stages whose runs the answers' figure draws, each with what its legend adds to the method's
name and its marker: the reruns, their continuations to twice the budget, the control."""


def curve_figures(compact: dict) -> dict[str, Any]:
    """{name: plotly figure}: best_vs_trials, and heldout_vs_completions / _tokens / _seconds: mean and
    min-max band over the final seeds per method, from one stage for all (``curve_stage``), of the
    runs with held-out scores; heldout_vs_completions_late, the first of those from half its axis on."""
    from ..analysis import reward_label
    from ..metrics import with_training_seconds
    from ..tune.export import export_groups as compact_groups
    from ..tune.report import placements
    from .plots import plot_runs_curve
    from .tuning import plot_best_so_far

    # the runs the held-out tables read: those that finished (a run cut short has no held-out
    # scores, and its rows stop early)
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
    figures["heldout_vs_completions_late"] = plot_runs_curve(
        late_rows(named, CURVES["completions"]), x=CURVES["completions"], y=HELDOUT_KEY, reward_label=reward_label(groups),
        title="Held-out score against training completions, their second half")
    return figures


def late_rows(named: dict[str, list[list[dict]]], x: str) -> dict[str, list[list[dict]]]:
    """Each run's rows from half the largest ``x`` any run reaches: the curves' second half, whose
    axis then spans the scores there (where the first steps climb from far below, as conciseness's
    do from -110, the differences at the end are a sliver of the whole figure's axis)."""
    half = max((row.get(x, 0) for runs in named.values() for rows in runs for row in rows), default=0) / 2
    return {name: [[row for row in rows if row.get(x, 0) >= half] for rows in runs] for name, runs in named.items()}


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


def answer_points(compact: dict) -> dict[str, list[dict[str, Any]]]:
    """{legend name: [{"seed", "empty", "target", "score"}, ...]} per method and stage of ``ANSWER_STAGES``
    (the runs with held-out scores): the shares of a run's held-out answers that are empty and that
    hold their target (``analysis.ANSWER_FLAGS``) and its mean held-out score in the study's measure.
    A run whose lines do not say both is left out (an older export, made before exports kept them)."""
    from ..analysis import answer_share, default_measure, heldout_scores
    from ..tune.export import export_groups as compact_groups

    runs = [run for run in compact["runs"] if run.get("heldout")]
    measure = (compact["summary"] or {}).get("measure") or default_measure(compact_groups(runs, "final"))
    points: dict[str, list[dict[str, Any]]] = {}
    for stage, (suffix, _) in ANSWER_STAGES.items():
        for method, records in compact_groups(runs, stage).items():
            for record in records:
                empty, target = answer_share(record, "empty"), answer_share(record, "has_target")
                if empty is None or target is None:
                    continue
                scores = heldout_scores(record, measure)
                points.setdefault(f"{method}{suffix}", []).append(
                    {"seed": record.seed, "empty": empty, "target": target, "score": sum(scores) / len(scores)})
    return points


def answer_figure(compact: dict) -> Any | None:
    """What the held-out answers became: for each run of ``answer_points``, the share of its answers
    that are empty (x) against the share that hold their target (y), a method's colour, a stage's
    marker (``ANSWER_STAGES``), the seed and mean score on hover, and the base model as a star where
    the study holds its summary (``read_study``'s "base"); None where nothing kept the
    flags. A run at the right answers nothing, one at the top answers right, whatever the reward paid."""
    import plotly.graph_objects as go

    from .plots import method_color

    points = answer_points(compact)
    base = compact.get("base") or {}
    judged = "empty" in base and "has_target" in base
    if not points and not judged:
        return None
    fig = go.Figure()
    for index, (name, group) in enumerate(points.items()):  # a name is its method's and its stage's suffix
        symbol = next((symbol for suffix, symbol in ANSWER_STAGES.values() if suffix and name.endswith(suffix)),
                      ANSWER_STAGES["final"][1])
        fig.add_trace(go.Scatter(
            x=[100 * p["empty"] for p in group], y=[100 * p["target"] for p in group], mode="markers",
            name=f"{name} (n={len(group)})",
            marker={"color": method_color(name, index), "symbol": symbol, "size": 10, "opacity": 0.7},
            text=[f"seed {p['seed']}: held out {p['score']:.3g}" for p in group], hoverinfo="text+name"))
    if judged:  # where every method started: the untrained model on the same problems (tune.base_answers)
        fig.add_trace(go.Scatter(x=[100 * base["empty"]], y=[100 * base["has_target"]], mode="markers",
                                 name="base model", marker={"color": "black", "symbol": "star", "size": 14},
                                 text=[f"held out: reward {base['reward']:.3g}, success {100 * base['success']:.0f} %"],
                                 hoverinfo="text+name"))
    fig.update_layout(title="What the held-out answers became, one point a run", template="plotly_white",
                      xaxis_title="empty answers (%)", yaxis_title="answers holding the target (%)")
    fig.update_xaxes(range=[-3, 103])
    fig.update_yaxes(range=[-3, 103])
    return fig


def export_study_figures(study_dir: str | Path, out_dir: str | Path,
                         formats: Sequence[str] = ("png", "svg"), storage: str | None = None) -> list[Path]:
    """Every figure of ``curve_figures`` (with ``answer_figure`` where the runs kept their answers'
    flags, and ``geometry_figures`` where STUDY_DIR/geometry.json exists) of a study folder or an
    export as OUT/<name>.{png,svg}; returns the paths."""
    from ..tune.export import read_study
    from .figures import export_figure

    compact = read_study(study_dir, storage)
    figures = curve_figures(compact)
    answers = answer_figure(compact)
    if answers is not None:
        figures["heldout_answers"] = answers
    if compact["geometry"]:
        figures.update(geometry_figures(compact["geometry"]))
    return [path for name, figure in figures.items() for path in export_figure(figure, name, out_dir, formats=formats)]
