"""Metrics rows streamed where researchers already look (the ``report_to`` setting), beside
metrics.jsonl, which stays the run's record.

``tensorboard`` writes the numbers of each row as scalars (tag: the row's key, e.g.
``train/reward_mean``; step: its ``generation``) to event files in ``run_dir/tensorboard``, offline;
``tensorboard --logdir run_dir`` shows them. A reporter (``Reporter``) is built from the run folder,
the rows to write again and the first generation it reports, and has ``report(row)`` and ``close()``;
another backend is such a class, registered in ``BACKENDS`` under its name in
``evolm_lib.config.ReportTo``. Its ``require()`` imports what it needs, only when ``report_to``
names it, before the run touches its folder.

A resumed run redoes the generations past its checkpoint: its reporters are opened with the
checkpoint's generation, drop what an earlier process reported from that generation on, and report
the rows of metrics.jsonl from there again, so each generation has one point, the row that
metrics.jsonl holds.
"""
from __future__ import annotations

import math
import re
import shutil
import time
from pathlib import Path
from typing import Iterable, Protocol

from .metrics import scored_here

TENSORBOARD_DIR = "tensorboard"
"""The folder of a run's TensorBoard event files, inside the run folder."""
TENSORBOARD_INSTALL = "pip install tensorboard==2.21.0"
STEP_KEYS = ("generation", "step")
"""Row keys that are the x axis (a GRPO row's ``step`` equals its ``generation``), not charts of their own."""
CLOCK_SLACK_S = 2.0
"""How far ahead of this machine's clock an earlier event file may be named before it is rebuilt, not waited for."""


class Reporter(Protocol):
    """Where metrics rows go besides metrics.jsonl: one call per row, flushed before it returns.
    Built as ``Backend(run_dir, history, first_step)`` (see ``TensorBoardReporter``)."""

    @staticmethod
    def require() -> object:
        """Import what the backend needs; an ImportError naming ``report_to`` and what to install."""

    def report(self, row: dict) -> None:
        """Send one metrics row (the row as metrics.jsonl holds it)."""

    def close(self) -> None:
        """Flush and release what the reporter holds; a second call does nothing."""


def scalars(row: dict) -> dict[str, float]:
    """The numbers of a metrics row by key, as metrics.jsonl holds them: ints and finite floats (a
    NaN or inf is null there, so no point), not flags, text or lists, and not the step keys."""
    return {key: value for key, value in row.items()
            if key not in STEP_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


def _event_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*tfevents*")) if folder.is_dir() else []


def _opened_at(path: Path) -> int:
    """The second an event file was opened, from its name (events.out.tfevents.<seconds>.<host>...)."""
    match = re.search(r"tfevents\.(\d+)", path.name)
    return int(match.group(1)) if match else 0


class TensorBoardReporter:
    """Each row's numbers as TensorBoard scalars in ``run_dir/tensorboard``, flushed row by row."""

    def __init__(self, run_dir: str | Path, history: Iterable[dict] = (), first_step: int = 0):
        """A writer on the run folder's event files. ``first_step``: the first generation this process
        reports (a resumed run's checkpoint). Points an earlier process left from it on are purged
        (TensorBoard's ``purge_step``) and the ``history`` rows from it on (metrics.jsonl's) are
        written again; with no earlier event files, the whole history is written (``report_to``
        added to a run that had none)."""
        summary_writer = self.require()
        self.folder = Path(run_dir) / TENSORBOARD_DIR
        earlier = _event_files(self.folder)
        if earlier and not self._wait_to_sort_after(earlier):
            shutil.rmtree(self.folder)  # written under a clock far ahead: rebuilt whole from metrics.jsonl
            earlier = []
        # Every writer opens with a purge (a session start), a new run's at 0 too: TensorBoard's
        # Python reader takes the first start it sees as no restart, and would keep the points the
        # first resume purges.
        purge_step = first_step if earlier else 0
        self._writer = summary_writer(str(self.folder), purge_step=purge_step)
        for row in history:
            if row.get("generation", -1) >= purge_step:
                self._write(row)
        self._writer.flush()

    @staticmethod
    def require():
        """torch's SummaryWriter, or an ImportError that names ``report_to`` and the package to install."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError(f"report_to: 'tensorboard' needs the tensorboard package ({TENSORBOARD_INSTALL}), "
                              f"or drop it from report_to ({error})") from None
        return SummaryWriter

    @staticmethod
    def _wait_to_sort_after(earlier: list[Path]) -> bool:
        """Wait until a file opened now sorts after ``earlier`` (TensorBoard reads a folder's event
        files in name order, and a name starts with the second it was opened: the purge must come after
        the points it drops); False, without waiting, when they are named further ahead than
        ``CLOCK_SLACK_S`` (another machine's clock)."""
        wait = max(_opened_at(path) for path in earlier) + 1 - time.time()
        if wait > CLOCK_SLACK_S:
            return False
        if wait > 0:
            time.sleep(wait)
        return True

    def _write(self, row: dict) -> None:
        step = int(row["generation"])
        # scores that rode in a generation's call belong to the mean they scored (``policy/generation``)
        scored = int(row.get("policy/generation", step))
        for key, value in scalars(row).items():
            self._writer.add_scalar(key, value, scored if scored_here(key) else step)

    def report(self, row: dict) -> None:
        """Write the row's numbers at step = its generation, and flush them to the event file."""
        self._write(row)
        self._writer.flush()  # a kill after this row loses nothing of it

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


BACKENDS = {"tensorboard": TensorBoardReporter}
"""The reporter class of each name ``report_to`` accepts (``evolm_lib.config.ReportTo``)."""


class Reporters:
    """The reporters a run's ``report_to`` names, as one (none: nothing is written)."""

    def __init__(self, reporters: Iterable[Reporter] = ()):
        self.reporters = list(reporters)

    def report(self, row: dict) -> None:
        """Send the row to every reporter."""
        for reporter in self.reporters:
            reporter.report(row)

    def close(self) -> None:
        """Close every reporter; a second call does nothing."""
        reporters, self.reporters = self.reporters, []
        for reporter in reporters:
            reporter.close()


def check_backends(report_to: Iterable[str]) -> None:
    """Import the backends ``report_to`` names, before a run touches its folder or starts an engine:
    an ImportError names ``report_to`` and the package to install."""
    for name in report_to:
        BACKENDS[name].require()


def open_reporters(report_to: Iterable[str], run_dir: str | Path, history: Iterable[dict] = (),
                   first_step: int = 0) -> Reporters:
    """The reporters ``report_to`` names on ``run_dir`` (see ``TensorBoardReporter`` for
    ``history`` and ``first_step``: a resumed run passes metrics.jsonl's rows and its checkpoint's generation)."""
    history = list(history)
    return Reporters(BACKENDS[name](run_dir, history, first_step) for name in report_to)
