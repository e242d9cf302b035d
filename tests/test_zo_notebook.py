"""Notebook 05 (zeroth-order estimators on synthetic functions): its shape, its batch file, and a
papermill run with a tiny budget on the real code (slow: a kernel and a browser for the figures)."""
from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from evolm_lib import batch
from evolm_lib.zo.estimators import ESTIMATORS

os.environ.setdefault("OMP_NUM_THREADS", "1")  # kernels inherit it

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "notebooks" / "05_zo_synthetic.py"
SPEC = REPO / "papermill_runs" / "zo_synthetic.yaml"
TINY = {"function": "rosenbrock", "dimension": 30, "num_seeds": 2, "query_budget": 300}
MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "pdf": b"%PDF-", "svg": b"<svg"}


def plotly_values(values) -> list:
    """A trace's values as the notebook's JSON holds them: a list, or plotly's typed array (a numpy
    array written as ``{"dtype": "f8", "bdata": base64}``)."""
    import base64

    import numpy as np

    if isinstance(values, dict) and "bdata" in values:
        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=np.dtype(values["dtype"])).tolist()
    return list(values)


def _cells(path: Path):
    import jupytext

    return jupytext.read(str(path)).cells


def test_py_and_ipynb_in_sync_without_outputs():
    paired = SOURCE.with_suffix(".ipynb")
    assert [(c.cell_type, c.source.strip()) for c in _cells(SOURCE)] == [(c.cell_type, c.source.strip()) for c in _cells(paired)], \
        "run `.venv/bin/python -m jupytext --sync notebooks/05_zo_synthetic.py`"
    notebook = json.loads(paired.read_text())
    assert notebook["metadata"]["kernelspec"]["name"] == "python3"
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in notebook["cells"] if c["cell_type"] == "code")


def test_notebook_shape():
    """Title, one parameters cell of typed, commented scalars, then the config cell, no definitions, no
    asserts (the checks are this file's: the notebook ends with its figure)."""
    cells = _cells(SOURCE)
    assert cells[0].cell_type == "markdown" and cells[0].source.startswith("# ")
    tagged = [i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1
    lines = cells[tagged[0]].source.strip().splitlines()
    declared = batch.notebook_parameters(SOURCE)
    assert len(declared) == len(lines) and "figures_dir" in declared
    for line, (name, info) in zip(lines, declared.items()):
        assert line.startswith(f"{name}: ") and info["inferred_type_name"] in ("str", "int", "float", "bool") and info["help"], line
    assert "config = ComparisonConfig.from_dict(" in cells[tagged[0] + 1].source
    for cell in cells:
        if cell.cell_type == "code":
            nodes = list(ast.walk(ast.parse(cell.source)))
            assert not any(isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Lambda, ast.Assert)) for n in nodes), cell.source
    assert cells[-1].cell_type == "code" and cells[-1].source.strip().endswith("final_values")


def test_standard_grid_batch_file(tmp_path):
    spec = batch.load_batch_spec(SPEC)
    plan = batch.plan_batch(spec, tmp_path)  # checks every parameter is declared by the notebook
    assert [params["function"] for _, params, _ in plan] == ["ackley", "levy", "rosenbrock", "quadratic", "rastrigin"]
    for run, params, folder in plan:
        assert params["dimension"] == 1000 and params["num_seeds"] == 3
        assert params["figures_dir"] == str(folder / "figures")
    assert spec.parameters["estimators"].split(",") == list(ESTIMATORS)


@pytest.mark.slow
def test_papermill_run_with_a_tiny_budget(tmp_path):
    figures = tmp_path / "figures"
    executed = batch.execute_notebook(SOURCE, tmp_path / "05.ipynb", {**TINY, "figures_dir": str(figures)}, cwd=REPO)
    notebook = json.loads(executed.read_text())
    outputs = [o for c in notebook["cells"] for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    printed = "".join("".join(o.get("text", "")) for o in outputs if o.get("output_type") == "stream")
    assert printed.count(" seed ") == 14 * 2  # every estimator on both seeds
    written = sorted(path.name for path in figures.iterdir())
    assert written == sorted(f"zo_rosenbrock_d30_{kind}.{fmt}" for kind in ("f_vs_queries", "final_f") for fmt in MAGIC)
    for path in figures.iterdir():
        head = path.read_bytes()[:500]
        assert head.startswith(MAGIC[path.suffix[1:]]) or (path.suffix == ".svg" and MAGIC["svg"] in head)
    # what the notebook shows, read back from its outputs: every estimator on every seed, within the
    # query budget, f finite, and the exact gradient lowering f
    import math

    estimators = ast.literal_eval(batch.notebook_parameters(SOURCE)["estimators"]["default"]).split(",")
    f_vs_queries, final_f = (o["data"]["application/vnd.plotly.v1+json"]["data"] for o in outputs
                             if "application/vnd.plotly.v1+json" in o.get("data", {}))
    assert sorted(t["name"] for t in final_f) == sorted(estimators)
    finals = [plotly_values(t["y"]) for t in final_f]
    assert all(len(y) == TINY["num_seeds"] and all(math.isfinite(v) for v in y) for y in finals)
    curves = {t["name"]: (plotly_values(t["x"]), plotly_values(t["y"])) for t in f_vs_queries
              if not t["name"].endswith(" band")}
    assert sorted(curves) == sorted(estimators)
    assert all(max(x) <= TINY["query_budget"] and all(math.isfinite(v) for v in y) for x, y in curves.values())
    assert curves["fo"][1][-1] < curves["fo"][1][0]  # the exact gradient lowers f
    summary = next("".join(o["data"]["text/plain"]) for c in notebook["cells"] for o in c.get("outputs", [])
                   if "".join(c["source"]).startswith("summary = final_table"))
    assert all(name in summary for name in estimators)


@pytest.mark.slow
def test_bad_estimator_fails_in_the_config_cell_with_the_known_ones(tmp_path):
    from papermill.exceptions import PapermillExecutionError

    with pytest.raises(PapermillExecutionError) as caught:
        batch.execute_notebook(SOURCE, tmp_path / "out.ipynb", {**TINY, "estimators": "zoar,zoarr", "figures_dir": str(tmp_path)})
    assert caught.value.ename == "ValueError"
    assert "estimator 'zoarr' is unknown; choose from ['fo', 'es'" in caught.value.evalue
    assert "config = ComparisonConfig.from_dict(" in caught.value.source
