"""The sweep's library pieces: planning (no learning rate picked on one seed), checkpoint KLs, the summary."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from evolm_lib import sweep

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "data" / "es_vs_grpo"
SPEC = REPO / "papermill_runs" / "es_vs_grpo_conciseness_cpu.yaml"


def test_a_grpo_learning_rate_list_is_refused_naming_the_setting_and_what_to_use():
    """A list once picked one rate on seed 0 and reported that run as seed 0: refused, pointing at
    grpo_modes (every seed each) and `evolm tune`; nothing is planned from it."""
    from evolm_lib.config import ConfigError

    _, spec = sweep.load_sweep_spec(SPEC)
    listed = {**spec, "grpo": {**spec["grpo"], "learning_rate": [1e-3, 3e-3]}}
    for call in (lambda: sweep.check_sections(listed), lambda: sweep.plan_sweep(listed, 2, [0], {"model": "tiny-random"})):
        with pytest.raises(ConfigError, match=r"sweep.grpo.learning_rate: one rate, not a list") as caught:
            call()
        assert "sweep.grpo_modes" in str(caught.value) and "evolm tune" in str(caught.value)
    plan = sweep.plan_sweep(spec, 2, [4, 5], {"model": "tiny-random"})
    assert [(r.name, r.config.learning_rate) for r in plan if r.kind == "grpo"] == [("grpo_seed4", 3e-3), ("grpo_seed5", 3e-3)]
    assert not any(r.name.startswith("lrsweep") for r in plan)


def test_summary_has_a_row_per_run_with_results_and_checkpoint_kls(tmp_path):
    out = tmp_path / "sweep"
    shutil.copytree(FIXTURES, out)
    first = sorted(p for p in out.iterdir() if (p / "config.yaml").exists())[0]
    (first / "kl.jsonl").write_text('{"generation": 0, "policy/kl": 0.0}\n{"generation": 2, "policy/kl": 0.25}\n')
    rows = sweep.summarize(out)
    assert {r["run"] for r in rows} == {p.name for p in out.iterdir() if (p / "config.yaml").exists()}
    row = next(r for r in rows if r["run"] == first.name)
    assert row["kl_by_checkpoint"] == {0: 0.0, 2: 0.25}
    assert row["method"] == "es eggroll" and row["train_reward_final"] is not None  # the analysis's label
    header = (out / "summary.csv").read_text().splitlines()[0].split(",")
    assert {"run", "method", "seed", "learning_rate", "eval_reward_final", "kl_final", "kl_by_checkpoint"} <= set(header)


def test_checkpoint_points_pair_each_measured_kl_with_the_reward_of_its_generation(tmp_path):
    from evolm_lib.analysis import checkpoint_points, load_runs
    from evolm_lib.viz.plots import plot_reward_vs_kl

    out = tmp_path / "sweep"
    shutil.copytree(FIXTURES, out)
    for made in out.glob("*/kl.jsonl"):  # the fixtures' own checkpoint KLs: tests/test_analysis.py reads them
        made.unlink()
    run = out / "es_seed0"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "kl.jsonl").write_text('{"generation": 0, "policy/kl": 0.0}\n{"generation": 2, "policy/kl": 0.5}\n')
    groups = load_runs([str(out / "es_*"), str(out / "grpo_*")])
    points = checkpoint_points(groups)
    expected = {g: r["eval/reward"] for r in rows for g in [r["generation"]] if g in (0, 2)}
    assert [(p["generation"], p["kl"], p["reward"]) for p in points] == [(0, 0.0, expected[0]), (2, 0.5, expected[2])]
    fig = plot_reward_vs_kl(points)
    assert [list(trace.x) for trace in fig.data if trace.mode == "lines+markers"] == [[0.0, 0.5]]


def test_grpo_modes_are_methods_of_their_own_with_every_seed():
    _, spec = sweep.load_sweep_spec(SPEC)
    spec["grpo"] = {**spec["grpo"], "learning_rate": 0.001, "group_size": 8}
    spec["grpo_modes"] = {"lr2e3": {"learning_rate": 0.002}, "small": {"learning_rate": 0.0005, "group_size": 4}}
    plan = sweep.plan_sweep(spec, generations=2, seeds=[0, 1], overrides={"model": "tiny-random"})
    grpo = [(r.name, r.label, r.config.learning_rate, r.config.group_size, r.length) for r in plan if r.kind == "grpo"]
    steps = 2 * plan[0].config.population_size
    assert grpo == [("grpo_lr2e3_seed0", "grpo lr2e3", 0.002, 8, steps // 8), ("grpo_small_seed0", "grpo small", 0.0005, 4, steps // 4),
                    ("grpo_lr2e3_seed1", "grpo lr2e3", 0.002, 8, steps // 8), ("grpo_small_seed1", "grpo small", 0.0005, 4, steps // 4)]
    assert len({r.budget for r in plan}) == 1  # a variant's own group size keeps the budget: more steps
    # the other GRPO settings come from sweep.grpo, under the variant's own
    assert {r.config.loss_type for r in plan if r.kind == "grpo"} == {spec["grpo"].get("loss_type", "grpo_clip")}
    assert [r.name for r in sweep.select_methods(plan, ["grpo_small"])] == ["grpo_small_seed0", "grpo_small_seed1"]
    with pytest.raises(ValueError, match=r"--methods: \['grpo'\] not in this sweep.*'grpo_lr2e3', 'grpo_small'"):
        sweep.select_methods(plan, ["grpo"])


@pytest.mark.parametrize("modes, message", [
    ({"fast": {"learning_rte": 0.1}}, "sweep.grpo_modes.fast.learning_rte: not one of the GRPOConfig settings (did you mean learning_rate?)"),
    ({"two": {"learning_rate": [0.1, 0.2]}}, "sweep.grpo_modes.two: one group_size and one learning_rate per variant"),
    ({"a-b": {}}, "sweep.grpo_modes.a-b: a name of letters, digits and _"),
    ([0.1], "sweep.grpo_modes: expected a mapping of name -> GRPOConfig settings"),
])
def test_bad_grpo_modes_fail_naming_the_variant(modes, message):
    _, spec = sweep.load_sweep_spec(SPEC)
    with pytest.raises(ValueError, match=re.escape(message)):
        sweep.check_sections({**spec, "grpo_modes": modes})


def test_the_countdown_spec_that_replaced_the_gpu_script_keeps_its_budget_and_settings():
    """papermill_runs/es_vs_grpo_countdown_smollm2_gpu.yaml, once scripts/gpu_countdown.py --generations 12."""
    _, spec = sweep.load_sweep_spec(REPO / "papermill_runs" / "es_vs_grpo_countdown_smollm2_gpu.yaml")
    es_run, grpo_run = sweep.plan_sweep(spec)
    assert (es_run.name, es_run.length, grpo_run.name, grpo_run.length) == ("es_seed0", 12, "grpo_seed0", 45)
    assert es_run.budget == grpo_run.budget == 12 * 30 * 8  # 2,880 training completions, as the README's table
    assert (es_run.config.sigma, es_run.config.learning_rate, es_run.config.fitness_shaping) == (0.05, 0.4, "centered_ranks")
    assert (grpo_run.config.group_size, grpo_run.config.learning_rate, grpo_run.config.temperature) == (8, 0.002, 1.0)
    for run in (es_run, grpo_run):
        assert (run.config.model, run.config.lora_rank, run.config.lora_alpha, run.config.max_new_tokens) == \
               ("smollm2-135m-instruct", 8, 16.0, 256)
        assert run.config.task_options == {"num_train": 256, "num_eval": 200} and run.config.prompts_per_step == 8


@pytest.mark.parametrize("task, generations, steps, budget", [("addition", 60, 225, 14_400), ("conciseness", 40, 150, 2_400)])
def test_the_study_specs_plan_five_seeds_of_five_methods_at_one_budget(task, generations, steps, budget):
    """papermill_runs/study_*_smollm2_gpu.yaml: the five-seed GPU study of docs/measurements.md."""
    _, spec = sweep.load_sweep_spec(REPO / "papermill_runs" / f"study_{task}_smollm2_gpu.yaml")
    plan = sweep.plan_sweep(spec)
    assert len(plan) == 25 and {run.budget for run in plan} == {budget}
    assert {run.method for run in plan} == {"es_lora", "es_eggroll", "es_full", "grpo_lr2e3", "grpo_lr5e4"}
    assert {run.method: run.config.learning_rate for run in plan if run.kind == "grpo"} == \
           {"grpo_lr2e3": 0.002, "grpo_lr5e4": 0.0005}
    assert sorted({run.config.seed for run in plan}) == [0, 1, 2, 3, 4]
    assert {run.length for run in plan if run.kind == "es"} == {generations}
    assert {run.length for run in plan if run.kind == "grpo"} == {steps}
    assert all(run.config.deterministic and run.config.lora_rank == 8 for run in plan)
    full = next(run.config for run in plan if run.method == "es_full")
    assert (full.es_weights, full.population_size, full.sigma, full.learning_rate, full.fitness_shaping) == \
           ("all", 30, 0.001, 0.0005, "z_score")  # Qiu et al.'s settings
    assert [run.name for run in sweep.select_methods(plan, ["es_full"]) if run.config.seed == 0] == ["es_full_seed0"]


def test_dry_run_estimates_only_from_timings_that_fit_the_runs(capsys):
    """The spec's seconds_per_completion were measured with its own model and completion length: with
    --model or --max-new-tokens the dry run says it has no estimate instead of printing a wrong one."""
    from evolm_lib.cli import sweep as sweep_cli

    assert sweep_cli.main([str(SPEC), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "estimated wall time 112.5 min (seconds_per_completion {'es': 2.0, 'grpo': 4.5}" in printed
    assert sweep_cli.main([str(SPEC), "--dry-run", "--model", "tiny-random", "--generations", "1", "--seeds", "0"]) == 0
    printed = capsys.readouterr().out
    assert "estimated wall time" not in printed
    assert "no estimate: the spec's seconds_per_completion {'es': 2.0, 'grpo': 4.5} were measured with its own " \
           "settings, not with --model tiny-random (the spec's model: smollm2-135m-instruct)" in printed


def test_spec_errors_name_the_section_the_setting_came_from(tmp_path, capsys):
    from evolm_lib.cli import sweep as sweep_cli

    text = SPEC.read_text()
    misspelt = tmp_path / "misspelt.yaml"
    misspelt.write_text(text.replace("    sigma: 0.05\n", "    sigmaa: 0.05\n"))
    assert sweep_cli.main([str(misspelt), "--dry-run"]) == 2
    assert "sweep.es.sigmaa: not one of the ESConfig settings (did you mean sigma?)" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("    sigma: 0.05\n", "    sigma: -0.05\n").replace("lora_rank: 1\n", "lora_rank: 0\n"))
    assert sweep_cli.main([str(bad), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "invalid ESConfig: sweep.common.lora_rank: Input should be greater than or equal to 1; " \
           "sweep.es.sigma: Input should be greater than 0" in err, err
    assert sweep_cli.main([str(SPEC), "--dry-run", "--model", "no-such-model"]) == 2
    assert "invalid ESConfig: --model: unknown model 'no-such-model'" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text(text.replace("  es:  ", "  es: [  "))
    assert sweep_cli.main([str(broken), "--dry-run"]) == 2
    assert re.search(r"broken.yaml, line \d+, column \d+: not valid YAML", capsys.readouterr().err)


def test_the_comparison_notebook_runs_on_a_sweep_of_es_methods_alone(tmp_path):
    # `--methods es_lora,es_full` leaves no grpo_* folder: the notebook gets an empty GRPO glob
    out = tmp_path / "sweep"
    for run in ("es_seed0", "es_seed1", "es_full_seed0", "es_full_seed1"):
        shutil.copytree(FIXTURES / run, out / run)
    spec = REPO / "papermill_runs" / "modes_conciseness_smollm2_cpu.yaml"
    batch, _ = sweep.load_sweep_spec(spec)
    executed = sweep.run_notebook(batch, out, spec)
    import nbformat

    injected = next(c for c in nbformat.read(executed, as_version=4).cells if "injected-parameters" in c.metadata.get("tags", []))
    assert 'grpo_runs = ""' in injected.source and "es_runs = " in injected.source
    assert sorted(p.name for p in (out / "figures").glob("*.png")) == sorted(
        f"es_vs_grpo_{name}.png" for name in ("heldout", "reward_vs_kl", "reward_vs_kl_checkpoints", "reward_vs_samples",
                                              "reward_vs_time", "seed_spread"))


# ----------------------------------------------------------------------------- variants and run folders

VARIANTS = {  # four ES variants that differ in sigma alone
    "common": {"model": "tiny-random", "task": "conciseness", "target_modules": ["q_proj", "v_proj"], "lora_rank": 1,
               "max_new_tokens": 64, "max_model_len": 256, "kv_cache_gb": 0.25, "eval_every": 1},
    "es": {"population_size": 4, "learning_rate": 0.05},
    "es_modes": {"s01": {"sigma": 0.01}, "s02": {"sigma": 0.02}, "s04": {"sigma": 0.04}, "s08": {"sigma": 0.08}},
    "grpo": {"group_size": 4},
    "generations": 2,
    "seeds": [0, 1],
}


def es_plan(sweep_section: dict) -> list:
    plan = sweep.plan_sweep(sweep_section)
    return sweep.select_methods(plan, [m for m in dict.fromkeys(r.method for r in plan) if m.startswith("es")])


def test_four_es_variants_that_differ_in_sigma_are_four_methods_in_every_table_and_the_summary(tmp_path):
    """Real ES runs on the synthetic engine: the tables hold four methods of two seeds each, never one
    method of eight runs, and summary.csv has sigma as a column."""
    import csv

    from evolm_lib import analysis
    from evolm_lib.engines.synthetic import SyntheticEngine

    out = tmp_path / "sweep"
    plan = es_plan(VARIANTS)
    assert len(plan) == 8
    sweep.run_sweep(plan, out, engine=SyntheticEngine())
    groups = analysis.load_runs(analysis.method_globs(out)["es"])
    labels = ["es sigma=0.01", "es sigma=0.02", "es sigma=0.04", "es sigma=0.08"]
    assert list(groups) == labels
    assert all([r.seed for r in runs] == [0, 1] for runs in groups.values())
    assert list(analysis.seed_spread_table(groups)["seeds"]) == [2, 2, 2, 2]
    assert list(analysis.study_table(groups, measure="reward").index) == labels
    assert len(analysis.method_comparisons(groups, measure="reward")) == 6  # C(4, 2) pairs of methods
    rows = sweep.summarize(out)
    with open(out / "summary.csv") as handle:
        table = list(csv.DictReader(handle))
    assert list(table[0])[:5] == ["run", "status", "method", "seed", "sigma"]
    assert [(row["run"], row["method"], row["seed"], row["sigma"]) for row in table] == [
        (f"es_{name}_seed{seed}", f"es sigma={sigma:g}", str(seed), str(sigma))
        for name, sigma in (("s01", 0.01), ("s02", 0.02), ("s04", 0.04), ("s08", 0.08)) for seed in (0, 1)]
    details = json.loads((out / "summary.json").read_text())["runs"]
    assert [run["settings"] for run in details] == [{"sigma": row["sigma"]} for row in rows]


def _cli_sweep(spec: Path, out: Path, *options: str) -> int:
    from evolm_lib.cli import sweep as sweep_cli

    return sweep_cli.main([str(spec), "--methods", "es", "--out", str(out), "--no-kl", "--no-notebook", *options])


def test_a_rerun_with_a_changed_setting_is_refused_before_an_engine_starts_and_overwrite_replaces_that_run(
        tmp_path, monkeypatch, capsys):
    """The sweep's engine is the synthetic one here; the refusal must come before any engine is made."""
    import yaml

    from evolm_lib.engines.synthetic import SyntheticEngine
    from evolm_lib.runs import read_metrics

    engines = []
    monkeypatch.setattr(sweep, "make_shared_engine", lambda plan: engines.append(SyntheticEngine()) or engines[-1])
    section = {**VARIANTS, "es": {**VARIANTS["es"], "sigma": 0.02}}
    section.pop("es_modes")
    spec, out = tmp_path / "spec.yaml", tmp_path / "sweep"
    spec.write_text(yaml.safe_dump({"notebook": str(REPO / "notebooks" / "04_es_vs_grpo.py"), "sweep": section}))
    assert _cli_sweep(spec, out) == 0 and len(engines) == 1
    before = {name: (out / name / "metrics.jsonl").read_text() for name in ("es_seed0", "es_seed1")}
    capsys.readouterr()

    section["es"]["sigma"] = 0.05
    spec.write_text(yaml.safe_dump({"notebook": str(REPO / "notebooks" / "04_es_vs_grpo.py"), "sweep": section}))
    for options in ((), ("--dry-run",)):
        assert _cli_sweep(spec, out, *options) == 1
        printed = capsys.readouterr()
        for name in ("es_seed0", "es_seed1"):
            assert re.search(rf"conflict\s+{name}\s+es, 2 generations; its folder holds a run with other settings: "
                             rf"sigma 0.02 -> 0.05; kept as it is: `--overwrite es/{name[-1]}` replaces", printed.out)
        assert "hold runs made with other settings" in printed.err and "Traceback" not in printed.err
    assert len(engines) == 1  # refused before any engine started
    assert {name: (out / name / "metrics.jsonl").read_text() for name in before} == before

    assert _cli_sweep(spec, out, "--overwrite", "es/1", "--dry-run") == 1  # es/0 still conflicts
    assert re.search(r"overwrite\s+es_seed1\s+es, 2 generations; replaces the run there \(was changed: sigma 0.02 -> 0.05\)",
                     capsys.readouterr().out)
    assert _cli_sweep(spec, out, "--overwrite", "es/7") == 2
    assert "--overwrite: 'es/7': es has no seed '7' here (seeds: [0, 1])" in capsys.readouterr().err
    assert _cli_sweep(spec, out, "--overwrite", "es/1", "--methods", "es", "--seeds", "1") == 0
    assert yaml.safe_load((out / "es_seed1" / "config.yaml").read_text())["sigma"] == 0.05
    assert [r["generation"] for r in read_metrics(out / "es_seed1")] == [0, 1, 2]
    assert (out / "es_seed0" / "metrics.jsonl").read_text() == before["es_seed0"]  # just that run replaced
    assert not list(out.glob(".es_seed1.kept-*")) and not list(out.glob("*.failed-*"))


class FailingEngine:
    """An engine whose every call fails, as a crashed one does (the synthetic engine, then an error)."""

    def __init__(self):
        from evolm_lib.engines.synthetic import SyntheticEngine

        self.inner = SyntheticEngine()

    def __getattr__(self, name):
        if name in ("generate", "generate_population", "score"):
            raise RuntimeError("the engine died")
        return getattr(self.inner, name)


def test_a_failed_overwrite_keeps_the_finished_run_and_reports_one_message(tmp_path):
    from evolm_lib.engines.synthetic import SyntheticEngine

    section = {**VARIANTS, "seeds": [0]}
    section.pop("es_modes")
    plan = es_plan(section)
    out = tmp_path / "sweep"
    sweep.run_sweep(plan, out, engine=SyntheticEngine())
    finished = (out / "es_seed0" / "metrics.jsonl").read_text()
    with pytest.raises(sweep.SweepRunFailed, match=r"^es_seed0: RuntimeError: the engine died; the run it was to "
                                                   r"replace is kept in .*es_seed0, this attempt moved to es_seed0.failed-"):
        sweep.run_sweep(plan, out, engine=FailingEngine(), overwrite={"es_seed0"})
    assert (out / "es_seed0" / "metrics.jsonl").read_text() == finished
    assert len(list(out.glob("es_seed0.failed-*"))) == 1 and not list(out.glob(".es_seed0.kept-*"))
    assert [row["run"] for row in sweep.summarize(out)] == ["es_seed0"]  # the failed attempt is no run of the sweep


def test_unequal_budgets_name_the_methods_at_each_budget():
    section = {**VARIANTS, "es_modes": {"two": {}, "one": {"prompts_per_step": 1}}}
    with pytest.raises(ValueError, match=r"unequal budgets across runs, in training completions — 8: es_one \(2 x 4 x 1 "
                                         r"prompts\); 16: es_two \(2 x 4 x 2 prompts\), grpo \(2 x 4 x 2 prompts\)"):
        sweep.plan_sweep(section)


# --------------------------------------------------------------------------- refused before any folder exists

TINY_SWEEP = {"common": {"model": "tiny-random", "task": "conciseness", "max_new_tokens": 8, "max_model_len": 256,
                         "kv_cache_gb": 0.1, "checkpoint_every": 1},
              "es": {"population_size": 4}, "grpo": {"group_size": 4}, "generations": 2, "seeds": [0]}


def _write_sweep(path: Path, **changes) -> Path:
    spec = {"notebook": "notebooks/04_es_vs_grpo.py", "sweep": {**TINY_SWEEP, **changes}}
    path.write_text(json.dumps(spec))
    return path


def _evolm_sweep(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evolm_lib.cli", "sweep", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("changes, message", [
    ({"es": {"population_size": 10**9}, "grpo": {"group_size": 10**9}},
     r"es_seed0: population_size=1,000,000,000 is more than this machine can hold: .*the largest population_size "
     r"that fits is [\d,]+"),
    ({"grpo": {"group_size": 10**9}, "grpo_completions": 2 * 10**9},  # 2 training prompts a step
     r"grpo_seed0: group_size=1,000,000,000 is more than this machine can hold: .*the largest group_size that fits "
     r"is [\d,]+"),
])
def test_sizes_of_ten_to_the_ninth_are_refused_before_any_run_folder_exists(tmp_path, changes, message):
    """A real `evolm sweep` with population or group size 10^9: the dry run and the run itself exit 2 with
    one line naming the run, the field and the largest value that fits; OUT is never created."""
    spec, out = _write_sweep(tmp_path / "big.yaml", **changes), tmp_path / "out"
    for dry in (["--dry-run"], ["--no-kl", "--no-notebook"]):
        result = _evolm_sweep(str(spec), "--out", str(out), *dry)
        assert result.returncode == 2, result.stdout + result.stderr
        assert re.fullmatch(rf"error: {message}\n", result.stderr), result.stderr
        assert not out.exists()


@pytest.mark.parametrize("changes, field", [({"seeds": []}, "sweep.seeds"),
                                            ({"grpo": {"group_size": []}}, "sweep.grpo.group_size"),
                                            ({"es_modes": {}}, "sweep.es_modes")])
def test_empty_grids_and_method_lists_are_refused_naming_the_field(tmp_path, changes, field):
    """`seeds: []` planned a garbled run and crashed; `grpo: {group_size: []}` ran ES alone: both are refused."""
    spec, out = _write_sweep(tmp_path / "empty.yaml", **changes), tmp_path / "out"
    for dry in (["--dry-run"], ["--no-kl", "--no-notebook"]):
        result = _evolm_sweep(str(spec), "--out", str(out), *dry)
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr.startswith(f"error: {field}: empty ("), result.stderr
        assert "give at least one value, or leave the key out for its default" in result.stderr
        assert not out.exists()


def test_a_run_folder_that_lost_its_config_yaml_is_refused_with_the_command_that_restores_it(tmp_path):
    """A sweep's ES run (two generations, a real ES run on the synthetic engine) whose config.yaml was
    deleted: the plan says neither "resumes at generation -1" nor that the same command continues; it
    names the file and gives the command that restores it; that command, run as printed, restores it and
    the plan then resumes the run."""
    from evolm_lib.engines.synthetic import SyntheticEngine
    from evolm_lib.train.es import ESRun

    spec, out = _write_sweep(tmp_path / "s.yaml"), tmp_path / "out"
    [es_run] = [run for run in sweep.plan_sweep(TINY_SWEEP) if run.kind == "es"]
    run = ESRun.create(es_run.config, out / es_run.name, engine=SyntheticEngine())
    run.run(1)
    run.close()
    (out / es_run.name / "config.yaml").unlink()

    for dry in (["--dry-run"], ["--no-kl", "--no-notebook"]):
        result = _evolm_sweep(str(spec), "--out", str(out), *dry)
        assert result.returncode == 1, result.stdout + result.stderr
        assert "generation -1" not in result.stdout and "the same command continues" not in result.stderr
        line = next(line for line in result.stdout.splitlines() if es_run.name in line)
        assert line.split()[0] == "damaged" and f"{out / es_run.name / 'config.yaml'} is missing" in line, line
        assert "lost their config.yaml (listed above, with the command that restores each)" in result.stderr
    command = re.search(r"`(\S*python\S* -c .*?)`", line).group(1)
    restored = subprocess.run(command, shell=True, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert restored.returncode == 0, restored.stderr
    [action] = [a for a in sweep.plan_actions(sweep.plan_sweep(TINY_SWEEP), out) if a.name == es_run.name]
    assert (action.state, action.action) == ("unfinished", "resume") and "resumes at generation 1 of 2" in action.reason


def test_a_sweep_pointed_at_a_batchs_folder_names_it_and_leaves_it_unchanged(tmp_path):
    """A real batch (the fixture notebook that fills a run folder) then a sweep with --out at its folder:
    refused before any plan runs, naming the batch's points; every file there unchanged."""
    from evolm_lib.cli import batch as batch_cli

    out = tmp_path / "out"
    spec = tmp_path / "p.yaml"
    spec.write_text(f"notebook: {REPO / 'tests' / 'data' / 'batch_run_nb.py'}\nname: fx\ngrid: {{seed: [0]}}\n")
    assert batch_cli.main([str(spec), "--out", str(out)]) == 0
    before = {str(p): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    for dry in (["--dry-run"], ["--no-kl", "--no-notebook"]):
        result = _evolm_sweep(str(_write_sweep(tmp_path / "s.yaml")), "--out", str(out), *dry)
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr == (f"error: this folder, {out.resolve()}, holds an `evolm batch`'s points of batch_run_nb.py "
                                 "(fx__seed-0); a sweep would write its runs and its summary.csv beside them. The folder "
                                 "is left as it is: give --out another folder\n"), result.stderr
        assert {str(p): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before


def test_a_spec_naming_a_setting_by_its_older_name_plans_with_it():
    _, spec = sweep.load_sweep_spec(SPEC)
    spec = {**spec, "common": {**spec.get("common", {}), "evaluator": "local"}}
    sweep.check_sections(spec)
    plan = sweep.plan_sweep(spec, generations=2, seeds=[0], overrides={"model": "tiny-random"})
    assert {r.config.engine_host for r in plan} == {"local"}
