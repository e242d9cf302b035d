"""A grid point's state: its status.json, who holds it, and how its folder compares with its new
settings (the one comparison the dry run and the real run share)."""
from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..grid import ACTIONS, BUSY, FAILED, NOT_RUN, OK, Change, Step, run_changes, stamp  # noqa: F401 - the batch's names
from .spec import INJECTED

STATUS_FILE = "status.json"
RUNNING, PLANNED = "running", "planned"
STOPPED = "stopped"  # its batch was stopped (Ctrl-C, SIGTERM) while the point ran: a rerun resumes it
# ok, failed and busy (another process holds the point or its run folder: nothing done, nothing written),
# and what a batch does with a point by its state (ACTIONS), are the shared planner's (`evolm_lib.grid`)


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
    """Why, in words (e.g. "finished <time>", "settings changed: sigma 0.05 -> 0.1; ...")."""
    results: dict[str, Any] = field(default_factory=dict)
    """The run folder's results (`evolm_lib.analysis.run_results`), where the notebook made one."""
    attempt_error: str = ""
    """The error of this batch's attempt on a finished point that it kept (the row is the kept point's)."""


@dataclass
class PointPlan(Step):
    """One grid point (`grid.Step`, its ``run`` the point's `RunSpec`) with its full parameters, the
    status.json its folder holds and its resolved settings."""

    parameters: dict[str, Any] = field(default_factory=dict)
    status: dict[str, Any] = field(default_factory=dict)
    config: Any = None
    """The point's resolved settings (notebooks tagged `settings:<kind>`), as its kernel will build them."""


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
    from ..runs.durable import naming  # runs imports torch: not at the command's start

    with naming(folder / STATUS_FILE):
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


def point_results(parameters: dict[str, Any]) -> dict[str, Any]:
    if not parameters.get("run_dir"):
        return {}
    from ..analysis import run_results

    return run_results(parameters["run_dir"])


def settings_changes(folder: Path, parameters: dict[str, Any], config=None, defaults: dict[str, Any] | None = None,
                     status: dict[str, Any] | None = None) -> tuple[list[Change], bool, bool]:
    """The one comparison of a point's folder with its new settings, for the dry run and the real run.

    With ``config`` (the point's resolved settings) and a run in its run folder: the run's config.yaml
    against ``config``, setting by setting; a change of budget or cadence (`evolm_lib.runs.EXTENDABLE`)
    extends the run. Otherwise the parameters in status.json against ``parameters``, the notebook's
    ``defaults`` filling what either left out. Returns (changes, whether they keep the run from
    continuing, whether they were read from a run folder)."""
    defaults = defaults or {}
    from_run = run_changes(parameters.get("run_dir"), config) if config is not None else None
    if from_run is not None:
        return *from_run, True
    status = read_status(folder) if status is None else status
    before = _comparable({**defaults, **status.get("parameters", {})})
    now = _comparable({**defaults, **parameters})
    changes = [Change(k, before.get(k), now.get(k)) for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
    return changes, bool(changes), False


def point_lock(folder: Path) -> Path:
    """The lock a batch holds while it runs a point: beside the point's folder, not in it."""
    return folder.parent / f".{folder.name}.lock"


def _point_holder(folder: Path, parameters: dict[str, Any]) -> dict | None:
    """Who holds the point (a batch running it) or its run folder (a notebook or sweep writing it), or None."""
    from ..runs import lock_holder  # runs imports torch: not at the command's start

    holder = lock_holder(folder, lock_file=point_lock(folder))
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
        from ..runs import describe_holder

        return "busy", f"held by {describe_holder(holder)}", read_status(folder)
    if not folder.exists() or not any(folder.iterdir()):
        return "new", "", {}
    if parameters.get("run_dir"):
        from ..runs import missing_config

        missing = missing_config(parameters["run_dir"])
        if missing is not None:  # no plan can say where its run resumes: left as it is, with the way back
            return "damaged", missing, read_status(folder)
    status = read_status(folder)
    if not status:
        return "unfinished", "a folder without status.json (an earlier batch stopped in it)", status
    if status.get("status") == RUNNING:
        if _alive(status):
            return "running", f"running in process {status['pid']} since {status.get('started', '?')}", status
        return "unfinished", f"stopped while running (started {status.get('started', '?')})", status
    if status.get("status") == STOPPED:
        return "unfinished", f"its batch was stopped while it ran ({status.get('stopped', '?')})", status
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
    results = point_results(parameters)
    generation, budget = results.get("generation"), results.get("budget")
    if isinstance(generation, (int, float)) and isinstance(budget, (int, float)) and generation < budget:
        return "unfinished", f"its run reached generation {generation:g} of {budget:g}", status
    return "finished", f"finished {status.get('finished', '')}".strip(), status


def conflict_fix(name: str) -> str:
    """How to run a point's new settings when its folder holds another finished point or run."""
    return (f"kept as it is: `--overwrite {name}` replaces this point alone, "
            "or `--out` another folder runs the new settings there")


def now_text() -> str:
    """This moment as ISO 8601 text with the local offset, to the second (status.json and summary.json)."""
    return datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")
