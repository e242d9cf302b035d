"""Running a batch: each point's notebook under the point's lock, with status.json before and after,
a finished point kept until an attempt on it succeeds, and the summary rewritten after every point."""
from __future__ import annotations

import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, Collection

from ..grid import Outcome, Replacement, execute, held_by
from ..paths import project_root
from .notebooks import NOTEBOOK_FILE, error_text, execute_notebook, notebook_info, read_notebook
from .plan import plan_points
from .spec import INJECTED, BatchSpec, load_batch_spec
from .state import (BUSY, FAILED, NOT_RUN, OK, PLANNED, RUNNING, STOPPED, PointPlan, RunResult, now_text, point_lock,
                    point_results, stamp, write_status)
from .summary import write_summary


def _result(point: PointPlan, status: str, seconds: float, error: str, action: str | None = None,
            reason: str | None = None) -> RunResult:
    return RunResult(point.run.name, status, seconds, error, point.folder, point.folder / NOTEBOOK_FILE,
                     point.parameters, action or point.action, reason or point.reason, point_results(point.parameters))


def _kept(point: PointPlan, record: dict[str, Any], attempt_error: str = "") -> RunResult:
    """The row of a point left as its folder has it: its status, time, error and parameters as recorded."""
    status = {"running": RUNNING, "busy": BUSY}.get(point.state, record.get("status", OK))
    parameters = {**record.get("parameters", {}), **{k: point.parameters[k] for k in INJECTED if k in point.parameters}}
    return RunResult(point.run.name, status, float(record.get("seconds", 0.0)), record.get("error", ""),
                     point.folder, point.folder / NOTEBOOK_FILE, parameters or point.parameters, point.action,
                     point.reason, point_results(point.parameters), attempt_error)


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
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: no "running" left behind for a process that is ending
        write_status(point.folder, {**base, "status": STOPPED, "seconds": time.perf_counter() - clock,
                                    "stopped": now_text()})
        raise
    except Exception as err:  # noqa: BLE001 - one failed run must not stop the batch
        # a run folder that another process opened after the check in run_point: busy, not failed
        status, error = (BUSY if getattr(err, "ename", "") == "RunFolderBusy" else FAILED), error_text(err)
    return status, time.perf_counter() - clock, error


def run_point(spec: BatchSpec, point: PointPlan, log_output: bool = False) -> RunResult:
    """Run one grid point's notebook in its folder, with status.json before and after; a point that
    another process holds (another batch, or a run open on its run folder) is left untouched: busy."""
    from ..runs import RunFolderBusy, WriterLock, describe_holder

    if point.action == "invalid" and not point.folder.exists():  # failed its checks: no lock, no folder, nothing
        return _result(point, FAILED, 0.0, point.error)
    try:
        lock = WriterLock.acquire(point.folder, lock_file=point_lock(point.folder))
    except RunFolderBusy as busy:
        return _result(point, BUSY, 0.0, "", action="skip", reason=f"held by {describe_holder(busy.holder)}")
    with lock:
        run_dir = point.parameters.get("run_dir")
        busy = held_by(run_dir) if run_dir else None  # e.g. the stepper open on it in JupyterLab
        if busy is not None:
            return _result(point, BUSY, 0.0, "", action="skip", reason=busy)
        return _run_point(spec, point, log_output)


def _run_point(spec: BatchSpec, point: PointPlan, log_output: bool) -> RunResult:
    """One attempt at a point under its lock. A finished point (status ok) is kept until the attempt
    succeeds: see the module's doc string."""
    # the finished point this attempt must not lose (also when an earlier attempt on it was killed)
    kept = dict(point.status) if point.status.get("status") == OK else point.status.get("kept")
    attempts = int(point.status.get("attempts", 0)) + 1
    started = now_text()
    base = {"parameters": point.parameters, "notebook": str(spec.notebook), "started": started,
            "attempts": attempts, "action": point.action}
    if kept is not None and point.action != "overwrite":  # an attempt in the finished point's own folder
        base["kept"] = kept
    if point.action == "invalid":  # failed its checks: no kernel
        if kept is not None:  # a finished point stays as it is; this attempt's error is reported beside it
            return _kept(point, kept, point.error)
        if point.folder.exists():  # an earlier attempt's folder: it says this one failed its checks
            write_status(point.folder, {**base, "status": FAILED, "seconds": 0.0, "error": point.error,
                                        "finished": started, "before_start": True})
        return _result(point, FAILED, 0.0, point.error)  # a new point: no folder, no summary row
    replaced = None
    if point.action == "overwrite" and point.folder.exists():
        if kept is not None:  # moved aside, back if the new attempt fails (grid.Replacement)
            replaced = Replacement(point.folder)
        else:
            shutil.rmtree(point.folder)
    output = point.folder / (NOTEBOOK_FILE if kept is None or replaced is not None else "notebook.attempt.ipynb")
    status, seconds, error = _execute_point(spec, point, output, base, log_output)
    if status == BUSY and kept is not None and replaced is None:  # another writer came first: nothing lost, nothing kept
        if output.exists():
            output.unlink()
        write_status(point.folder, kept)
        return _result(point, BUSY, 0.0, "", action="skip", reason=f"its run folder is held: {error}")
    if status == OK or kept is None:
        if output.name != NOTEBOOK_FILE:
            os.replace(output, point.folder / NOTEBOOK_FILE)
        base.pop("kept", None)
        write_status(point.folder, {**base, "status": status, "seconds": seconds, "error": error, "finished": now_text()})
        if replaced is not None:
            replaced.succeeded()
        return _result(point, status, seconds, error)
    # the attempt failed on a finished point: keep the point, and the attempt beside it
    if replaced is not None:
        write_status(point.folder, {**base, "status": FAILED, "seconds": seconds, "error": error, "finished": now_text()})
        attempt = replaced.failed()
    else:
        attempt = point.folder / f"notebook.failed-{stamp()}.ipynb"
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
                          p.action, p.reason, point_results(p.parameters) if p.action in NOT_RUN else {})
                for p in points]

    defaults = notebook_info(read_notebook(spec.notebook, spec.kernel)).defaults
    results = {p.run.name: _kept(p, p.status) for p in points if p.action in NOT_RUN}
    work = [p for p in points if p.action not in NOT_RUN]
    order = [p.run.name for p in points]
    bar = tqdm(work, desc="batch", unit="run", file=sys.stderr, disable=not work)

    def attempt(point: PointPlan) -> RunResult:
        bar.set_postfix_str(f"{point.action} {point.run.name}")
        return run_point(spec, point, log_output)

    def after(point: PointPlan, outcome: Outcome) -> None:
        # run_point records a notebook's failure and a busy point itself; what else raised fails the point here
        result = outcome.value or _result(point, FAILED, outcome.seconds, outcome.error)
        results[point.run.name] = result
        if result.status == FAILED or result.attempt_error:
            bar.write(f"[failed] {point.run.name}: {result.error or result.attempt_error}", file=sys.stderr)
        _write_summary([results[n] for n in order if n in results], out_dir, spec, defaults)

    execute(bar, attempt, after)
    bar.close()
    ordered = [results[n] for n in order]
    _write_summary(ordered, out_dir, spec, defaults)
    return ordered


def _write_summary(results: list[RunResult], out_dir: Path, spec: BatchSpec, defaults: dict[str, Any]) -> None:
    """The summary of the points that have a folder: a point that failed its checks before its first
    attempt created nothing, and has no row; a batch of such points alone writes no summary."""
    rows = [r for r in results if r.folder.exists()]
    if rows or out_dir.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        write_summary(rows, out_dir, spec, defaults)
