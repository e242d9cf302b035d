"""Whether and what a generation (ES) or step (GRPO) scores: one pure function, ``scoring_plan``,
and the row keys a scoring gives (``score_keys``).

Scoring is the greedy reward of the current mean (or policy) on the train, held-out and, where the
task has them, validation prompts. It happens in one of two places:

- after the update, in an engine call of its own (``after``): every ``eval_every`` generations and
  at the end of the budget;
- riding in the population's engine call (``ride``), where the engine batches several grids in one
  call and ``score_in_population`` is on: generation g's call then scores the mean of g - 1 (the
  mean the members were drawn around), every ``eval_every``; only the budget's last mean is scored
  after its update, in a call of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Mapping

SETS = ("train", "eval")
"""What a scoring always covers: the train prompts and the held-out prompts."""
VALIDATION = "validation"


@dataclass(frozen=True)
class ScoringSettings:
    """What the plan depends on besides the generation; read from a run's settings and engine."""

    eval_every: int
    """Score the mean every this many generations (0: only at the end of the budget)."""
    budget: int
    """The run's last generation (``num_generations``, GRPO's ``num_steps``)."""
    rides: bool = False
    """The mean's scoring rides in the population's engine call (an engine that batches grids)."""
    validation: bool = False
    """The task has validation prompts, scored beside the train and held-out ones."""


@dataclass(frozen=True)
class ScoringPlan:
    """What generation g scores."""

    ride: bool
    """Its population's engine call also scores the mean of g - 1 (the row then names it in ``policy/generation``)."""
    after: bool
    """The mean its update makes (the mean of g) is scored in an engine call of its own after the update."""
    sets: tuple[str, ...]
    """The prompt sets a scoring covers: "train", "eval" and, where the task has them, "validation"."""


def scoring_plan(generation: int, settings: ScoringSettings, scored: Collection[int] = ()) -> ScoringPlan:
    """Whether and what generation ``generation`` scores. ``scored``: means whose scores a row already
    holds (a run extended past its budget scored its last mean then), never scored again by riding."""
    every = settings.eval_every
    mean = generation - 1  # the mean the generation's members are drawn around

    def due(g: int) -> bool:
        return bool(every and g % every == 0)

    if settings.rides:
        # the budget's last generation does not ride: its own new mean is scored right after it
        ride = mean > 0 and due(mean) and generation < settings.budget and mean not in scored
        after = generation >= settings.budget and generation not in scored
    else:
        ride = False
        after = due(generation) or generation >= settings.budget
    return ScoringPlan(ride, after, SETS + ((VALIDATION,) if settings.validation else ()))


def scored_means(rows: Iterable[Mapping]) -> set[int]:
    """The means whose scores these rows hold (``policy/generation`` where scores rode along, else the row's generation)."""
    return {row.get("policy/generation", row.get("generation")) for row in rows if "eval/reward" in row}


def score_keys(scores, eval_s: float | None) -> dict:
    """A row's scoring keys from (train, held-out[, validation]) scores; ``eval_s`` when scoring had
    a call of its own."""
    train, held_out, *validation = scores
    keys = {
        "policy/train_reward": train.mean,
        "eval/reward": held_out.mean,
        "policy/train_completions": [c.text for c in train.completions],
        "policy/eval_completions": [c.text for c in held_out.completions],
        "policy/train_tokens": train.num_tokens,
    }
    if validation:
        keys["validation/reward"] = validation[0].mean
    if eval_s is not None:
        keys["time/eval_s"] = eval_s
    return keys
