"""Tests for evolm_lib.analysis: loading run folders (and its errors), the equal-budget table and the
seed spread on hand-computed rows, final points, the sweep's equal budgets, and notebook 04 run by
papermill on the fixture runs in tests/data/es_vs_grpo (rebuilt by scripts/make_analysis_fixtures.py)."""
from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from evolm_lib import analysis
from evolm_lib.analysis import MixedRuns, NotARunFolder, RunRecord

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "data" / "es_vs_grpo"
ES, GRPO = str(FIXTURES / "es_*"), str(FIXTURES / "grpo_*")
MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "pdf": b"%PDF-", "svg": b"<svg"}


def fixture_groups():
    return analysis.load_runs([ES, GRPO])


def copy_runs(tmp_path: Path) -> Path:
    """The fixture runs copied to tmp_path/runs, free to edit."""
    shutil.copytree(FIXTURES, tmp_path / "runs")
    return tmp_path / "runs"


def edit_config(run_dir: Path, **changes) -> None:
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    (run_dir / "config.yaml").write_text(yaml.safe_dump({**config, **changes}, sort_keys=False))


def record(method: str, seed: int, budgets: list, rewards: list, **extra) -> RunRecord:
    rows = [{"generation": i, "seed": seed, "samples/completions": b, "eval/reward": r, **extra}
            for i, (b, r) in enumerate(zip(budgets, rewards))]
    return RunRecord(Path(f"{method}_seed{seed}"), method, seed, {"kind": method, "seed": seed}, rows)


# ----------------------------------------------------------------------------- loading


def test_load_runs_groups_the_fixtures_by_kind():
    groups = fixture_groups()
    assert list(groups) == ["es", "grpo"]
    assert [(r.name, r.seed, r.kind) for r in groups["es"]] == [("es_seed0", 0, "es"), ("es_seed1", 1, "es")]
    assert [r.seed for r in groups["grpo"]] == [0, 1]
    for runs in groups.values():
        for run in runs:
            assert [row["generation"] for row in run.rows] == list(range(5))
            assert run.rows[-1]["samples/completions"] == 64  # equal budgets: 8 x 2 prompts x 4
            assert run.config["model"] == "tiny-random" and run.config["task"] == "conciseness"
    plots = analysis.runs_for_plots(groups)
    assert {k: len(v) for k, v in plots.items()} == {"es": 2, "grpo": 2}
    assert plots["es"][0] is groups["es"][0].rows
    table = analysis.describe_runs(groups)
    assert list(table["run"]) == ["es_seed0", "es_seed1", "grpo_seed0", "grpo_seed1"]


def test_load_runs_labels_from_a_mapping_and_from_config(tmp_path):
    groups = analysis.load_runs({"ES (fixture)": ES, "GRPO (fixture)": [GRPO]})
    assert list(groups) == ["ES (fixture)", "GRPO (fixture)"]
    assert all(r.method == "ES (fixture)" for r in groups["ES (fixture)"])
    runs = copy_runs(tmp_path)
    edit_config(runs / "grpo_seed1", label="grpo-lr")
    assert list(analysis.load_runs(str(runs / "*"))) == ["es", "grpo", "grpo-lr"]


def test_runs_of_one_kind_with_different_group_sizes_are_split(tmp_path):
    runs = copy_runs(tmp_path)
    edit_config(runs / "grpo_seed1", group_size=4)
    groups = analysis.load_runs(str(runs / "*"))
    assert list(groups) == ["es", "grpo G=8", "grpo G=4"]
    assert [r.method for r in groups["grpo G=4"]] == ["grpo G=4"]


def test_empty_glob_fails_with_the_pattern(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such_runs.* matches no run folder"):
        analysis.load_runs([ES, str(tmp_path / "no_such_runs_*")])
    with pytest.raises(ValueError, match="no run folder patterns"):
        analysis.load_runs([])


def test_a_folder_that_is_not_a_run_folder_fails(tmp_path):
    (tmp_path / "notes").mkdir()
    with pytest.raises(NotARunFolder, match=r"notes is not a run folder: no config.yaml and no metrics.jsonl"):
        analysis.load_runs(str(tmp_path / "*"))
    (tmp_path / "notes" / "config.yaml").write_text("kind: es\n")
    with pytest.raises(NotARunFolder, match="no metrics.jsonl"):
        analysis.load_runs(str(tmp_path / "notes"))
    (tmp_path / "notes" / "metrics.jsonl").write_text("")
    with pytest.raises(NotARunFolder, match="holds no rows"):
        analysis.load_runs(str(tmp_path / "notes"))


def test_mixed_tasks_and_models_fail_listing_the_fields(tmp_path):
    runs = copy_runs(tmp_path)
    edit_config(runs / "grpo_seed0", task="countdown", model="smollm2-135m-instruct")
    with pytest.raises(MixedRuns) as caught:
        analysis.load_runs([str(runs / "es_*"), str(runs / "grpo_*")])
    message = str(caught.value)
    assert "model: 'tiny-random' (es_seed0, es_seed1, grpo_seed1); 'smollm2-135m-instruct' (grpo_seed0)" in message
    assert "task: 'conciseness'" in message and "'countdown' (grpo_seed0)" in message
    assert "lora_rank" not in message and "allow_mixed=True" in message
    groups = analysis.load_runs([str(runs / "es_*"), str(runs / "grpo_*")], allow_mixed=True)
    assert len(groups["grpo"]) == 2


# ----------------------------------------------------------------------------- tables and points


def test_equal_budget_table_interpolates_at_the_common_budget():
    es = [record("es", 0, [0, 10, 15, 20], [-10, -6, None, -2]),  # a row without the reward is skipped
          record("es", 1, [0, 10, 20], [-12, -8, -4])]
    grpo = [record("grpo", 0, [0, 8, 16], [-10, -8, -4]),
            record("grpo", 1, [0, 8, 24], [-10, -9, -1])]
    table = analysis.equal_budget_table({"es": es, "grpo": grpo})
    # every run reached 16 completions (grpo seed 0 stopped there): es 0 -6 + 0.6 x 4 = -3.6,
    # es 1 -8 + 0.6 x 4 = -5.6; grpo 0 -4 (a logged point), grpo 1 -9 + 0.5 x 8 = -5
    assert table.attrs["budget"] == 16
    assert table.loc["es", "samples/completions"] == 16
    assert table.loc["es", "reward_mean"] == pytest.approx(-4.6)
    assert table.loc["es", "reward_std"] == pytest.approx(math.sqrt(2))
    assert (table.loc["es", "reward_min"], table.loc["es", "reward_max"]) == pytest.approx((-5.6, -3.6))
    assert table.loc["grpo", "reward_mean"] == pytest.approx(-4.5)
    assert table.loc["grpo", "reward_std"] == pytest.approx(math.sqrt(0.5))
    assert table.loc["grpo", "final_budget_mean"] == pytest.approx(20)
    assert table.loc["grpo", "final_reward_mean"] == pytest.approx(-2.5)
    with pytest.raises(ValueError, match="no row with both"):
        analysis.equal_budget_table({"es": [record("es", 0, [0], [None])]})


def test_equal_budget_table_on_the_fixtures():
    table = analysis.equal_budget_table(fixture_groups())
    assert list(table.index) == ["es", "grpo"] and table.attrs["budget"] == 64
    assert list(table["seeds"]) == [2, 2]


def test_final_points_take_the_last_kl_and_reward():
    runs = {"es": [record("es", 0, [0, 10], [-5, -3], **{"policy/kl": 0.1})],
            "grpo": [record("grpo", 0, [0, 10], [-6, -2]), record("grpo", 1, [0, 10], [-6, -4])]}
    runs["es"][0].rows[-1]["policy/kl"] = None  # the last row lacks it: the one before counts
    runs["grpo"][1].rows[-1]["policy/kl"] = 0.3
    points = analysis.final_points(runs)
    assert points == [{"method": "es", "seed": 0, "kl": 0.1, "reward": -3.0},
                      {"method": "grpo", "seed": 0, "kl": None, "reward": -2.0},
                      {"method": "grpo", "seed": 1, "kl": 0.3, "reward": -4.0}]
    kept, note = analysis.split_points_by_kl(points)
    assert [(p["method"], p["seed"]) for p in kept] == [("es", 0), ("grpo", 1)]
    assert "1 run(s)" in note and "grpo seed 0" in note
    fixture_points = analysis.final_points(fixture_groups())
    assert len(fixture_points) == 4 and all(p["kl"] > 0 for p in fixture_points)
    assert analysis.split_points_by_kl(fixture_points)[1] == ""


def test_seed_spread_table_and_std_ratio():
    runs = {"es": [record("es", 0, [0, 1], [0, -1]), record("es", 1, [0, 1], [0, -3])],
            "grpo": [record("grpo", s, [0, 1], [0, r]) for s, r in enumerate([-1, -5, -9])]}
    table = analysis.seed_spread_table(runs, key="eval/reward")
    assert table.loc["es", ["seeds", "mean", "min", "max"]].tolist() == [2, -2, -3, -1]
    assert table.loc["es", "std"] == pytest.approx(math.sqrt(2))
    assert table.loc["grpo", "std"] == pytest.approx(4.0)
    assert table.loc["grpo", "std(es)/std"] == pytest.approx(math.sqrt(2) / 4)
    assert table.loc["es", "std(es)/std"] == 1.0  # ES against itself, not NaN


def test_seed_spread_table_of_one_method_has_no_ratio_column():
    runs = {"grpo": [record("grpo", s, [0, 1], [0, r]) for s, r in enumerate([-1, -5])]}
    table = analysis.seed_spread_table(runs)
    assert "std(es)/std" not in table.columns and table.loc["grpo", "seeds"] == 2
    labelled = {"ES (mine)": [record("es", s, [0, 1], [0, r]) for s, r in enumerate([-1, -3])], **runs}
    assert analysis.seed_spread_table(labelled).loc["ES (mine)", "std(es)/std"] == 1.0  # found by kind


def test_empty_patterns_mean_no_runs_of_that_method():
    groups = analysis.load_runs([ES, ""])
    assert list(groups) == ["es"]
    with pytest.raises(ValueError, match="no run folder patterns"):
        analysis.load_runs(["", " "])


def test_run_results_for_batch_summaries(tmp_path):
    results = analysis.run_results(FIXTURES / "grpo_seed0")
    assert list(results) == list(analysis.RUN_RESULT_COLUMNS)
    rows = analysis.read_run(FIXTURES / "grpo_seed0").rows
    assert results["kind"] == "grpo" and results["budget"] == 4 and results["generation"] == 4
    assert results["train_reward_start"] == rows[0]["policy/train_reward"]
    assert results["eval_reward_final"] == rows[-1]["eval/reward"]
    assert results["eval_reward_best"] == max(r["eval/reward"] for r in rows)
    assert results["kl_final"] == rows[-1]["policy/kl"] and results["completions"] == 64
    assert results["tokens"] == rows[-1]["samples/tokens"] and results["wall_s"] == rows[-1]["time/wall_s"]
    assert results["eval_accuracy_final"] == 0.0  # conciseness: exact length only; the fixtures' x-strings miss
    assert analysis.run_results(tmp_path) == {}


def test_final_accuracy_counts_completions_at_the_success_threshold():
    from evolm_lib.tasks import get_task

    targets = [e.target for e in get_task("conciseness").eval_examples()]
    rows = [{"generation": 0, "policy/eval_completions": ["x" * len(t) for t in targets[:4]] + ["?"] * 4}]
    run = RunRecord(Path("r"), "es", 0, {"kind": "es", "task": "conciseness"}, rows)
    hits = 4 + sum(len(t) == 1 for t in targets[4:])  # "?" has the length of a one-character target
    assert analysis.final_accuracy(run) == hits / 8
    assert analysis.reward_label({"es": [run]}) == "-|length difference|, chars"


def test_side_by_side_completions_share_the_prompts():
    from evolm_lib.tasks import get_task

    table = analysis.side_by_side_completions(fixture_groups(), example_index=[0, 2], max_chars=None)
    eval_examples = get_task("conciseness").eval_examples()
    assert list(table["prompt"]) == [eval_examples[0].prompt, eval_examples[2].prompt]
    assert list(table.columns) == ["prompt", "target", "es seed 0", "es seed 1", "grpo seed 0", "grpo seed 1"]
    last = fixture_groups()["grpo"][1].rows[-1]["policy/eval_completions"]
    assert table["grpo seed 1"].tolist() == [last[0], last[2]]
    with pytest.raises(IndexError, match="out of range"):
        analysis.side_by_side_completions(fixture_groups(), example_index=99)


def test_record_final_metrics_adds_to_the_last_row(tmp_path):
    run = copy_runs(tmp_path) / "es_seed0"
    before = analysis.read_run(run).rows
    row = analysis.record_final_metrics(run, {"policy/kl": 0.5})
    after = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert after[:-1] == before[:-1] and after[-1] == row == {**before[-1], "policy/kl": 0.5}


# ----------------------------------------------------------------------------- the sweep's plan


def test_sweep_plans_equal_budgets():
    from evolm_lib import sweep

    batch_part, spec = sweep.load_sweep_spec(REPO / "papermill_runs" / "es_vs_grpo_conciseness_cpu.yaml")
    assert batch_part["notebook"] == "notebooks/04_es_vs_grpo.py"
    plan = sweep.plan_sweep(spec, generations=3, seeds=[0, 1], overrides={"model": "tiny-random"},
                            grpo_learning_rate=sweep.grpo_learning_rates(spec)[-1])
    assert [p.name for p in plan] == ["es_seed0", "grpo_seed0", "es_seed1", "grpo_seed1"]
    assert {p.budget for p in plan} == {16 * 2 * 3}
    assert [p.length for p in plan[:2]] == [3, 3]
    assert sweep.estimate_seconds(plan, {"es": 1.0, "grpo": 2.0}) == (96 + 4 * 10) * 3 * 2

    _, countdown = sweep.load_sweep_spec(REPO / "papermill_runs" / "es_vs_grpo_countdown_gpu.yaml")
    names = {p.name: p for p in sweep.plan_sweep(countdown, generations=4, seeds=[0])}
    assert (names["grpo_G8_seed0"].length, names["grpo_G30_seed0"].length) == (15, 4)  # 4 x 30 / G
    assert names["es_seed0"].config.sigma == 0.001 and names["es_seed0"].config.learning_rate == 0.0005
    with pytest.raises(ValueError, match="unequal budgets"):
        sweep.plan_sweep(countdown, generations=3, seeds=[0])  # 3 x 30 / 8 is not whole


# ----------------------------------------------------------------------------- notebook 04


@pytest.mark.slow
def test_notebook_04_draws_and_exports_every_figure(tmp_path):
    from evolm_lib.batch import execute_notebook

    figures = tmp_path / "figures"
    execute_notebook(REPO / "notebooks" / "04_es_vs_grpo.py", tmp_path / "04.ipynb",
                     {"es_runs": ES, "grpo_runs": GRPO, "figures_dir": str(figures)}, cwd=REPO)
    # what the notebook's last cell asserted before it was made to work with any subset of methods
    groups = fixture_groups()
    assert "es" in groups and any(label.startswith("grpo") for label in groups), list(groups)
    assert set(analysis.equal_budget_table(groups).index) == set(groups)
    assert list(analysis.seed_spread_table(groups).index) == list(groups)
    written = sorted(p.name for p in figures.iterdir())
    stems = ["es_vs_grpo_reward_vs_kl", "es_vs_grpo_reward_vs_samples", "es_vs_grpo_reward_vs_time",
             "es_vs_grpo_seed_spread"]
    assert written == sorted(f"{s}.{fmt}" for s in stems for fmt in MAGIC)
    for stem in stems:
        for fmt, magic in MAGIC.items():
            head = (figures / f"{stem}.{fmt}").read_bytes()[:500]
            assert magic in head if fmt == "svg" else head.startswith(magic), (stem, fmt)


@pytest.mark.slow
def test_notebook_04_works_with_es_runs_only(tmp_path):
    from evolm_lib.batch import execute_notebook

    executed = execute_notebook(REPO / "notebooks" / "04_es_vs_grpo.py", tmp_path / "04.ipynb",
                                {"es_runs": ES, "grpo_runs": "", "figures_dir": str(tmp_path / "figures")}, cwd=REPO)
    cells = json.loads(executed.read_text())["cells"]
    assert not [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert len(list((tmp_path / "figures").glob("*.png"))) == 4
