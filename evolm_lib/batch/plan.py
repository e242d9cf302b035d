"""A batch's plan: every grid point with its full parameters, folder, state and the action the batch
takes; and the folders a changed grid left behind."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Collection

from ..config import did_you_mean
from ..grid import decide, out_contents
from .checks import check_point
from .notebooks import NotebookInfo, check_parameters, notebook_info, read_notebook
from .spec import INJECTED, BatchSpec, RunSpec, expand_runs, folder_slug
from .state import STATUS_FILE, PointPlan, conflict_fix, point_state


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
    check_out_folder(spec, out_dir, info.kind)
    planned = plan_batch(spec, out_dir, info)
    replace = _overwritten(overwrite, [run.name for run, _, _ in planned])
    points = []
    for run, params, folder in planned:
        config, error, notes = check_point(info, params) if validate else (None, "", [])
        state, reason, status = point_state(folder, params, config, info.defaults)
        action = decide(state, run.name in replace, retry_failed)
        if action == "overwrite":
            reason = f"was {state}" + (f": {reason}" if state == "changed" else "")
        elif action == "skip" and state == "failed":
            reason += " (--retry-failed runs it again)"
        elif state == "changed":
            reason += f"; {conflict_fix(run.name)}"
        elif state == "damaged":
            reason += f"; or `--overwrite {run.name}` starts this point again"
        if error and action == "skip":  # a finished run stays as it is; say what the check says now
            notes = [f"its settings fail the checks now: {error}"]
        elif error:
            action = "invalid"
        points.append(PointPlan(run, folder, state, action, "; ".join(filter(None, [reason, *notes])),
                                error if action == "invalid" else "", parameters=params, status=status, config=config))
    return points


def stale_folders(spec: BatchSpec, out_dir: str | Path) -> list[Path]:
    """Point folders in OUT that the batch's grid no longer has (e.g. a grid value since corrected);
    failed attempts kept beside a point (<point>.failed-<time>) are not counted."""
    out_dir = Path(out_dir)
    current = {run.name for run in expand_runs(spec)}
    prefix = folder_slug(spec.name)
    if not out_dir.is_dir():
        return []
    return sorted(p for p in out_dir.iterdir() if p.is_dir() and (p / STATUS_FILE).exists()
                  and p.name not in current and ".failed-" not in p.name
                  and (p.name == prefix or p.name.startswith(prefix + "__")))


KIND_NAMES = {"es": "ES", "grpo": "GRPO", None: "notebook"}


def _belongs(spec: BatchSpec, name: str) -> bool:
    """True when a point folder's name is one this batch's name makes (its prefix, alone or with grid values)."""
    prefix = folder_slug(spec.name)
    return name == prefix or name.startswith(prefix + "__")


def _point_kind(status: dict[str, Any]) -> str | None:
    """The kind (es, grpo) of the run a point's status.json describes: its run folder's config.yaml,
    else its notebook's `settings:<kind>` tag; None when neither says."""
    from ..runs import read_config_kind

    run_dir = (status.get("parameters") or {}).get("run_dir")
    if run_dir and (Path(run_dir) / "config.yaml").is_file():
        try:
            return read_config_kind(run_dir)
        except Exception:  # noqa: BLE001 - a damaged config.yaml: the notebook's tag below
            pass
    notebook = status.get("notebook")
    if notebook and Path(notebook).is_file():
        try:
            return notebook_info(read_notebook(Path(notebook))).kind
        except Exception:  # noqa: BLE001 - unreadable: the kind is unknown
            return None
    return None


def check_out_folder(spec: BatchSpec, out_dir: str | Path, kind: str | None) -> None:
    """Refuse an output folder that holds another batch (point folders or a summary.json another batch
    name made) or runs of another kind (a GRPO batch's folder for an ES batch): a ValueError naming what
    the folder holds, before anything is written; the folder and its summary stay as they are."""
    from .state import read_status

    out_dir = Path(out_dir)
    points, written = out_contents(out_dir)
    others: dict[str, list[str]] = {}  # "<kind> run(s) of <notebook>" -> point names
    for folder in points:
        status = read_status(folder)
        theirs = _point_kind(status)
        # kinds compared where both are known (a notebook without a settings tag declares none)
        if not _belongs(spec, folder.name) or (theirs != kind and None not in (theirs, kind)):
            label = f"{KIND_NAMES.get(theirs, theirs)} run(s) of {Path(str(status.get('notebook', '?'))).name}"
            others.setdefault(label, []).append(folder.name)
    if written:
        runs = [r.get("name") for r in written.get("runs", []) if isinstance(r, dict) and r.get("name")]
        foreign = [n for n in runs if not _belongs(spec, n) and not any(n in names for names in others.values())]
        if foreign and written.get("notebook"):
            label = f"a summary of {Path(written['notebook']).name}"
            others.setdefault(label, []).extend(foreign)
        swept = [r.get("run") for r in written.get("runs", []) if isinstance(r, dict) and r.get("run") and "name" not in r]
        if swept:  # `evolm sweep` names its rows by "run"
            others.setdefault("the runs of an `evolm sweep`", []).extend(swept)
    if others:
        held = "; ".join(f"{label} ({', '.join(names)})" for label, names in others.items())
        raise ValueError(
            f"this folder, {out_dir.resolve()}, holds another batch's points: {held}; this batch ({spec.name!r}) runs "
            f"{KIND_NAMES.get(kind, kind)} points of {spec.notebook.name}. The folder and its summary.csv are left "
            "as they are: give --out another folder")
