"""Batch runs of a notebook with papermill: one YAML file, a parameter grid, one folder per grid point,
and batches that continue where they stopped.

    evolm batch PARAMS.yaml [--out DIR] [--notebook PATH] [--dry-run] [--retry-failed] [--overwrite [POINT]]

PARAMS.yaml:

    notebook: notebooks/03_es_stepper.py   # relative to the YAML file or to the repository root
    name: sigma-sweep                      # optional run-name prefix (default: the notebook's name)
    kernel: python3                        # optional
    parameters: {num_generations: 20, settings: {optimizer: adam}}   # base parameters
    grid: {seed: [0, 1, 2], sigma: [0.01, 0.05]}   # optional; cartesian product

Each grid point gets OUT/<name>__seed-0__sigma-0.05/ with notebook.ipynb, status.json and, when the
notebook declares them in its `parameters` cell, `run_dir` (= that folder/run) and `figures_dir`
(= that folder/figures). A mapping or list given for a `str` parameter (e.g. `task_options`) is
passed as JSON text; a `dict` parameter (the stepper's `settings`, which reaches every ESConfig
setting) gets the mapping itself.

Rerunning a batch continues it. Each point's status.json says what happened to it; a point is
- new (no folder): it runs;
- finished (its notebook completed with these settings, its run reached its budget): skipped;
- unfinished (killed mid-run, or its run short of its budget, e.g. num_generations raised): it runs
  again in its folder, and a notebook that resumes runs (03_es_stepper) continues from the last checkpoint;
- failed (its notebook raised): skipped, and rerun with --retry-failed;
- changed (its folder holds a finished point, or a run, made with other settings): left as it is
  (action "conflict"); the batch lists what changed, old and new values as the run folder has them,
  and the fix: --out another folder to run the new settings there, or --overwrite POINT to replace
  that point alone (--overwrite alone replaces every point);
- changed-failed (a failed or unfinished point whose settings changed, its folder holding no run made
  with other settings): it runs again in its folder;
- running (another batch process is running it now): skipped;
- busy (another process holds it: a batch running the point, or a notebook or sweep with its run
  folder open, see `evolm_lib.runs.WriterLock`): skipped and reported busy, its files untouched.
Settings are compared as the run has them: for a notebook whose parameters cell is tagged
`settings:es` (or `settings:grpo`), the run folder's config.yaml against the point's resolved settings
(a change of budget or cadence, `evolm_lib.runs.EXTENDABLE`, extends the run instead); otherwise the
parameters in status.json, the notebook's declared defaults filling what a spec left out. The dry run
and the real run use this one comparison, so they say the same thing.

A failed attempt never replaces a finished point: a point that is extended or overwritten keeps its
notebook.ipynb, run folder, status and summary row until the attempt succeeds; a failed extension
leaves its notebook beside it as notebook.failed-<time>.ipynb, a failed overwrite its whole folder
as OUT/<point>.failed-<time>/ (both listed in status.json under `failed_attempts`). While an overwrite
runs, the point it replaces waits in OUT/.<point>.kept-<time>/ (left there if the batch is killed).

Before any kernel starts, each point is checked without running notebook code: its parameters against
the notebook's declared names and types (papermill's own inspection of the `parameters` cell), then,
for a notebook tagged `settings:<kind>`, its settings through the config class exactly as the
notebook's config cell builds them (`evolm_lib.parameters.notebook_config`), then the engine limits of
`evolm_lib.preflight`. A bad point fails at once, and --dry-run lists every point with what would
happen to it.

OUT/summary.csv (and summary.json, with every parameter and result) holds one row per grid point,
rewritten after every point; a point the batch left as it was keeps its row. Columns (a result
column that no point has is left out):
- run: the point's folder name under OUT;
- status: ok, failed (its notebook raised, or its settings failed the checks) or running;
- wall_s: seconds its notebook ran (kernel and engine start included), for the attempt that made this
  row (a point resumed after a kill: its last attempt), to 0.1 s;
- error: the notebook's exception, for a failed point;
- one column per parameter the spec sets (grid and parameters; a mapping such as `settings` gives
  one column per key, e.g. settings.optimizer), with the value the point's run has (a spec that left
  one out: the notebook's default);
- kind (es or grpo), budget (generations or steps asked), generation (the last one logged);
- train_reward_start, train_reward_final, train_reward_best: the greedy reward of the current adapter
  on the train prompts at generation 0, at the end and at its best, in the task's reward unit (e.g.
  conciseness: -|length difference| in characters); eval_reward_*: the same on the held-out prompts;
- eval_accuracy_final: share (0 to 1) of the final greedy eval completions at or above the task's
  success threshold (tasks with one, e.g. countdown);
- kl_final: KL(adapter || base) in nats per token, where the run measured it (`evolm sweep` does);
- completions, tokens: training completions and generated tokens used;
- notebook: the executed notebook.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import csv
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
from typing import Any, Collection

import yaml

from .config import ConfigError, config_class, did_you_mean
from .parameters import SETTINGS, kind_of_tags, notebook_config
from .paths import project_root

SPEC_KEYS = ("notebook", "parameters", "grid", "name", "kernel", "sweep")  # sweep: read by evolm_lib.sweep only
INJECTED = ("run_dir", "figures_dir")  # filled in by the runner, per run
NOTEBOOK_FILE = "notebook.ipynb"
STATUS_FILE = "status.json"
KERNEL_START_ATTEMPTS = 2  # a notebook's kernel that dies before answering is started once more
KERNEL_DIED_AT_START = "Kernel died before replying to kernel_info"  # jupyter_client's words for it
RUNNING, OK, FAILED, PLANNED = "running", "ok", "failed", "planned"
BUSY = "busy"  # another process holds the point or its run folder: nothing done, nothing written
# what a batch does with a grid point, by the point's state (see the module's doc string)
ACTIONS = {"new": "run", "finished": "skip", "failed": "skip", "unfinished": "resume", "changed": "conflict",
           "changed-failed": "rerun", "running": "skip", "busy": "skip"}
NOT_RUN = ("skip", "conflict")  # actions that leave a point's folder as it is
# papermill's inferred type names -> the Python types a value given for them may have
TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,), "dict": (dict,), "list": (list,)}


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


@dataclass(frozen=True)
class NotebookInfo:
    """What a batch knows of its notebook without running it: papermill's view of its parameters cell."""

    declared: dict[str, dict[str, Any]]
    """Declared parameters: name -> {name, inferred_type_name, default (source text), help}."""
    defaults: dict[str, Any]
    """Declared defaults that are literals (every one in the project's notebooks), as values."""
    kind: str | None
    """The run kind its parameters configure (its `settings:<kind>` tag), or None."""


@dataclass(frozen=True)
class Change:
    """One setting that differs between a point's folder and its new settings."""

    name: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.name} {self.old!r} -> {self.new!r}"


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
    """What this batch did: run, resume, retry, rerun, overwrite, skip, conflict; or "invalid" (failed its checks)."""
    reason: str = ""
    """Why, in words (e.g. "finished 2026-11-26 10:41", "settings changed: sigma 0.05 -> 0.1; ...")."""
    results: dict[str, Any] = field(default_factory=dict)
    """The run folder's results (`evolm_lib.analysis.run_results`), where the notebook made one."""
    attempt_error: str = ""
    """The error of this batch's attempt on a finished point that it kept (the row is the kept point's)."""


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
    config: Any = None
    """The point's resolved settings (notebooks tagged `settings:<kind>`), as its kernel will build them."""


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
        hints = "".join(did_you_mean(k, SPEC_KEYS) for k in unknown)
        raise ValueError(f"unknown top-level key(s) {unknown}{where}{hints}; allowed: {list(SPEC_KEYS)}")
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


def read_yaml_file(path: str | Path) -> Any:
    """A YAML file's content; a syntax error becomes a ValueError naming the file and the line."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{path}{where}: not valid YAML: {getattr(error, 'problem', None) or error}") from None


def load_batch_spec(path: str | Path) -> BatchSpec:
    """Read and validate a batch YAML file."""
    path = Path(path).resolve()
    return spec_from_dict(read_yaml_file(path), source=path)


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


def _parameters_cell(notebook):
    return next((c for c in notebook.cells if "parameters" in c.get("metadata", {}).get("tags", [])), None)


def notebook_parameters(notebook) -> dict[str, dict[str, Any]]:
    """Parameters declared in the notebook's `parameters` cell: name -> {type, default, help}
    (papermill's own inspection, as `papermill --help-notebook` shows them)."""
    from papermill.translators import papermill_translators

    if isinstance(notebook, (str, Path)):
        notebook = read_notebook(notebook)
    cell = _parameters_cell(notebook)
    if cell is None:
        return {}
    kernel = notebook.metadata.get("kernelspec", {}).get("name", "python3")
    language = notebook.metadata.get("kernelspec", {}).get("language", "python")
    translator = papermill_translators.find_translator(kernel, language)
    return {p.name: p._asdict() for p in translator.inspect(cell)}


def notebook_info(notebook) -> NotebookInfo:
    """The declared parameters, their literal defaults and the settings kind of a notebook."""
    if isinstance(notebook, (str, Path)):
        notebook = read_notebook(notebook)
    declared = notebook_parameters(notebook)
    defaults = {}
    for name, info in declared.items():
        with contextlib.suppress(ValueError, SyntaxError, TypeError):  # not a literal: the check goes without it
            defaults[name] = ast.literal_eval(info["default"])
    cell = _parameters_cell(notebook)
    kind = kind_of_tags(cell.metadata.get("tags", [])) if cell is not None else None
    return NotebookInfo(declared, defaults, kind)


def check_parameters(parameters: dict[str, Any], declared: dict[str, Any], notebook: Path,
                     kind: str | None = None) -> None:
    """Fail with the declared names (and the nearest one) when a parameter is not declared by the notebook."""
    undeclared = [k for k in parameters if k not in declared]
    if not undeclared:
        return
    listing = ", ".join(declared) or "(none: no cell tagged `parameters`)"
    hints = "".join(did_you_mean(k, list(declared)) for k in undeclared)
    fields = config_class(kind).model_fields if kind else {}
    settings = [k for k in undeclared if k in fields]
    if settings and SETTINGS in declared:
        example = ", ".join(f"{k}: {parameters[k]!r}" for k in settings)
        hints += f"; {', '.join(settings)} {'is a setting' if len(settings) == 1 else 'are settings'} of " \
                 f"{config_class(kind).__name__}: give {'it' if len(settings) == 1 else 'them'} under " \
                 f"`{SETTINGS}` ({SETTINGS}: {{{example}}})"
    raise ValueError(f"parameter(s) {undeclared} not declared in the parameters cell of "
                     f"{notebook}{hints}; declared: {listing}")


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
    for attempt in range(1, KERNEL_START_ATTEMPTS + 1):
        try:
            papermill.execute_notebook(
                copy.deepcopy(nb), str(output_path), parameters=dict(parameters or {}), kernel_name=kernel_name,
                progress_bar=False, log_output=log_output, cwd=str(cwd or project_root()),
                execution_timeout=execution_timeout,
                store_widget_state=False,  # a FigureWidget would otherwise add ~5 MB of plotly.js
                # the kernel's own start-up notices (e.g. "running over TCP without encryption") go to the
                # terminal of every batch point: errors only, unless EVOLM_VERBOSE
                extra_arguments=[] if verbose() else ["--IPKernelApp.log_level=ERROR"],
            )
            return output_path
        except RuntimeError as error:
            # A kernel that died before it answered ran no cell (e.g. its port was taken by another
            # process between jupyter_client choosing it and the kernel binding it): start another.
            if KERNEL_DIED_AT_START not in str(error) or attempt == KERNEL_START_ATTEMPTS:
                raise
            warnings.warn(f"{notebook_path}: the kernel died before it answered ({error}); starting another",
                          RuntimeWarning, stacklevel=2)
    return output_path


def _error_text(err: BaseException) -> str:
    ename, evalue = getattr(err, "ename", None), getattr(err, "evalue", None)
    if ename:  # PapermillExecutionError: the notebook's own exception
        return f"{ename}: {evalue}"
    return f"{type(err).__name__}: {err}"


# --------------------------------------------------------------------------- checks without a kernel


def check_types(parameters: dict[str, Any], declared: dict[str, dict[str, Any]]) -> list[str]:
    """Parameters whose values do not have their declared type (None is always allowed: YAML's null)."""
    wrong = []
    for name, value in parameters.items():
        type_name = declared.get(name, {}).get("inferred_type_name")
        allowed = TYPES.get(type_name)
        if allowed is None or value is None:
            continue
        if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
            wrong.append(f"{name}: expected {type_name} (declared `{name}: {type_name}`), got {value!r}")
    return wrong


def check_point(info: NotebookInfo, parameters: dict[str, Any], cwd: Path | None = None) -> tuple[Any, str, list[str]]:
    """Check one grid point as its kernel will see it, running no notebook code: its parameters against
    their declared types, then (a notebook tagged `settings:<kind>`) the settings its config cell builds
    from them (`evolm_lib.parameters.notebook_config` over the declared defaults and the point's values),
    then the engine limits of those settings (`evolm_lib.preflight`, when the model folder exists
    without a build). Returns (settings or None, error text or "", warnings)."""
    wrong = check_types(parameters, info.declared)
    if wrong:
        return None, "TypeError: " + "; ".join(wrong), []
    if info.kind is None:
        return None, "", []
    from .preflight import EngineWarning

    values = {**info.defaults, **parameters}
    # relative paths (a JSONL task's file) are read from the kernel's working directory
    with contextlib.chdir(cwd or project_root()), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            config = notebook_config(config_class(info.kind), values)
            _check_engine(config)
        except Exception as err:  # noqa: BLE001 - reported as the point's error, as the kernel would raise it
            return None, _error_text(err), []
    return config, "", [str(w.message) for w in caught if issubclass(w.category, EngineWarning)]


def _check_engine(config) -> None:
    """Engine limits of a run's settings, when its model is already a local folder (no build or download here)."""
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


def _run_settings(run_dir: Any, config) -> dict[str, Any] | None:
    """The settings of the run in ``run_dir`` as its config.yaml has them (defaults of settings added
    since filled in), or None when the folder holds no run (no config.yaml or no finished generation)."""
    from .runs import list_checkpoints, load_run_config, read_metrics

    run_dir = Path(run_dir) if run_dir else None
    if run_dir is None or not (run_dir / "config.yaml").is_file():
        return None
    if not read_metrics(run_dir) and not list_checkpoints(run_dir):
        return None  # a creation that stopped before its first generation: nothing to keep
    try:
        return load_run_config(run_dir, type(config)).to_dict()
    except (ConfigError, ValueError, TypeError):  # another kind, or settings this version no longer has
        data = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        return {k: v for k, v in data.items() if k not in ("kind", "label")}


def settings_changes(folder: Path, parameters: dict[str, Any], config=None, defaults: dict[str, Any] | None = None,
                     status: dict[str, Any] | None = None) -> tuple[list[Change], bool, bool]:
    """The one comparison of a point's folder with its new settings, for the dry run and the real run.

    With ``config`` (the point's resolved settings) and a run in its run folder: the run's config.yaml
    against ``config``, setting by setting; a change of budget or cadence (`evolm_lib.runs.EXTENDABLE`)
    extends the run. Otherwise the parameters in status.json against ``parameters``, the notebook's
    ``defaults`` filling what either left out. Returns (changes, whether they keep the run from
    continuing, whether they were read from a run folder)."""
    from .runs import EXTENDABLE

    defaults = defaults or {}
    old_settings = _run_settings(parameters.get("run_dir"), config) if config is not None else None
    if old_settings is not None:
        new = config.to_dict()
        changes = [Change(k, old_settings.get(k), v) for k, v in new.items() if old_settings.get(k) != v]
        return changes, any(c.name not in EXTENDABLE for c in changes), True
    status = read_status(folder) if status is None else status
    before = _comparable({**defaults, **status.get("parameters", {})})
    now = _comparable({**defaults, **parameters})
    changes = [Change(k, before.get(k), now.get(k)) for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
    return changes, bool(changes), False


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


def point_state(folder: Path, parameters: dict[str, Any], config=None,
                defaults: dict[str, Any] | None = None) -> tuple[str, str, dict[str, Any]]:
    """(state, reason, status) of a grid point's folder; states as in the module's doc string.
    ``config`` and ``defaults`` (see :func:`settings_changes`) make the comparison of settings exact."""
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
    changes, blocking, from_run = settings_changes(folder, parameters, config, defaults, status)
    listed = ", ".join(map(str, changes))
    if blocking:
        said = "settings changed (as its run has them)" if from_run else "settings changed"
        if from_run or status.get("status") == OK:
            return "changed", f"{said}: {listed}", status
        return "changed-failed", f"{said} since it failed: {listed}", status
    if changes:  # budget or cadence only: the run continues under the new ones
        return "unfinished", f"settings changed that its run can follow: {listed}", status
    if status.get("status") == FAILED:
        return "failed", f"failed: {status.get('error', '')}", status
    results = _run_results(parameters)
    generation, budget = results.get("generation"), results.get("budget")
    if isinstance(generation, (int, float)) and isinstance(budget, (int, float)) and generation < budget:
        return "unfinished", f"its run reached generation {generation:g} of {budget:g}", status
    return "finished", f"finished {status.get('finished', '')}".strip(), status


def conflict_fix(name: str) -> str:
    """How to run a point's new settings when its folder holds another finished point or run."""
    return (f"kept as it is: `--overwrite {name}` replaces this point alone, "
            "or `--out` another folder runs the new settings there")


# --------------------------------------------------------------------------- batch


def _json_text_for_str_parameters(parameters: dict[str, Any], declared: dict[str, Any]) -> dict[str, Any]:
    """A mapping or list given for a parameter the notebook declares as `str` becomes JSON text
    (papermill parameters are simple types; `task_options: {num_train: 8}` reads well in YAML)."""
    converted = dict(parameters)
    for name, value in parameters.items():
        if isinstance(value, (dict, list)) and declared.get(name, {}).get("inferred_type_name") == "str":
            converted[name] = json.dumps(value)
    return converted


def plan_batch(spec: BatchSpec, out_dir: str | Path,
               info: NotebookInfo | None = None) -> list[tuple[RunSpec, dict[str, Any], Path]]:
    """Runs with their full parameters (paths injected where declared) and folders; checks names."""
    info = info or notebook_info(read_notebook(spec.notebook, spec.kernel))
    declared = info.declared
    set_by_runner = [k for k in INJECTED if k in spec.parameters or k in spec.grid]
    if set_by_runner:
        raise ValueError(f"{set_by_runner} are set per run by the batch runner; "
                         "remove them from the batch file")
    check_parameters({**spec.parameters, **spec.grid}, declared, spec.notebook, info.kind)
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


def _overwritten(overwrite: bool | Collection[str], names: list[str]) -> set[str]:
    """The points to overwrite: all (True), none (False), or those named (each must be a point)."""
    if isinstance(overwrite, bool):
        return set(names) if overwrite else set()
    unknown = [n for n in overwrite if n not in names]
    if unknown:
        hints = "".join(did_you_mean(n, names) for n in unknown)
        raise ValueError(f"--overwrite names no point of this batch: {unknown}{hints}; points: {', '.join(names)}")
    return set(overwrite)


def plan_points(spec: BatchSpec, out_dir: str | Path, retry_failed: bool = False,
                overwrite: bool | Collection[str] = False, validate: bool = True) -> list[PointPlan]:
    """Every grid point with its state and the action a batch takes (checked without a kernel
    when ``validate``: a point that fails its checks gets the action "invalid"). ``overwrite``:
    True for every point, or the names of the points to replace."""
    info = notebook_info(read_notebook(spec.notebook, spec.kernel))
    planned = plan_batch(spec, out_dir, info)
    replace = _overwritten(overwrite, [run.name for run, _, _ in planned])
    points = []
    for run, params, folder in planned:
        config, error, notes = check_point(info, params) if validate else (None, "", [])
        state, reason, status = point_state(folder, params, config, info.defaults)
        action = ACTIONS[state]
        if run.name in replace and state not in ("new", "running"):
            action, reason = "overwrite", f"was {state}" + (f": {reason}" if state == "changed" else "")
        elif state == "failed" and retry_failed:
            action = "retry"
        elif state == "failed":
            reason += " (--retry-failed runs it again)"
        elif state == "changed":
            reason += f"; {conflict_fix(run.name)}"
        if error and action == "skip":  # a finished run stays as it is; say what the check says now
            notes = [f"its settings fail the checks now: {error}"]
        elif error:
            action = "invalid"
        points.append(PointPlan(run, params, folder, state, action, "; ".join(filter(None, [reason, *notes])),
                                error if action == "invalid" else "", status, config))
    return points


def _now() -> str:
    return datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")


def _stamp() -> str:
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def _result(point: PointPlan, status: str, seconds: float, error: str, action: str | None = None,
            reason: str | None = None) -> RunResult:
    return RunResult(point.run.name, status, seconds, error, point.folder, point.folder / NOTEBOOK_FILE,
                     point.parameters, action or point.action, reason or point.reason, _run_results(point.parameters))


def _kept(point: PointPlan, record: dict[str, Any], attempt_error: str = "") -> RunResult:
    """The row of a point left as its folder has it: its status, time, error and parameters as recorded."""
    status = {"running": RUNNING, "busy": BUSY}.get(point.state, record.get("status", OK))
    parameters = {**record.get("parameters", {}), **{k: point.parameters[k] for k in INJECTED if k in point.parameters}}
    return RunResult(point.run.name, status, float(record.get("seconds", 0.0)), record.get("error", ""),
                     point.folder, point.folder / NOTEBOOK_FILE, parameters or point.parameters, point.action,
                     point.reason, _run_results(point.parameters), attempt_error)


def _execute_point(spec: BatchSpec, point: PointPlan, output: Path, base: dict[str, Any],
                   log_output: bool) -> tuple[str, float, str]:
    """(status, seconds, error) of one execution of the point's notebook into ``output``, with
    status.json saying "running" while it runs."""
    write_status(point.folder, {**base, "status": RUNNING, "pid": os.getpid(), "host": socket.gethostname()})
    clock = time.perf_counter()
    try:
        execute_notebook(spec.notebook, output, point.parameters, cwd=project_root(),
                         kernel_name=spec.kernel, log_output=log_output)
        status, error = OK, ""
    except Exception as err:  # noqa: BLE001 - one failed run must not stop the batch
        # a run folder that another process opened after the check in run_point: busy, not failed
        status, error = (BUSY if getattr(err, "ename", "") == "RunFolderBusy" else FAILED), _error_text(err)
    return status, time.perf_counter() - clock, error


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
    """One attempt at a point under its lock. A finished point (status ok) is kept until the attempt
    succeeds: see the module's doc string."""
    # the finished point this attempt must not lose (also when an earlier attempt on it was killed)
    kept = dict(point.status) if point.status.get("status") == OK else point.status.get("kept")
    attempts = int(point.status.get("attempts", 0)) + 1
    started = _now()
    base = {"parameters": point.parameters, "notebook": str(spec.notebook), "started": started,
            "attempts": attempts, "action": point.action}
    if kept is not None and point.action != "overwrite":  # an attempt in the finished point's own folder
        base["kept"] = kept
    if point.action == "invalid":  # failed its checks: no kernel
        if kept is not None:  # a finished point stays as it is; this attempt's error is reported beside it
            return _kept(point, kept, point.error)
        write_status(point.folder, {**base, "status": FAILED, "seconds": 0.0, "error": point.error,
                                    "finished": started, "before_start": True})
        return _result(point, FAILED, 0.0, point.error)
    aside = None
    if point.action == "overwrite" and point.folder.exists():
        if kept is not None:  # moved aside, back if the new attempt fails
            aside = point.folder.with_name(f".{point.folder.name}.kept-{_stamp()}")
            point.folder.rename(aside)
        else:
            shutil.rmtree(point.folder)
    output = point.folder / (NOTEBOOK_FILE if kept is None or aside is not None else "notebook.attempt.ipynb")
    status, seconds, error = _execute_point(spec, point, output, base, log_output)
    if status == BUSY and kept is not None and aside is None:  # another writer came first: nothing lost, nothing kept
        if output.exists():
            output.unlink()
        write_status(point.folder, kept)
        return _result(point, BUSY, 0.0, "", action="skip", reason=f"its run folder is held: {error}")
    if status == OK or kept is None:
        if output.name != NOTEBOOK_FILE:
            os.replace(output, point.folder / NOTEBOOK_FILE)
        base.pop("kept", None)
        write_status(point.folder, {**base, "status": status, "seconds": seconds, "error": error, "finished": _now()})
        if aside is not None:
            shutil.rmtree(aside)
        return _result(point, status, seconds, error)
    # the attempt failed on a finished point: keep the point, and the attempt beside it
    if aside is not None:
        attempt = point.folder.with_name(f"{point.folder.name}.failed-{_stamp()}")
        write_status(point.folder, {**base, "status": FAILED, "seconds": seconds, "error": error, "finished": _now()})
        point.folder.rename(attempt)
        aside.rename(point.folder)
    else:
        attempt = point.folder / f"notebook.failed-{_stamp()}.ipynb"
        os.replace(output, attempt)
    kept["failed_attempts"] = [*kept.get("failed_attempts", []),
                               {"started": started, "action": point.action, "error": error, "kept_at": str(attempt)}]
    write_status(point.folder, kept)
    return _kept(point, kept, f"{error} (this attempt: {attempt})")


def run_batch(spec_or_path: BatchSpec | str | Path, out_dir: str | Path, overwrite: bool | Collection[str] = False,
              dry_run: bool = False, log_output: bool = False, retry_failed: bool = False) -> list[RunResult]:
    """Run or continue every grid point (failures are recorded, not raised); writes OUT/summary.{csv,json}.
    ``overwrite``: True replaces every point, a collection of point names those points alone.

    A dry run checks every point and returns what would happen, status "planned", running nothing."""
    from tqdm.auto import tqdm

    spec = spec_or_path if isinstance(spec_or_path, BatchSpec) else load_batch_spec(spec_or_path)
    out_dir = Path(out_dir).resolve()
    points = plan_points(spec, out_dir, retry_failed=retry_failed, overwrite=overwrite)
    if dry_run:
        return [RunResult(p.run.name, PLANNED, 0.0, p.error, p.folder, p.folder / NOTEBOOK_FILE, p.parameters,
                          p.action, p.reason, _run_results(p.parameters) if p.action in NOT_RUN else {})
                for p in points]

    out_dir.mkdir(parents=True, exist_ok=True)
    defaults = notebook_info(read_notebook(spec.notebook, spec.kernel)).defaults
    results = {p.run.name: _kept(p, p.status) for p in points if p.action in NOT_RUN}
    work = [p for p in points if p.action not in NOT_RUN]
    order = [p.run.name for p in points]
    bar = tqdm(work, desc="batch", unit="run", file=sys.stderr, disable=not work)
    for point in bar:
        bar.set_postfix_str(f"{point.action} {point.run.name}")
        result = run_point(spec, point, log_output)
        results[point.run.name] = result
        if result.status == FAILED or result.attempt_error:
            bar.write(f"[failed] {point.run.name}: {result.error or result.attempt_error}", file=sys.stderr)
        write_summary([results[n] for n in order if n in results], out_dir, spec, defaults)
    bar.close()
    ordered = [results[n] for n in order]
    write_summary(ordered, out_dir, spec, defaults)
    return ordered


def stale_folders(spec: BatchSpec, out_dir: str | Path) -> list[Path]:
    """Point folders in OUT that the batch's grid no longer has (e.g. a grid value since corrected);
    failed attempts kept beside a point (<point>.failed-<time>) are not counted."""
    out_dir = Path(out_dir)
    current = {run.name for run in expand_runs(spec)}
    prefix = _slug(spec.name)
    if not out_dir.is_dir():
        return []
    return sorted(p for p in out_dir.iterdir() if p.is_dir() and (p / STATUS_FILE).exists()
                  and p.name not in current and ".failed-" not in p.name
                  and (p.name == prefix or p.name.startswith(prefix + "__")))


# --------------------------------------------------------------------------- summaries


def _setting_columns(results: list[RunResult], spec: BatchSpec | None,
                     defaults: dict[str, Any]) -> list[tuple[str, str | None]]:
    """(parameter, key) of every settings column: the spec's grid then its other parameters; a mapping
    parameter gives one column per key it has in any row (key None: the parameter itself)."""
    names = [*spec.grid, *(k for k in spec.parameters if k not in spec.grid)] if spec else []
    columns: list[tuple[str, str | None]] = []
    for name in (n for n in names if n not in INJECTED):
        values = [r.parameters.get(name, defaults.get(name)) for r in results]
        if any(isinstance(v, dict) for v in values):
            keys = dict.fromkeys(k for v in values if isinstance(v, dict) for k in v)
            columns += [(name, key) for key in keys]
        else:
            columns.append((name, None))
    return columns


def _setting_value(result: RunResult, name: str, key: str | None, defaults: dict[str, Any]) -> Any:
    value = result.parameters.get(name, defaults.get(name))
    if key is not None:
        value = value.get(key) if isinstance(value, dict) else None
    return json.dumps(value) if isinstance(value, (dict, list)) else value


def summary_rows(results: list[RunResult], spec: BatchSpec | None = None,
                 defaults: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The rows of summary.csv (columns in the module's doc string), a result column no row has left out."""
    defaults = defaults or {}
    settings = _setting_columns(results, spec, defaults)
    result_columns = [c for c in _result_columns() if any(r.results.get(c) is not None for r in results)]
    rows = []
    for r in results:
        row = {"run": r.name, "status": r.status, "wall_s": round(r.seconds, 1), "error": r.error}
        row.update({name if key is None else f"{name}.{key}": _setting_value(r, name, key, defaults)
                    for name, key in settings})
        row.update({c: r.results.get(c) for c in result_columns})
        row["notebook"] = str(r.notebook)
        rows.append(row)
    return rows


def _result_columns() -> tuple[str, ...]:
    from .analysis import RUN_RESULT_COLUMNS

    # the run's own wall time is left to summary.json: the one wall-time column is the notebook's wall_s
    return tuple(c for c in RUN_RESULT_COLUMNS if c != "wall_s")


def write_summary(results: list[RunResult], out_dir: Path, spec: BatchSpec | None = None,
                  defaults: dict[str, Any] | None = None) -> None:
    """Write OUT/summary.csv (one row per grid point: status, wall time, settings, results; see the
    module's doc string) and OUT/summary.json (every parameter and result, and what this batch did)."""
    rows = summary_rows(results, spec, defaults)
    header = list(rows[0]) if rows else ["run", "status", "wall_s", "error", "notebook"]
    with open(out_dir / "summary.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    payload = {
        "notebook": str(spec.notebook) if spec else None,
        "written": _now(),
        "runs": [{"name": r.name, "status": r.status, "action": r.action, "reason": r.reason,
                  "wall_s": r.seconds, "error": r.error, "attempt_error": r.attempt_error, "folder": str(r.folder),
                  "notebook": str(r.notebook), "parameters": r.parameters, "results": r.results} for r in results],
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


# the console table's result columns: (header, cell of a row's results); a column empty for every row is left out
RESULT_CELLS = (
    ("train reward: start -> end (best)", lambda res: _reward_cell(res, "train_reward")),
    ("eval reward: start -> end (best)", lambda res: _reward_cell(res, "eval_reward")),
    ("eval accuracy", lambda res: _number(res.get("eval_accuracy_final"), 2)),
    ("KL to base (nats/token)", lambda res: _number(res.get("kl_final"), 2)),
    ("completions", lambda res: _number(res.get("completions"))),
)


def format_summary(results: list[RunResult], error_width: int = 80) -> str:
    """A one-screen table with labelled columns: run, status, action, wall time in minutes, then its
    results (greedy train and eval reward: start -> end (best), eval accuracy, KL, training
    completions), or its error; a column empty for every point is left out."""
    cells = [[fn(r.results) for _, fn in RESULT_CELLS] for r in results]
    shown = [i for i in range(len(RESULT_CELLS)) if any(row[i] for row in cells)]
    header = ("run", "status", "action", "wall min", *(RESULT_CELLS[i][0] for i in shown))
    rows = [header]
    errors = []
    for r, row in zip(results, cells):
        rows.append((r.name, r.status, r.action, f"{r.seconds / 60:.1f}", *(row[i] for i in shown)))
        error = " ".join(r.error.split()) or (f"kept; its attempt failed: {' '.join(r.attempt_error.split())}"
                                              if r.attempt_error else "")
        errors.append(error if len(error) <= error_width else error[: error_width - 1] + "…")
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for row, error in zip(rows, [""] + errors):
        line = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].ljust(widths[2]), row[3].rjust(widths[3])]
        if error:  # a failed point: its error instead of its (empty) results
            lines.append("  ".join(line + [error]).rstrip())
        else:
            line += [row[i].rjust(widths[i]) for i in range(4, len(header))]
            lines.append("  ".join(line).rstrip())
    return "\n".join(lines)


def format_plan(results: list[RunResult]) -> str:
    """What a dry run found (or a batch left as it was), one line per point: action, name, why, and
    the check's error."""
    width = max((len(r.name) for r in results), default=0)
    lines = []
    for r in results:
        detail = r.error or r.reason
        lines.append(f"  {r.action:<9} {r.name:<{width}}  {detail}".rstrip())
    return "\n".join(lines)
