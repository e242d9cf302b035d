"""How long a study's next trial or run should take, read from the study's own finished work, and the
rule a worker claims by (``Deadline``): with ``finish_by`` (``evolm tune --finish-by``, a lent
machine's end) it starts only work expected to end by then, so no run is begun that the machine's
return would cut short and no slot waits behind a fixed window while work that fits is left.

A trial is expected to take what its method's complete trials took (the median of their runs' wall
clocks, ``time/wall_s``, which goes on across a resume); a rerun or a control run its method's seconds
a generation or step (its reruns' median pace where any has timed rows, else its winner trial's) times
the generations or steps it has left, counted from the checkpoint it would resume from; a continued
rerun the same, at its rerun's own pace (``final.continuation_seconds``). Work with nothing to pace it
by (a method without a complete trial) is expected to take no time: only ``finish_by`` itself stops it.
A worker that has not started its engine yet asks as of the time its engine will be up
(``starting_later``), so it starts none for work that would no longer fit by then.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..runs import list_checkpoints
from ..sweep import PlannedRun
from .spec import TuneSpec
from .study import load_study, median_pace, run_wall, trial_walls

FINISH_MARGIN = 1.2
"""Expected seconds are stretched by this much before they are held against ``finish_by``: a run's
pace on a shared card moves with what shares it, and its wall clock leaves out the engine's start and
the scoring after its last row (docs/tuning.md gives the spread seen on the lent machines)."""


@dataclass
class Deadline:
    """Whether a worker may start work expected to take ``seconds``: before ``claim_until`` (any work,
    whatever its length) and, where ``finish_by`` is set, only work that ends by then once stretched
    by ``margin``. Both are times on ``clock`` (seconds since the epoch for ``time.time``).
    ``refused`` counts the claims turned down for their length alone: ``tune.work`` ends a worker
    after a pass that refused one, since the time left only shrinks, and its slot goes to other work."""

    claim_until: float | None = None
    finish_by: float | None = None
    margin: float = FINISH_MARGIN
    clock: Callable[[], float] | None = None  # time.time, looked up at each call
    refused: int = 0

    def __call__(self, seconds: float | Callable[[], float] = 0.0) -> bool:
        """``seconds``: the work's expected length, or a function giving it, called only where
        ``finish_by`` makes the length matter (reading it means reading the study's run folders)."""
        now = (self.clock or time.time)()
        if self.claim_until is not None and now >= self.claim_until:
            return False
        if self.finish_by is None:
            return True
        if now >= self.finish_by:
            return False
        if now + (seconds() if callable(seconds) else seconds) * self.margin > self.finish_by:
            self.refused += 1
            return False
        return True


def starting_later(rule: Callable[..., bool], seconds: float) -> Callable[..., bool]:
    """``rule`` asked as of ``seconds`` from now: a ``Deadline`` whose clock runs that far ahead (its own
    ``refused`` count), for a worker whose engine takes that long to start before any work can begin;
    any other rule (``tune.always``), or ``seconds`` of 0, as it is."""
    if not isinstance(rule, Deadline) or seconds <= 0:
        return rule
    return replace(rule, clock=lambda: (rule.clock or time.time)() + seconds, refused=0)


def step_seconds(spec: TuneSpec, method: str) -> float:
    """Seconds a generation or step of ``method``'s winner: the median over its reruns on the final seeds
    that have timed rows (finished or under way) of each one's wall clock over the generations or steps
    it ran; where none has, its best trial's runs' wall clocks over theirs (the rerun's setting and
    length are the trial's, but the trial ran beside other trials, at another load). 0.0 where the
    method has no complete trial or its folders no timed rows."""
    reruns = spec.out / "final" / method
    pace = median_pace([wall for folder in sorted(reruns.glob("seed*")) if (wall := run_wall(folder)) is not None])
    if pace is not None:
        return pace
    study = load_study(spec, method)
    try:
        best = study.best_trial
    except ValueError:
        return 0.0
    walls = trial_walls(spec, method, study, best)
    return sum(wall for wall, _ in walls) / sum(generation for _, generation in walls) if walls else 0.0


def resumes_at(folder: Path) -> int:
    """The generation or step a run in ``folder`` goes on from: its newest checkpoint's (0 for none)."""
    found = [int(path.name.split(".")[0]) for path in list_checkpoints(folder) if path.name.split(".")[0].isdigit()]
    return max(found, default=0)


def run_seconds(spec: TuneSpec, planned: PlannedRun, folder: Path, start: int | None = None,
                step: float | None = None) -> float:
    """What ``planned`` (a rerun, a continued rerun or a control run, its winner's setting) should take
    in ``folder``: its method's ``step_seconds`` (``step``, where the caller has it) times what is left
    past ``start`` (where it goes on from; ``resumes_at(folder)`` when None)."""
    at = resumes_at(folder) if start is None else start
    if step is None:
        step = step_seconds(spec, planned.name.split("/")[0])
    return max(planned.length - at, 0) * step
