"""Batch runs of a notebook with papermill: one YAML file, a parameter grid, one folder per grid point,
and batches that continue where they stopped.

    evolm batch PARAMS.yaml [--out DIR] [--notebook PATH] [--dry-run] [--retry-failed] [--overwrite]

PARAMS.yaml:

    notebook: notebooks/03_es_stepper.py   # relative to the YAML file or to the repository root
    name: sigma-sweep                      # optional run-name prefix (default: the notebook's name)
    kernel: python3                        # optional
    parameters: {num_generations: 20}      # base parameters
    grid: {seed: [0, 1, 2], sigma: [0.01, 0.05]}   # optional; cartesian product

Each grid point gets OUT/<name>__seed-0__sigma-0.05/ with notebook.ipynb, status.json and, when the
notebook declares them in its `parameters` cell, `run_dir` (= that folder/run) and `figures_dir`
(= that folder/figures). A mapping or list given for a `str` parameter (e.g. `task_options`) is
passed as JSON text.

Rerunning a batch continues it. Each point's status.json says what happened to it; a point is
- new (no folder): it runs;
- finished (its notebook completed with these parameters, its run reached its budget): skipped;
- unfinished (killed mid-run, or its run short of its budget): it runs again in its folder, and a
  notebook that resumes runs (03_es_stepper) continues from the last checkpoint;
- failed (its notebook raised): skipped, and rerun with --retry-failed;
- changed (its folder holds another run's parameters): it runs again in its folder (03_es_stepper
  extends a run whose budget grew and refuses other changes: then use --overwrite);
- running (another batch process is running it now): skipped;
- busy (another process holds it: a batch running the point, or a notebook or sweep with its run
  folder open, see `evolm_lib.runs.WriterLock`): skipped and reported busy, its files untouched.
--overwrite deletes every point's folder first. Before any kernel starts, each point's settings are
checked the way the notebook would check them (its parameters cell and config cell, executed here
without a kernel, then the engine limits of `evolm_lib.preflight`): a bad point fails at once, and
--dry-run lists every point with what would happen to it.

OUT/summary.csv and OUT/summary.json hold one row per grid point with its results (start, final and
best greedy train and eval reward, final eval accuracy, KL, training completions and tokens, wall
time), rewritten after every point.
"""
from __future__ import annotations

import contextlib
import csv
import io
import itertools
import json
import os
import re
import shutil
import socket
import sys
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import yaml

from .paths import project_root

SPEC_KEYS = ("notebook", "parameters", "grid", "name", "kernel", "sweep")  # sweep: read by evolm_lib.sweep only
INJECTED = ("run_dir", "figures_dir")  # filled in by the runner, per run
NOTEBOOK_FILE = "notebook.ipynb"
STATUS_FILE = "status.json"
RUNNING, OK, FAILED, PLANNED = "running", "ok", "failed", "planned"
BUSY = "busy"  # another process holds the point or its run folder: nothing done, nothing written
# what a batch does with a grid point, by the point's state (see the module's doc string)
ACTIONS = {"new": "run", "finished": "skip", "failed": "skip", "unfinished": "resume", "changed": "rerun",
           "running": "skip", "busy": "skip"}


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
    """What happened (or, in a dry run, would happen) to one grid point."""

    name: str
    status: str  # "ok" | "failed" | "running" | "busy" | "planned" (dry run)
    seconds: float
    error: str
    folder: Path
    notebook: Path
    parameters: dict[str, Any]
    action: str = ""
    """What this batch did: run, resume, retry, rerun, overwrite, skip; or "invalid" (failed its checks)."""
    reason: str = ""
    """Why, in words (e.g. "finished 2026-11-26 10:41", "settings changed: sigma")."""
    results: dict[str, Any] = field(default_factory=dict)
    """The run folder's results (`evolm_lib.analysis.run_results`), where the notebook made one."""


@dataclass
class PointPlan:
    """One grid point with its full parameters, folder, state and the action a batch takes."""

    run: RunSpec
    parameters: dict[str, Any]
    folder: Path
    state: str
    action: str
    reason: str = ""
    error: str = ""
    status: dict[str, Any] = field(default_factory=dict)


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


def _parameters_cell_index(notebook) -> int | None:
    return next((i for i, c in enumerate(notebook.cells)
                 if "parameters" in c.get("metadata", {}).get("tags", [])), None)


def notebook_parameters(notebook) -> dict[str, dict[str, Any]]:
    """Parameters declared in the notebook's `parameters` cell: name -> {type, default, help}."""
    from papermill.translators import papermill_translators

    if isinstance(notebook, (str, Path)):
        notebook = read_notebook(notebook)
    index = _parameters_cell_index(notebook)
    if index is None:
        return {}
    kernel = notebook.metadata.get("kernelspec", {}).get("name", "python3")
    language = notebook.metadata.get("kernelspec", {}).get("language", "python")
    translator = papermill_translators.find_translator(kernel, language)
    return {p.name: p._asdict() for p in translator.inspect(notebook.cells[index])}


def config_cell(notebook) -> str | None:
    """The source of the cell that builds the settings from the parameters (the code cell after the
    `parameters` cell, when it assigns `config` or `groups`), or None when the notebook has none."""
    index = _parameters_cell_index(notebook)
    if index is None:
        return None
    following = [c for c in notebook.cells[index + 1:] if c.cell_type == "code"]
    if following and re.search(r"^(config|groups)\s*=", following[0].source, re.MULTILINE):
        return following[0].source
    return None


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

    from .quiet import verbose

    nb = read_notebook(notebook_path, kernel_name)
    output_path = Path(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(
        nb, str(output_path), parameters=dict(parameters or {}), kernel_name=kernel_name,
        progress_bar=False, log_output=log_output, cwd=str(cwd or project_root()),
        execution_timeout=execution_timeout,
        store_widget_state=False,  # a FigureWidget would otherwise add ~5 MB of plotly.js
        # the kernel's own start-up notices (e.g. "running over TCP without encryption") go to the
        # terminal of every batch point: errors only, unless EVOLM_VERBOSE
        extra_arguments=[] if verbose() else ["--IPKernelApp.log_level=ERROR"],
    )
    return output_path


def _error_text(err: BaseException) -> str:
    ename, evalue = getattr(err, "ename", None), getattr(err, "evalue", None)
    if ename:  # PapermillExecutionError: the notebook's own exception
        return f"{ename}: {evalue}"
    return f"{type(err).__name__}: {err}"


# --------------------------------------------------------------------------- checks without a kernel


@contextlib.contextmanager
def _sandbox(cwd: Path) -> Iterator[io.StringIO]:
    """The notebook's working directory, its prints captured, and the environment restored after."""
    previous_cwd, environment = Path.cwd(), dict(os.environ)
    output = io.StringIO()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(output):
            yield output
    finally:
        os.chdir(previous_cwd)
        os.environ.clear()
        os.environ.update(environment)


def validate_point(notebook, parameters: dict[str, Any], cwd: Path | None = None) -> tuple[str, list[str]]:
    """Check one grid point as its kernel would, without starting one: run the notebook's parameters
    cell, the point's parameters, and its config cell here; then the engine limits of the settings it
    built (`evolm_lib.preflight`, when the model folder exists without a build). Returns
    (error text or "", warnings)."""
    source = config_cell(notebook)
    if source is None:
        return "", []
    parameters_source = notebook.cells[_parameters_cell_index(notebook)].source
    namespace: dict[str, Any] = {"__name__": "__evolm_batch_check__"}
    with _sandbox(cwd or project_root()), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            exec(compile(parameters_source, "<parameters cell>", "exec"), namespace)  # noqa: S102 - the user's notebook
            namespace.update(parameters)
            exec(compile(source, "<config cell>", "exec"), namespace)  # noqa: S102
            _check_engine(namespace.get("config"))
        except Exception as err:  # noqa: BLE001 - reported as the point's error, as the kernel would
            return _error_text(err), []
    from .preflight import EngineWarning

    return "", [str(w.message) for w in caught if issubclass(w.category, EngineWarning)]


def _check_engine(config) -> None:
    """Engine limits of a run's settings, when its model is already a local folder (no build or download here)."""
    if config is None or not hasattr(config, "lora_spec"):
        return
    from .models import cached_model_dir
    from .preflight import check_engine_settings

    model_dir = cached_model_dir(config.model)
    if model_dir is not None:
        check_engine_settings(config, model_dir)


# --------------------------------------------------------------------------- point states


def _comparable(parameters: dict[str, Any]) -> dict[str, Any]:
    """Parameters as JSON data, without the injected paths (a moved OUT folder is the same run)."""
    return json.loads(json.dumps({k: v for k, v in parameters.items() if k not in INJECTED}, default=str))


def read_status(folder: Path) -> dict[str, Any]:
    """A grid point's status.json ({} when there is none or it is unreadable)."""
    try:
        return json.loads((Path(folder) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return {}


def write_status(folder: Path, status: dict[str, Any]) -> None:
    """Write status.json atomically (a kill leaves the old one or the new one)."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{STATUS_FILE}.tmp"
    tmp.write_text(json.dumps(status, indent=2, default=str) + "\n")
    os.replace(tmp, folder / STATUS_FILE)


def _alive(status: dict[str, Any]) -> bool:
    """True when the process that wrote a "running" status still runs on this machine."""
    if status.get("host") != socket.gethostname() or not isinstance(status.get("pid"), int):
        return False
    if status["pid"] == os.getpid():
        return False
    try:
        os.kill(status["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run_results(parameters: dict[str, Any]) -> dict[str, Any]:
    if not parameters.get("run_dir"):
        return {}
    from .analysis import run_results

    return run_results(parameters["run_dir"])


def _point_lock(folder: Path) -> Path:
    """The lock a batch holds while it runs a point: beside the point's folder, not in it."""
    return folder.parent / f".{folder.name}.lock"


def _point_holder(folder: Path, parameters: dict[str, Any]) -> dict | None:
    """Who holds the point (a batch running it) or its run folder (a notebook or sweep writing it), or None."""
    from .runs import lock_holder  # runs imports torch: not at the command's start

    holder = lock_holder(folder, lock_file=_point_lock(folder))
    if holder is None and parameters.get("run_dir"):
        holder = lock_holder(parameters["run_dir"])
    return holder


def point_state(folder: Path, parameters: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(state, reason, status) of a grid point's folder; states as in the module's doc string."""
    folder = Path(folder)
    holder = _point_holder(folder, parameters)
    if holder is not None:
        from .runs import describe_holder

        return "busy", f"held by {describe_holder(holder)}", read_status(folder)
    if not folder.exists() or not any(folder.iterdir()):
        return "new", "", {}
    status = read_status(folder)
    if not status:
        return "unfinished", "a folder without status.json (an earlier batch stopped in it)", status
    if status.get("status") == RUNNING:
        if _alive(status):
            return "running", f"running in process {status['pid']} since {status.get('started', '?')}", status
        return "unfinished", f"stopped while running (started {status.get('started', '?')})", status
    before, now = _comparable(status.get("parameters", {})), _comparable(parameters)
    if before != now:
        changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        return "changed", "settings changed: " + ", ".join(
            f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in changed), status
    if status.get("status") == FAILED:
        return "failed", f"failed: {status.get('error', '')}", status
    results = _run_results(parameters)
    generation, budget = results.get("generation"), results.get("budget")
    if isinstance(generation, (int, float)) and isinstance(budget, (int, float)) and generation < budget:
        return "unfinished", f"its run reached generation {generation:g} of {budget:g}", status
    return "finished", f"finished {status.get('finished', '')}".strip(), status


# --------------------------------------------------------------------------- batch


def _json_text_for_str_parameters(parameters: dict[str, Any], declared: dict[str, Any]) -> dict[str, Any]:
    """A mapping or list given for a parameter the notebook declares as `str` becomes JSON text
    (papermill parameters are simple types; `task_options: {num_train: 8}` reads well in YAML)."""
    converted = dict(parameters)
    for name, value in parameters.items():
        if isinstance(value, (dict, list)) and declared.get(name, {}).get("inferred_type_name") == "str":
            converted[name] = json.dumps(value)
    return converted


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
        params = _json_text_for_str_parameters(run.parameters, declared)
        if "run_dir" in declared:
            params["run_dir"] = str(folder / "run")
        if "figures_dir" in declared:
            params["figures_dir"] = str(folder / "figures")
        plan.append((run, params, folder))
    return plan


def plan_points(spec: BatchSpec, out_dir: str | Path, retry_failed: bool = False,
                overwrite: bool = False, validate: bool = True) -> list[PointPlan]:
    """Every grid point with its state and the action a batch takes (checked without a kernel
    when ``validate``: a point that fails its checks gets the action "invalid")."""
    notebook = read_notebook(spec.notebook, spec.kernel)
    points = []
    for run, params, folder in plan_batch(spec, out_dir):
        state, reason, status = point_state(folder, params)
        action = ACTIONS[state]
        if overwrite and state != "new":
            action, reason = "overwrite", f"was {state}"
        elif state == "failed" and retry_failed:
            action = "retry"
        elif state == "failed":
            reason += " (--retry-failed runs it again)"
        points.append(PointPlan(run, params, folder, state, action, reason, "", status))
    if validate:
        for point in points:
            error, notes = validate_point(notebook, point.parameters)
            if error and point.action == "skip":  # a finished run stays as it is; say what the check says now
                notes = [f"its settings fail the checks now: {error}"]
            elif error:
                point.action, point.error = "invalid", error
            point.reason = "; ".join(filter(None, [point.reason, *notes]))
    return points


def _now() -> str:
    return datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")


def _result(point: PointPlan, status: str, seconds: float, error: str, action: str | None = None,
            reason: str | None = None) -> RunResult:
    return RunResult(point.run.name, status, seconds, error, point.folder, point.folder / NOTEBOOK_FILE,
                     point.parameters, action or point.action, reason or point.reason, _run_results(point.parameters))


def _skipped(point: PointPlan) -> RunResult:
    status = {"running": RUNNING, "busy": BUSY}.get(point.state, point.status.get("status", OK))
    return _result(point, status, float(point.status.get("seconds", 0.0)), point.status.get("error", ""))


def run_point(spec: BatchSpec, point: PointPlan, log_output: bool = False) -> RunResult:
    """Run one grid point's notebook in its folder, with status.json before and after; a point that
    another process holds (another batch, or a run open on its run folder) is left untouched: busy."""
    from .runs import RunFolderBusy, WriterLock, describe_holder, lock_holder

    try:
        lock = WriterLock.acquire(point.folder, lock_file=_point_lock(point.folder))
    except RunFolderBusy as busy:
        return _result(point, BUSY, 0.0, "", action="skip", reason=f"held by {describe_holder(busy.holder)}")
    with lock:
        run_dir = point.parameters.get("run_dir")
        holder = lock_holder(run_dir) if run_dir else None  # e.g. the stepper open on it in JupyterLab
        if holder is not None:
            return _result(point, BUSY, 0.0, "", action="skip", reason=f"held by {describe_holder(holder)}")
        return _run_point(spec, point, log_output)


def _run_point(spec: BatchSpec, point: PointPlan, log_output: bool) -> RunResult:
    if point.action == "overwrite" and point.folder.exists():
        shutil.rmtree(point.folder)
    attempts = int(point.status.get("attempts", 0)) + 1
    started = _now()
    base = {"parameters": point.parameters, "notebook": str(spec.notebook), "started": started,
            "attempts": attempts, "action": point.action}
    if point.action == "invalid":  # failed its checks: no kernel
        write_status(point.folder, {**base, "status": FAILED, "seconds": 0.0, "error": point.error,
                                    "finished": started, "before_start": True})
        return _result(point, FAILED, 0.0, point.error)
    write_status(point.folder, {**base, "status": RUNNING, "pid": os.getpid(), "host": socket.gethostname()})
    output = point.folder / NOTEBOOK_FILE
    clock = time.perf_counter()
    try:
        execute_notebook(spec.notebook, output, point.parameters, cwd=project_root(),
                         kernel_name=spec.kernel, log_output=log_output)
        status, error = OK, ""
    except Exception as err:  # noqa: BLE001 - one failed run must not stop the batch
        # a run folder that another process opened after the check above: busy, not failed
        status, error = (BUSY if getattr(err, "ename", "") == "RunFolderBusy" else FAILED), _error_text(err)
    seconds = time.perf_counter() - clock
    write_status(point.folder, {**base, "status": status, "seconds": seconds, "error": error, "finished": _now()})
    return _result(point, status, seconds, error)


def run_batch(spec_or_path: BatchSpec | str | Path, out_dir: str | Path, overwrite: bool = False,
              dry_run: bool = False, log_output: bool = False, retry_failed: bool = False) -> list[RunResult]:
    """Run or continue every grid point (failures are recorded, not raised); writes OUT/summary.{csv,json}.

    A dry run checks every point and returns what would happen, status "planned", running nothing."""
    from tqdm.auto import tqdm

    spec = spec_or_path if isinstance(spec_or_path, BatchSpec) else load_batch_spec(spec_or_path)
    out_dir = Path(out_dir).resolve()
    points = plan_points(spec, out_dir, retry_failed=retry_failed, overwrite=overwrite)
    if dry_run:
        return [RunResult(p.run.name, PLANNED, 0.0, p.error, p.folder, p.folder / NOTEBOOK_FILE, p.parameters,
                          p.action, p.reason, _run_results(p.parameters) if p.action == "skip" else {})
                for p in points]

    out_dir.mkdir(parents=True, exist_ok=True)
    results = {p.run.name: _skipped(p) for p in points if p.action == "skip"}
    work = [p for p in points if p.action != "skip"]
    order = [p.run.name for p in points]
    bar = tqdm(work, desc="batch", unit="run", file=sys.stderr, disable=not work)
    for point in bar:
        bar.set_postfix_str(f"{point.action} {point.run.name}")
        result = run_point(spec, point, log_output)
        results[point.run.name] = result
        if result.status == FAILED:
            bar.write(f"[failed] {point.run.name}: {result.error}", file=sys.stderr)
        write_summary([results[n] for n in order if n in results], out_dir, spec)
    bar.close()
    ordered = [results[n] for n in order]
    write_summary(ordered, out_dir, spec)
    return ordered


def stale_folders(spec: BatchSpec, out_dir: str | Path) -> list[Path]:
    """Point folders in OUT that the batch's grid no longer has (e.g. a grid value since corrected)."""
    out_dir = Path(out_dir)
    current = {run.name for run in expand_runs(spec)}
    prefix = _slug(spec.name)
    if not out_dir.is_dir():
        return []
    return sorted(p for p in out_dir.iterdir() if p.is_dir() and (p / STATUS_FILE).exists()
                  and p.name not in current and (p.name == prefix or p.name.startswith(prefix + "__")))


# --------------------------------------------------------------------------- summaries


def _result_columns() -> tuple[str, ...]:
    from .analysis import RUN_RESULT_COLUMNS

    return RUN_RESULT_COLUMNS


def write_summary(results: list[RunResult], out_dir: Path, spec: BatchSpec | None = None) -> None:
    """Write OUT/summary.csv (one row per grid point: status, grid values, results) and OUT/summary.json."""
    grid_keys = list(spec.grid) if spec else []
    columns = _result_columns()
    with open(out_dir / "summary.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "status", "action", "seconds", "error", *grid_keys, *columns, "notebook"])
        for r in results:
            writer.writerow([r.name, r.status, r.action, f"{r.seconds:.2f}", r.error,
                             *(r.parameters.get(k) for k in grid_keys),
                             *("" if r.results.get(c) is None else r.results[c] for c in columns),
                             str(r.notebook)])
    payload = {
        "notebook": str(spec.notebook) if spec else None,
        "written": _now(),
        "runs": [{"name": r.name, "status": r.status, "action": r.action, "reason": r.reason,
                  "seconds": r.seconds, "error": r.error, "folder": str(r.folder), "notebook": str(r.notebook),
                  "parameters": r.parameters, "results": r.results} for r in results],
    }
    tmp = out_dir / ".summary.json.tmp"
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, out_dir / "summary.json")


def _number(value: Any, digits: int = 4) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, (int, float)) and float(value).is_integer() and abs(value) >= 1:
        return f"{int(value):,}"
    return f"{value:.{digits}g}" if isinstance(value, (int, float)) else str(value)


def _reward_cell(results: dict[str, Any], name: str) -> str:
    start, final, best = (results.get(f"{name}_{k}") for k in ("start", "final", "best"))
    if final is None:
        return ""
    text = f"{_number(start)} -> {_number(final)}" if start is not None else _number(final)
    return text + (f" ({_number(best)})" if best is not None and best != final else "")


def format_summary(results: list[RunResult], error_width: int = 80) -> str:
    """A one-screen table: run, status, action, minutes, then its results (train and eval reward:
    start -> final (best), eval accuracy, KL, training completions), or its error."""
    header = ("run", "status", "action", "min", "train reward", "eval reward", "acc", "KL", "completions")
    rows = [header]
    errors = []
    for r in results:
        res = r.results
        rows.append((r.name, r.status, r.action, f"{r.seconds / 60:.1f}", _reward_cell(res, "train_reward"),
                     _reward_cell(res, "eval_reward"), _number(res.get("eval_accuracy_final"), 2),
                     _number(res.get("kl_final"), 2), _number(res.get("completions"))))
        error = " ".join(r.error.split())
        errors.append(error if len(error) <= error_width else error[: error_width - 1] + "…")
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for row, error in zip(rows, [""] + errors):
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].ljust(widths[2]), row[3].rjust(widths[3])]
        if error:  # a failed point: its error instead of its (empty) results
            lines.append("  ".join(cells + [error]).rstrip())
        else:
            cells += [row[i].rjust(widths[i]) for i in range(4, len(header))]
            lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def format_plan(results: list[RunResult]) -> str:
    """What a dry run found, one line per point: action, name, why, and the check's error."""
    width = max((len(r.name) for r in results), default=0)
    lines = []
    for r in results:
        detail = r.error or r.reason
        lines.append(f"  {r.action:<9} {r.name:<{width}}  {detail}".rstrip())
    return "\n".join(lines)
