"""A batch file: its keys checked, its notebook found, its grid expanded into named points."""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..config import did_you_mean
from ..paths import project_root

SPEC_KEYS = ("notebook", "parameters", "grid", "name", "kernel", "sweep")  # sweep: read by evolm_lib.sweep only
INJECTED = ("run_dir", "figures_dir")  # filled in by the runner, per run


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


def folder_slug(value: Any) -> str:
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text).strip("_") or "_"


def expand_runs(spec: BatchSpec) -> list[RunSpec]:
    """The runs of a batch: the cartesian product of the grid over the base parameters."""
    keys = list(spec.grid)
    runs = []
    for values in itertools.product(*(spec.grid[k] for k in keys)):
        grid_values = dict(zip(keys, values))
        name = "__".join([folder_slug(spec.name)] + [f"{folder_slug(k)}-{folder_slug(v)}" for k, v in grid_values.items()])
        runs.append(RunSpec(name=name, parameters={**spec.parameters, **grid_values},
                            grid_values=grid_values))
    names = [r.name for r in runs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"grid values give duplicate run folder names: {duplicates}")
    return runs
