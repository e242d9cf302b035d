"""Batch runs of a notebook with papermill: one YAML file, a parameter grid, one folder per run.

    python -m evolm_lib.batch PARAMS.yaml [--out DIR] [--notebook PATH] [--dry-run] [--overwrite]

PARAMS.yaml:

    notebook: notebooks/03_es_stepper.py   # relative to the YAML file or to the repository root
    name: sigma-sweep                      # optional run-name prefix (default: the notebook's name)
    kernel: python3                        # optional
    parameters: {num_generations: 20}      # base parameters
    grid: {seed: [0, 1, 2], sigma: [0.01, 0.05]}   # optional; cartesian product

Each run gets OUT/<name>__seed-0__sigma-0.05/notebook.ipynb, and, when the notebook declares them in
its `parameters` cell, `run_dir` (= that folder/run) and `figures_dir` (= that folder/figures).
"""
from __future__ import annotations

import csv
import itertools
import json
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from .paths import project_root

SPEC_KEYS = ("notebook", "parameters", "grid", "name", "kernel", "sweep")  # sweep: read by evolm_lib.sweep only
INJECTED = ("run_dir", "figures_dir")  # filled in by the runner, per run
NOTEBOOK_FILE = "notebook.ipynb"


@dataclass(frozen=True)
class BatchSpec:
    """A parsed batch file."""

    notebook: Path
    """Notebook to run (jupytext .py or .ipynb), absolute."""
    parameters: dict[str, Any] = field(default_factory=dict)
    """Parameters shared by every run."""
    grid: dict[str, list[Any]] = field(default_factory=dict)
    """Parameter name -> values; runs are the cartesian product, in key order."""
    name: str = ""
    """Run-name prefix (default: the notebook's stem)."""
    kernel: str = "python3"
    """Jupyter kernel to execute with."""
    source: Path | None = None
    """The YAML file this came from, if any."""


@dataclass(frozen=True)
class RunSpec:
    """One run of a batch: its folder name and its parameters (without the injected paths)."""

    name: str
    parameters: dict[str, Any]
    grid_values: dict[str, Any]


@dataclass
class RunResult:
    """What happened to one run."""

    name: str
    status: str  # "ok" | "failed" | "planned"
    seconds: float
    error: str
    folder: Path
    notebook: Path
    parameters: dict[str, Any]


# --------------------------------------------------------------------------- spec


def _project_root_or_none() -> Path | None:
    try:
        return project_root()
    except FileNotFoundError:
        return None


def resolve_notebook(path: str | Path, spec_dir: Path | None) -> Path:
    """Find a notebook path given relative to the YAML file, the repository root or the cwd."""
    path = Path(path).expanduser()
    if path.is_absolute():
        candidates = [path]
    else:
        bases = [b for b in (spec_dir, _project_root_or_none(), Path.cwd()) if b is not None]
        candidates = list(dict.fromkeys((b / path).resolve() for b in bases))
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"notebook {str(path)!r} not found (tried: {tried})")


def spec_from_dict(data: dict[str, Any], source: Path | None = None) -> BatchSpec:
    """Validate a batch description (the YAML's content) and build a BatchSpec."""
    where = f" in {source}" if source else ""
    if not isinstance(data, dict):
        raise ValueError(f"batch file{where} must be a mapping with at least a `notebook` key")
    unknown = [k for k in data if k not in SPEC_KEYS]
    if unknown:
        raise ValueError(f"unknown top-level key(s) {unknown}{where}; allowed: {list(SPEC_KEYS)}")
    if "notebook" not in data:
        raise ValueError(f"batch file{where} needs a `notebook` key")
    parameters = data.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise ValueError(f"`parameters`{where} must be a mapping, got {type(parameters).__name__}")
    grid = data.get("grid") or {}
    if not isinstance(grid, dict):
        raise ValueError(f"`grid`{where} must be a mapping of name -> list of values")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"grid.{key}{where} must be a non-empty list, got {values!r}")
    notebook = resolve_notebook(data["notebook"], source.parent if source else None)
    kernel = data.get("kernel") or "python3"
    name = str(data.get("name") or notebook.stem)
    return BatchSpec(notebook=notebook, parameters=dict(parameters),
                     grid={str(k): list(v) for k, v in grid.items()},
                     name=name, kernel=str(kernel), source=source)


def load_batch_spec(path: str | Path) -> BatchSpec:
    """Read and validate a batch YAML file."""
    path = Path(path).resolve()
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    return spec_from_dict(data, source=path)


def _slug(value: Any) -> str:
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text).strip("_") or "_"


def expand_runs(spec: BatchSpec) -> list[RunSpec]:
    """The runs of a batch: the cartesian product of the grid over the base parameters."""
    keys = list(spec.grid)
    runs = []
    for values in itertools.product(*(spec.grid[k] for k in keys)):
        grid_values = dict(zip(keys, values))
        name = "__".join([_slug(spec.name)] + [f"{_slug(k)}-{_slug(v)}" for k, v in grid_values.items()])
        runs.append(RunSpec(name=name, parameters={**spec.parameters, **grid_values},
                            grid_values=grid_values))
    names = [r.name for r in runs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"grid values give duplicate run folder names: {duplicates}")
    return runs


# --------------------------------------------------------------------------- notebooks


def read_notebook(path: str | Path, kernel_name: str = "python3"):
    """A notebook (jupytext .py/.md or .ipynb) as an nbformat node, with a kernelspec."""
    import jupytext

    nb = jupytext.read(str(path))
    # a jupytext .py without a header has no kernelspec, which papermill needs
    if not nb.metadata.get("kernelspec", {}).get("name"):
        nb.metadata["kernelspec"] = {"name": kernel_name, "display_name": "Python 3",
                                     "language": "python"}
    nb.metadata.setdefault("language_info", {"name": "python"})
    return nb


def notebook_parameters(notebook) -> dict[str, dict[str, Any]]:
    """Parameters declared in the notebook's `parameters` cell: name -> {type, default, help}."""
    from papermill.translators import papermill_translators

    if isinstance(notebook, (str, Path)):
        notebook = read_notebook(notebook)
    cells = [c for c in notebook.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if not cells:
        return {}
    kernel = notebook.metadata.get("kernelspec", {}).get("name", "python3")
    language = notebook.metadata.get("kernelspec", {}).get("language", "python")
    translator = papermill_translators.find_translator(kernel, language)
    return {p.name: p._asdict() for p in translator.inspect(cells[0])}


def check_parameters(parameters: dict[str, Any], declared: dict[str, Any], notebook: Path) -> None:
    """Fail with the declared names when a parameter is not declared by the notebook."""
    undeclared = [k for k in parameters if k not in declared]
    if undeclared:
        listing = ", ".join(declared) or "(none: no cell tagged `parameters`)"
        raise ValueError(f"parameter(s) {undeclared} not declared in the parameters cell of "
                         f"{notebook}; declared: {listing}")


def execute_notebook(notebook_path: str | Path, output_path: str | Path,
                     parameters: dict[str, Any] | None = None, cwd: str | Path | None = None,
                     kernel_name: str = "python3", log_output: bool = False,
                     execution_timeout: float | None = None) -> Path:
    """Run one notebook (jupytext .py or .ipynb) with papermill; returns the executed notebook path.

    Raises papermill's PapermillExecutionError when a cell fails (the output notebook is still
    written, with the failing cell marked).
    """
    import papermill

    nb = read_notebook(notebook_path, kernel_name)
    output_path = Path(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(
        nb, str(output_path), parameters=dict(parameters or {}), kernel_name=kernel_name,
        progress_bar=False, log_output=log_output, cwd=str(cwd or project_root()),
        execution_timeout=execution_timeout,
        store_widget_state=False,  # a FigureWidget would otherwise add ~5 MB of plotly.js
    )
    return output_path


def _error_text(err: BaseException) -> str:
    ename, evalue = getattr(err, "ename", None), getattr(err, "evalue", None)
    if ename:  # PapermillExecutionError: the notebook's own exception
        return f"{ename}: {evalue}"
    return f"{type(err).__name__}: {err}"


# --------------------------------------------------------------------------- batch


def plan_batch(spec: BatchSpec, out_dir: str | Path) -> list[tuple[RunSpec, dict[str, Any], Path]]:
    """Runs with their full parameters (paths injected where declared) and folders; checks names."""
    nb = read_notebook(spec.notebook, spec.kernel)
    declared = notebook_parameters(nb)
    set_by_runner = [k for k in INJECTED if k in spec.parameters or k in spec.grid]
    if set_by_runner:
        raise ValueError(f"{set_by_runner} are set per run by the batch runner; "
                         "remove them from the batch file")
    check_parameters({**spec.parameters, **spec.grid}, declared, spec.notebook)
    out_dir = Path(out_dir).resolve()
    plan = []
    for run in expand_runs(spec):
        folder = out_dir / run.name
        params = dict(run.parameters)
        if "run_dir" in declared:
            params["run_dir"] = str(folder / "run")
        if "figures_dir" in declared:
            params["figures_dir"] = str(folder / "figures")
        plan.append((run, params, folder))
    return plan


def run_batch(spec_or_path: BatchSpec | str | Path, out_dir: str | Path, overwrite: bool = False,
              dry_run: bool = False, log_output: bool = False) -> list[RunResult]:
    """Run every grid point; failures are recorded, not raised. Writes OUT/summary.{csv,json}."""
    from tqdm.auto import tqdm

    spec = spec_or_path if isinstance(spec_or_path, BatchSpec) else load_batch_spec(spec_or_path)
    out_dir = Path(out_dir).resolve()
    plan = plan_batch(spec, out_dir)
    existing = [str(folder) for _, _, folder in plan if folder.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{len(existing)} run folder(s) already exist, refusing to overwrite "
                              f"(pass --overwrite / overwrite=True): {', '.join(existing)}")
    if dry_run:
        return [RunResult(run.name, "planned", 0.0, "", folder, folder / NOTEBOOK_FILE, params)
                for run, params, folder in plan]

    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    bar = tqdm(plan, desc="batch", unit="run", file=sys.stderr)
    for run, params, folder in bar:
        bar.set_postfix_str(run.name)
        if folder.exists():  # only reachable with overwrite=True
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        output = folder / NOTEBOOK_FILE
        start = time.perf_counter()
        try:
            execute_notebook(spec.notebook, output, params, cwd=project_root(),
                             kernel_name=spec.kernel, log_output=log_output)
            status, error = "ok", ""
        except Exception as err:  # noqa: BLE001 - one failed run must not stop the batch
            status, error = "failed", _error_text(err)
            bar.write(f"[failed] {run.name}: {error}", file=sys.stderr)
        results.append(RunResult(run.name, status, time.perf_counter() - start, error, folder,
                                 output, params))
    bar.close()
    write_summary(results, out_dir, spec)
    return results


def write_summary(results: list[RunResult], out_dir: Path, spec: BatchSpec | None = None) -> None:
    """Write OUT/summary.csv (one row per run, grid values as columns) and OUT/summary.json."""
    grid_keys = list(spec.grid) if spec else []
    with open(out_dir / "summary.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "status", "seconds", "error", *grid_keys, "notebook"])
        for r in results:
            writer.writerow([r.name, r.status, f"{r.seconds:.2f}", r.error,
                             *(r.parameters.get(k) for k in grid_keys), str(r.notebook)])
    payload = {
        "notebook": str(spec.notebook) if spec else None,
        "runs": [{**asdict(r), "folder": str(r.folder), "notebook": str(r.notebook)}
                 for r in results],
    }
    (out_dir / "summary.json").write_text(json.dumps(payload, indent=2, default=str) + "\n",
                                          encoding="utf-8")


def format_summary(results: list[RunResult], error_width: int = 80) -> str:
    """A plain-text table: run, status, seconds, error."""
    rows = [("run", "status", "seconds", "error")]
    for r in results:
        error = r.error if len(r.error) <= error_width else r.error[: error_width - 1] + "…"
        rows.append((r.name, r.status, f"{r.seconds:.1f}", error.replace("\n", " ")))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join([row[0].ljust(widths[0]), row[1].ljust(widths[1]),
                        row[2].rjust(widths[2]), row[3]]).rstrip() for row in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI
