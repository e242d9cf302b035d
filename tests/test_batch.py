"""The papermill batch runner, with a tiny fixture notebook (no model)."""
from __future__ import annotations

import csv
import json
import re
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


def test_refuses_to_overwrite_existing_runs(batch_out, tmp_path):
    spec_path, out, _ = batch_out
    with pytest.raises(FileExistsError, match="--overwrite"):
        batch.run_batch(spec_path, out)
    with pytest.raises(FileExistsError):
        batch.run_batch(spec_path, out, dry_run=True)
    planned = batch.run_batch(spec_path, out, overwrite=True, dry_run=True)
    assert [r.status for r in planned] == ["planned"] * 3
    assert batch_cli.main([str(spec_path), "--out", str(out)]) == 2  # CLI: clear error, no run


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
