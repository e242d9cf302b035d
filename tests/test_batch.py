"""The papermill batch runner, with a tiny fixture notebook (no model)."""
from __future__ import annotations

import csv
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evolm_lib import batch
from evolm_lib.cli import batch as batch_cli

DATA = Path(__file__).parent / "data"
FIXTURE = DATA / "batch_nb.py"


def write_yaml(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_grid_expands_to_cartesian_product(tmp_path):
    spec = batch.spec_from_dict({"notebook": str(FIXTURE), "name": "sweep",
                                 "parameters": {"fail": False, "scale": 9.0},
                                 "grid": {"seed": [0, 1, 2], "scale": [0.01, 0.05]}})
    runs = batch.expand_runs(spec)
    assert len(runs) == 6
    assert runs[0].name == "sweep__seed-0__scale-0.01"
    assert runs[-1].name == "sweep__seed-2__scale-0.05"
    assert runs[1].parameters == {"fail": False, "scale": 0.05, "seed": 0}  # grid overrides base
    assert runs[1].grid_values == {"seed": 0, "scale": 0.05}


def test_no_grid_is_one_run_named_after_notebook():
    runs = batch.expand_runs(batch.spec_from_dict({"notebook": str(FIXTURE)}))
    assert [r.name for r in runs] == ["batch_nb"]


def test_spec_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown top-level key\(s\) \['gird'\]"):
        batch.spec_from_dict({"notebook": str(FIXTURE), "gird": {"seed": [1]}})
    with pytest.raises(ValueError, match="grid.seed"):
        batch.spec_from_dict({"notebook": str(FIXTURE), "grid": {"seed": 1}})
    with pytest.raises(FileNotFoundError, match="nope.py"):
        batch.spec_from_dict({"notebook": "nope.py"})


def test_notebook_path_relative_to_yaml_or_repo_root(tmp_path):
    # relative to the repository root
    spec = batch.load_batch_spec(write_yaml(tmp_path / "a.yaml", "notebook: tests/data/batch_nb.py\n"))
    assert spec.notebook == FIXTURE.resolve()
    # relative to the YAML file
    (tmp_path / "nb.py").write_text(FIXTURE.read_text())
    spec = batch.load_batch_spec(write_yaml(tmp_path / "b.yaml", "notebook: nb.py\n"))
    assert spec.notebook == (tmp_path / "nb.py").resolve()


def test_declared_parameters_and_injection(tmp_path):
    declared = batch.notebook_parameters(FIXTURE)
    assert list(declared) == ["seed", "scale", "run_dir", "fail"]
    assert declared["seed"]["help"] == "random seed"
    spec = batch.spec_from_dict({"notebook": str(FIXTURE), "grid": {"seed": [0]}})
    [(run, params, folder)] = batch.plan_batch(spec, tmp_path)
    assert params["run_dir"] == str(tmp_path.resolve() / "batch_nb__seed-0" / "run")
    assert "figures_dir" not in params  # the fixture does not declare it


def test_undeclared_parameter_fails_early_listing_declared(tmp_path):
    spec = batch.spec_from_dict({"notebook": str(FIXTURE), "parameters": {"sigma": 0.1}})
    with pytest.raises(ValueError, match=r"\['sigma'\] not declared.*declared: seed, scale, run_dir, fail"):
        batch.run_batch(spec, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    spec = batch.spec_from_dict({"notebook": str(FIXTURE), "parameters": {"run_dir": "x"}})
    with pytest.raises(ValueError, match="set per run by the batch runner"):
        batch.run_batch(spec, tmp_path / "out")


@pytest.fixture(scope="module")
def batch_out(tmp_path_factory):
    """A real papermill batch of three runs; the middle one fails in the notebook."""
    tmp = tmp_path_factory.mktemp("batch")
    spec_path = write_yaml(tmp / "params.yaml", f"""
notebook: {FIXTURE}
name: fx
parameters: {{seed: 3}}
grid: {{scale: [2.0, -1.0, 0.5]}}
""")
    out = tmp / "out"
    results = batch.run_batch(spec_path, out)
    return spec_path, out, results


def test_real_batch_one_failure_does_not_stop_the_others(batch_out):
    _, out, results = batch_out
    assert [(r.name, r.status) for r in results] == [
        ("fx__scale-2", "ok"), ("fx__scale--1", "failed"), ("fx__scale-0.5", "ok")]
    assert results[1].error == "ValueError: scale must be > 0"
    for r, value in ((results[0], 6.0), (results[2], 1.5)):
        assert json.loads((r.folder / "run" / "result.json").read_text())["value"] == value
    assert all((r.folder / "notebook.ipynb").is_file() for r in results)  # failed ones too


def test_summary_files(batch_out):
    _, out, _ = batch_out
    with open(out / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["run"], r["status"], r["scale"]) for r in rows] == [
        ("fx__scale-2", "ok", "2.0"), ("fx__scale--1", "failed", "-1.0"), ("fx__scale-0.5", "ok", "0.5")]
    assert rows[1]["error"] == "ValueError: scale must be > 0"
    summary = json.loads((out / "summary.json").read_text())
    assert [r["status"] for r in summary["runs"]] == ["ok", "failed", "ok"]
    assert summary["runs"][0]["parameters"]["seed"] == 3


def test_executed_notebook_is_small_and_parameterised(batch_out):
    _, out, results = batch_out
    path = results[0].folder / "notebook.ipynb"
    assert path.stat().st_size < 50_000
    nb = json.loads(path.read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    injected = [c for c in nb["cells"] if "injected-parameters" in c["metadata"].get("tags", [])]
    assert "scale = 2.0" in "".join(injected[0]["source"])


def test_rerun_skips_finished_points_and_failed_ones_unless_asked(batch_out, capsys):
    spec_path, out, first = batch_out
    again = batch.run_batch(spec_path, out)  # same settings: nothing runs
    assert [(r.name, r.status, r.action) for r in again] == [
        ("fx__scale-2", "ok", "skip"), ("fx__scale--1", "failed", "skip"), ("fx__scale-0.5", "ok", "skip")]
    assert again[1].error == "ValueError: scale must be > 0" and "--retry-failed" in again[1].reason
    assert [r.seconds for r in again] == pytest.approx([r.seconds for r in first])  # the first run's times
    planned = batch.run_batch(spec_path, out, dry_run=True, retry_failed=True)
    assert [(r.status, r.action) for r in planned] == [("planned", "skip"), ("planned", "retry"), ("planned", "skip")]
    planned = batch.run_batch(spec_path, out, overwrite=True, dry_run=True)
    assert [r.status for r in planned] == ["planned"] * 3 and {r.action for r in planned} == {"overwrite"}
    assert batch_cli.main([str(spec_path), "--out", str(out)]) == 1  # a failed point remains
    printed = capsys.readouterr().out
    assert "2 ok, 1 failed (3 skip)" in printed and "--retry-failed runs them again" in printed


def test_cli_exit_code_and_summary(tmp_path, capsys):
    spec_path = write_yaml(tmp_path / "p.yaml", f"notebook: {FIXTURE}\ngrid: {{fail: [false, true]}}\n")
    out = tmp_path / "out"
    assert batch_cli.main([str(spec_path), "--out", str(out), "--dry-run"]) == 0
    assert not out.exists()
    assert batch_cli.main([str(spec_path), "--out", str(out)]) == 1
    text = capsys.readouterr().out
    assert re.search(r"batch_nb__fail-True +failed .*RuntimeError: failing on purpose", text)
    assert "1 ok, 1 failed" in text
    # --overwrite replaces the folders; --notebook swaps the notebook
    (tmp_path / "copy.py").write_text(FIXTURE.read_text())
    assert batch_cli.main([str(spec_path), "--out", str(out), "--overwrite",
                       "--notebook", str(tmp_path / "copy.py")]) == 1


def test_execute_notebook_single_run(tmp_path):
    output = batch.execute_notebook(FIXTURE, tmp_path / "nb.ipynb",
                                    {"seed": 2, "run_dir": str(tmp_path / "r")})
    assert output.is_file()
    assert json.loads((tmp_path / "r" / "result.json").read_text())["value"] == 2.0


# --------------------------------------------------------------------------- batches that continue

RUN_NB = DATA / "batch_run_nb.py"


def executions(folder: Path) -> int:
    path = folder / "executions.txt"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_a_bad_point_fails_before_its_kernel_and_a_rerun_after_the_fix_runs_only_it(tmp_path, capsys):
    spec_path = write_yaml(tmp_path / "p.yaml", f"notebook: {RUN_NB}\nname: fx\ngrid: {{sigma: [0.05, -1.0]}}\n")
    out = tmp_path / "out"
    assert batch_cli.main([str(spec_path), "--out", str(out), "--dry-run"]) == 1  # checked without a kernel
    printed = capsys.readouterr().out
    assert re.search(r"invalid +fx__sigma--1 +ConfigError: invalid ESConfig: sigma: Input should be greater than 0",
                     printed), printed
    assert re.search(r"run +fx__sigma-0.05", printed) and not out.exists()

    assert batch_cli.main([str(spec_path), "--out", str(out)]) == 1
    capsys.readouterr()
    bad = batch.read_status(out / "fx__sigma--1")
    assert bad["status"] == "failed" and bad["before_start"] and bad["error"].startswith("ConfigError: invalid ESConfig")
    assert not (out / "fx__sigma--1" / "notebook.ipynb").exists()  # no kernel started for it
    assert executions(out / "fx__sigma-0.05") == 1

    write_yaml(spec_path, f"notebook: {RUN_NB}\nname: fx\ngrid: {{sigma: [0.05, 0.02]}}\n")  # the fix
    assert batch_cli.main([str(spec_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 ok, 0 failed (1 skip, 1 run)" in printed and "no longer points of this grid" in printed
    assert executions(out / "fx__sigma-0.05") == 1 and executions(out / "fx__sigma-0.02") == 1
    assert {r.name: r.status for r in batch.run_batch(spec_path, out, dry_run=True)} == {
        "fx__sigma-0.05": "planned", "fx__sigma-0.02": "planned"}
    assert [r.action for r in batch.run_batch(spec_path, out, dry_run=True)] == ["skip", "skip"]

    # summary.csv: one row per point with the run's results
    with open(out / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    fixture = [json.loads(line) for line in (DATA / "es_vs_grpo" / "es_seed0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["run"] for r in rows] == ["fx__sigma-0.05", "fx__sigma-0.02"]
    for column in ("kind", "budget", "generation", "train_reward_start", "train_reward_final", "train_reward_best",
                   "eval_reward_start", "eval_reward_final", "eval_reward_best", "eval_accuracy_final", "kl_final",
                   "completions", "tokens", "wall_s"):
        assert column in rows[0], column
    assert rows[0]["kind"] == "es" and int(rows[0]["generation"]) == 4 == int(rows[0]["budget"])
    assert float(rows[0]["eval_reward_final"]) == fixture[-1]["eval/reward"]
    assert float(rows[0]["train_reward_best"]) == max(r["policy/train_reward"] for r in fixture)
    assert float(rows[0]["kl_final"]) == fixture[-1]["policy/kl"] and float(rows[0]["eval_accuracy_final"]) == 0.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"][1]["results"]["completions"] == 64


def test_a_mapping_for_a_text_parameter_arrives_as_json_and_is_checked(tmp_path):
    spec_path = write_yaml(tmp_path / "p.yaml", f"notebook: {RUN_NB}\nparameters: {{task_options: {{bogus: 1}}}}\n")
    [planned] = batch.run_batch(spec_path, tmp_path / "out", dry_run=True)
    assert planned.parameters["task_options"] == '{"bogus": 1}'
    assert planned.action == "invalid" and "task 'conciseness' has no option 'bogus'" in planned.error


def test_point_states(tmp_path):
    folder, params = tmp_path / "p", {"seed": 1, "run_dir": str(tmp_path / "p" / "run")}
    assert batch.point_state(folder, params)[0] == "new"
    folder.mkdir()
    (folder / "notebook.ipynb").write_text("{}")
    assert batch.point_state(folder, params)[0] == "unfinished"  # a folder without status.json
    batch.write_status(folder, {"status": "running", "pid": 999_999_999, "host": "elsewhere", "parameters": params})
    assert batch.point_state(folder, params)[:2] == ("unfinished", "stopped while running (started ?)")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        batch.write_status(folder, {"status": "running", "pid": sleeper.pid, "host": socket.gethostname(),
                                    "parameters": params})
        assert batch.point_state(folder, params)[0] == "running"  # another batch runs it now
    finally:
        sleeper.kill()
        sleeper.wait()
    batch.write_status(folder, {"status": "ok", "parameters": {**params, "run_dir": "/moved/run"}})
    assert batch.point_state(folder, params)[0] == "finished"  # the injected paths do not count
    assert batch.point_state(folder, {**params, "seed": 2})[:2] == ("changed", "settings changed: seed 1 -> 2")
    # finished notebook, but its run short of its budget (e.g. a budget raised and run elsewhere): resume
    run = folder / "run"
    run.mkdir()
    (run / "config.yaml").write_text("kind: es\nnum_generations: 10\nseed: 1\n")
    (run / "metrics.jsonl").write_text(json.dumps({"generation": 0}) + "\n" + json.dumps({"generation": 3}) + "\n")
    assert batch.point_state(folder, params)[:2] == ("unfinished", "its run reached generation 3 of 10")
    batch.write_status(folder, {"status": "failed", "error": "E: x", "parameters": params})
    assert batch.point_state(folder, params)[:2] == ("failed", "failed: E: x")


def test_a_batch_killed_mid_grid_resumes(tmp_path):
    """SIGKILL the batch command (and its kernel) while the second of three points runs; the rerun
    skips the first, resumes the second in its folder and runs the third."""
    release = tmp_path / "release"
    spec_path = write_yaml(tmp_path / "p.yaml", f"""
notebook: {RUN_NB}
name: fx
parameters: {{hold: {release}, hold_seed: 1}}
grid: {{seed: [0, 1, 2]}}
""")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "evolm_lib.cli", "batch", str(spec_path), "--out", str(out)]
    process = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[1], start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pid_file = out / "fx__seed-1" / "run" / "kernel.pid"
    try:
        deadline = time.monotonic() + 300
        while not pid_file.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.5)
        assert pid_file.exists(), "the second point never reached its hold"
        time.sleep(0.5)
        kernel = int(pid_file.read_text())
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the batch command and what shares its session
        process.wait(30)
    os.kill(kernel, signal.SIGKILL)  # jupyter starts kernels in a session of their own
    assert batch.read_status(out / "fx__seed-1")["status"] == "running"
    assert batch.point_state(out / "fx__seed-1", {})[0] in ("unfinished", "changed")
    assert not (out / "fx__seed-2").exists()

    release.write_text("go")
    results = batch.run_batch(spec_path, out)
    assert [(r.name, r.action, r.status) for r in results] == [
        ("fx__seed-0", "skip", "ok"), ("fx__seed-1", "resume", "ok"), ("fx__seed-2", "run", "ok")]
    assert [executions(out / f"fx__seed-{s}") for s in range(3)] == [1, 2, 1]
    assert batch.read_status(out / "fx__seed-1")["attempts"] == 2
    assert all(r.results["generation"] == 4 for r in results)  # every run reached its budget


def test_the_conciseness_spec_that_replaced_the_sweep_script_runs_both_rates_on_three_seeds():
    """papermill_runs/conciseness_smollm2_lr_seeds_cpu.yaml, once scripts/sweep_conciseness.py: the demo's
    settings at learning rates 0.2 and 0.4, seeds 0-2."""
    spec = batch.load_batch_spec(Path(__file__).parents[1] / "papermill_runs" / "conciseness_smollm2_lr_seeds_cpu.yaml")
    demo = batch.load_batch_spec(Path(__file__).parents[1] / "papermill_runs" / "conciseness_smollm2_cpu.yaml")
    runs = batch.expand_runs(spec)
    assert [(r.parameters["learning_rate"], r.parameters["seed"]) for r in runs] == \
           [(lr, seed) for lr in (0.2, 0.4) for seed in (0, 1, 2)]
    assert {k: v for k, v in spec.parameters.items()} == {k: v for k, v in demo.parameters.items() if k != "learning_rate"}
