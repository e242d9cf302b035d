"""Tests for evolm_lib.analysis: loading run folders (and its errors), labels per ES mode, the
equal-budget table and the seed spread on hand-computed rows, final and checkpoint points, the study's
held-out tables against values worked out by hand from the fixtures' heldout.jsonl, the sweep's equal
budgets, and notebook 04 run by papermill on the fixture runs in tests/data/es_vs_grpo (rebuilt by
scripts/make_analysis_fixtures.py: LoRA ES and GRPO trained, ES EGGROLL and full made by hand)."""
from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from evolm_lib import analysis
from evolm_lib.analysis import MixedRuns, NotARunFolder, RunRecord

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "data" / "es_vs_grpo"
ES, GRPO = str(FIXTURES / "es_*"), str(FIXTURES / "grpo_*")
MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "pdf": b"%PDF-", "svg": b"<svg"}
METHODS = ["es", "es eggroll", "es full", "grpo"]
ES_RUNS = ["es_eggroll_seed0", "es_eggroll_seed1", "es_full_seed0", "es_full_seed1", "es_seed0", "es_seed1"]


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


def test_load_runs_groups_the_fixtures_by_kind_and_es_mode():
    groups = fixture_groups()
    assert list(groups) == METHODS  # ES modes in the order lora, eggroll, full (folder names sort otherwise)
    assert [(r.name, r.seed, r.kind, r.es_mode) for r in groups["es"]] == [("es_seed0", 0, "es", "lora"),
                                                                          ("es_seed1", 1, "es", "lora")]
    assert "es_mode" not in groups["es"][0].config  # a folder older than the setting: LoRA
    assert [(r.name, r.es_mode) for r in groups["es full"]] == [("es_full_seed0", "full"), ("es_full_seed1", "full")]
    assert [r.name for r in groups["es eggroll"]] == ["es_eggroll_seed0", "es_eggroll_seed1"]
    assert [r.seed for r in groups["grpo"]] == [0, 1] and groups["grpo"][0].es_mode is None
    for runs in groups.values():
        for run in runs:
            assert [row["generation"] for row in run.rows] == list(range(5))
            assert run.rows[-1]["samples/completions"] == 64  # equal budgets: 8 x 2 prompts x 4
            assert run.config["model"] == "tiny-random" and run.config["task"] == "conciseness"
    plots = analysis.runs_for_plots(groups)
    assert {k: len(v) for k, v in plots.items()} == {method: 2 for method in METHODS}
    assert plots["es"][0] is groups["es"][0].rows
    table = analysis.describe_runs(groups)
    assert list(table["run"]) == ["es_seed0", "es_seed1", "es_eggroll_seed0", "es_eggroll_seed1", "es_full_seed0",
                                  "es_full_seed1", "grpo_seed0", "grpo_seed1"]


def test_method_labels_per_es_mode_unless_a_label_is_given(tmp_path):
    assert analysis.method_label({"kind": "es"}) == "es"
    assert analysis.method_label({"kind": "es", "es_mode": "lora"}) == "es"
    assert analysis.method_label({"kind": "es", "es_mode": "eggroll"}) == "es eggroll"
    assert analysis.method_label({"kind": "es", "es_mode": "full"}) == "es full"
    assert analysis.method_label({"kind": "grpo"}) == "grpo"
    runs = copy_runs(tmp_path)
    edit_config(runs / "es_full_seed1", label="paper ES")
    groups = analysis.load_runs(str(runs / "es_*"))
    assert list(groups) == ["es", "es eggroll", "es full", "paper ES"]
    assert [r.name for r in groups["es full"]] == ["es_full_seed0"]
    # the modes share every compared setting; a LoRA rank that differs is still caught across modes
    edit_config(runs / "es_eggroll_seed0", lora_rank=4)
    with pytest.raises(MixedRuns, match=r"lora_rank: 4 \(es_eggroll_seed0\); 1 \(es_eggroll_seed1, es_full_seed0"):
        analysis.load_runs(str(runs / "es_*"))


def test_load_runs_labels_from_a_mapping_and_from_config(tmp_path):
    groups = analysis.load_runs({"ES (fixture)": str(FIXTURES / "es_seed*"), "GRPO (fixture)": [GRPO]})
    assert list(groups) == ["ES (fixture)", "GRPO (fixture)"] and len(groups["ES (fixture)"]) == 2
    assert all(r.method == "ES (fixture)" for r in groups["ES (fixture)"])
    runs = copy_runs(tmp_path)
    edit_config(runs / "grpo_seed1", label="grpo-lr")
    assert list(analysis.load_runs(str(runs / "*"))) == [*METHODS, "grpo-lr"]
    # a mapping keeps its own order; its label is split by the settings its runs differ in (the ES modes
    # and their noise schemes here), never pooling three seed-0 runs as seeds of one method
    groups = analysis.load_runs({"GRPO": GRPO, "ES": ES})
    assert list(groups) == ["GRPO", "ES es_mode=eggroll noise_scheme=flat", "ES es_mode=full noise_scheme=flat",
                            "ES es_mode=lora noise_scheme=per_tensor"]
    assert [r.name for r in groups["ES es_mode=full noise_scheme=flat"]] == ["es_full_seed0", "es_full_seed1"]


def test_runs_of_one_kind_with_different_group_sizes_are_split(tmp_path):
    runs = copy_runs(tmp_path)
    edit_config(runs / "grpo_seed1", group_size=4)
    groups = analysis.load_runs(str(runs / "*"))
    assert list(groups) == ["es", "es eggroll", "es full", "grpo G=8", "grpo G=4"]
    assert [r.method for r in groups["grpo G=4"]] == ["grpo G=4"]


def test_grpo_runs_at_different_learning_rates_are_split(tmp_path):
    runs = copy_runs(tmp_path)  # a sweep's grpo_modes at two learning rates, one seed each here
    edit_config(runs / "grpo_seed1", learning_rate=0.0005)
    groups = analysis.load_runs(str(runs / "*"))
    rate = yaml.safe_load((runs / "grpo_seed0" / "config.yaml").read_text())["learning_rate"]
    assert list(groups) == ["es", "es eggroll", "es full", f"grpo lr={rate:g}", "grpo lr=0.0005"]
    assert [r.name for r in groups["grpo lr=0.0005"]] == ["grpo_seed1"]


def test_a_method_is_its_full_set_of_settings_and_repeated_seeds_are_refused(tmp_path):
    runs = copy_runs(tmp_path)
    edit_config(runs / "es_seed1", sigma=0.1, learning_rate=0.4)  # another setting, not another seed
    groups = analysis.load_runs(str(runs / "es_*"))
    assert list(groups) == ["es sigma=0.02 lr=0.05", "es sigma=0.1 lr=0.4", "es eggroll", "es full"]
    assert [r.name for r in groups["es sigma=0.1 lr=0.4"]] == ["es_seed1"]
    assert list(analysis.seed_spread_table(groups)["seeds"]) == [1, 1, 2, 2]
    # settings that do not change the science (budget, cadence, engine placement) do not split a method
    # (these folders were written when engine_host was called evaluator: the older name still reads)
    edit_config(runs / "es_full_seed1", num_generations=40, eval_every=3, evaluator="ray")
    assert [r.name for r in analysis.load_runs(str(runs / "es_full_*"))["es full"]] == ["es_full_seed0", "es_full_seed1"]
    # the same settings and seed twice: refused, naming the method, the seed and both folders
    shutil.copytree(runs / "es_full_seed0", runs / "es_full_again_seed0")
    with pytest.raises(analysis.RepeatedSeeds, match=r"'es full' seed 0: .*es_full_again_seed0, .*es_full_seed0 "):
        analysis.load_runs(str(runs / "es_full_*"))
    with pytest.raises(analysis.RepeatedSeeds, match=r"'ES' seed 0"):  # an explicit label pools nothing either
        analysis.load_runs({"ES": [str(runs / "es_full_seed0"), str(runs / "es_full_again_seed0")]})


def test_method_labels_name_every_setting_that_differs_within_a_label():
    configs = [{"kind": "es", "sigma": s, "learning_rate": lr, "seed": seed}
               for s, lr in ((0.1, 0.4), (0.05, 0.2)) for seed in (0, 1)]
    configs.append({"kind": "grpo", "group_size": 8, "seed": 0})
    assert analysis.method_labels(configs) == ["es sigma=0.1 lr=0.4", "es sigma=0.1 lr=0.4", "es sigma=0.05 lr=0.2",
                                               "es sigma=0.05 lr=0.2", "grpo"]
    assert analysis.varying_settings([{"a": 1, "b": [1]}, {"a": 1, "b": [2]}, {"a": 1}]) == ["b"]


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
    assert (f"model: 'tiny-random' ({', '.join(ES_RUNS)}, grpo_seed1); 'smollm2-135m-instruct' (grpo_seed0)"
            in message)
    assert "task: 'conciseness'" in message and "'countdown' (grpo_seed0)" in message
    assert "lora_rank" not in message and "allow_mixed=True" in message
    groups = analysis.load_runs([str(runs / "es_*"), str(runs / "grpo_*")], allow_mixed=True)
    # compared anyway, but as two methods: runs on another model and task are never seeds of one method
    assert [(label, [r.name for r in groups[label]]) for label in groups if label.startswith("grpo")] == [
        ("grpo model=smollm2-135m-instruct task=countdown", ["grpo_seed0"]),
        ("grpo model=tiny-random task=conciseness", ["grpo_seed1"])]


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


def test_equal_budget_comparisons_test_each_runs_value_at_the_common_budget_across_seeds():
    # es runs reach 20 completions, grpo runs stop at 10: at 10, es seed s is 2 + s (half-way from
    # 0 + s to 4 + s), grpo seed s is s / 10
    es = [record("es", s, [0, 20], [s, 4 + s]) for s in range(3)]
    grpo = [record("grpo", s, [0, 5, 10], [0, 9, s / 10]) for s in range(3)]
    table = analysis.equal_budget_comparisons({"es": es, "grpo": grpo})
    assert table.attrs["budget"] == 10
    row = table.iloc[0]
    assert (row["method_a"], row["method_b"], row["seeds_a"], row["seeds_b"]) == ("es", "grpo", 3, 3)
    assert row["difference"] == pytest.approx(3.0 - 0.1)  # mean(2, 3, 4) - mean(0, 0.1, 0.2)
    # every es value beats every grpo value: of the C(6, 3) = 20 splits only this one and its mirror
    # are as extreme, so the exact two-sided p is 2 / 20
    assert row["permutation_p"] == pytest.approx(0.1) and bool(row["exact"])
    assert row["larger_than_seed_noise"] == "no"  # 3 seeds a side can never go below 0.1


def test_equal_budget_table_on_the_fixtures():
    table = analysis.equal_budget_table(fixture_groups())
    assert list(table.index) == METHODS and table.attrs["budget"] == 64
    assert list(table["seeds"]) == [2, 2, 2, 2]


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
    assert len(fixture_points) == 8 and all(p["kl"] > 0 for p in fixture_points)
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
    assert list(groups) == ["es", "es eggroll", "es full"]
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
    assert list(table.columns) == ["prompt", "target", *(f"{m} seed {s}" for m in METHODS for s in (0, 1))]
    eggroll = fixture_groups()["es eggroll"][0].rows[-1]["policy/eval_completions"]
    assert table["es eggroll seed 0"].tolist() == [eggroll[0], eggroll[2]]
    last = fixture_groups()["grpo"][1].rows[-1]["policy/eval_completions"]
    assert table["grpo seed 1"].tolist() == [last[0], last[2]]
    with pytest.raises(IndexError, match="out of range"):
        analysis.side_by_side_completions(fixture_groups(), example_index=99)


def test_record_final_metrics_adds_to_the_last_row(tmp_path):
    from evolm_lib.runs import record_final_metrics  # analysis reads; the run folder's module writes

    run = copy_runs(tmp_path) / "es_seed0"
    before = analysis.read_run(run).rows
    row = record_final_metrics(run, {"policy/kl": 0.5})
    after = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert after[:-1] == before[:-1] and after[-1] == row == {**before[-1], "policy/kl": 0.5}


# ----------------------------------------------------------------------------- the study: held-out tables

# Per-seed held-out scores of the fixtures, worked out from their heldout.jsonl (eight problems each;
# scripts/make_analysis_fixtures.py's HELDOUT_GAPS): successes are the problems with gap 0, rewards
# minus the gaps. es: 8 and 6 of 8; eggroll: 4 and 4; full: 3 and 5; grpo: 2 and 1.
SUCCESS = {"es": [1.0, 0.75], "es eggroll": [0.5, 0.5], "es full": [0.375, 0.625], "grpo": [0.25, 0.125]}
REWARD = {"es": [0.0, -3 / 8], "es eggroll": [-0.5, -0.5], "es full": [-10 / 8, -12 / 8], "grpo": [-18 / 8, -35 / 8]}


def fixture_rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / name / "metrics.jsonl").read_text().splitlines()]


def test_read_heldout_reads_the_lines_and_names_a_bad_one(tmp_path):
    rows = analysis.read_heldout(FIXTURES / "es_seed1")
    assert [r["index"] for r in rows] == list(range(8)) and [r["success"] for r in rows].count(True) == 6
    assert rows[3] == {"index": 3, "prompt": "What comes next: 2, 4, 6, 8, ?", "target": "10", "completion": "xxxx",
                       "reward": -2.0, "success": False}
    assert analysis.read_heldout(tmp_path) is None
    (tmp_path / "heldout.jsonl").write_text('{"index": 0, "reward": 1.0, "success": true}\n{"index": 1, "rew')
    assert len(analysis.read_heldout(tmp_path)) == 1  # a line torn by a kill is skipped
    (tmp_path / "heldout.jsonl").write_text('{"index": 0, "reward": 1.0, "success": true}\n{"index": 1, "reward": 0}\n')
    with pytest.raises(ValueError, match="heldout.jsonl: row 2 has no success"):
        analysis.read_heldout(tmp_path)


def test_study_table_of_the_fixtures_by_hand():
    groups = fixture_groups()
    table = analysis.study_table(groups)
    assert list(table.index) == METHODS and table.attrs["note"] == "" and table.attrs["key"] == "heldout/accuracy"
    assert table["seeds"].tolist() == [2, 2, 2, 2] and table["problems"].tolist() == [8, 8, 8, 8]
    assert table["mean"].tolist() == pytest.approx([0.875, 0.5, 0.5, 0.1875])
    # two seeds are too few for a bootstrap: Student's t, mean -/+ t_(0.975, 1) |a - b| / 2 (s / sqrt 2 with
    # s = |a - b| / sqrt 2), t_(0.975, 1) = tan(0.475 pi) = 12.706, cut to a share's range [0, 1]
    half = math.tan(0.475 * math.pi) * np.array([0.25, 0.0, 0.25, 0.125]) / 2
    means = np.array([0.875, 0.5, 0.5, 0.1875])
    assert table["interval"].tolist() == ["t"] * 4
    assert table["ci_low"].tolist() == pytest.approx(np.clip(means - half, 0, 1).tolist()) == [0.0, 0.5, 0.0, 0.0]
    assert table["ci_high"].tolist() == pytest.approx(np.clip(means + half, 0, 1).tolist())
    assert table["ci_low"].tolist() == table["t_low"].tolist() and table["ci_high"].tolist() == table["t_high"].tolist()
    assert table["seed_std"].tolist() == pytest.approx([0.25 / math.sqrt(2), 0.0, 0.25 / math.sqrt(2), 0.125 / math.sqrt(2)])
    assert table["min"].tolist() == [0.75, 0.5, 0.375, 0.125] and table["max"].tolist() == [1.0, 0.5, 0.625, 0.25]
    assert table.loc["es", "per_seed"].startswith("0: 1 [1, 1]; 1: 0.75 [")  # every problem solved: no spread
    # the hand-made runs' KL and seconds: eggroll 0.002, 0.0025 and four generations of 0.005 s and of 0.006 s
    assert table.loc["es eggroll", "kl_mean"] == pytest.approx(0.00225)
    assert table.loc["es eggroll", "kl_std"] == pytest.approx(0.0005 / math.sqrt(2))
    assert table.loc["es eggroll", "seconds_per_step"] == pytest.approx(0.0055)
    assert table.loc["es full", "kl_mean"] == pytest.approx(0.0045) and table.loc["es full", "seconds_per_step"] == pytest.approx(0.025)
    # the trained runs' KL and seconds, from their metrics.jsonl
    for method, names in (("es", ["es_seed0", "es_seed1"]), ("grpo", ["grpo_seed0", "grpo_seed1"])):
        rows = [fixture_rows(name) for name in names]
        assert table.loc[method, "kl_mean"] == pytest.approx(sum(r[-1]["policy/kl"] for r in rows) / 2)
        seconds = sorted(row["time/generation_s"] for r in rows for row in r if "time/generation_s" in row)
        assert len(seconds) == 8 and table.loc[method, "seconds_per_step"] == pytest.approx((seconds[3] + seconds[4]) / 2)
    assert table["training_completions"].tolist() == [64, 64, 64, 64]


def test_study_table_of_rewards_by_hand():
    table = analysis.study_table(fixture_groups(), measure="reward")
    assert table.attrs["key"] == "heldout/reward"
    assert table["mean"].tolist() == pytest.approx([sum(v) / 2 for v in REWARD.values()])  # -0.1875, -0.5, -1.375, -3.3125
    # two seeds: Student's t (as above), mean -/+ 12.706 |a - b| / 2
    half = [math.tan(0.475 * math.pi) * abs(v[0] - v[1]) / 2 for v in REWARD.values()]
    assert table["ci_low"].tolist() == pytest.approx([sum(v) / 2 - h for v, h in zip(REWARD.values(), half)])
    assert table["ci_high"].tolist() == pytest.approx([sum(v) / 2 + h for v, h in zip(REWARD.values(), half)])
    with pytest.raises(ValueError, match="measure: one of 'success', 'reward'"):
        analysis.study_table(fixture_groups(), measure="accuracy")


def test_heldout_table_gives_each_run_an_interval_over_problems():
    from evolm_lib import stats

    table = analysis.heldout_table(fixture_groups())
    assert table["run"].tolist()[:2] == ["es_seed0", "es_seed1"] and len(table) == 8
    assert table["value"].tolist() == [v for values in SUCCESS.values() for v in values]
    assert table["problems"].tolist() == [8] * 8
    first = table.iloc[0]
    assert (first["value"], first["ci_low"], first["ci_high"]) == (1.0, 1.0, 1.0)  # 8 of 8: no spread
    eggroll = table[table["run"] == "es_eggroll_seed0"].iloc[0]
    assert (eggroll["value"], eggroll["ci_low"], eggroll["ci_high"]) == stats.bootstrap_interval([1, 0] * 4)
    assert 0 < eggroll["ci_low"] < 0.5 < eggroll["ci_high"] < 1
    assert table["kl"].tolist()[2:4] == [0.002, 0.0025]


def test_method_comparisons_of_the_fixtures_by_hand():
    table = analysis.method_comparisons(fixture_groups())
    pairs = list(zip(table["method_a"], table["method_b"]))
    assert pairs == [("es", "es eggroll"), ("es", "es full"), ("es", "grpo"), ("es eggroll", "es full"),
                     ("es eggroll", "grpo"), ("es full", "grpo")]
    # difference of means, and Welch's t interval (two seeds a side are too few for a bootstrap):
    # difference -/+ t_(0.975, dof) se, se = sqrt(var_a / 2 + var_b / 2) with the variances below
    import scipy.stats

    difference = [0.375, 0.375, 0.6875, 0.0, 0.3125, 0.3125]
    se = [math.sqrt(v) for v in (1 / 64, 1 / 32, 1 / 64 + 1 / 256, 1 / 64, 1 / 256, 1 / 64 + 1 / 256)]
    dof = [1.0, 2.0, 25 / 17, 1.0, 1.0, 25 / 17]
    half = [scipy.stats.t.ppf(0.975, d) * e for d, e in zip(dof, se)]
    assert table["difference"].tolist() == pytest.approx(difference)
    assert table["interval"].tolist() == ["t"] * 6
    assert table["ci_low"].tolist() == pytest.approx([d - h for d, h in zip(difference, half)])
    assert table["ci_high"].tolist() == pytest.approx([d + h for d, h in zip(difference, half)])
    # 2 vs 2 seeds: 6 splits; the observed one and its mirror are the most extreme except for eggroll
    # vs full, whose split {0.5, 0.5} | {0.375, 0.625} has difference 0 and every split |d| >= 0
    assert table["permutation_p"].tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3, 1.0, 1 / 3, 1 / 3])
    assert table["exact"].all() and table["smallest_p"].tolist() == pytest.approx([1 / 3] * 6)
    assert table["larger_than_seed_noise"].tolist() == ["no"] * 6  # 2 seeds can never show it
    # Welch: variances 1/32 (es, full), 0 (eggroll), 1/128 (grpo); t = difference / se, dof by Welch-Satterthwaite
    assert table["welch_t"].tolist() == pytest.approx([3.0, 3 / math.sqrt(2), 11 / math.sqrt(5), 0.0, 5.0, math.sqrt(5)])
    assert table["welch_dof"].tolist() == pytest.approx([1.0, 2.0, 25 / 17, 1.0, 1.0, 25 / 17])
    cauchy = lambda t: 1 - 2 * math.atan(t) / math.pi  # noqa: E731 - dof 1
    assert table.loc[[0, 3, 4], "welch_p"].tolist() == pytest.approx([cauchy(3), 1.0, cauchy(5)])
    assert table.loc[1, "welch_p"] == pytest.approx(1 - (3 / math.sqrt(2)) / math.sqrt(2 + 4.5))  # dof 2


def test_method_comparisons_decide_at_alpha_and_with_five_seeds(tmp_path):
    assert analysis.method_comparisons(fixture_groups(), alpha=0.5)["larger_than_seed_noise"].tolist() == ["yes"] * 3 + ["no"] + ["yes"] * 2
    groups = {"es": [], "grpo": []}
    for seed in range(5):  # es solves 4 + (seed % 2) of 8 problems, grpo 1 + (seed % 2)
        for method, solved in (("es", 4 + seed % 2), ("grpo", 1 + seed % 2)):
            run = tmp_path / f"{method}_seed{seed}"
            run.mkdir()
            (run / "heldout.jsonl").write_text("".join(json.dumps({"index": i, "reward": float(i < solved),
                                                                   "success": i < solved}) + "\n" for i in range(8)))
            groups[method].append(RunRecord(run, method, seed, {"kind": method, "seed": seed}, [{"generation": 0}]))
    [row] = analysis.method_comparisons(groups).to_dict("records")
    # es 0.5, 0.625, 0.5, 0.625, 0.5 against grpo 0.125, 0.25, 0.125, 0.25, 0.125: every es seed above
    # every grpo seed, so only the observed split and its mirror of C(10, 5) = 252 are that extreme
    assert row["difference"] == pytest.approx(0.375) and row["permutation_p"] == pytest.approx(2 / 252)
    assert row["larger_than_seed_noise"] == "yes" and row["seeds_a"] == row["seeds_b"] == 5
    assert row["ci_low"] > 0 and row["welch_dof"] == pytest.approx(8.0)  # equal variances and sizes: n + m - 2


def test_runs_without_heldout_are_left_out_and_named(tmp_path):
    runs = copy_runs(tmp_path)
    (runs / "es_seed1" / "heldout.jsonl").unlink()
    for seed in (0, 1):
        (runs / f"grpo_seed{seed}" / "heldout.jsonl").unlink()
    groups = analysis.load_runs([str(runs / "es_*"), str(runs / "grpo_*")])
    table = analysis.study_table(groups)
    assert list(table.index) == ["es", "es eggroll", "es full"] and table.loc["es", "seeds"] == 1
    assert table.loc["es", "mean"] == 1.0 and math.isnan(table.loc["es", "seed_std"])
    assert table.attrs["note"].startswith("3 run(s) without held-out scores left out: es seed 1 (es_seed1), grpo seed 0")
    comparisons = analysis.method_comparisons(groups)
    assert len(comparisons) == 3 and "grpo" not in set(comparisons["method_b"])
    assert math.isnan(comparisons.loc[0, "welch_p"])  # one es seed: no variance
    runs_table = analysis.heldout_table(groups)
    assert runs_table.loc[runs_table["run"] == "es_seed1", "problems"].item() == 0


def test_checkpoint_points_cover_every_method():
    points = analysis.checkpoint_points(fixture_groups())
    assert len(points) == 16 and {p["method"] for p in points} == set(METHODS)
    full = [(p["generation"], p["kl"], p["reward"]) for p in points if p["method"] == "es full" and p["seed"] == 1]
    # hand-made: the gap starts at 93 and shrinks by 7 a generation; KL 0.75 x and 1 x the final 0.005
    assert full == [(3, pytest.approx(0.00375), -72.0), (4, 0.005, -65.0)]
    grpo = fixture_rows("grpo_seed0")
    assert [(p["generation"], p["reward"]) for p in points if p["method"] == "grpo" and p["seed"] == 0] == \
        [(3, grpo[3]["eval/reward"]), (4, grpo[4]["eval/reward"])]


# ----------------------------------------------------------------------------- the sweep's plan


def test_sweep_plans_equal_budgets():
    from evolm_lib import sweep

    batch_part, spec = sweep.load_sweep_spec(REPO / "papermill_runs" / "es_vs_grpo_conciseness_cpu.yaml")
    assert batch_part["notebook"] == "notebooks/04_es_vs_grpo.py"
    plan = sweep.plan_sweep(spec, generations=3, seeds=[0, 1], overrides={"model": "tiny-random"})
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


@pytest.fixture(scope="module")
def notebook_04(tmp_path_factory):
    """Notebook 04 run once by papermill on the fixture runs (ES and GRPO), two held-out prompts side
    by side: the executed notebook and its figures folder, read by the tests below."""
    from evolm_lib.batch import execute_notebook

    folder = tmp_path_factory.mktemp("notebook_04")
    executed = execute_notebook(REPO / "notebooks" / "04_es_vs_grpo.py", folder / "04.ipynb",
                                {"es_runs": ES, "grpo_runs": GRPO, "figures_dir": str(folder / "figures"),
                                 "num_examples": 2}, cwd=REPO)
    return executed, folder / "figures"


@pytest.mark.slow
def test_notebook_04_draws_and_exports_every_figure(notebook_04):
    executed, figures = notebook_04
    cells = json.loads(executed.read_text())["cells"]
    assert not [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    # the tables the notebook shows, from the same runs: every method in each, a comparison for every
    # pair, intervals around the means
    groups = fixture_groups()
    assert "es" in groups and any(label.startswith("grpo") for label in groups), list(groups)
    equal_budget = analysis.equal_budget_table(groups)
    assert set(equal_budget.index) == set(groups) and equal_budget.attrs["budget"] > 0
    assert len(analysis.equal_budget_comparisons(groups)) == len(groups) * (len(groups) - 1) // 2
    assert list(analysis.seed_spread_table(groups).index) == list(groups)
    measure = analysis.default_measure(groups)
    study = analysis.study_table(groups, measure=measure)
    assert len(study) and set(study.index) <= set(groups)
    assert len(analysis.method_comparisons(groups, measure=measure)) == len(study) * (len(study) - 1) // 2
    assert ((study["ci_low"] <= study["mean"]) & (study["mean"] <= study["ci_high"])).all()
    shown = "".join("".join(o.get("data", {}).get("text/plain", "")) for c in cells for o in c.get("outputs", []))
    assert all(method in shown for method in groups)
    # the fixtures are tiny-random runs: the summary and every reward figure's title say their rewards mean nothing
    note = "tiny-random: a plumbing check; its rewards mean nothing"
    printed = "".join("".join(o.get("text", "")) for c in cells for o in c.get("outputs", []))
    titles = [o["data"]["application/vnd.plotly.v1+json"]["layout"]["title"]["text"] for c in cells
              for o in c.get("outputs", []) if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert note in printed and len(titles) == 6 and all(title.endswith(f"({note})") for title in titles), titles
    written = sorted(p.name for p in figures.iterdir())
    stems = ["es_vs_grpo_heldout", "es_vs_grpo_reward_vs_kl", "es_vs_grpo_reward_vs_kl_checkpoints",
             "es_vs_grpo_reward_vs_samples", "es_vs_grpo_reward_vs_time", "es_vs_grpo_seed_spread"]
    assert written == sorted(f"{s}.{fmt}" for s in stems for fmt in MAGIC)
    for stem in stems:
        for fmt, magic in MAGIC.items():
            head = (figures / f"{stem}.{fmt}").read_bytes()[:500]
            assert magic in head if fmt == "svg" else head.startswith(magic), (stem, fmt)


@pytest.mark.slow
def test_notebook_04_shows_completions_long_so_the_table_fits_the_screen(notebook_04):
    """Notebook 04's completions: one row per prompt and run under four columns, whatever the number of
    runs (one column per run ran off the screen)."""
    import re

    executed, _ = notebook_04
    tables = ["".join(o["data"]["text/html"]) for c in json.loads(executed.read_text())["cells"]
              for o in c.get("outputs", []) if "final greedy completion" in "".join(o.get("data", {}).get("text/html", ""))]
    [table] = tables
    headings = re.findall(r'class="col_heading[^"]*" >([^<]*)</th>', table)
    assert headings == ["prompt", "target", "run", "final greedy completion"]
    runs = len(list(FIXTURES.glob("es_*"))) + len(list(FIXTURES.glob("grpo_*")))
    assert table.count("<tr>") - 1 == 2 * runs  # a header row, then a row per prompt (num_examples 2) and run


@pytest.mark.slow
def test_notebook_04_works_with_es_runs_only(tmp_path):
    from evolm_lib.batch import execute_notebook

    executed = execute_notebook(REPO / "notebooks" / "04_es_vs_grpo.py", tmp_path / "04.ipynb",
                                {"es_runs": ES, "grpo_runs": "", "figures_dir": str(tmp_path / "figures")}, cwd=REPO)
    cells = json.loads(executed.read_text())["cells"]
    assert not [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert len(list((tmp_path / "figures").glob("*.png"))) == 6  # the four, the checkpoints' KL and held-out


def test_scores_that_rode_along_are_placed_at_the_mean_they_scored():
    from evolm_lib.metrics import by_mean, series

    rows = [
        {"generation": 0, "samples/completions": 0, "eval/reward": 0.1},
        {"generation": 1, "samples/completions": 8},
        {"generation": 2, "samples/completions": 16, "eval/reward": 0.3, "policy/generation": 1},
        {"generation": 3, "samples/completions": 24, "eval/reward": 0.5},
    ]
    assert series(rows, "eval/reward", x="samples/completions") == ([0.0, 8.0, 24.0], [0.1, 0.3, 0.5])
    moved = by_mean(rows)
    assert moved[1]["eval/reward"] == 0.3 and "eval/reward" not in moved[2]
    assert moved[2]["samples/completions"] == 16  # what the row trained stays where it was
    assert series(rows, "samples/completions") == ([0.0, 1.0, 2.0, 3.0], [0.0, 8.0, 16.0, 24.0])
