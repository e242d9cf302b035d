"""Figures from hand-made metrics rows, and static export with kaleido."""
from __future__ import annotations


import plotly.graph_objects as go
import pytest

from evolm_lib import metrics
from evolm_lib.viz import figures, plots


def make_rows(n: int = 4, with_policy: bool = True) -> list[dict]:
    rows = []
    for g in range(n):
        row = {
            "generation": g, "method": "es", "seed": 0,
            "train/reward_mean": 0.1 * g, "train/reward_best": 0.2 * g,
            "train/reward_p20": 0.05 * g, "train/reward_p80": 0.15 * g, "train/reward_worst": 0.0,
            "eval/reward": 0.5 * g if g % 2 == 0 else None,  # eval every 2 generations
            "time/adapters_s": 1.0, "time/generate_s": 2.0, "time/reward_s": 0.5,
            "time/update_s": 0.25, "time/generation_s": 4.0,
            "samples/completions": 8 * (g + 1), "time/wall_s": 4.0 * (g + 1),
        }
        if with_policy and g != 1:  # missing on some rows
            row["policy/train_reward"] = 0.3 * g
        rows.append(row)
    return rows


def trace(fig: go.Figure, name: str):
    matches = [t for t in fig.data if t.name == name]
    assert len(matches) == 1, f"no single trace named {name!r} in {[t.name for t in fig.data]}"
    return matches[0]


def test_plot_fitness_traces_and_values():
    fig = plots.plot_fitness(make_rows(), title="t")
    assert isinstance(fig, go.Figure)
    assert [t.name for t in fig.data] == ["p20-p80", "mean", "best", "mean adapter (greedy)", "eval"]
    assert list(trace(fig, "mean").x) == [0, 1, 2, 3]
    assert list(trace(fig, "mean").y) == pytest.approx([0, 0.1, 0.2, 0.3])
    assert list(trace(fig, "best").y) == pytest.approx([0, 0.2, 0.4, 0.6])
    # eval only where it was measured
    assert list(trace(fig, "eval").x) == [0, 2]
    assert list(trace(fig, "eval").y) == pytest.approx([0, 1.0])
    # greedy reward skips the row without it
    assert list(trace(fig, "mean adapter (greedy)").x) == [0, 2, 3]
    # band: a closed polygon along p80 and back along p20
    band = trace(fig, "p20-p80")
    assert list(band.x) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert list(band.y) == pytest.approx([0, 0.15, 0.3, 0.45, 0.15, 0.1, 0.05, 0])
    assert band.fill == "toself"
    assert fig.layout.title.text == "t"


def test_plot_fitness_without_optional_series():
    rows = make_rows(with_policy=False)
    for r in rows:
        r.pop("eval/reward")
    fig = plots.plot_fitness(rows)
    assert {t.name for t in fig.data} == {"p20-p80", "mean", "best"}


def test_plot_fitness_grpo_steps():
    rows = [{"step": s, "train/reward_mean": float(s)} for s in range(3)]
    fig = plots.plot_fitness(rows)
    assert list(trace(fig, "mean").x) == [0, 1, 2]
    assert fig.layout.xaxis.title.text == "step"


def test_the_live_plot_gains_a_point_per_generation_in_its_synced_outputs():
    from evolm_lib.viz.live import live_fitness_plot

    live = live_fitness_plot(title="live")
    assert {t.name for t in live.figure.data} == set(plots.FITNESS_TRACE_NAMES)
    assert all(len(t.x or ()) == 0 for t in live.figure.data)
    rows = make_rows(4)
    live.update(rows[:2])
    assert len(trace(live.figure, "mean").x) == 2
    live.update(rows[:3])
    assert len(trace(live.figure, "mean").x) == 3
    assert trace(live.figure, "mean").y[-1] == pytest.approx(0.2)
    assert list(trace(live.figure, "eval").x) == [0, 2]
    # what the front end draws is the widget's synced state: one output, the figure as plotly's
    # renderer reads it, with the points and the title
    [output] = live.widget.get_state()["outputs"]
    drawn = output["data"]["application/vnd.plotly.v1+json"]
    assert output["output_type"] == "display_data" and drawn["layout"]["title"]["text"] == "live"
    assert {t["name"]: list(t["x"]) for t in drawn["data"]}["mean"] == [0, 1, 2]
    assert output["data"]["text/plain"] == "<live: 3 points>"


def test_a_line_of_one_point_shows_a_marker_the_steppers_first_generation_included():
    # plotly draws nothing for a "lines" trace of one point: the stepper's first Step showed an empty plot
    from evolm_lib.viz.live import live_fitness_plot

    live = live_fitness_plot()
    live.update(make_rows(1))
    [output] = live.widget.get_state()["outputs"]
    drawn = {t["name"]: t for t in output["data"]["application/vnd.plotly.v1+json"]["data"]}
    for name in ("mean", "best"):
        assert len(drawn[name]["x"]) == 1 and "markers" in drawn[name]["mode"], drawn[name]
    one = plots.plot_fitness(make_rows(1))
    assert "markers" in trace(one, "mean").mode and "markers" in trace(one, "best").mode
    # a short run keeps its markers (each generation visible); a long one is a plain line
    assert trace(plots.plot_fitness(make_rows(plots.MARKERS_UP_TO)), "mean").mode == "lines+markers"
    assert trace(plots.plot_fitness(make_rows(plots.MARKERS_UP_TO + 1)), "mean").mode == "lines"
    # the mean curve across seeds: one point (one generation logged) is drawn too
    rows = make_rows(1)
    curve = plots.plot_reward_vs_samples({"es": [rows, rows]})
    assert "markers" in trace(curve, "es (n=2)").mode


@pytest.mark.skipif(not figures.chromium_available(),
                    reason="no Chromium for kaleido: apt-get install chromium (or make setup)")
def test_a_fitness_plot_of_one_generation_draws_its_point_in_the_png(tmp_path):
    import io

    import numpy as np
    from PIL import Image

    fig = plots.plot_fitness([{"generation": 0, "train/reward_mean": 0.5}]).update_layout(showlegend=False)
    [png] = figures.export_figure(fig, "one", tmp_path, formats=("png",), style=None, scale=1)
    pixels = np.asarray(Image.open(io.BytesIO(png.read_bytes())).convert("RGB")).astype(int)
    mean_color = np.array(plotly_rgb(trace(fig, "mean").line.color))
    # the mean's colour appears only where its point is drawn (no legend sample, no band)
    assert (np.abs(pixels - mean_color).sum(axis=2) < 30).sum() > 10


def plotly_rgb(color: str) -> tuple[int, int, int]:
    from plotly.colors import hex_to_rgb

    return hex_to_rgb(color)


def test_the_tiny_random_model_is_named_a_plumbing_check_in_titles():
    from evolm_lib.viz import labels

    note = "tiny-random: a plumbing check; its rewards mean nothing"
    assert labels.TINY_MODEL_NOTE == note
    assert labels.model_title("ES on conciseness", "tiny-random") == f"ES on conciseness ({note})"
    assert labels.model_title("ES on conciseness", "smollm2-135m-instruct") == "ES on conciseness (smollm2-135m-instruct)"
    assert labels.model_note(["smollm2-135m-instruct", "/cache/models/tiny-random/"]) == note  # by its folder too
    assert labels.model_note({"smollm2-135m-instruct", None}) == "" and labels.model_note(None) == ""
    fig = labels.note_model(plots.plot_reward_vs_samples({"es": [make_rows()]}), {"tiny-random"})
    assert fig.layout.title.text == f"Reward vs samples ({note})"
    assert labels.note_model(plots.plot_seed_spread({"es": [make_rows()]}), ["my-model"]).layout.title.text == \
        "Final greedy reward on train prompts per seed"


def test_the_steppers_plot_names_the_task_and_the_model():
    from types import SimpleNamespace

    from evolm_lib.viz import labels
    from evolm_lib.viz.stepper import ESStepper

    run = SimpleNamespace(config=SimpleNamespace(task="conciseness", model="tiny-random"), history=[], generation=0)
    stepper = ESStepper(run)
    assert stepper.plot.figure.layout.title.text == f"ES on conciseness ({labels.TINY_MODEL_NOTE})"


def test_update_fitness_on_plain_figure():
    fig = plots.fitness_figure()
    plots.update_fitness(fig, make_rows(2))
    assert list(trace(fig, "best").y) == pytest.approx([0, 0.2])


def test_time_breakdown_gives_eval_its_own_slice():
    rows = make_rows(3)
    for row in rows:
        row.update({"time/eval_s": 0.25})  # the phases now sum to time/generation_s: no "other"
    fig = plots.plot_time_breakdown(rows)
    assert [t.name for t in fig.data] == ["adapters", "generate", "reward", "update", "eval"]
    assert list(trace(fig, "eval").y) == [0.25] * 3
    grpo = [{"step": s, "time/rollout_s": 1.0, "time/reward_s": 0.1, "time/update_s": 2.0, "time/eval_s": 0.5,
             "time/generation_s": 3.6} for s in range(1, 4)]
    fig = plots.plot_time_breakdown(grpo, title="GRPO")
    assert [t.name for t in fig.data] == ["rollouts", "reward", "update", "eval"]
    assert fig.layout.xaxis.title.text == "step" and fig.layout.yaxis.title.text == "time per generation (s)"


def test_generation_axes_have_whole_number_ticks():
    fig = plots.plot_fitness(make_rows(4))
    assert fig.layout.xaxis.tickformat == "d" and fig.layout.xaxis.dtick == 1 and fig.layout.xaxis.tick0 == 0
    long = [{"generation": g, "train/reward_mean": 0.0} for g in range(0, 501, 10)]
    assert plots.plot_fitness(long).layout.xaxis.dtick == 100
    assert plots.plot_time_breakdown(make_rows(3)).layout.xaxis.dtick == 1


def test_tick_formats_read_right():
    fig = plots.plot_reward_vs_kl([{"method": "es", "seed": 0, "kl": 1e-4, "reward": 1.0}])
    assert fig.layout.xaxis.tickformat == "~g"  # 0.0001, not plotly's "100µ"
    runs = {"es": [seed_run(0, [0, 10000, 20000])]}
    assert plots.plot_reward_vs_samples(runs).layout.xaxis.tickformat == "~s"  # 20k


def test_rewards_carry_the_task_definition():
    fig = plots.plot_fitness(make_rows(), reward_label="-|length difference|, chars")
    assert fig.layout.yaxis.title.text == "reward<br>(-|length difference|, chars)"
    runs = {"es": [seed_run(0, [0, 10])]}
    fig = plots.plot_reward_vs_samples(runs, reward_label="exact match, 0 or 1")
    assert fig.layout.yaxis.title.text == "greedy reward on train<br>prompts<br>(exact match, 0 or 1)"
    assert fig.layout.xaxis.title.text == "training completions"


def _axis_titles(fig) -> dict[str, str]:
    return {name: fig.layout[name].title.text for name in fig.layout if name.startswith(("xaxis", "yaxis"))}


def _figures_of_every_plot_function():
    runs = {"es": [seed_run(0, [0, 10]), seed_run(2, [0, 10], seed=1)], "grpo": [seed_run(1, [0, 5, 10], method="grpo")]}
    points = [{"method": "es", "seed": 0, "kl": 0.01, "reward": 0.5}, {"method": "grpo", "seed": 0, "kl": 0.5, "reward": 0.7}]
    return {
        "plot_fitness": plots.plot_fitness(make_rows()),
        "fitness_figure": plots.fitness_figure(),
        "plot_time_breakdown": plots.plot_time_breakdown(make_rows()),
        "plot_reward_distribution": plots.plot_reward_distribution([0.0, 1.0]),
        "plot_layer_scales": plots.plot_layer_scales(["0", "1"], [0.1, 0.2]),
        "plot_runs_curve": plots.plot_runs_curve(runs, "samples/tokens", "grpo/grad_norm"),
        "plot_reward_vs_samples": plots.plot_reward_vs_samples(runs),
        "plot_reward_vs_time": plots.plot_reward_vs_time(runs),
        "plot_reward_vs_kl": plots.plot_reward_vs_kl(points),
        "plot_seed_spread": plots.plot_seed_spread(runs),
        "plot_heldout": plots.plot_heldout([{"method": "es", "seed": 0, "value": 0.5}],
                                           [{"method": "es", "mean": 0.5, "ci_low": 0.4, "ci_high": 0.6}]),
    }


def test_every_figure_function_labels_its_axes_in_words():
    import inspect
    import re

    drawn = _figures_of_every_plot_function()
    public = {name for name, f in inspect.getmembers(plots, inspect.isfunction)
              if f.__module__ == plots.__name__ and (name.startswith("plot_") or name.endswith("_figure"))}
    assert public == set(drawn), f"add {public - set(drawn)} to this test"
    for name, fig in drawn.items():
        titles = _axis_titles(fig)
        assert set(titles) >= {"xaxis", "yaxis"}, name
        for axis, text in titles.items():
            assert text and not re.search(r"\w/\w", text), (name, axis, text)  # no raw `a/b` key


def test_labels_map_keys_to_words_with_units():
    from evolm_lib.viz import labels

    assert labels.label("policy/train_reward", "-|length difference|, chars") == \
        "greedy reward on train prompts (-|length difference|, chars)"
    assert labels.label("samples/completions") == "training completions"
    assert labels.label("time/wall_s") == "wall-clock time (s)"
    assert labels.label("policy/kl", "ignored for non-rewards") == "KL to the base model (nats per token)"
    assert labels.label("grpo/some_new_metric") == "some new metric (grpo)"
    assert labels.label("time/checkpoint_s") == "checkpoint (s)"
    assert all("/" not in text for text in labels.KEY_LABELS.values())
    assert labels.integer_ticks(3)["dtick"] == 1 and labels.integer_ticks(40)["dtick"] == 5


def test_paper_style_drops_the_title_and_sizes_fonts_for_a_column():
    fig = plots.plot_fitness(make_rows(), title="shown in the notebook")
    paper = figures.paper_style(fig, width=900)
    assert fig.layout.title.text == "shown in the notebook"  # the notebook's figure is untouched
    assert not paper.layout.title.text
    assert paper.layout.font.size == 30  # 8 pt once 900 px are shrunk to a 240 pt column
    assert paper.layout.xaxis.title.font.size == paper.layout.yaxis.title.font.size == 34
    assert paper.layout.legend.orientation == "h"
    with pytest.raises(ValueError, match="unknown style"):
        figures.export_figure(fig, "x", style="poster")


def test_a_long_legend_makes_the_paper_figure_taller_not_the_plot_smaller():
    few = go.Figure([go.Scatter(x=[0, 1], y=[0, 1], name="es")])  # one entry: plotly shows no legend
    assert figures.paper_height(few, 900) == 630 and figures.paper_style(few).layout.margin.t == 30
    asked = go.Figure([go.Scatter(x=[0, 1], y=[0, 1], name="es", showlegend=True)])
    assert figures.paper_height(asked, 900) == 630 + 45  # one row of 1.5 x the 30-pixel tick font
    names = [f"es_eggroll, 5 engines/card (n={n})" for n in range(5)]  # one entry a row at this width
    many = go.Figure([go.Scatter(x=[0, 1], y=[0, 1], name=name) for name in names])
    styled = figures.paper_style(many)
    assert styled.layout.legend.orientation == "h" and styled.layout.legend.entrywidth == 1
    assert figures.paper_height(many, 900) == 630 + 5 * 45
    assert styled.layout.margin.t == 5 * 45 + 30  # the legend's rows above the plot: the plot keeps its 0.7 x width
    # a name wider than the plot (41 characters fit at 900 px) is broken into lines at its spaces, and
    # the legend is as many lines tall: here 2 + 1
    wide = go.Figure([go.Scatter(x=[0, 1], y=[0, 1], name=name)
                      for name in ("es_eggroll, 2, 4, 5 engines/card (MPS in part) (n=10)", "es_full, 4 engines/card (n=8)")])
    styled = figures.paper_style(wide)
    assert [t.name for t in styled.data] == ["es_eggroll, 2, 4, 5 engines/card (MPS in<br>part) (n=10)",
                                             "es_full, 4 engines/card (n=8)"]
    assert wide.data[0].name == "es_eggroll, 2, 4, 5 engines/card (MPS in part) (n=10)"  # the notebook's figure keeps it
    assert figures.paper_height(wide, 900) == 630 + 3 * 45 and styled.layout.margin.t == 3 * 45 + 30


def test_best_so_far_draws_one_legend_entry_a_method():
    from evolm_lib.viz.tuning import plot_best_so_far

    def trial(number, value, state="complete", retries=None, error=None):
        return {"number": number, "value": value, "state": state, "retries": retries, "error": error}

    # es: a failed trial counts (its error said why), a pruned one too; grpo: trial 1 was killed and
    # Optuna retried it as trial 3, which takes its place; trial 4 still runs
    fig = plot_best_so_far({"es": [trial(0, None, "pruned"), trial(1, 0.2), trial(2, None, "fail", error="OOM"),
                                   trial(3, 0.5), trial(4, 0.1)],
                            "grpo": [trial(0, 0.7), trial(1, None, "fail"), trial(2, 0.6), trial(3, 0.9, retries=1),
                                     trial(4, None, "running")]})
    assert [t.name for t in fig.data if t.showlegend is not False] == ["es", "grpo"]
    # the x axis numbers the trials as the log and their folders do (from 0; a retry by its first attempt)
    assert list(trace(fig, "es").x) == [1, 2, 3, 4] and list(trace(fig, "es").y) == [0.2, 0.2, 0.5, 0.5]
    assert list(trace(fig, "es, each trial").y) == [0.2, 0.5, 0.1]  # complete trials only, no legend entry
    assert list(trace(fig, "grpo").x) == [0, 1, 2] and list(trace(fig, "grpo").y) == [0.7, 0.9, 0.9]
    assert list(trace(fig, "grpo, each trial").x) == [0, 1, 2]  # the retry in the killed trial's place
    assert list(trace(fig, "grpo, each trial").y) == [0.7, 0.9, 0.6]
    assert trace(fig, "es, each trial").marker.color == trace(fig, "es").line.color
    # a method has one colour in every figure: the tuned study's names, their labels, and the sweeps' names
    assert plots.method_color("es_lora", 3) == plots.method_color("es_lora, 5 engines/card (n=10)", 0) == \
        plots.method_color("es", 1) == trace(fig, "es").line.color
    assert plots.method_color("grpo_full", 0) == plots.method_color("grpo full", 2) != plots.method_color("grpo_lora", 0)
    assert plots.method_color("es shuffled", 0) != plots.method_color("es shuffled", 1)  # others: by index


def test_a_retry_of_a_retry_takes_the_first_killed_trials_place():
    from evolm_lib.tune.report import counted_trials

    def trial(number, state, retries=None, error=None):
        return {"number": number, "value": 0.5 if state == "complete" else None, "state": state, "retries": retries,
                "error": error}

    # trial 1 was killed, its retry 3 killed too, and 3's retry 5 finished: 5 stands where 1 stood
    trials = [trial(0, "complete"), trial(1, "fail"), trial(2, "fail", error="CUDA out of memory"),
              trial(3, "fail", retries=1), trial(4, "pruned"), trial(5, "complete", retries=3), trial(6, "waiting")]
    assert [t["number"] for t in counted_trials(trials)] == [0, 5, 2, 4]


def test_training_seconds_leave_scoring_and_checkpoints_out():
    rows = [{"generation": 0, "time/eval_s": 1.0, "time/wall_s": 5.0},  # the first scoring: before training
            {"generation": 1, "time/generation_s": 3.0, "time/eval_s": 1.0, "time/wall_s": 8.5},
            {"generation": 2, "time/generation_s": 2.0, "time/wall_s": 22.5},  # a checkpoint's 12 s before it
            {"generation": 3, "time/generation_s": 4.0, "time/eval_s": 0.5, "time/wall_s": 26.5}]
    timed = metrics.with_training_seconds(rows)
    assert [row[metrics.TRAINING_SECONDS] for row in timed] == [0.0, 2.0, 4.0, 7.5]
    assert "time/training_s" not in rows[3] and timed[3]["time/wall_s"] == 26.5  # copies; wall time kept


def test_the_study_curves_come_from_one_stage_for_every_method():
    from evolm_lib.viz.study import curve_stage

    def runs(stage, method, seeds):
        return [{"stage": stage, "method": method, "seed": seed} for seed in seeds]

    final = runs("final", "es", [0, 1]) + runs("final", "grpo", [0, 1])
    assert curve_stage(final + runs("long", "es", [0, 1]) + runs("long", "grpo", [0, 1])) == "long"
    assert curve_stage(final + runs("long", "es", [0, 1])) == "final"  # grpo not continued yet: reruns for all
    assert curve_stage(final + runs("long", "es", [0]) + runs("long", "grpo", [0, 1])) == "final"
    assert curve_stage(runs("sweep", "es", [0]) + runs("trial", "es", [0])) == "sweep"
    assert curve_stage(runs("trial", "es", [0])) is None


def test_the_study_curves_draw_the_runs_the_tables_read_those_with_held_out_scores():
    """A rerun cut short (no held-out scores, rows that stop early) is left out of the curves,
    as the held-out table leaves it out: the continued reruns of the finished seeds are drawn, n=2."""
    from evolm_lib.viz.study import curve_figures

    def run(stage, seed, generations, heldout=True):
        rows = [{"generation": g, "eval/reward": -10.0 + g, "samples/completions": 10 * g, "samples/tokens": 40 * g,
                 "time/generation_s": 1.0, "time/wall_s": float(g)} for g in range(generations + 1)]
        return {"stage": stage, "method": "es_full", "seed": seed, "path": f"{stage}/es_full/seed{seed}",
                "config": {"population_size": 4}, "rows": rows, "placement": [],
                "heldout": {"index": [0], "reward": [-1.0], "success": [0.0], "generation": generations} if heldout else None}

    compact = {"runs": [run("final", 0, 3), run("final", 1, 3), run("final", 2, 1, heldout=False),
                        run("long", 0, 6), run("long", 1, 6)], "trials": [], "summary": None}
    figures = curve_figures(compact)
    means = [t for t in figures["heldout_vs_completions"].data if t.showlegend is not False]
    assert [t.name for t in means] == ["es_full (n=2)"]
    assert list(means[0].x) == [0, 10, 20, 30, 40, 50, 60]  # the continuations, to twice the budget
    late = [t for t in figures["heldout_vs_completions_late"].data if t.showlegend is not False]
    assert list(late[0].x) == [30, 40, 50, 60] and list(late[0].y) == [-7.0, -6.0, -5.0, -4.0]  # from half the axis on


def test_the_answers_figure_puts_each_run_where_its_held_out_answers_are_empty_or_hold_their_target():
    """One point a finished run: x the share of its answers that are empty, y the share holding their
    target (the flags compact keeps), a marker per stage; a run cut short, or compacted before the
    flags were kept, is left out; no flags at all, no figure."""
    from evolm_lib.viz.study import answer_figure, answer_points

    def run(stage, method, seed, empty=None, target=None, reward=(-1.0, -2.0, -3.0, -6.0)):
        heldout = {"index": [0, 1, 2, 3], "reward": list(reward), "success": [0.0] * 4}
        if empty is not None:
            heldout.update(empty=list(empty), has_target=list(target))
        return {"stage": stage, "method": method, "seed": seed, "path": f"{stage}/{method}/seed{seed}",
                "config": {}, "rows": [], "placement": [], "heldout": heldout}

    quiet, talks = (True, True, True, False), (False, False, False, False)
    compact = {"summary": {"measure": "reward"}, "trials": [], "runs": [
        run("final", "es_lora", 0, quiet, (False, False, False, True)),  # 3 of 4 empty, 1 of 4 right
        run("final", "es_lora", 1, talks, (True, True, False, False), reward=(-4.0, -4.0, -4.0, -4.0)),
        run("final", "es_lora", 2),  # compacted before the flags: left out
        {**run("final", "es_lora", 3, quiet, talks), "heldout": None},  # cut short: left out
        run("long", "es_lora", 0, talks, talks),
        run("control", "es_lora", 0, talks, (False, True, False, False)),
        run("final", "grpo_full", 0, quiet, talks)]}
    points = answer_points(compact)
    assert points == {
        "es_lora": [{"seed": 0, "empty": 0.75, "target": 0.25, "score": -3.0},
                    {"seed": 1, "empty": 0.0, "target": 0.5, "score": -4.0}],
        "grpo_full": [{"seed": 0, "empty": 0.75, "target": 0.0, "score": -3.0}],
        "es_lora, 2x budget": [{"seed": 0, "empty": 0.0, "target": 0.0, "score": -3.0}],
        "es_lora, shuffled fitness": [{"seed": 0, "empty": 0.0, "target": 0.25, "score": -3.0}]}
    figure = answer_figure(compact)
    traces = {t.name: t for t in figure.data}
    assert list(traces) == ["es_lora (n=2)", "grpo_full (n=1)", "es_lora, 2x budget (n=1)", "es_lora, shuffled fitness (n=1)"]
    assert list(traces["es_lora (n=2)"].x) == [75.0, 0.0] and list(traces["es_lora (n=2)"].y) == [25.0, 50.0]
    assert [t.marker.symbol for t in figure.data] == ["circle", "circle", "diamond", "x"]
    assert traces["es_lora (n=2)"].marker.color == traces["es_lora, 2x budget (n=1)"].marker.color  # one colour a method
    assert traces["es_lora (n=2)"].marker.color != traces["grpo_full (n=1)"].marker.color
    assert list(traces["es_lora (n=2)"].text) == ["seed 0: held out -3", "seed 1: held out -4"]
    assert answer_figure({**compact, "runs": [run("final", "es_lora", 2)]}) is None


def test_the_study_curves_name_the_card_only_where_the_methods_ran_on_different_ones():
    from evolm_lib.viz.study import curve_names

    h100 = {"device": "NVIDIA H100 80GB HBM3", "engines_per_card": "5"}
    assert curve_names({"es": h100, "grpo": h100}) == {"es": "es, 5 engines/card", "grpo": "grpo, 5 engines/card"}
    mixed = curve_names({"es": h100, "grpo": {"device": "NVIDIA H200", "engines_per_card": "2, 3"}})
    assert mixed == {"es": "es, H100, 5 engines/card", "grpo": "grpo, H200, 2, 3 engines/card"}
    assert curve_names({"es": {"device": "", "engines_per_card": ""}}) == {"es": "es"}  # nothing recorded
    assert curve_names({"es": {**h100, "mps": "MPS"}}) == {"es": "es, 5 engines/card (MPS)"}


def test_time_breakdown_stacks_phases_and_rest():
    fig = plots.plot_time_breakdown(make_rows(3))
    assert fig.layout.barmode == "stack"
    assert [t.name for t in fig.data] == ["adapters", "generate", "reward", "update", "other"]
    assert list(trace(fig, "generate").y) == [2.0, 2.0, 2.0]
    assert list(trace(fig, "other").y) == pytest.approx([0.25] * 3)  # 4 - (1 + 2 + 0.5 + 0.25)


def test_reward_distribution_and_layer_scales():
    fig = plots.plot_reward_distribution([0.0, 1.0, 1.0, float("nan"), None], title="d")
    assert list(fig.data[0].x) == [0.0, 1.0, 1.0]
    fig = plots.plot_layer_scales(["q", "v"], [0.1, 0.2], title="s")
    assert list(fig.data[0].x) == ["q", "v"] and list(fig.data[0].y) == [0.1, 0.2]
    with pytest.raises(ValueError, match="length"):
        plots.plot_layer_scales(["q"], [0.1, 0.2])


def seed_run(offset: float, xs: list[float], method: str = "es", seed: int = 0) -> list[dict]:
    return [{"samples/completions": x, "time/wall_s": x / 10, "policy/train_reward": x + offset,
             "method": method, "seed": seed} for x in xs]


def test_aggregate_seeds_interpolates_on_common_grid():
    a = seed_run(0.0, [0, 10, 20])
    b = seed_run(1.0, [0, 20, 40])  # x=10 is interpolated: 11; x=40 is outside seed a's range
    agg = metrics.aggregate_seeds([a, b], "samples/completions", "policy/train_reward")
    assert agg["x"] == [0, 10, 20]
    assert agg["mean"] == pytest.approx([0.5, 10.5, 20.5])
    assert agg["min"] == pytest.approx([0, 10, 20])
    assert agg["max"] == pytest.approx([1, 11, 21])
    assert agg["std"] == pytest.approx([0.5, 0.5, 0.5])


def test_reward_vs_samples_and_time():
    runs = {"es": [seed_run(0, [0, 10]), seed_run(2, [0, 10], seed=1)],
            "grpo": [seed_run(1, [0, 5, 10], method="grpo")]}
    fig = plots.plot_reward_vs_samples(runs)
    names = [t.name for t in fig.data]
    assert names == ["es min-max", "es (n=2)", "grpo (n=1)"]  # one seed: no band
    assert list(trace(fig, "es (n=2)").y) == pytest.approx([1, 11])
    band = trace(fig, "es min-max")
    assert list(band.y) == pytest.approx([2, 12, 10, 0])
    fig = plots.plot_reward_vs_samples(runs, band="std")
    assert list(trace(fig, "es ±std").y) == pytest.approx([2, 12, 10, 0])
    fig = plots.plot_reward_vs_time(runs)
    assert list(trace(fig, "grpo (n=1)").x) == pytest.approx([0, 0.5, 1.0])
    assert fig.layout.xaxis.title.text == "wall-clock time (s)"  # words with units, not the key
    with pytest.raises(ValueError):
        plots.plot_reward_vs_samples(runs, band="iqr")


def test_reward_vs_kl_pareto():
    points = [{"method": "es", "seed": 0, "kl": 0.01, "reward": 0.5},
              {"method": "es", "seed": 1, "kl": 0.02, "reward": 0.4},  # dominated
              {"method": "grpo", "seed": 0, "kl": 0.5, "reward": 0.7}]
    fig = plots.plot_reward_vs_kl(points)
    assert list(trace(fig, "es").x) == [0.01, 0.02]
    assert list(trace(fig, "grpo").y) == [0.7]
    front = trace(fig, "Pareto front")
    assert list(front.x) == [0.01, 0.5] and list(front.y) == [0.5, 0.7]


def test_reward_vs_kl_goes_logarithmic_when_the_kls_span_decades():
    near = [{"method": "es", "seed": 0, "kl": kl, "reward": r, "generation": g}
            for g, kl, r in ((0, 0.0, 0.1), (10, 0.002, 0.2), (20, 0.005, 0.3))]
    fig = plots.plot_reward_vs_kl(near)  # 0.002 to 0.005: one decade, linear, the base point kept
    assert fig.layout.xaxis.type is None and list(trace(fig, "es").x) == [0.0, 0.002, 0.005]
    far = near + [{"method": "grpo", "seed": 0, "kl": kl, "reward": r, "generation": g}
                  for g, kl, r in ((0, 0.0, 0.1), (10, 0.8, 0.5), (20, 3.0, 0.0))]
    fig = plots.plot_reward_vs_kl(far)  # 0.002 to 3: more than two decades
    assert fig.layout.xaxis.type == "log" and fig.layout.xaxis.dtick == 1
    assert list(trace(fig, "es").x) == [0.002, 0.005] and list(trace(fig, "grpo").x) == [0.8, 3.0]
    assert fig.layout.xaxis.title.text.endswith("(nats per token; log scale, KL 0 (2) left out)")
    assert plots.plot_reward_vs_kl(far, log_kl=False).layout.xaxis.type is None  # asked for: linear
    assert plots.plot_reward_vs_kl(near, log_kl=True).layout.xaxis.type == "log"


def test_seed_spread_uses_final_value_per_seed():
    runs = {"es": [seed_run(0, [0, 10], seed=3), seed_run(1, [0, 10], seed=4)],
            "grpo": [seed_run(0, [0, 5], method="grpo")]}
    runs["es"][1][-1]["policy/train_reward"] = None  # last row without the value: use the one before
    fig = plots.plot_seed_spread(runs)
    assert list(trace(fig, "es").y) == [10.0, 1.0]
    assert list(trace(fig, "es").text) == ["seed 3", "seed 4"]
    assert list(trace(fig, "grpo").y) == [5.0]
    # two seeds: their points and the mean, no box (quartiles of two values mean nothing)
    assert trace(fig, "es").type == "scatter" and list(trace(fig, "es mean").y) == [5.5]
    assert not [t for t in fig.data if t.type == "box"]


def test_seed_spread_draws_a_box_from_five_seeds():
    runs = {"es": [seed_run(float(s), [0, 10], seed=s) for s in range(5)],
            "grpo": [seed_run(0, [0, 5], method="grpo", seed=s) for s in range(2)]}
    fig = plots.plot_seed_spread(runs, reward_label="-|length difference|, chars")
    es = trace(fig, "es")
    assert es.type == "box" and es.boxpoints == "all" and es.boxmean is True
    assert list(es.y) == [10.0, 11.0, 12.0, 13.0, 14.0]
    assert trace(fig, "grpo").type == "scatter" and "grpo mean" in [t.name for t in fig.data]
    assert fig.layout.yaxis.title.text.endswith("(-|length difference|, chars)")


def test_heldout_draws_each_seed_with_its_interval_and_the_mean_with_its_own():
    import pandas as pd

    runs = [{"method": "es", "seed": 0, "value": 0.75, "ci_low": 0.5, "ci_high": 1.0},
            {"method": "es", "seed": 1, "value": 0.5, "ci_low": 0.25, "ci_high": 0.625},
            {"method": "es full", "seed": 0, "value": 0.25, "ci_low": 0.0, "ci_high": 0.5},
            {"method": "grpo", "seed": 0, "value": float("nan")}]  # a run without held-out scores: no point
    methods = pd.DataFrame([{"method": "es", "mean": 0.625, "ci_low": 0.5, "ci_high": 0.75},
                            {"method": "es full", "mean": 0.25, "ci_low": 0.25, "ci_high": 0.25}]).set_index("method")
    fig = plots.plot_heldout(runs, methods, y="heldout/accuracy")
    assert [t.name for t in fig.data] == ["es seeds", "es", "es full seeds", "es full"]
    seeds = trace(fig, "es seeds")
    assert list(seeds.x) == pytest.approx([-0.3, -0.05]) and list(seeds.y) == [0.75, 0.5]
    assert list(seeds.error_y.array) == [0.25, 0.125] and list(seeds.error_y.arrayminus) == [0.25, 0.25]
    assert list(seeds.text) == ["es, seed 0", "es, seed 1"]
    mean = trace(fig, "es")
    assert list(mean.x) == [0.15] and list(mean.y) == [0.625]
    assert list(mean.error_y.array) == [0.125] and list(mean.error_y.arrayminus) == [0.125]
    assert list(trace(fig, "es full seeds").x) == [1 - 0.175]  # one seed: in the middle of its side
    assert list(fig.layout.xaxis.ticktext) == ["es", "es<br>full", "grpo"] and list(fig.layout.xaxis.tickvals) == [0, 1, 2]
    assert fig.layout.yaxis.title.text == "held-out accuracy<br>(fraction solved)"
    assert trace(fig, "es").marker.color != trace(fig, "es full").marker.color
    fig = plots.plot_heldout(runs[:1], [], y="heldout/reward", reward_label="-|length difference|, chars")
    assert fig.layout.yaxis.title.text.endswith("(-|length difference|, chars)")
    assert plots.plot_heldout([runs[3]], []).data == ()  # nothing to draw: an empty figure, not an error


def test_completions_table_shortens_long_text():
    df = metrics.completions_table([{"prompt": "p", "completion": "x" * 50, "reward": 1.0}], max_chars=10)
    assert list(df.columns) == ["prompt", "completion", "reward"]
    assert len(df.loc[0, "completion"]) == 10


def test_sanitize_name():
    assert figures.sanitize_name("../a b/c") == "a_b_c"
    with pytest.raises(ValueError):
        figures.sanitize_name("///")


@pytest.mark.skipif(not figures.chromium_available(),
                    reason="no Chromium for kaleido: apt-get install chromium (or make setup)")
def test_export_figure_writes_real_files(tmp_path):
    out = tmp_path / "figs"
    fig = plots.plot_fitness(make_rows())
    paths = figures.export_figure(fig, "fitness/es run", out_dir=out)
    assert [p.name for p in paths] == ["fitness_es_run.png", "fitness_es_run.pdf", "fitness_es_run.svg"]
    assert all(p.parent == out for p in paths)
    png, pdf, svg = (p.read_bytes() for p in paths)
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert int.from_bytes(png[16:20], "big") == 1800  # width 900 x scale 2
    # the paper style's height: 0.7 x width for the plot and 3 rows of 45 px for its 5 legend entries
    assert int.from_bytes(png[20:24], "big") == 2 * figures.paper_height(fig, 900) == 2 * (630 + 3 * 45)
    assert pdf.startswith(b"%PDF")
    assert b"<svg" in svg[:200]
    # the sync server makes later exports fast
    paths = figures.export_figure(plots.plot_time_breakdown(make_rows()), "time", out_dir=out,
                                  formats=("svg",))
    assert paths[0].read_bytes().lstrip().startswith(b"<svg")


def test_export_without_chromium_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(figures, "find_chromium", lambda: None)
    with pytest.raises(RuntimeError, match="apt-get install -y chromium"):
        figures.export_figure(go.Figure(), "x", out_dir=tmp_path)
