"""Searchers: an estimator run on an explicit point x for the synthetic testbed (`init(x0) -> state`,
`step(objective, x, state) -> Step`). Here the protocols and the searchers whose gradient comes from
seeded directions (every seed-population estimator, fo and zohs_expavg)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Protocol

import torch

from .coefficients import coefficients, directions, needs_center, query_members
from .config import EstimatorConfig, Generation, HistoryState


class Objective(Protocol):
    """What a searcher may ask of the function: values of a batch of points, or (fo) a gradient."""

    def __call__(self, points: torch.Tensor) -> torch.Tensor:
        """Values (m,) of points (m, d); each row is one query."""

    def gradient(self, x: torch.Tensor) -> torch.Tensor:
        """Exact gradient (d,) at x (d,): the first-order oracle, used by fo only."""


class Searcher(Protocol):
    """An estimator run on an explicit point x (the synthetic testbed)."""

    config: EstimatorConfig

    def init(self, x0: torch.Tensor) -> Any:
        """The state before the first step."""

    def step(self, objective: Objective, x: torch.Tensor, state: Any) -> "Step":
        """One generation at x: a gradient estimate or a new point, and the next state."""


@dataclass(frozen=True)
class Step:
    """What one step of a searcher gives: a gradient for the update rule, or the new point itself."""

    state: Any
    """The searcher's next state."""
    gradient: torch.Tensor | None = None
    """Estimate of grad f at x (d,), for the update rule (None when `x` is set)."""
    x: torch.Tensor | None = None
    """The new point, for searchers that move it themselves (xnes, sepcmaes)."""
    info: Mapping[str, float] = field(default_factory=dict)
    """Extra metrics, e.g. {"relizo/reused": 3}."""


def check_x(x: torch.Tensor, dimension: int | None = None) -> None:
    if x.ndim != 1:
        raise ValueError(f"x must be one point of shape (d,), got shape {tuple(x.shape)}")
    if dimension is not None and x.shape[0] != dimension:
        raise ValueError(f"x has dimension {x.shape[0]} but the searcher's state has dimension {dimension}")


def _query_generation(
    config: EstimatorConfig, objective: Objective, x: torch.Tensor, base_seed: int, generation: int, center: bool
) -> tuple[Generation, tuple[int, ...], torch.Tensor]:
    """Evaluate one generation at x: the Generation, its distinct seeds and their directions (rows)."""
    members = query_members(config, base_seed, generation)
    unique = tuple(dict.fromkeys(m.seed for m in members))
    u = directions(unique, x.shape[0], x.dtype)  # (distinct seeds, d)
    row = {seed: i for i, seed in enumerate(unique)}
    index = torch.tensor([row[m.seed] for m in members])
    signs = torch.tensor([m.sign for m in members], dtype=x.dtype)
    values = objective(x + config.mu * signs[:, None] * u[index])  # (num_queries,)
    center_value = float(objective(x[None])[0]) if center else None
    return Generation.from_members(members, values, center_value), unique, u


@dataclass(frozen=True)
class SeedState:
    """State of a seed-population searcher: the generation counter and the estimator's history."""

    generation: int = 0
    """Generations evaluated so far (the next one's seeds derive from it)."""
    history: HistoryState = HistoryState()
    """The coefficient rule's state (plain data)."""
    cache: tuple[tuple[tuple[int, ...], torch.Tensor], ...] = ()
    """Directions of the history's generations (distinct seeds, rows); derived, rebuilt when empty."""

    def to_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint (the direction cache is regenerated from the seeds)."""
        return {"generation": self.generation, "history": self.history.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SeedState":
        """Inverse of `to_dict`."""
        return cls(generation=int(data["generation"]), history=HistoryState.from_dict(data["history"]))


@dataclass(frozen=True)
class SeedSearcher:
    """Runs a seed-population estimator on an explicit x: query, coefficients, g from the directions."""

    config: EstimatorConfig
    seed: int
    """Base seed of the population (seeds derive from (seed, generation, index) as in the LLM runner)."""

    def init(self, x0: torch.Tensor) -> SeedState:
        """Fresh state (no history)."""
        check_x(x0)
        return SeedState()

    def step(self, objective: Objective, x: torch.Tensor, state: SeedState) -> Step:
        """One generation: the estimate g at x and the advanced state."""
        check_x(x)
        current, unique, u = _query_generation(self.config, objective, x, self.seed, state.generation, needs_center(self.config))
        coefficient, history = coefficients(self.config, current, state.history)
        blocks = list(state.cache)
        if len(blocks) != len(state.history.generations):  # a restored state: regenerate from the seeds
            blocks = [(tuple(dict.fromkeys(g.seeds)), None) for g in state.history.generations]
            blocks = [(seeds, directions(seeds, x.shape[0], x.dtype)) for seeds, _ in blocks]
        for _, rows in blocks:
            if rows.shape[1] != x.shape[0]:
                raise ValueError(f"the history's directions have dimension {rows.shape[1]} but x has dimension {x.shape[0]}")
        blocks.append((unique, u))
        gradient = torch.zeros_like(x)
        seen: set[int] = set()
        for seeds, rows in blocks:
            # a seed in two generations (a 31-bit collision) is one direction: count its coefficient once
            weights = torch.tensor([0.0 if s in seen else coefficient.get(s, 0.0) for s in seeds], dtype=x.dtype)
            seen.update(seeds)
            if torch.any(weights != 0):
                gradient += weights @ rows
        gradient /= self.config.mu
        kept = len(history.generations)
        cache = tuple(blocks[len(blocks) - kept:]) if kept else ()
        return Step(state=SeedState(state.generation + 1, history, cache), gradient=gradient)


@dataclass(frozen=True)
class FirstOrderSearcher:
    """The exact gradient (a first-order baseline)."""

    config: EstimatorConfig
    seed: int

    def init(self, x0: torch.Tensor) -> None:
        """No state."""
        check_x(x0)
        return None

    def step(self, objective: Objective, x: torch.Tensor, state: None) -> Step:
        """g = grad f(x)."""
        check_x(x)
        return Step(state=None, gradient=objective.gradient(x))


@dataclass(frozen=True)
class ExpavgState:
    """zohs_expavg: the generation counter and the running average of the estimates."""

    generation: int = 0
    average: torch.Tensor | None = None
    """Running average (d,) of the vanilla estimates; None before the first step."""


@dataclass(frozen=True)
class ExpavgSearcher:
    """zohs_expavg: an exponential average of vanilla estimates (a d-sized state, hence no coefficient form)."""

    config: EstimatorConfig
    seed: int

    def init(self, x0: torch.Tensor) -> ExpavgState:
        """No average yet."""
        check_x(x0)
        return ExpavgState()

    def step(self, objective: Objective, x: torch.Tensor, state: ExpavgState) -> Step:
        """avg = g_1 at the first step, then beta * avg + (1 - beta) * g_t (as the reference)."""
        check_x(x, None if state.average is None else state.average.shape[0])
        vanilla = replace(self.config, name="vanilla")
        current, unique, u = _query_generation(vanilla, objective, x, self.seed, state.generation, center=True)
        coefficient, _ = coefficients(vanilla, current)
        g = torch.tensor([coefficient[s] for s in unique], dtype=x.dtype) @ u / self.config.mu
        beta = self.config.expavg_beta
        average = g if state.average is None else beta * state.average + (1 - beta) * g
        return Step(state=ExpavgState(state.generation + 1, average), gradient=average)
