"""The registry of estimators: what each entry says of an estimator, and the lookup by name (the
entries themselves are in `catalog`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# (generation, one weight per member) pairs; a generation is ``config.Generation``, which this
# leaf of the package does not import (``config`` looks estimators up here)
Weights = list[tuple[Any, list[float]]]


@dataclass(frozen=True)
class EstimatorSpec:
    """A registry entry: how the estimator queries, what it estimates, how it runs."""

    name: str
    summary: str
    """One line."""
    bias: str
    """What E[g] is (tested in tests/test_zo_estimators.py)."""
    seed_population: bool
    """True: coefficients over seeded directions (`coefficients`), pluggable into the LLM runner."""
    searcher: Callable[..., Any]
    """(EstimatorConfig, seed) -> a searcher with init/step for an explicit x."""
    weights: Callable[..., Weights] | None = None
    """The coefficient rule (seed-population estimators): (EstimatorConfig, current Generation,
    earlier Generations) -> Weights."""
    center: str = "never"
    """Queries f(x): "always", "never", or "baseline" (when baseline == "single")."""
    antithetic: bool = False
    """Queries come in +/- pairs."""
    uses_history: bool = False
    """Keeps the last num_histories generations."""
    unbiased: bool = False
    """E[g] = grad f_mu (the smoothed gradient; the true one on the quadratic) at any point."""
    min_queries: int = 1
    """Smallest num_queries that makes sense."""


ESTIMATORS: dict[str, EstimatorSpec] = {}


def register(spec: EstimatorSpec) -> None:
    """Add an entry to `ESTIMATORS`."""
    ESTIMATORS[spec.name] = spec


def get_estimator(name: str) -> EstimatorSpec:
    """The registry entry `name`; ValueError listing the known ones otherwise."""
    if name not in ESTIMATORS:
        raise ValueError(f"estimator {name!r} is unknown; choose from {list(ESTIMATORS)}")
    return ESTIMATORS[name]
