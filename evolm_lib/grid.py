"""One planner and one executor for the runners that put work into folders, one item a folder: a
batch's grid points (`evolm_lib.batch`, a papermill notebook each), a sweep's runs (`evolm_lib.sweep`,
an ESRun or GRPORun each) and a study's reruns (`evolm_lib.tune.final`). Each runner keeps what is its
own: how an item runs, what it scores, what it summarises, and (a study) which settings come next.

The planner decides, before anything runs, what a runner does with each item, from its folder's
state (`decide`):

| state | its folder | action |
| --- | --- | --- |
| new | nothing yet | run |
| finished | the item done with these settings | skip (a sweep: finish, completing its scores) |
| unfinished | stopped short of its budget, or a budget or cadence raised since | resume |
| failed | the item raised (a batch's status.json says so) | skip; retry where asked |
| changed | a finished item or a run made with other settings | conflict: left as it is |
| changed-failed | a failed item whose settings changed, holding no run made with other settings | rerun |
| running | another process runs it now (its status says so, and the process lives) | skip |
| busy | another process holds its lock (`evolm_lib.runs.WriterLock`) | skip, its files untouched |
| damaged | checkpoints without config.yaml | damaged: left as it is, with the way back |

An item named to be replaced gets "overwrite" in every state but new, running and busy. A run
folder's state against new settings is `run_folder_state`, the settings compared by `run_changes`;
a folder another process holds is `held_by` it.

The executor (`execute`) runs the items one after another: an item whose folder another process
holds is busy (nothing of it written), an item that raises is failed with its error and the next one
runs (or, where a runner stops at the first failure, the error goes up with the items before it kept).
An item that replaces a folder's content keeps the old content aside until it succeeds
(`Replacement`): OUT/.<item>.kept-<time> while it runs, put back if it fails, the failed attempt kept
beside it as OUT/<item>.failed-<time>.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable

ACTIONS = {"new": "run", "finished": "skip", "failed": "skip", "unfinished": "resume", "changed": "conflict",
           "changed-failed": "rerun", "running": "skip", "busy": "skip", "damaged": "damaged"}
"""What a runner does with an item, by its folder's state (see the module's doc string)."""
NOT_RUN = ("skip", "conflict", "damaged")
"""Actions that leave an item's folder as it is."""
OK, FAILED, BUSY = "ok", "failed", "busy"
"""How an item's attempt ended (`Outcome.status`)."""


def decide(state: str, replace: bool = False, retry_failed: bool = False, finished: str = "skip") -> str:
    """The action for an item in ``state`` (`ACTIONS`): "overwrite" where ``replace`` names it (not
    for a new, running or busy item: there is nothing to replace, or another process has it), "retry"
    for a failed item with ``retry_failed``, ``finished`` for a finished one."""
    if replace and state not in ("new", "running", "busy"):
        return "overwrite"
    if state == "failed" and retry_failed:
        return "retry"
    return finished if state == "finished" else ACTIONS[state]


def format_plan(steps: list) -> str:
    """What the planner decided (or a runner left as it was), one line per item: action, name, why, and
    the check's error (a `Step`, or a batch's `RunResult`)."""
    width = max((len(step.name) for step in steps), default=0)
    return "\n".join(f"  {step.action:<9} {step.name:<{width}}  {step.error or step.reason}".rstrip() for step in steps)


@dataclass
class Step:
    """One planned item with its folder, the folder's state and what the runner does with it."""

    run: Any
    """What runs: a batch's `RunSpec`, a sweep's or a study's `PlannedRun` (each has a ``name``)."""
    folder: Path
    state: str
    action: str
    reason: str = ""
    """Why, in words (e.g. "finished <time>", "settings changed: sigma 0.05 -> 0.1; ...")."""
    error: str = ""
    """Where the item failed its checks before it ran (action "invalid"): why."""

    @property
    def name(self) -> str:
        """The item's folder name under OUT."""
        return self.run.name


def out_contents(out: str | Path) -> tuple[list[Path], dict[str, Any]]:
    """What an output folder holds that says which runner wrote it, for a runner to refuse another's
    folder: the folders of a batch's points (status.json in them; failed attempts kept beside a point,
    <point>.failed-<time>, and folders waiting aside, .<point>.kept-<time>, left out) and its summary.json
    ({} where there is none or it is unreadable)."""
    import json

    out = Path(out)
    if not out.is_dir():
        return [], {}
    points = sorted(p for p in out.iterdir() if p.is_dir() and (p / "status.json").is_file()
                    and not p.name.startswith(".") and ".failed-" not in p.name)
    try:
        summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = {}
    return points, summary if isinstance(summary, dict) else {}


# --------------------------------------------------------------------------- a run folder against new settings


@dataclass(frozen=True)
class Change:
    """One setting that differs between a folder's run and its new settings."""

    name: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.name} {self.old!r} -> {self.new!r}"


def _recorded_settings(run_dir: Path, config) -> dict[str, Any]:
    """The settings in ``run_dir``'s config.yaml (defaults of settings added since filled in)."""
    import yaml

    from .config import ConfigError
    from .runs import load_run_config  # runs imports torch: not at a command's start

    try:
        return load_run_config(run_dir, type(config)).to_dict()
    except (ConfigError, ValueError, TypeError):  # another kind, or settings this version no longer has
        data = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        return {k: v for k, v in data.items() if k not in ("kind", "label")}


def _changes(old: dict[str, Any], config) -> tuple[list[Change], bool]:
    """(the settings in which ``old`` differs from ``config``, whether they keep its run from continuing):
    a change of budget or cadence (`evolm_lib.runs.EXTENDABLE`) extends a run; any other is a change of run."""
    from .runs import EXTENDABLE

    changes = [Change(k, old.get(k), v) for k, v in config.to_dict().items() if old.get(k) != v]
    return changes, any(c.name not in EXTENDABLE for c in changes)


def run_changes(run_dir: Any, config) -> tuple[list[Change], bool] | None:
    """``_changes`` of the run in ``run_dir`` against ``config``, or None where the folder holds no run
    (no config.yaml, or a creation that stopped before its first generation)."""
    from .runs import list_checkpoints, read_metrics

    run_dir = Path(run_dir) if run_dir else None
    if run_dir is None or not (run_dir / "config.yaml").is_file():
        return None
    if not read_metrics(run_dir) and not list_checkpoints(run_dir):
        return None  # nothing to keep
    return _changes(_recorded_settings(run_dir, config), config)


def held_by(folder: Path) -> str | None:
    """"held by <the process>" where another live process holds ``folder``'s writer lock, else None."""
    from .runs import describe_holder, lock_holder

    holder = lock_holder(folder) if Path(folder).is_dir() else None
    return None if holder is None else f"held by {describe_holder(holder)}"


@dataclass(frozen=True)
class FolderState:
    """A run folder's state against a run's new settings (`run_folder_state`)."""

    state: str
    """new, finished, unfinished, changed, busy or damaged."""
    reason: str = ""
    changes: list[Change] = field(default_factory=list)


def run_folder_state(folder: Path, config, length: int) -> FolderState:
    """The state of the run folder ``folder`` for a run of ``config`` to ``length`` generations or
    steps: busy (another process writes it), damaged (checkpoints without config.yaml, the reason the
    command that restores it), new, changed (a run made with other settings), unfinished (short of
    ``length``, or settings changed that its run can follow) or finished."""
    from .runs import list_checkpoints, missing_config, read_metrics

    folder = Path(folder)
    busy = held_by(folder)
    if busy is not None:
        return FolderState("busy", busy)
    missing = missing_config(folder)
    if missing is not None:  # no plan can say where it resumes
        return FolderState("damaged", missing)
    rows = read_metrics(folder) if (folder / "config.yaml").is_file() else []
    if not rows and not list_checkpoints(folder):
        return FolderState("new")
    # a run is there, and its config.yaml (checkpoints without it are damaged, above): its rows read once
    changes, blocking = _changes(_recorded_settings(folder, config), config)
    listed = ", ".join(map(str, changes))
    done = rows[-1].get("generation", -1) if rows else -1
    if blocking:
        return FolderState("changed", f"its folder holds a run with other settings: {listed}", changes)
    if changes:
        return FolderState("unfinished", f"settings changed that its run can follow: {listed}", changes)
    if done >= length:
        return FolderState("finished", "finished")
    return FolderState("unfinished", f"resumes at generation {done} of {length}")


# --------------------------------------------------------------------------- the executor


def stamp() -> str:
    """This moment for a file name (<item>.failed-<stamp>, .<item>.kept-<stamp>)."""
    return datetime.now().strftime("%Y%m%d-%H%M%S")


class Replacement:
    """A folder's content moved aside while an attempt replaces it: removed when the attempt succeeds,
    put back when it fails (the attempt kept beside it as <name>.failed-<time>) or when it never began
    (another process held the folder)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.aside = self.folder.with_name(f".{self.folder.name}.kept-{stamp()}")
        self.folder.rename(self.aside)

    @classmethod
    def begin(cls, folder: Path, replacing: bool = True) -> "Replacement | None":
        """The content of ``folder`` moved aside, or None where there is nothing to replace."""
        return cls(folder) if replacing and Path(folder).exists() else None

    def succeeded(self) -> None:
        """The attempt made the folder anew: the old content goes."""
        shutil.rmtree(self.aside)

    def failed(self) -> Path:
        """The attempt failed: it moves to <name>.failed-<time> and the old content comes back. Returns
        where the attempt is kept."""
        attempt = self.folder.with_name(f"{self.folder.name}.failed-{stamp()}")
        if self.folder.exists():
            self.folder.rename(attempt)
        self.aside.rename(self.folder)
        return attempt

    def abandoned(self) -> None:
        """The attempt never began: the old content comes back as it was."""
        self.aside.rename(self.folder)


@dataclass
class Outcome:
    """How one item's attempt ended."""

    name: str
    status: str
    """ok, failed or busy (another process held its folder: nothing done, nothing written)."""
    seconds: float = 0.0
    error: str = ""
    value: Any = None
    """What the attempt returned."""
    holder: dict | None = None
    """Who held a busy item's folder (`evolm_lib.runs.lock_holder`)."""


def execute(items: Iterable[Any], attempt: Callable[[Any], Any], after: Callable[[Any, Outcome], None] | None = None,
            keep_going: bool = True, name: Callable[[Any], str] = lambda item: item.name) -> list[Outcome]:
    """``attempt(item)`` for each item in turn, one `Outcome` each, ``after(item, outcome)`` called
    after each (a summary rewritten, a line printed). An item whose folder another process holds
    (``RunFolderBusy``) is busy and the next one runs. An item that raises is failed, with its error,
    and the next one runs; with ``keep_going`` False its error goes up instead, the items before it
    kept. Ctrl-C (KeyboardInterrupt) ends it at once."""
    from .runs import RunFolderBusy

    outcomes = []
    for item in items:
        started = time.perf_counter()
        try:
            outcome = Outcome(name(item), OK, value=attempt(item))
        except RunFolderBusy as busy:
            outcome = Outcome(name(item), BUSY, error=str(busy), holder=busy.holder)
        except Exception as error:  # noqa: BLE001 - one failed item must not stop the others
            if not keep_going:
                raise
            outcome = Outcome(name(item), FAILED, error=f"{type(error).__name__}: {error}")
        if outcome.status != BUSY:
            outcome.seconds = time.perf_counter() - started
        outcomes.append(outcome)
        if after is not None:
            after(item, outcome)
    return outcomes
