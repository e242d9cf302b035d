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
    printed = capsys.readouterr().out
    assert re.search(r"fx__sigma--1 +failed .*ConfigError: invalid ESConfig", printed), printed
    assert not (out / "fx__sigma--1").exists()  # an invalid point creates nothing: no folder, no summary row
    with open(out / "summary.csv", newline="") as f:
        assert [r["run"] for r in csv.DictReader(f)] == ["fx__sigma-0.05"]
    assert executions(out / "fx__sigma-0.05") == 1

    write_yaml(spec_path, f"notebook: {RUN_NB}\nname: fx\ngrid: {{sigma: [0.05, 0.02]}}\n")  # the fix
    assert batch_cli.main([str(spec_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 ok, 0 failed (1 skip, 1 run)" in printed and "no longer points of this grid" not in printed
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


# --------------------------------------------------------------------------- changed settings and failed attempts


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _summary_row(out: Path, name: str) -> dict[str, str]:
    with open(out / "summary.csv", newline="") as f:
        return next(row for row in csv.DictReader(f) if row["run"] == name)


def _point_line(printed: str, name: str) -> str:
    return next(line.strip() for line in printed.splitlines() if re.match(rf"\s*\w+ +{re.escape(name)} ", line))


def test_changed_settings_keep_a_finished_point_and_say_so_the_same_way_in_dry_and_real_runs(tmp_path, capsys):
    """A finished point, then a spec that changes its sigma over the same folder: the dry run and the
    real run print the same line with the old value as its run has it (0.05, the notebook's default,
    which the first spec never named); its notebook, run folder and summary row stay as they were, and
    so they do after a failed --overwrite of that point, which is kept beside it. A good --overwrite
    POINT then replaces that point alone."""
    out = tmp_path / "out"
    first = write_yaml(tmp_path / "a.yaml", f"notebook: {RUN_NB}\nname: fx\ngrid: {{seed: [0, 1]}}\n")
    assert batch_cli.main([str(first), "--out", str(out)]) == 0
    capsys.readouterr()
    point = out / "fx__seed-0"
    notebook, run, row = (point / "notebook.ipynb").read_bytes(), _tree(point / "run"), _summary_row(out, "fx__seed-0")

    changed = write_yaml(tmp_path / "b.yaml", f"notebook: {RUN_NB}\nname: fx\nparameters: {{sigma: 0.1}}\n"
                                              "grid: {seed: [0, 1]}\n")
    assert batch_cli.main([str(changed), "--out", str(out), "--dry-run"]) == 1
    dry = _point_line(capsys.readouterr().out, "fx__seed-0")
    assert dry.startswith("conflict  fx__seed-0  settings changed (as its run has them): sigma 0.05 -> 0.1; "), dry
    assert "`--overwrite fx__seed-0` replaces this point alone" in dry and "`--out` another folder" in dry
    assert batch_cli.main([str(changed), "--out", str(out)]) == 1
    real = capsys.readouterr().out
    assert _point_line(real.split("other settings:")[1], "fx__seed-0") == dry  # the same words
    # a point left as it was is not counted ok: its folder holds a run of other settings than this batch's
    assert "0 ok, 0 failed, 2 left as they were (settings changed) (2 conflict)" in real, real
    unchanged = (point / "notebook.ipynb").read_bytes(), _tree(point / "run"), _summary_row(out, "fx__seed-0")
    assert unchanged[:2] == (notebook, run)
    assert {k: unchanged[2][k] for k in row} == row and unchanged[2]["sigma"] == "0.05"  # the run's value

    # a failed attempt to replace it keeps the finished point, and the attempt beside it
    failing = write_yaml(tmp_path / "c.yaml", f"notebook: {RUN_NB}\nname: fx\nparameters: {{sigma: 0.1, fail: true}}\n"
                                              "grid: {seed: [0, 1]}\n")
    assert batch_cli.main([str(failing), "--out", str(out), "--overwrite", "fx__seed-0"]) == 1
    printed = capsys.readouterr().out
    assert re.search(r"fx__seed-0 +ok +overwrite .*kept; its attempt failed: RuntimeError: failing on purpose", printed)
    assert re.search(r"conflict +fx__seed-1 ", printed)  # the other point is not overwritten
    assert (point / "notebook.ipynb").read_bytes() == notebook and _tree(point / "run") == run
    assert {k: v for k, v in _summary_row(out, "fx__seed-0").items() if k in row} == row
    [attempt] = batch.read_status(point)["failed_attempts"]
    kept = Path(attempt["kept_at"])
    assert kept.parent == out and kept.name.startswith("fx__seed-0.failed-")
    assert batch.read_status(kept)["error"] == "RuntimeError: failing on purpose"
    assert "failing on purpose" in (kept / "notebook.ipynb").read_text()
    assert kept not in batch.stale_folders(batch.load_batch_spec(failing), out)

    # a good --overwrite POINT replaces that point alone
    assert batch_cli.main([str(changed), "--out", str(out), "--overwrite", "fx__seed-0"]) == 1  # seed 1: conflict
    assert "sigma: 0.1" in (point / "run" / "config.yaml").read_text()
    assert "sigma: 0.05" in (out / "fx__seed-1" / "run" / "config.yaml").read_text()
    assert not list(out.glob(".fx__seed-0.kept-*"))  # the replaced folder is gone once the attempt succeeded
    with pytest.raises(ValueError, match=r"--overwrite names no point of this batch: \['fx__seed-2'\]"):
        batch.run_batch(changed, out, overwrite=["fx__seed-2"], dry_run=True)


def test_a_failed_extension_keeps_the_finished_notebook_beside_the_attempt(tmp_path):
    """A budget raised over a finished point extends its run (num_generations may change); when that
    attempt fails, notebook.ipynb and the point's status stay those of the finished point."""
    out = tmp_path / "out"
    spec = write_yaml(tmp_path / "a.yaml", f"notebook: {RUN_NB}\nname: fx\n")
    assert [r.status for r in batch.run_batch(spec, out)] == ["ok"]
    notebook = (out / "fx" / "notebook.ipynb").read_bytes()
    longer = write_yaml(tmp_path / "b.yaml", f"notebook: {RUN_NB}\nname: fx\nparameters: {{num_generations: 6, fail: true}}\n")
    [planned] = batch.run_batch(longer, out, dry_run=True)
    assert (planned.action, planned.reason) == ("resume", "settings changed that its run can follow: num_generations 4 -> 6")
    [result] = batch.run_batch(longer, out)
    assert (result.status, result.action) == ("ok", "resume") and "RuntimeError: failing on purpose" in result.attempt_error
    assert (out / "fx" / "notebook.ipynb").read_bytes() == notebook
    [failed] = list((out / "fx").glob("notebook.failed-*.ipynb"))
    assert "failing on purpose" in failed.read_text()
    status = batch.read_status(out / "fx")
    assert status["status"] == "ok" and status["failed_attempts"][0]["kept_at"] == str(failed)


def test_dry_run_checks_the_stepper_through_papermill_inspection_and_its_config_class(tmp_path, capsys):
    """Notebook 03's points are checked without a kernel and without running its cells: types from
    papermill's inspection, settings through ESConfig as its config cell builds them, every error
    naming the field (a setting given in `settings` by its path) and, for a misspelling, the nearest name."""
    stepper = Path(__file__).resolve().parents[1] / "notebooks" / "03_es_stepper.py"
    tiny = {"model": "tiny-random", "max_model_len": 256, "kv_cache_gb": 0.1, "max_new_tokens": 8}
    spec = write_yaml(tmp_path / "p.yaml", json.dumps({"notebook": str(stepper), "name": "s", "parameters": tiny, "grid": {
        "settings": [{"optimizr": "adam"}, {"optimizer": "adam", "antithetic": False}]}}))
    results = batch.run_batch(spec, tmp_path / "out", dry_run=True)
    assert [r.action for r in results] == ["invalid", "run"]
    assert results[0].error == ("ConfigError: invalid ESConfig: settings.optimizr: unknown setting "
                                "(did you mean optimizer?)")
    bad = {"population_size": 5, "task_options": "{num_train: [8}", "num_generations": "two"}
    for name, value in bad.items():
        spec = write_yaml(tmp_path / "p.yaml", json.dumps({"notebook": str(stepper), "parameters": {**tiny, name: value}}))
        [result] = batch.run_batch(spec, tmp_path / "out", dry_run=True)
        assert result.action == "invalid", name
        assert {"population_size": "population_size: must be even with antithetic sampling (+/- pairs), got 5; use an even population or antithetic: false",
                "task_options": "task_options: not valid YAML at line 1, column",
                "num_generations": "num_generations: expected int (declared `num_generations: int`), got 'two'",
                }[name] in result.error, result.error
    for name, hint in (("sigmaa", "(did you mean sigma?)"),
                       ("optimizer", "optimizer is a setting of ESConfig: give it under `settings` "
                                     "(settings: {optimizer: 'adam'})")):
        spec = write_yaml(tmp_path / "p.yaml", json.dumps({"notebook": str(stepper), "parameters": {name: "adam"}}))
        assert batch_cli.main([str(spec), "--out", str(tmp_path / "out"), "--dry-run"]) == 2
        assert hint in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_summary_columns_are_labelled_settings_without_a_grid_and_one_wall_time(tmp_path, capsys):
    spec = write_yaml(tmp_path / "p.yaml", f"notebook: {RUN_NB}\nname: fx\n"
                                           "parameters: {sigma: 0.02, settings: {lora_alpha: 2.0}}\n")
    assert batch_cli.main([str(spec), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("run "))
    assert header.split("  ")[0:1] == ["run"] and "wall min" in header and "train reward: start -> end (best)" in header
    assert "KL to base (nats/token)" in header and "eval accuracy" in header  # the fixture run has both
    with open(tmp_path / "out" / "summary.csv", newline="") as f:
        [row] = list(csv.DictReader(f))
    assert (row["sigma"], row["settings.lora_alpha"]) == ("0.02", "2.0")  # settings present without a grid
    assert "seconds" not in row and "action" not in row and row["wall_s"] == f"{float(row['wall_s']):.1f}"
    assert "kl_final" in row  # measured in this run
    empty = batch.summary_rows([batch.RunResult("x", "ok", 1.26, "", tmp_path, tmp_path / "nb.ipynb", {},
                                                results={"kind": "es", "kl_final": None})])
    assert empty == [{"run": "x", "status": "ok", "wall_s": 1.3, "error": "", "kind": "es", "notebook": str(tmp_path / "nb.ipynb")}]


def _kernel_dying_first(tmp_path, name: str, deaths: int) -> Path:
    """A kernelspec `name` under tmp_path/jupyter whose first `deaths` kernels exit before answering
    (as one whose port another process took); later ones are the ordinary ipykernel."""
    script = tmp_path / f"{name}.py"
    script.write_text(
        "import pathlib, runpy, sys\n"
        f"count = pathlib.Path({str(tmp_path / (name + '.deaths'))!r})\n"
        "died = int(count.read_text()) if count.exists() else 0\n"
        f"if died < {deaths}:\n"
        "    count.write_text(str(died + 1))\n"
        "    sys.exit(1)\n"
        "sys.argv = ['ipykernel_launcher', *sys.argv[1:]]\n"
        "runpy.run_module('ipykernel_launcher', run_name='__main__')\n")
    spec = tmp_path / "jupyter" / "kernels" / name
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps(
        {"argv": [sys.executable, str(script), "-f", "{connection_file}"], "display_name": name, "language": "python"}))
    return tmp_path / f"{name}.deaths"


def test_a_kernel_that_dies_before_answering_is_started_once_more(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    notebook = tmp_path / "n.py"
    notebook.write_text("# %%\nprint('ran')\n")
    deaths = _kernel_dying_first(tmp_path, "dies-once", deaths=1)
    with pytest.warns(RuntimeWarning, match="the kernel died before it answered"):
        out = batch.execute_notebook(notebook, tmp_path / "out.ipynb", kernel_name="dies-once", cwd=tmp_path)
    assert deaths.read_text() == "1" and "ran" in out.read_text()
    deaths = _kernel_dying_first(tmp_path, "always-dies", deaths=99)
    with pytest.raises(RuntimeError, match=batch.KERNEL_DIED_AT_START), pytest.warns(RuntimeWarning):
        batch.execute_notebook(notebook, tmp_path / "out2.ipynb", kernel_name="always-dies", cwd=tmp_path)
    assert deaths.read_text() == str(batch.KERNEL_START_ATTEMPTS)


def test_sigterm_on_a_batch_prints_what_ctrl_c_prints_and_leaves_no_running_status(tmp_path):
    """SIGTERM (kill, a scheduler) on a real `evolm batch` process while its second point's kernel runs:
    the same one line as Ctrl-C, exit 143, no traceback, the kernel ended, and status.json no longer
    "running" with a dead pid; the same command then resumes that point."""
    import psutil

    release = tmp_path / "release"
    spec_path = write_yaml(tmp_path / "p.yaml", f"""
notebook: {RUN_NB}
name: fx
parameters: {{hold: {release}, hold_seed: 1}}
grid: {{seed: [0, 1]}}
""")
    out = tmp_path / "out"
    stderr = open(tmp_path / "stderr", "w+")
    process = subprocess.Popen([sys.executable, "-m", "evolm_lib.cli", "batch", str(spec_path), "--out", str(out)],
                               cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL, stderr=stderr)
    pid_file = out / "fx__seed-1" / "run" / "kernel.pid"
    try:
        deadline = time.monotonic() + 300
        while not pid_file.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.5)
        assert pid_file.exists(), (tmp_path / "stderr").read_text()[-3000:]
        time.sleep(0.5)
        kernel = int(pid_file.read_text())
        before = len((tmp_path / "stderr").read_text())
        process.send_signal(signal.SIGTERM)
        assert process.wait(120) == 143
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    printed = (tmp_path / "stderr").read_text()[before:].replace("\r", "\n")
    lines = [line for line in printed.splitlines() if line.strip() and not line.startswith("batch:")]
    assert "Traceback" not in printed and "KeyboardInterrupt" not in printed, printed
    assert lines == [f"interrupted: 1 of 2 point(s) finished and kept in {out.resolve()}; "
                     "run the same command again to continue"], printed
    assert not psutil.pid_exists(kernel) or psutil.Process(kernel).status() == psutil.STATUS_ZOMBIE
    status = batch.read_status(out / "fx__seed-1")
    assert status["status"] == "stopped" and "pid" not in status  # no "running" for a process that is gone
    release.write_text("go")
    results = batch.run_batch(spec_path, out)
    assert [(r.name, r.action, r.status) for r in results] == [("fx__seed-0", "skip", "ok"), ("fx__seed-1", "resume", "ok")]


REPO = Path(__file__).resolve().parents[1]
TINY_STEPPER = {"model": "tiny-random", "task": "conciseness", "max_new_tokens": 8, "max_model_len": 256,
                "kv_cache_gb": 0.1}


def _evolm(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`evolm ARGS` as a user runs it: a process of its own, from the project folder."""
    return subprocess.run([sys.executable, "-m", "evolm_lib.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_a_population_of_ten_to_the_ninth_is_refused_by_the_dry_run_and_the_run_creates_nothing(tmp_path,
                                                                                                   tiny_model_dir):
    """population_size 10^9 on the ES stepper: the dry run lists the point as invalid, naming the field and
    the largest population that fits this machine; the real batch starts no kernel and creates nothing
    (no point folder, no summary)."""
    spec = write_yaml(tmp_path / "big.yaml", json.dumps({
        "notebook": str(REPO / "notebooks" / "03_es_stepper.py"), "name": "big",
        "parameters": {**TINY_STEPPER, "population_size": 10**9, "num_generations": 2}}))
    out = tmp_path / "out"
    dry = _evolm("batch", str(spec), "--out", str(out), "--dry-run")
    assert dry.returncode == 1, dry.stderr
    assert re.search(r"invalid +big +ConfigError: population_size=1,000,000,000 is more than this machine can hold: "
                     r".* the largest population_size that fits is [\d,]+", dry.stdout), dry.stdout
    real = _evolm("batch", str(spec), "--out", str(out))
    assert real.returncode == 1 and "population_size=1,000,000,000" in real.stdout, real.stdout + real.stderr
    assert "0 ok, 1 failed" in real.stdout and "no summary written" in real.stdout
    assert not out.exists()  # no point folder, no summary.csv: nothing was allocated or written


def test_empty_grid_values_are_refused_naming_the_field(tmp_path):
    spec = write_yaml(tmp_path / "p.yaml", f"notebook: {RUN_NB}\nname: fx\ngrid: {{seed: []}}\n")
    result = _evolm("batch", str(spec), "--out", str(tmp_path / "out"), "--dry-run")
    assert result.returncode == 2 and "grid.seed in " in result.stderr and "must be a non-empty list, got []" in result.stderr
    assert not (tmp_path / "out").exists()


def _tree_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_es_batch_pointed_at_a_grpo_batchs_folder_names_it_and_leaves_it_unchanged(tmp_path):
    """A real GRPO batch (notebook 06 on tiny-random, labelled a plumbing check), then an ES batch of the
    same name and then of another name with --out at its folder: each is refused before anything runs,
    saying the folder holds a GRPO run of notebook 06; every file there, summary.csv included, unchanged."""
    out = tmp_path / "quick_grpo"
    grpo = write_yaml(tmp_path / "grpo.yaml", json.dumps({
        "notebook": str(REPO / "notebooks" / "06_grpo_stepper.py"), "name": "quick",
        "parameters": {**TINY_STEPPER, "group_size": 4, "num_steps": 1, "prompts_per_step": 2}, "grid": {"seed": [0]}}))
    made = _evolm("batch", str(grpo), "--out", str(out))
    assert made.returncode == 0, made.stdout + made.stderr
    assert ("note: every point ran on tiny-random, a model with random weights: a plumbing check (the notebook, "
            "engine and files work), its rewards mean nothing about the method") in made.stdout
    before = _tree_bytes(out)
    assert "summary.csv" in before
    for name in ("quick", "other"):
        es = write_yaml(tmp_path / f"es_{name}.yaml", json.dumps({
            "notebook": str(REPO / "notebooks" / "03_es_stepper.py"), "name": name,
            "parameters": {**TINY_STEPPER, "population_size": 4, "num_generations": 1}, "grid": {"seed": [0]}}))
        for dry in (["--dry-run"], []):
            result = _evolm("batch", str(es), "--out", str(out), *dry)
            assert result.returncode == 2, result.stdout + result.stderr
            assert result.stderr.strip() == (
                f"error: this folder, {out.resolve()}, holds another batch's points: GRPO run(s) of "
                f"06_grpo_stepper.py (quick__seed-0); this batch ({name!r}) runs ES points of 03_es_stepper.py. "
                "The folder and its summary.csv are left as they are: give --out another folder"), result.stderr
            assert _tree_bytes(out) == before


def test_a_prompt_longer_than_max_model_len_is_found_by_the_dry_run(tmp_path, tiny_model_dir):
    """A JSONL task whose one prompt is longer than max_model_len: the dry run tokenizes it with the
    model's own tokenizer and lists the point as invalid, naming max_model_len and the prompt's tokens."""
    task = tmp_path / "long.jsonl"
    task.write_text(json.dumps({"prompt": "word " * 5000, "target": "x"}) + "\n"
                    + json.dumps({"prompt": "hi", "target": "x", "split": "eval"}) + "\n")
    spec = write_yaml(tmp_path / "long.yaml", json.dumps({
        "notebook": str(REPO / "notebooks" / "03_es_stepper.py"), "name": "long",
        "parameters": {**TINY_STEPPER, "task": "jsonl", "task_options": {"path": str(task)}, "population_size": 4,
                       "num_generations": 1}}))
    result = _evolm("batch", str(spec), "--out", str(tmp_path / "out"), "--dry-run")
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(r"invalid +long +ConfigError: max_model_len=256 is too short for the task's longest prompt "
                     r"\(\d{4,} tokens\) plus max_new_tokens=8", result.stdout), result.stdout
    assert not (tmp_path / "out").exists()


def test_a_parameter_by_a_settings_older_name_is_refused_naming_its_name_now():
    from evolm_lib.batch.notebooks import check_parameters, notebook_info

    stepper = Path(__file__).resolve().parents[1] / "notebooks" / "03_es_stepper.py"
    info = notebook_info(stepper)
    with pytest.raises(ValueError, match=r"\['evaluator'\] not declared .*; evaluator is now called engine_host; declared: "):
        check_parameters({"evaluator": "ray"}, info.declared, stepper, info.kind)
