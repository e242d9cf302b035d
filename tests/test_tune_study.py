"""The tuned study's stages on tiny-random: a searched split at the same budget, the winners continued
to twice the budget in copies (the reruns untouched), the shuffled-fitness control of the best ES
form, best_es / best_grpo decided by the validation winners, the study exported to a few files and
its tables, figures and geometry rebuilt from them; and every bad setting refused before an engine."""
from __future__ import annotations

import copy
import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from evolm_lib import tune
from evolm_lib.analysis import load_runs, study_table
from evolm_lib.env import code_identity
from evolm_lib.runs import read_jsonl, read_metrics
from evolm_lib.sweep import plan_sweep
from evolm_lib.tune.export import columns, export_groups, export_study, from_columns, read_study, scalar_row

REPO = Path(__file__).resolve().parents[1]

SPEC = {
    "notebook": "notebooks/07_tuning.py",
    "parameters": {},
    "sweep": {
        "common": {"model": "tiny-random", "task": "jsonl",  # task_options: write_spec's file

                   "target_modules": ["q_proj", "v_proj"], "lora_rank": 1, "max_new_tokens": 4,
                   "max_model_len": 256, "kv_cache_gb": 0.1, "eval_every": 1, "prompts_per_step": 2},
        "es": {"population_size": 4, "temperature": 0.0},
        "grpo": {"group_size": 4, "temperature": 1.0},
        "generations": 2,          # 2 x 4 members x 2 prompts = 16 training completions a run
        "seeds": [0],
    },
    "tune": {
        "trials": 2, "seeds": [100], "startup_trials": 2,
        "space": {"es": {"sigma": {"log": [0.005, 0.2]}, "split": ["4x2", "2x4"]},
                  "grpo": {"learning_rate": {"log": [1.0e-5, 3.0e-3]}}},
        "primary": [["best_es", "best_grpo"]], "long": 2, "control": "best_es", "measure": "reward",
    },
    "final_seeds": [0, 1],
}


WORDS = ["hi", "yes", "blue", "seven", "Paris", "cold", "up", "tree", "one", "red", "sun", "no", "cat", "Rome"]


def write_task(tmp_path: Path) -> Path:
    """10 training prompts (the last 2 carved off as validation) and 4 held-out ones, scored by the
    length reward: the tiny model's completions differ in length, so members' rewards differ."""
    path = tmp_path / "words.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say the word {word}.", "target": word,
                                        **({"split": "eval"} if i >= 10 else {})}) + "\n" for i, word in enumerate(WORDS)))
    return path


def write_spec(tmp_path: Path, change=None) -> Path:
    spec = copy.deepcopy(SPEC)
    spec["sweep"]["out"] = str(tmp_path / "out")
    spec["sweep"]["common"]["task_options"] = {"path": str(write_task(tmp_path)), "reward": "length", "num_validation": 2}
    if change:
        change(spec)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_split_sets_population_and_prompts_and_keeps_the_budget(tmp_path):
    spec = tune.load_tune_spec(write_spec(tmp_path))
    planned = spec.tuning_runs["es"][0]
    assert planned.budget == 16
    config = tune.trial_config(spec, planned, {"split": "2x4"})  # 16 = 2 generations x 2 members x 4 prompts
    assert (config.population_size, config.prompts_per_step, config.num_generations) == (2, 4, 2)
    config = tune.trial_config(spec, planned, {"split": "8x2"})  # 16 = 1 x 8 x 2
    assert (config.population_size, config.prompts_per_step, config.num_generations) == (8, 2, 1)
    with pytest.raises(ValueError, match=r"tune.space.es.split: 4x8 makes 32 completions a generation, which does "
                                         r"not divide the budget of 16"):
        tune.trial_config(spec, planned, {"split": "4x8"})
    with pytest.raises(ValueError, match=r"tune.space.es.split: 2x9 scores each member on 9 prompts, but the task "
                                         r"has 8 training prompts"):
        tune.trial_config(spec, planned, {"split": "2x9"})


def _set(path: list, value):
    def change(spec):
        node = spec
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return change


@pytest.mark.parametrize("change, message", [
    (_set(["tune", "space", "es", "split"], ["4x2", "4by2"]), r'tune.space.es.split: each choice is "SIZExPROMPTS"'),
    (_set(["tune", "space", "es", "split"], {"int": [1, 4]}), r'tune.space.es.split: a list of "SIZExPROMPTS" choices'),
    (_set(["tune", "space", "es", "split"], ["4x2", "3x2"]), r"tune.space.es.split: .*even"),
    (_set(["tune", "space", "es", "prompts_per_step"], [2, 4]), r"tune.space.es.prompts_per_step: not searched: .*split"),
    (_set(["tune", "long"], 0), r"tune.long: a whole number >= 1"),
    (_set(["tune", "control"], "grpo"), r"tune.control: none, best_es or a tuned ES method.*ES methods: \['es'\]"),
    (_set(["tune", "control"], "best_grpo"), r"tune.control: none, best_es or a tuned ES method"),
    (_set(["tune", "primary"], [["best_es", "best_gpro"]]), r"tune.primary: \['best_gpro'\] not a method of this sweep "
                                                             r"\(did you mean best_grpo\?\)"),
    (_set(["tune", "primary"], [["es", "es"]]), r"tune.primary: \['es', 'es'\] compares a method with itself"),
    (_set(["sweep", "grpo_completions"], 16), r"sweep.grpo_completions: gives GRPO a budget of its own"),
])
def test_bad_study_settings_fail_naming_the_setting_before_any_engine(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        tune.load_tune_spec(write_spec(tmp_path, change))
    assert not (tmp_path / "out").exists()


def test_best_of_a_kind_needs_a_tuned_method_of_that_kind(tmp_path):
    path = write_spec(tmp_path, lambda spec: spec["tune"]["space"].pop("grpo"))  # GRPO planned, but not tuned
    with pytest.raises(ValueError, match=r"tune: best_grpo names the best GRPO method, but no grpo method is tuned "
                                         r"here; tuned: \['es'\]"):
        tune.load_tune_spec(path, methods=["es"])


def test_the_dry_run_shows_the_later_stages_and_the_declared_family(tmp_path):
    lines = "\n".join(tune.describe(tune.load_tune_spec(write_spec(tmp_path))))
    assert "continued to 2 x the budget (32 training completions)" in lines
    assert "control: best_es's winner on the final seeds with fitness_control shuffled" in lines
    assert "primary family (Holm): best_es vs best_grpo; best_es / best_grpo: the ES / GRPO method whose winner" in lines



def test_a_tune_without_its_libraries_is_refused_before_any_engine(tmp_path, monkeypatch, capsys):
    from evolm_lib.cli import tune as tune_cli

    monkeypatch.setattr(tune_cli, "TUNE_LIBRARIES", ("optuna", "evolm_no_such_library"))
    assert tune_cli.main([str(write_spec(tmp_path)), "--dry-run"]) == 2  # the dry run too: it vouches for a launch
    assert "error: evolm tune needs evolm_no_such_library, not importable here" in capsys.readouterr().err
    assert tune_cli.missing_libraries(("optuna", "scipy", "statsmodels")) == []
    monkeypatch.setattr(tune_cli, "TUNE_LIBRARIES", ("optuna",))
    monkeypatch.setattr(tune_cli, "FIGURE_LIBRARIES", ("evolm_no_such_plotting",))
    assert tune_cli.main([str(write_spec(tmp_path)), "--dry-run"]) == 2  # its figures would end it after the work
    assert "error: evolm tune's figures need evolm_no_such_plotting" in capsys.readouterr().err
    assert tune_cli.main([str(write_spec(tmp_path)), "--dry-run", "--no-figures"]) == 0

@pytest.mark.parametrize("task", ["addition", "conciseness"])
def test_the_gpu_study_specs_check_and_checkpoint_and_score_grpo_no_more_often_than_es(task):
    """Every searched setting of the tuned study's GPU specs builds a config; and at the same budget a
    GRPO run writes no more checkpoints than an ES run: a full-weight GRPO checkpoint (the weights and
    AdamW's moments) written every 10 of 450 steps took most of a trial on the GPU. Nor does it score
    its mean more often: the addition study, which ran first, scored GRPO every 10 steps (up to 45
    times a run against ES's 6); its spec stays as it ran."""
    from evolm_lib.tune.spec import check_space

    configs = check_space(tune.load_tune_spec(REPO / "papermill_runs" / f"tune_study_{task}_gpu.yaml"))
    for every in ("checkpoint_every", "eval_every"):
        es = [c.num_generations // getattr(c, every) for c in configs if hasattr(c, "num_generations")]
        grpo = [c.num_steps // getattr(c, every) for c in configs if hasattr(c, "num_steps")]
        assert es and grpo
        if task == "addition" and every == "eval_every":
            assert (max(grpo), max(es)) == (45, 6)
        else:
            assert max(grpo) <= max(es), every


def test_a_runs_budget_counts_every_training_prompt_where_prompts_per_step_is_unset():
    from evolm_lib.config import ESConfig, GRPOConfig
    from evolm_lib.sweep import run_budget

    # conciseness trains on the paper's two prompts: 240 x 30 x 2 and 900 x 8 x 2, the GPU study's budget
    es = ESConfig(model="tiny-random", task="conciseness", population_size=30, num_generations=240)
    grpo = GRPOConfig(model="tiny-random", task="conciseness", group_size=8, num_steps=900)
    assert es.prompts_per_step is None and run_budget("es", es) == run_budget("grpo", grpo) == 14_400
    assert run_budget("es", es.replace(task="arithmetic", task_options={"digits": 2}, prompts_per_step=8,
                                       num_generations=60)) == 14_400  # 60 x 30 x 8


def test_a_protocols_own_grpo_budget_sets_the_steps(tmp_path):
    sweep = copy.deepcopy(SPEC["sweep"])
    sweep["common"]["task_options"] = {"path": str(write_task(tmp_path)), "reward": "length", "num_validation": 2}
    sweep["grpo_completions"] = 40  # 5 steps of a group of 4 on 2 prompts
    plan = {run.kind: run for run in plan_sweep(sweep)}
    assert (plan["es"].budget, plan["grpo"].budget, plan["grpo"].config.num_steps) == (16, 40, 5)
    sweep["grpo_completions"] = 42
    with pytest.raises(ValueError, match=r"sweep.grpo_completions: 42 is not a whole number of steps of 8 completions"):
        plan_sweep(sweep)


def test_how_soon_each_method_of_a_pair_reaches_the_weaker_ones_final_score():
    """reach_table, hand-computed: the target is the lower of the two methods' mean final evaluation
    reward (a: 0.6 and 0.4, mean 0.5; b: 0.8 and 0.9); a seed's first row at or above it gives its
    training seconds (scoring left out) and completions; medians over the seeds that reach it."""
    from types import SimpleNamespace

    from evolm_lib.tune.report import reach_table

    def run(*rows):
        return SimpleNamespace(rows=[{"generation": g, **row} for g, row in enumerate(rows)])

    groups = {
        "a": [run({"eval/reward": 0.1, "samples/completions": 0},
                  {"time/generation_s": 2.0, "eval/reward": 0.45, "samples/completions": 10},
                  {"time/generation_s": 3.0, "time/eval_s": 1.0, "eval/reward": 0.6, "samples/completions": 20}),
              run({"eval/reward": 0.1, "samples/completions": 0},
                  {"time/generation_s": 2.0, "eval/reward": 0.4, "samples/completions": 10})],
        "b": [run({"eval/reward": 0.2, "samples/completions": 0},
                  {"time/generation_s": 1.0, "eval/reward": 0.8, "samples/completions": 5}),
              run({"eval/reward": 0.5, "samples/completions": 0},  # there before any training
                  {"time/generation_s": 1.0, "eval/reward": 0.9, "samples/completions": 5})]}
    table = reach_table(groups, [("a", "b")])
    assert table.to_dict("records") == [
        {"a": "a", "b": "b", "target": 0.5, "method": "a", "seeds": 2, "reached": 1, "training_seconds": 4.0,
         "completions": 20},
        {"a": "a", "b": "b", "target": 0.5, "method": "b", "seeds": 2, "reached": 2, "training_seconds": 0.5,
         "completions": 2.5}]


def test_a_protocols_sweep_is_digested_at_its_own_budgets_and_at_the_common_one():
    """A plain sweep whose methods trained on different budgets (Qiu et al.'s protocol): its runs in
    the digest's table, the budgets said to differ, each method's evaluation reward at the common
    budget interpolated between its logged points (hand-computed: b's seeds reach 0.5, 0.5 and 0.4 at
    100 completions), both comparisons, and 3 seeds against 3 named as unable to reach 0.05."""
    from evolm_lib.tune.digest import study_digest
    from evolm_lib.tune.report import study_tables

    def run(method, seed, curve, solved):
        rows = [{"generation": g, "samples/completions": c, "eval/reward": r} for g, (c, r) in enumerate(curve)]
        return {"stage": "sweep", "method": method, "seed": seed, "trial": None, "path": f"{method}_seed{seed}",
                "config": {"seed": seed}, "rows": rows, "placement": [],
                "heldout": {"generation": len(curve) - 1, "index": list(range(4)), "reward": [float(x) for x in solved],
                            "success": [bool(x) for x in solved]}}

    runs = [run("a", 0, [(0, 0.1), (100, 0.5)], [1, 1, 0, 0]), run("a", 1, [(0, 0.1), (100, 0.6)], [1, 1, 1, 0]),
            run("a", 2, [(0, 0.1), (100, 0.7)], [1, 1, 1, 0]),
            run("b", 0, [(0, 0.1), (50, 0.3), (200, 0.9)], [1, 0, 0, 0]),
            run("b", 1, [(0, 0.1), (50, 0.4), (200, 0.7)], [1, 1, 0, 0]),
            run("b", 2, [(0, 0.1), (50, 0.2), (200, 0.8)], [0, 0, 0, 0])]
    tables = study_tables({"runs": runs, "trials": [], "summary": None, "geometry": None}, measure="success")
    assert set(tables) == {"sweep", "sweep_comparisons", "sweep_equal_budget", "sweep_equal_budget_tests"}
    equal = tables["sweep_equal_budget"]
    assert equal.attrs["budget"] == 100
    assert equal.loc["b", "reward_mean"] == pytest.approx((0.5 + 0.5 + 0.4) / 3)
    assert equal.loc["b", "final_reward_mean"] == pytest.approx(0.8)
    digest = study_digest(tables, "protocol").splitlines()
    assert ("Held-out success over each method's seeds: mean (95 % interval across seeds: BCa bootstrap from 5 seeds, "
            "Student's t below, where a bootstrap has too few distinct resamples), t interval, seed standard deviation."
            in digest)
    assert [line.split(" | ")[:6] for line in digest if line.startswith(("| a |", "| b |"))][:2] == [
        # three seeds: t intervals (mean -/+ 4.303 s / sqrt 3), cut to the shares' range [0, 100 %]
        ["| a", "", "", "", "3", "66.7 % (30.8-100.0 %)"], ["| b", "", "", "", "3", "25.0 % (0.0-87.1 %)"]]
    assert ("Not an equal-budget comparison: the methods trained on different numbers of completions, a on 100 and "
            "b on 200 (means over the seeds).") in digest
    assert "| a | 3 | 0.6 (std 0.1) | 0.6 (100) |" in digest and "| b | 3 | 0.467 (std 0.058) | 0.8 (200) |" in digest
    assert any(line.startswith("| a | b | exploratory | +41.7 points (") for line in digest)
    assert any(line.startswith("| a | b | exploratory | +0.133 (") for line in digest)
    assert sum(line.startswith("Too few seeds to call beyond seed noise at 0.05, whatever the difference: a - b (3 and 3 "
                               "seeds: smallest p 0.1; Welch's t p ") for line in digest) == 2


def test_negative_rewards_read_as_intervals_from_one_bound_to_the_other():
    """Conciseness rewards are negative: an interval reads "low to high", never "-2.5--1.5"; one of
    success rates keeps its short form (the previous test)."""
    from evolm_lib.tune.digest import study_digest
    from evolm_lib.tune.report import study_tables

    def run(seed, rewards):
        return {"stage": "sweep", "method": "a", "seed": seed, "trial": None, "path": f"a_seed{seed}",
                "config": {"seed": seed}, "rows": [{"generation": 0, "samples/completions": 0, "eval/reward": -3.0}],
                "placement": [], "heldout": {"generation": 0, "index": [0, 1], "reward": rewards,
                                             "success": [False, False]}}

    runs = [run(0, [-2.0, -3.0]), run(1, [-1.0, -2.0]), run(2, [-2.0, -2.0])]  # means -2.5, -1.5, -2
    digest = study_digest(study_tables({"runs": runs, "trials": [], "summary": None, "geometry": None},
                                       measure="reward"), "conciseness").splitlines()
    row = next(line.split(" | ") for line in digest if line.startswith("| a |"))
    # three seeds: no bootstrap, the held-out cell gives the t interval: -2 -+ 4.303 * 0.5 / sqrt(3)
    assert row[5] == "-2 (-3.24 to -0.758)" and "--" not in row[5]
    assert row[6] == "-3.24 to -0.758"


def test_a_comparison_with_one_seed_on_a_side_says_it_has_no_interval():
    """An interim study whose method has one seed so far: its comparisons have no BCa interval,
    permutation p nor Welch's t (scipy asks for two values a group), nor has its own row a spread,
    and the digest says so in words rather than printing "+nan to +nan", "-4 (-4 to -4)" or "nan";
    two seeds a side with no spread in either have no Welch's t either, and it says why."""
    from evolm_lib.tune.digest import study_digest
    from evolm_lib.tune.report import study_tables

    def run(method, seed, rewards):
        return {"stage": "sweep", "method": method, "seed": seed, "trial": None, "path": f"{method}_seed{seed}",
                "config": {"seed": seed}, "rows": [{"generation": 0, "samples/completions": 0, "eval/reward": -3.0}],
                "placement": [], "heldout": {"generation": 0, "index": [0, 1], "reward": rewards,
                                             "success": [False, False]}}

    runs = [run("a", 0, [-2.0, -3.0]), run("a", 1, [-1.0, -2.0]), run("a", 2, [-2.0, -2.0]), run("b", 0, [-4.0, -4.0]),
            run("c", 0, [-3.0, -3.0]), run("c", 1, [-2.0, -4.0]), run("d", 0, [-5.0, -5.0]), run("d", 1, [-5.0, -5.0])]
    digest = study_digest(study_tables({"runs": runs, "trials": [], "summary": None, "geometry": None},
                                       measure="reward"), "one seed").splitlines()
    assert "| a | b | exploratory | +2 (no interval: one seed on a side) |  |  | no |" in digest  # -2 - (-4)
    assert next(line for line in digest if line.startswith("| b |")).split(" | ")[4:8] == ["1", "-4 (one seed)", "", ""]
    assert not any("nan" in line for line in digest)
    short = next(line for line in digest if line.startswith("Too few seeds"))
    assert "a - b (3 and 1 seeds: smallest p 0.5; no Welch's t with one seed on a side)" in short  # 2 / C(4, 1)
    # c's seeds both score -3 and d's both -5: two seeds a side, but no variance for Welch's t
    assert "c - d (2 and 2 seeds: smallest p 0.33; no Welch's t: no spread within either side)" in short  # 2 / C(4, 2)


def test_a_study_short_of_its_trials_or_seeds_is_digested_as_interim():
    """The digest of a study under way opens by naming each method short of its trials (the
    summary's tune.trials), of final seeds with held-out scores, or of continued reruns (hand-counted:
    b has 1 of 2 trials, 1 of 2 final seeds and no continued one), and the control while it is
    undecided or short of seeds; a finished study's digest does not. A summary that predates
    trials_per_method is checked on its seeds alone."""
    from evolm_lib.tune.digest import study_digest
    from evolm_lib.tune.report import study_tables

    def trial(method, number):
        return {"method": method, "number": number, "state": "complete", "value": -1.0, "params": {"sigma": 0.1},
                "config": {}, "retries": None, "error": None, "seconds": 1.0}

    def run(stage, method, seed):
        return {"stage": stage, "method": method, "seed": seed, "trial": None, "path": f"{stage}/{method}/seed{seed}",
                "config": {"seed": seed}, "rows": [{"generation": 0, "samples/completions": 0}], "placement": [],
                "heldout": {"generation": 0, "index": [0, 1], "reward": [-1.0, -2.0], "success": [False, False]}}

    summary = {"final_seeds": [0, 1], "trials_per_method": 2, "long": {"factor": 2}, "measure": "reward",
               "control": {"declared": "best_es", "method": None}}
    trials = [trial("a", 0), trial("a", 1), trial("b", 0)]
    runs = [run(stage, "a", seed) for stage in ("final", "long") for seed in (0, 1)] + [run("final", "b", 0)]
    tables = study_tables({"runs": runs, "trials": trials, "summary": summary, "geometry": None})
    completeness = tables["completeness"]
    assert completeness.loc["a"].to_dict() == {"trials": 2, "trials_planned": 2, "final_seeds": 2, "final_seeds_planned": 2,
                                               "long_seeds": 2, "long_seeds_planned": 2, "complete": True}
    assert completeness.loc["b", ["trials", "final_seeds", "long_seeds", "complete"]].tolist() == [1, 1, 0, False]
    assert ("**Interim: the study is not finished.** Read nothing here as its result: b (1 of 2 trials, 1 of 2 final "
            "seeds, 0 of 2 continued reruns) and control (best_es: undecided) (0 of 2 final seeds).") \
        in study_digest(tables, "t").splitlines()

    finished = trials + [trial("b", 1)]
    runs += [run("final", "b", 1)] + [run(stage, "b", seed) for stage in ("long", "control") for seed in (0, 1)]
    summary["control"]["method"] = "b"
    tables = study_tables({"runs": runs, "trials": finished, "summary": summary, "geometry": None})
    assert tables["completeness"].loc["control (best_es: b)", "final_seeds"] == 2
    assert tables["completeness"]["complete"].all() and "Interim" not in study_digest(tables, "t")
    older = {k: v for k, v in summary.items() if k != "trials_per_method"}  # tune.trials unrecorded: not checked
    tables = study_tables({"runs": runs, "trials": trials, "summary": older, "geometry": None})
    assert tables["completeness"]["complete"].all()


def test_what_a_study_under_way_has_left_is_paced_by_its_own_finished_runs():
    """left.csv, hand-computed. es: trials of 100 and 300 s pace it at their median, 200; of its 4
    trials 2 are left, one under way at 5 of 10 generations from a checkpoint (half kept): 1.5 x 200;
    its reruns at that pace too, its trials not being done: seed 0 at 4 of 10 from a checkpoint,
    1.6 x 200; two continuations, 2 x 200; 1,020 s. grpo, its trials done: a rerun at its winner's
    80 s; seed 1 under way but beginning again (no checkpoint), 1 x 80; a continuation at 15 of 20
    from a checkpoint (half of its own length kept), 1.5 x 80; 200 s. The control, undecided: the
    ES form ahead so far (es), 2 reruns x 200 = 400 s. Once grpo's reruns have timed rows (6 s a
    step over seed 0's 10, 8 over seed 1's 7), a rerun goes at their median pace, 7 x 10 = 70 s:
    1 x 70 + 1.5 x 70 = 175 s."""
    from evolm_lib.tune.digest import study_digest
    from evolm_lib.tune.report import study_tables

    def trial(method, number, seconds, value=-1.0, state="complete"):
        return {"method": method, "number": number, "state": state, "value": value if state == "complete" else None,
                "params": {}, "config": {}, "retries": None, "error": None, "seconds": seconds}

    def run(stage, method, seed, at, length, resume, trial_number=None, finished=False):
        kind = method
        return {"stage": stage, "method": method, "seed": seed, "trial": trial_number, "path": f"{stage}/{method}/{seed}",
                "config": {"seed": seed, "num_generations": length}, "placement": [],
                "rows": [{"generation": g, "method": kind, "samples/completions": g} for g in range(at + 1)],
                "resume": {"generation": at} if resume else None,
                "heldout": {"generation": at, "index": [0], "reward": [-1.0], "success": [False]} if finished else None}

    summary = {"final_seeds": [0, 1], "trials_per_method": 4, "long": {"factor": 2}, "measure": "reward",
               "control": {"declared": "best_es", "method": None}}
    trials = [trial("es", 0, 100.0), trial("es", 1, 300.0), trial("es", 2, None, state="running"),
              trial("grpo", 0, 50.0, -1.0), trial("grpo", 1, 80.0, -0.5), trial("grpo", 2, 60.0, -2.0),
              trial("grpo", 3, 70.0, -3.0)]
    runs = [run("trial", "es", 100, 5, 10, True, trial_number=2), run("final", "es", 0, 4, 10, True),
            run("final", "grpo", 0, 10, 10, True, finished=True), run("final", "grpo", 1, 7, 10, False),
            run("long", "grpo", 0, 15, 20, True)]
    tables = study_tables({"runs": runs, "trials": trials, "summary": summary, "geometry": None})
    left = tables["left"]
    assert left.loc["es", ["trials_left", "reruns_left", "continuations_left", "trial_pace_seconds", "rerun_seconds"]
                    ].tolist() == [2, 2, 2, 200.0, 200.0]
    assert left.loc["es", "seconds_left"] == pytest.approx(1.5 * 200 + 1.6 * 200 + 2 * 200)
    assert left.loc["grpo", ["trials_left", "reruns_left", "continuations_left", "trial_pace_seconds", "rerun_seconds"]
                    ].tolist() == [0, 1, 2, 65.0, 80.0]
    assert left.loc["grpo", "seconds_left"] == pytest.approx(1 * 80 + 1.5 * 80)
    assert left.loc["control (best_es: es so far)", "seconds_left"] == pytest.approx(400)
    assert any(line.startswith(f"Left, in one worker's hours at the pace of each method's own finished runs "
                               f"(`left.csv`; a floor, the engines a card as they ran): about {1620 / 3600:.1f} in all (es 0.3, ")
               for line in study_digest(tables, "t").splitlines())

    for timed, step in ((runs[2], 6.0), (runs[3], 8.0)):  # grpo's reruns, seed 0 finished, seed 1 under way
        for row in timed["rows"]:
            row["time/wall_s"] = row["generation"] * step
    left = study_tables({"runs": runs, "trials": trials, "summary": summary, "geometry": None})["left"]
    assert left.loc["grpo", "rerun_seconds"] == pytest.approx(70.0)
    assert left.loc["grpo", "seconds_left"] == pytest.approx(1 * 70 + 1.5 * 70)
    assert left.loc["es", "seconds_left"] == pytest.approx(1.5 * 200 + 1.6 * 200 + 2 * 200)  # no timed rows: as before


def test_a_trials_seconds_count_its_runs_own_clock_across_a_resume():
    """The winners table's tuning seconds: a trial finished by the retry of a killed attempt, which
    resumed its run from a checkpoint, counts its run's wall clock at the last row (25 s, the run's
    folder carrying the first attempt's number) where that is more than the retry's own seconds
    (10); a trial that ran whole counts its seconds (30, more than its rows' 20): 55 in all."""
    from evolm_lib.tune.report import winners_table

    def trial(number, state, seconds, retries=None):
        return {"method": "es", "number": number, "state": state, "value": -1.0 if state == "complete" else None,
                "params": {"sigma": 0.1}, "config": {}, "retries": retries, "error": None, "seconds": seconds}

    def run(number, wall):
        return {"stage": "trial", "method": "es", "trial": number, "seed": 100, "placement": [],
                "rows": [{"generation": 0, "time/wall_s": wall / 2}, {"generation": 1, "time/wall_s": wall}]}

    trials = [trial(0, "fail", None), trial(1, "complete", 10.0, retries=0), trial(2, "complete", 30.0)]
    table = winners_table(trials, [run(0, 25.0), run(2, 20.0)])
    assert table.loc["es", "trials"] == 2 and table.loc["es", "tuning_seconds"] == pytest.approx(55.0)


def test_an_answer_holds_its_target_as_a_word_of_its_own_in_any_case():
    from evolm_lib.analysis import target_in_answer

    def holds(completion, target):
        return target_in_answer({"completion": completion, "target": target})

    assert holds("The capital of France is Paris.", "Paris") and holds("paris", "Paris") and holds("10.", "10")
    assert not holds("100", "10") and not holds("Parisian", "Paris") and not holds("", "Paris")
    assert holds("x = 2.5", "2.5") and not holds("x = 285", "2.5")  # the target is matched as text, not a pattern
    assert target_in_answer({"completion": "Paris"}) is None and target_in_answer({"target": "Paris"}) is None
    assert target_in_answer({"has_target": 1, "completion": ""}) is True  # a compacted run's flag stands


def test_the_base_model_answers_the_studys_held_out_problems_for_reference(tmp_path, tiny_vllm, capsys):
    """`evolm_lib.tune.base_answers`: the spec's task and token limit, no adapter, every held-out problem
    once, lines as a run's heldout.jsonl (rewards the task's own), and means that are those of the lines."""
    import statistics

    from evolm_lib.analysis import target_in_answer
    from evolm_lib.tasks.conciseness import length_reward
    from evolm_lib.tune.base_answers import base_answers, main as base_main
    from evolm_lib.tune.spec import load_tune_spec

    spec_path = REPO / "papermill_runs" / "tune_study_conciseness_gpu.yaml"
    found = base_answers(load_tune_spec(spec_path, overrides={"model": "tiny-random", "max_new_tokens": 8}), tiny_vllm)
    lines, summary = found["lines"], found["summary"]
    assert [line["index"] for line in lines] == list(range(108)) and {line["generation"] for line in lines} == {0}
    assert lines[0]["prompt"] == "What is the capital of France?" and lines[0]["target"] == "Paris"
    assert all(line["reward"] == length_reward(line["completion"], line["target"]).value for line in lines)
    assert summary["problems"] == 108 and summary["reward"] == statistics.fmean(line["reward"] for line in lines)
    assert summary["has_target"] == statistics.fmean(float(target_in_answer(line)) for line in lines)
    assert 0 <= summary["empty"] <= 1 and summary["success"] == statistics.fmean(float(l["success"]) for l in lines)
    assert base_main([str(tmp_path / "no_such_spec.yaml")]) == 2 and "error:" in capsys.readouterr().err


def test_empty_held_out_answers_are_kept_by_the_export_and_their_share_reported(tmp_path):
    """The held-out table gains each method's mean share of empty or whitespace answers over its
    seeds, read from the run folders (hand-computed: 2 of 3, 1 of 3 and 0 of 3 empty: 1/3), and of
    answers that hold their target (1 of 3, 2 of 3 and 2 of 3, since "840" does not hold "84": 5/9); the export keeps the flags (not the
    answers), so the study's tables give the same shares and the digest names them; runs whose lines
    carry no completion (an older study) give no such columns."""
    from evolm_lib.analysis import ANSWER_SHARES, load_runs, study_table
    from evolm_lib.tune.export import export_study, read_study
    from evolm_lib.tune.digest import ANSWER_LINES, study_digest
    from evolm_lib.tune.report import study_tables

    assert set(ANSWER_LINES) == set(ANSWER_SHARES)  # a digest line for each share the table can have
    study = tmp_path / "study"
    answers = {0: ["", " \n", "It is true."], 1: ["", "84", "True"], 2: ["The capital is paris.", "840", "True"]}
    targets = ["Paris", "84", "True"]
    for seed, completions in answers.items():
        folder = study / "final" / "es_lora" / f"seed{seed}"
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(f"seed: {seed}\n")
        (folder / "metrics.jsonl").write_text(json.dumps({"generation": 0, "samples/completions": 0}) + "\n")
        (folder / "heldout.jsonl").write_text("".join(
            json.dumps({"index": i, "generation": 0, "completion": c, "target": targets[i],
                        "reward": -float(abs(len(c) - 2)), "success": len(c) == 2}) + "\n"
            for i, c in enumerate(completions)))
    from_folders = study_table(load_runs({"es_lora": str(study / "final" / "es_lora" / "seed*")}), measure="reward")
    assert from_folders.loc["es_lora", "empty_answers"] == pytest.approx(1 / 3)  # notebook 04's table, from the runs
    assert from_folders.loc["es_lora", "target_answers"] == pytest.approx(5 / 9)
    export_study(study, tmp_path / "compact")
    loaded = read_study(tmp_path / "compact")
    assert sorted(run["heldout"]["empty"] for run in loaded["runs"]) == [
        [False, False, False], [True, False, False], [True, True, False]]
    assert sorted(run["heldout"]["has_target"] for run in loaded["runs"]) == [
        [False, False, True], [False, True, True], [True, False, True]]
    assert "paris" not in json.dumps(loaded["runs"]).lower()  # the answers and targets themselves stay out
    tables = study_tables(loaded, measure="reward")
    assert tables["heldout"].loc["es_lora", "empty_answers"] == pytest.approx(1 / 3)
    assert tables["heldout"].loc["es_lora", "target_answers"] == pytest.approx(5 / 9)
    digest = study_digest(tables, "t").splitlines()
    assert ("Empty held-out answers (nothing but whitespace; where the reward is minus the length gap, an empty one "
            "scores minus the target's length), the mean share over the seeds: es_lora 33 %.") in digest
    assert ("Held-out answers that hold their target as a word, in any case (whether they are right, which a length "
            "reward does not check), the mean share over the seeds: es_lora 56 %.") in digest

    for folder in (study / "final" / "es_lora").iterdir():  # an older study's lines: no completion
        lines = [json.loads(line) for line in (folder / "heldout.jsonl").read_text().splitlines()]
        (folder / "heldout.jsonl").write_text("".join(json.dumps({k: v for k, v in line.items() if k != "completion"})
                                                      + "\n" for line in lines))
    export_study(study, tmp_path / "older")
    tables = study_tables(read_study(tmp_path / "older"), measure="reward")
    assert "empty_answers" not in tables["heldout"] and "target_answers" not in tables["heldout"]
    assert "Empty held-out" not in study_digest(tables, "t") and "hold their target" not in study_digest(tables, "t")


def test_the_base_model_s_lines_go_into_the_export_and_become_the_tables_and_figures_reference(tmp_path, capsys):
    """STUDY/base/heldout.jsonl (tune.base_answers --out, never written over): the export keeps its summary (hand-computed: rewards -5, 0, -14 and 0 of four answers, one empty, three holding their
    target), which the tables give as a row, the digest as a line and the answers figure as a star."""
    from evolm_lib.tune.base_answers import main as base_main
    from evolm_lib.tune.export import export_study, read_study
    from evolm_lib.tune.final import BASE_HELDOUT
    from evolm_lib.tune.digest import study_digest
    from evolm_lib.tune.report import study_tables
    from evolm_lib.viz.study import answer_figure

    study = tmp_path / "study"
    (study / "base").mkdir(parents=True)
    base = [("", "Paris", -5.0), ("Paris", "Paris", 0.0), ("The answer is 84", "84", -14.0), ("No", "No", 0.0)]
    (study / BASE_HELDOUT).write_text("".join(json.dumps(
        {"index": i, "generation": 0, "completion": c, "target": target, "reward": r, "success": r == 0.0}) + "\n"
        for i, (c, target, r) in enumerate(base)))
    run = study / "final" / "es_lora" / "seed0"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    (run / "metrics.jsonl").write_text(json.dumps({"generation": 0, "samples/completions": 0}) + "\n")
    (run / "heldout.jsonl").write_text(json.dumps({"index": 0, "generation": 0, "completion": "", "target": "Paris",
                                                   "reward": -5.0, "success": False}) + "\n")
    assert base_main(["no_spec_read.yaml", "--out", str(study / BASE_HELDOUT)]) == 2  # refused before any work
    assert f"--out {study / BASE_HELDOUT} exists" in capsys.readouterr().err

    export_study(study, tmp_path / "compact")
    loaded = read_study(tmp_path / "compact")
    assert loaded["base"] == {"problems": 4, "reward": -4.75, "success": 0.5, "empty": 0.25, "has_target": 0.75}
    tables = study_tables(loaded, measure="reward")
    assert tables["base"].loc["base model", "reward"] == -4.75
    assert ("The base model, untrained, on the same 4 held-out problems (`python -m evolm_lib.tune.base_answers`): -4.75, "
            "25 % of its answers empty and 75 % holding their target.") in study_digest(tables, "t").splitlines()
    star = [trace for trace in answer_figure(loaded).data if trace.name == "base model"]
    assert len(star) == 1 and list(star[0].x) == [25.0] and list(star[0].y) == [75.0]
    assert star[0].marker.symbol == "star"


def test_where_a_stage_ran_is_told_per_group_of_methods_when_they_differ():
    import pandas as pd

    from evolm_lib.tune.digest import _where

    def table(rows):
        return pd.DataFrame(rows, index=[r["method"] for r in rows])

    h100 = {"device": "NVIDIA H100 80GB HBM3", "engines_per_card": "5", "code": ""}
    same = table([{"method": "es", **h100}, {"method": "grpo", **h100}])
    assert _where("The final seeds", same) == ("The final seeds ran on NVIDIA H100 80GB HBM3, 5 engines a card; "
                                               "code not recorded (runs from before placement.jsonl recorded it).")
    mixed = table([{"method": "es", **h100}, {"method": "grpo", "device": "NVIDIA H200", "engines_per_card": "2, 3",
                                              "code": "301acde"}, {"method": "es_full", **h100}])
    assert _where("The runs at twice the budget", mixed) == (
        "The runs at twice the budget ran in 2 places: es and es_full on NVIDIA H100 80GB HBM3, 5 engines a card, "
        "code not recorded (runs from before placement.jsonl recorded it); grpo on NVIDIA H200, 2, 3 engines a card, "
        "code 301acde.")
    through = table([{"method": "es", **h100, "mps": "MPS"}, {"method": "grpo", **h100, "mps": "MPS in part"}])
    assert _where("The final seeds", through) == (
        "The final seeds ran in 2 places: es on NVIDIA H100 80GB HBM3, 5 engines a card (MPS), code not recorded "
        "(runs from before placement.jsonl recorded it); grpo on NVIDIA H100 80GB HBM3, 5 engines a card (MPS in part), "
        "code not recorded (runs from before placement.jsonl recorded it).")


def test_placements_say_mps_only_where_a_run_shared_its_card_through_it():
    from evolm_lib.tune.report import placements

    line = {"device": "NVIDIA H200", "engines_per_card": 5, "code_commit": "01a12b3c0", "code_digest": "d"}
    before = {"placement": [line]}  # lines from before MPS was recorded: no MPS
    through = {"placement": [{**line, "cuda_mps_pipe_directory": "/tmp/evolm-mps/pipe"}]}
    without = {"placement": [{**line, "cuda_mps_pipe_directory": None}]}
    assert placements([before])["mps"] == "" and placements([without])["mps"] == ""
    assert placements([through])["mps"] == "MPS" and placements([through, before])["mps"] == "MPS in part"


def test_the_geometry_tables_average_over_seeds_and_skip_directionless_updates():
    """geometry.json's updates, drift, cosines and paths as tables and digest lines, against
    hand-computed means and standard deviations; a cosine of no direction (None) is left out."""
    from evolm_lib.tune.digest import geometry_digest
    from evolm_lib.tune.report import geometry_tables

    def update(method, seed, norm, changed):
        return {"method": method, "seed": seed, "form": "full", "values": 100, "norm": norm, "base_norm": 10.0,
                "changed_share": changed, "by_layer": [{"layer": 0, "values": 100, "norm": norm, "base_norm": 10.0,
                                                        "changed_share": changed}]}

    geometry = {
        "seeds": [0, 1],
        "updates": [update("es", 0, 3.0, 0.9), update("es", 1, 5.0, 0.7), update("grpo", 0, 1.0, 0.2),
                    update("grpo", 1, 1.0, 0.4)],
        "drift": [{"method": "es", "seed": 0, "task": "conciseness", "kl": 0.1},
                  {"method": "es", "seed": 1, "task": "conciseness", "kl": 0.3},
                  {"method": "grpo", "seed": 0, "task": "conciseness", "kl": 0.2},
                  {"method": "grpo", "seed": 1, "task": "conciseness", "kl": None}],
        "cosines": [{"seed": 0, "a": "es", "b": "grpo", "overall": 0.1}, {"seed": 1, "a": "es", "b": "grpo", "overall": -0.3},
                    {"seed": 0, "a": "es", "b": "es", "overall": None}],
        "paths": [{"a": "es", "b": "grpo", "seed": 0, "barrier": 0.05,
                   "rows": [{"t": 0.0, "eval/reward": 0.5}, {"t": 0.5, "eval/reward": 0.6}, {"t": 1.0, "eval/reward": 0.8}]}],
    }
    tables = geometry_tables(geometry)
    updates = tables["geometry_updates"]
    assert updates.loc["es", "update_norm"] == 4.0 and updates.loc["es", "update_norm_sd"] == pytest.approx(2 ** 0.5)
    assert updates.loc["es", "relative_norm"] == pytest.approx(0.4) and updates.loc["es", "changed_share"] == pytest.approx(0.8)
    assert updates.loc["es", "drift_kl"] == pytest.approx(0.2) and updates.loc["es", "drift_kl_sd"] == pytest.approx(2 ** 0.5 / 10)
    assert updates.loc["grpo", "drift_kl"] == pytest.approx(0.2)  # the seed without a KL left out
    assert updates.loc["grpo", "update_norm_sd"] == 0.0 and updates.loc["grpo", "seeds"] == 2
    (cosine,) = tables["geometry_cosines"].to_dict("records")  # es with es had no direction
    # chance level 1/sqrt(d): geometry.json without it gives d as the larger update's values, 100
    assert cosine == {"a": "es", "b": "grpo", "seeds": 2, "cosine": pytest.approx(-0.1), "lowest": -0.3, "highest": 0.1,
                      "chance": pytest.approx(0.1)}
    measured = {**geometry, "cosines": [{**c, "chance": 0.05} for c in geometry["cosines"]]}
    assert geometry_tables(measured)["geometry_cosines"]["chance"].tolist() == [0.05]  # as update_cosine gave it
    (path,) = tables["geometry_paths"].to_dict("records")
    assert path == {"a": "es", "b": "grpo", "seed": 0, "t=0": 0.5, "t=0.5": 0.6, "t=1": 0.8, "barrier": 0.05}
    lines = geometry_digest(tables, "success")
    assert "| es | full | 4 (1.4) | 0.4 | 80.0 % | 0.2 (0.14) |" in lines
    assert "| es | grpo | -0.1 | -0.3 to 0.1 | 0.1 |" in lines  # the chance level beside the cosine
    assert "| es | grpo | 0 | 50.0 % | 60.0 % | 80.0 % | 5.0 % |" in lines
    assert geometry_digest({}, "success") == [] and geometry_tables({}) == {}
    from evolm_lib.viz.study import geometry_figures

    figure = geometry_figures(geometry)["geometry_path_es_grpo"]  # its ends named on the axis, as a paper's title goes
    assert figure.layout.xaxis.title.text == "t (0: es, 1: grpo)"


def test_exported_rows_keep_scalars_and_come_back_by_column():
    row = {"generation": 3, "method": "es", "eval/reward": 0.1234567891, "time/generate_s": 0.123456,
           "time/wall_s": 12.3456789, "ok": True, "policy/train_completions": ["a", "b"], "es/weights": [0.5],
           "train/reward_std": float("nan"), "note": "x" * 65}
    assert scalar_row(row) == {"generation": 3, "method": "es", "eval/reward": 0.123457, "time/generate_s": 0.123,
                               "time/wall_s": 12.3457, "ok": True}
    rows = [{"generation": 0, "eval/reward": 0.5}, {"generation": 1}]
    assert columns(rows) == {"eval/reward": [0.5, None], "generation": [0, 1]}
    assert from_columns(columns(rows)) == rows


def _png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_the_study_end_to_end_then_exported_tabled_drawn_and_measured(tmp_path, tiny_vllm):
    """Two trials each of ES (searching a split) and GRPO, the winners on two final seeds, continued to
    twice the budget, the control of the best ES form; then export -> report (the same tables as the
    report of the live folder) -> figures, and the geometry."""
    spec = tune.load_tune_spec(write_spec(tmp_path))
    quiet = lambda line: None  # noqa: E731
    assert tune.tune(spec, tiny_vllm, log=quiet) == {"es": 2, "grpo": 2}
    for trial in tune.study_trials(spec, "es"):  # a split's size, prompts and generations recorded with the trial
        size, prompts = map(int, trial["params"]["split"].split("x"))
        assert trial["config"]["population_size"] == size and trial["config"]["prompts_per_step"] == prompts
        assert trial["config"]["num_generations"] * size * prompts == 16
    tune.run_finals(spec, tiny_vllm, log=quiet)
    for method in ("es", "grpo"):  # the worker that finishes a rerun continues it before the next rerun
        def started(stage: str, seed: int) -> float:  # a continuation's folder holds its rerun's line first
            return read_jsonl(spec.out / stage / method / f"seed{seed}" / "placement.jsonl")[-1]["time"]
        assert started("final", 0) < started("long", 0) < started("final", 1) < started("long", 1)
    done = tune.run_extras(spec, tiny_vllm, log=quiet)  # the continuations found finished, and the control
    assert sorted(done) == ["control/es", "long/es", "long/grpo"]
    best = {"es": tune.best_trial(spec, "es"), "grpo": tune.best_trial(spec, "grpo")}
    for method in ("es", "grpo"):
        for seed in (0, 1):
            final, long = (spec.out / stage / method / f"seed{seed}" for stage in ("final", "long"))
            length = yaml.safe_load((final / "config.yaml").read_text())["num_generations" if method == "es" else "num_steps"]
            final_rows, long_rows = read_metrics(final), read_metrics(long)
            assert [r["generation"] for r in final_rows] == list(range(length + 1))  # the rerun as it was
            assert {line["generation"] for line in read_jsonl(final / "heldout.jsonl")} == {length}
            assert [r["generation"] for r in long_rows] == list(range(2 * length + 1))
            assert long_rows[:length + 1] == final_rows  # continued from the rerun's end, not started again
            assert long_rows[-1]["samples/completions"] == 2 * final_rows[-1]["samples/completions"] == 32
            assert {line["generation"] for line in read_jsonl(long / "heldout.jsonl")} == {2 * length}
            assert json.loads((long / "continued_from.json").read_text())["generation"] == length
            for folder in (final, long):
                (placement,) = {json.dumps({k: v for k, v in line.items() if k in ("device", "engine_host")})
                                for line in read_jsonl(folder / "placement.jsonl")}
                assert json.loads(placement) == {"device": "cpu", "engine_host": "local"}
                assert {line["code_digest"] for line in read_jsonl(folder / "placement.jsonl")} == {
                    code_identity()["code_digest"]}  # the code each run ran
                resolved = {(line.get("policy_process"), line.get("policy_attention"))
                            for line in read_jsonl(folder / "placement.jsonl")}
                assert resolved == ({("same", "sdpa")} if method == "grpo" else {(None, None)})  # a CPU policy
    winner = "es"  # the only ES method: best_es
    for seed in (0, 1):
        config = yaml.safe_load((spec.out / "control" / winner / f"seed{seed}" / "config.yaml").read_text())
        final = yaml.safe_load((spec.out / "final" / winner / f"seed{seed}" / "config.yaml").read_text())
        assert config["fitness_control"] == "shuffled" and final["fitness_control"] == "none"
        assert {k: v for k, v in config.items() if k != "fitness_control"} == {k: v for k, v in final.items()
                                                                                if k != "fitness_control"}
        assert all(config[k] == v for k, v in best["es"].params.items() if k != "split")

    summary = tune.summarize(spec)
    assert summary["primary"]["resolved"] == {"best_es": "es", "best_grpo": "grpo"}
    assert summary["primary"]["family"] == [["es", "grpo"]]
    (comparison,) = summary["comparisons"]
    assert comparison["family"] == "primary" and comparison["holm_p"] == comparison["permutation_p"]
    assert [row["seeds"] for row in summary["long"]["final"]] == [2, 2] and summary["long"]["budget"] == 32
    assert summary["control"]["method"] == "es" and summary["control"]["final"][0]["method"] == "es shuffled"
    assert {row["method_a"] for row in summary["control"]["comparison"]} | {
        row["method_b"] for row in summary["control"]["comparison"]} == {"es", "es shuffled"}

    compact = tmp_path / "exported" / "out"  # named as the study: the digests' titles are the same
    from evolm_lib.cli import main

    assert main(["tune", "export", str(spec.out), str(compact)]) == 0
    assert json.loads((compact / tune.SUMMARY).read_text())["final"] == summary["final"]
    live, exported = tmp_path / "live_tables", tmp_path / "exported_tables"
    assert main(["tune", "report", str(spec.out), "--out", str(live), "--no-figures"]) == 0
    assert main(["tune", "report", str(compact), "--out", str(exported), "--no-figures"]) == 0
    written = sorted(p.name for p in live.iterdir())
    assert "summary.md" in written and "heldout.csv" in written and written == sorted(p.name for p in exported.iterdir())
    for name in written:  # the export gives the tables the live folder gives
        assert (live / name).read_text() == (exported / name).read_text(), name
    manifest = json.loads((compact / "manifest.json").read_text())
    assert manifest["runs"] == {"control": 2, "final": 4, "long": 4, "trial": 4} and manifest["trials"] == 4
    assert sum(manifest["bytes"].values()) < 100_000
    first = (compact / "runs.jsonl.gz").read_bytes()
    export_study(spec.out, compact)  # the same study exports to the same bytes
    assert (compact / "runs.jsonl.gz").read_bytes() == first
    with gzip.open(compact / "runs.jsonl.gz", "rt") as handle:
        stored = {line["path"]: line for line in map(json.loads, handle)}
    assert stored["long/es/seed0"]["rows_from"] == {"path": "final/es/seed0", "rows": 3}  # shared rows stored once
    loaded = read_study(compact)
    by_path = {run["path"]: run for run in loaded["runs"]}
    assert by_path["long/es/seed1"]["rows"] == [scalar_row(r) for r in read_metrics(spec.out / "long" / "es" / "seed1")]
    folders = load_runs({m: str(spec.out / "final" / m / "seed*") for m in ("es", "grpo")}, allow_mixed=True)
    for column in ("seeds", "mean", "ci_low", "ci_high", "t_low", "t_high"):  # the tables from the exported files
        assert study_table(export_groups(loaded["runs"], "final"), measure="reward")[column].tolist() == pytest.approx(
            study_table(folders, measure="reward")[column].tolist(), nan_ok=True)

    from evolm_lib.tune.geometry import GEOMETRY, write_geometry

    with pytest.raises(FileNotFoundError, match="missing.yaml"):  # a bad drift spec: before any engine or file
        write_geometry(spec.out, compact, seeds=[0], points=2, drift_spec=tmp_path / "missing.yaml")
    assert not (compact / GEOMETRY).exists()
    with pytest.raises(ValueError, match="drift_spec: .* the task these runs trained on"):  # drift needs another task
        write_geometry(spec.out, compact, seeds=[0], points=2, drift_spec=spec.path)
    # beside the compacted files; the drift on the other study's held-out prompts (conciseness's)
    write_geometry(spec.out, compact, seeds=[0], points=2, drift_spec=REPO / "papermill_runs" / "tune_study_conciseness_gpu.yaml",
                   drift_samples=1)
    saved = json.loads((compact / GEOMETRY).read_text())
    assert [(d["method"], d["seed"], d["task"], d["prompts"], d["samples"]) for d in saved["drift"]] == [
        ("es", 0, "conciseness", 108, 1), ("grpo", 0, "conciseness", 108, 1)]
    assert all(d["kl"] is not None and d["kl"] > 0 for d in saved["drift"])  # both moved off the base, on prompts never trained on
    assert [(u["method"], u["form"]) for u in saved["updates"]] == [("es", "lora"), ("grpo", "lora")]
    assert all(u["norm"] > 0 for u in saved["updates"])  # both moved their adapters
    (cosine,) = saved["cosines"]
    assert (cosine["a"], cosine["b"]) == ("es", "grpo") and -1 <= cosine["overall"] <= 1
    (path,) = saved["paths"]  # the declared pair: best_es vs best_grpo
    assert [row["t"] for row in path["rows"]] == [0.0, 1.0] and path["barrier"] == 0.0  # two points: the ends

    tables = tmp_path / "tables"
    result = subprocess.run([sys.executable, "-m", "evolm_lib.cli", "tune", "report", str(compact), "--out", str(tables)],
                            capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO), **_env()})
    from evolm_lib.viz.figures import chromium_available

    assert result.returncode == 0, result.stderr
    assert chromium_available() or "no figures: chromium is missing" in result.stderr
    import pandas as pd

    winners = pd.read_csv(tables / "winners.csv", index_col=0)
    assert winners.loc["es", "trials"] == 2 and winners.loc["es", "winner_trial"] == best["es"].number
    assert json.loads(winners.loc["grpo", "setting"]) == pytest.approx(best["grpo"].params)
    heldout = pd.read_csv(tables / "heldout.csv", index_col=0)
    assert heldout.loc["es", "seeds"] == 2 and heldout.loc["es", "device"] == "cpu"
    comparisons = pd.read_csv(tables / "comparisons.csv")
    assert comparisons["family"].tolist() == ["primary"]
    assert set(pd.read_csv(tables / "control.csv")["method"]) == {"es shuffled"}
    assert set(pd.read_csv(tables / "long.csv")["method"]) == {"es", "grpo"}
    digest = (tables / "summary.md").read_text().splitlines()  # what a findings section quotes, as Markdown
    es_line = next(line for line in digest if line.startswith("| es |"))  # the methods' table comes first
    cells = [cell.strip() for cell in es_line.strip("|").split("|")]
    assert cells[:3] == ["es", "2", f"trial {best['es'].number} ({best['es'].value:.3g})"]
    assert cells[4] == "2" and cells[5].startswith(f"{heldout.loc['es', 'mean']:.3g} (")  # reward: as it is
    assert cells[9] == f"{heldout.loc['es', 'generated_tokens']:,.0f}"  # the tokens axis, the seeds' mean
    assert cells[10].startswith(f"{heldout.loc['es', 'training_seconds']:.0f} (")  # with its engines a card
    assert [line for line in digest if line.startswith("| es shuffled |")]  # the control's own score
    assert [line for line in digest if line.startswith("| es | grpo | primary |")]
    reach = pd.read_csv(tables / "reach.csv", index_col=0)  # the declared pair on the budget axes
    assert reach[["a", "b", "method"]].values.tolist() == [["es", "grpo", "es"], ["es", "grpo", "grpo"]]
    assert (reach["reached"] >= 1).all()  # each method reaches the weaker one's final mean: the weaker on its seeds' average
    assert [line for line in digest if line.startswith("| es | grpo | ") and " of 2 | " in line]
    code = code_identity()  # where the finals ran: this process's device and code
    named = code["code_commit"][:7] if code["code_commit"] else f"digest {code['code_digest']}"
    assert f"The final seeds ran on cpu, an unrecorded number of engines a card; code {named}." in digest
    if chromium_available():
        for name in ("best_vs_trials", "heldout_vs_completions", "heldout_vs_completions_late", "heldout_vs_tokens", "heldout_vs_seconds",
                     "heldout_answers", "geometry_update_norms", "geometry_path_es_grpo"):
            assert _png(tables / f"{name}.png") and (tables / f"{name}.svg").read_text().lstrip().startswith("<svg")


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_the_committed_conciseness_study_imports_into_a_folder_that_evolm_tune_continues(tmp_path, capsys):
    """`evolm tune import` writes the committed conciseness study back as a study folder (the spec its
    summary names): every exported trial in the storage under its number, the finished runs' rows; what
    `evolm tune` would do next there is its unfinished reruns, and its report gives the export's tables."""
    from evolm_lib.cli import main

    export = REPO / "figures" / "study" / "summaries" / "tune_study_conciseness"
    study = tmp_path / "tune_study_conciseness"
    assert main(["tune", "import", str(export), str(study)]) == 0
    assert f"continue it with: evolm tune SPEC --out {study}" in capsys.readouterr().out
    assert main(["tune", "import", str(export), str(study)]) == 2  # never written over
    assert "exists and is not empty" in capsys.readouterr().err
    spec = tune.load_tune_spec(REPO / "papermill_runs" / "tune_study_conciseness_gpu.yaml", out=study)
    exported = read_study(export)["trials"]
    for method in spec.methods:
        rows = tune.study_trials(spec, method)
        assert [(t["number"], t["state"], t["params"]) for t in rows] == [
            (t["number"], t["state"], t["params"]) for t in exported if t["method"] == method]
        assert tune.finished(spec, method)
    left = tune.unfinished_parts(spec)
    assert left and all(entry.split("/")[0] in ("final", "long", "control") for entry in left)
    for folder in (study, export):
        assert main(["tune", "report", str(folder), "--out", str(tmp_path / folder.parent.name), "--no-figures"]) == 0
    tables = sorted(p.name for p in (tmp_path / "summaries").glob("*.csv"))
    assert "heldout.csv" in tables and "winners.csv" in tables
    for name in tables:
        assert (tmp_path / "summaries" / name).read_text() == (tmp_path / tmp_path.name / name).read_text(), name
