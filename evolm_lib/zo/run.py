"""The synthetic testbed's driver: estimator x function x seed at an equal query budget.

A query is one evaluation of f at a point an estimator asked for. f at the current point, logged
after every step for the plots, is a monitor and is not counted (no estimator uses it). A run stops
before the step that would exceed the budget, so every run ends within one step of it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence

import pandas as pd
import torch

from evolm_lib.zo.estimators import ESTIMATORS, EstimatorConfig, make_searcher, queries_per_step
from evolm_lib.zo.functions import DTYPE, TestFunction, check_dimension, get_function, start_point
from evolm_lib.zo.updates import UpdateConfig, apply_update, init_update_state

DEFAULT_ESTIMATORS = tuple(ESTIMATORS)


@dataclass
class CountingObjective:
    """A test function that counts queries: one per point evaluated, `gradient_cost` per gradient."""

    function: TestFunction
    dimension: int
    gradient_cost: int = 1
    """Queries charged for one exact gradient (fo)."""
    queries: int = 0
    """Queries so far."""

    def __call__(self, points: torch.Tensor) -> torch.Tensor:
        """Values (m,) of points (m, d), counting m queries."""
        if points.ndim != 2 or points.shape[1] != self.dimension:
            raise ValueError(f"points must have shape (m, {self.dimension}), got {tuple(points.shape)}")
        self.queries += points.shape[0]
        return self.function.value(points)

    def gradient(self, x: torch.Tensor) -> torch.Tensor:
        """Exact gradient at x, counting `gradient_cost` queries."""
        self.queries += self.gradient_cost
        return self.function.gradient(x)


def run_estimator(
    function: str,
    estimator: EstimatorConfig,
    update: UpdateConfig,
    dimension: int,
    query_budget: int,
    seed: int = 0,
    x0: torch.Tensor | None = None,
    max_rows: int = 500,
) -> pd.DataFrame:
    """One run from x0 (default: `start_point(dimension, seed)`) until the query budget; one row per logged step.

    Columns: function, dimension, estimator, seed, step, queries, f (at the current point),
    seconds (since the start), and the estimator's extra metrics (e.g. relizo/reused).
    """
    test_function = get_function(function)
    check_dimension(dimension, test_function)
    if x0 is None:
        x = start_point(dimension, seed)
    else:
        x = torch.as_tensor(x0, dtype=DTYPE).clone()
        if x.ndim != 1 or x.shape[0] != dimension:
            raise ValueError(f"x0 has shape {tuple(x.shape)} but dimension is {dimension}")
    per_step = queries_per_step(estimator)
    if query_budget < per_step:
        raise ValueError(f"query_budget {query_budget} is below one step of {estimator.name} ({per_step} queries)")
    objective = CountingObjective(test_function, dimension, gradient_cost=estimator.num_queries)
    searcher = make_searcher(estimator, seed)
    state = searcher.init(x)
    update_state = init_update_state(update, x)
    log_every = max(1, math.ceil(query_budget / per_step / max_rows))
    base = {"function": function, "dimension": dimension, "estimator": estimator.name, "seed": seed}
    rows = [{**base, "step": 0, "queries": 0, "f": float(test_function.value(x)), "seconds": 0.0}]
    started = time.perf_counter()
    step = 0
    while objective.queries + per_step <= query_budget:
        outcome = searcher.step(objective, x, state)
        state = outcome.state
        if outcome.x is not None:
            x = outcome.x
        else:
            x, update_state = apply_update(update, update_state, x, outcome.gradient)
        step += 1
        value = float(test_function.value(x))
        finite = math.isfinite(value)
        last = objective.queries + per_step > query_budget or not finite
        if step % log_every == 0 or last:
            rows.append({**base, "step": step, "queries": objective.queries, "f": value,
                         "seconds": time.perf_counter() - started, **outcome.info})
        if not finite:
            break  # diverged: the row with the non-finite f says so
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class ComparisonConfig:
    """Estimators compared on one function and dimension at an equal query budget, over seeds."""

    function: str = "rosenbrock"
    """Test function (see `evolm_lib.zo.functions.FUNCTIONS`)."""
    dimension: int = 1000
    """Number of variables."""
    estimators: tuple[str, ...] = DEFAULT_ESTIMATORS
    """Estimator names (see `evolm_lib.zo.estimators.ESTIMATORS`)."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """One run per seed: start point and perturbations."""
    query_budget: int = 10_000
    """Queries per run, equal for every estimator."""
    num_queries: int = 10
    """Queries per generation."""
    mu: float = 0.05
    """Perturbation scale (and xnes/sepcmaes's initial step size)."""
    num_histories: int = 5
    """Past generations reused by zoar and averaged by zohs."""
    baseline: str = "single"
    """zoo and reinforce baseline: single or average."""
    update: UpdateConfig = field(default_factory=UpdateConfig)
    """Update rule of the gradient estimators (xnes and sepcmaes move the point themselves)."""

    def __post_init__(self) -> None:
        check_dimension(self.dimension, get_function(self.function))
        if not self.estimators:
            raise ValueError("estimators must name at least one estimator")
        if len(set(self.estimators)) != len(self.estimators):
            raise ValueError(f"estimators has duplicates: {list(self.estimators)}")
        if not self.seeds:
            raise ValueError("seeds must hold at least one seed")
        if isinstance(self.query_budget, bool) or not isinstance(self.query_budget, int) or self.query_budget < 1:
            raise ValueError(f"query_budget must be a positive int, got {self.query_budget!r}")
        for name in self.estimators:
            config = self.estimator_config(name)  # unknown names and bad settings fail here, naming them
            if self.query_budget < queries_per_step(config):
                raise ValueError(f"query_budget {self.query_budget} is below one step of {name} ({queries_per_step(config)} queries)")

    def estimator_config(self, name: str) -> EstimatorConfig:
        """The EstimatorConfig of `name` with this comparison's settings."""
        return EstimatorConfig(name=name, num_queries=self.num_queries, mu=self.mu,
                               num_histories=self.num_histories, baseline=self.baseline)

    @classmethod
    def from_dict(cls, parameters: Mapping[str, Any]) -> "ComparisonConfig":
        """From flat notebook parameters: estimators as "a,b,c", num_seeds, update_rule, learning_rate, bias_correction."""
        data = dict(parameters)
        update = UpdateConfig(rule=data.pop("update_rule", "radazo"), learning_rate=data.pop("learning_rate", 1e-3),
                              bias_correction=data.pop("bias_correction", False))
        estimators = data.pop("estimators", DEFAULT_ESTIMATORS)
        if isinstance(estimators, str):
            estimators = [name.strip() for name in estimators.split(",") if name.strip()]
        if "num_seeds" in data:
            num_seeds = data.pop("num_seeds")
            if isinstance(num_seeds, bool) or not isinstance(num_seeds, int) or num_seeds < 1:
                raise ValueError(f"num_seeds must be a positive int, got {num_seeds!r}")
            data["seeds"] = tuple(range(num_seeds))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown comparison settings {unknown}; known: {sorted(known | {'num_seeds', 'update_rule', 'learning_rate', 'bias_correction'})}")
        return cls(estimators=tuple(estimators), update=update, **data)


def run_comparison(config: ComparisonConfig, progress: bool = True) -> pd.DataFrame:
    """Every estimator x seed of `config`; the rows of all runs in one frame."""
    frames = []
    for name in config.estimators:
        for seed in config.seeds:
            frame = run_estimator(config.function, config.estimator_config(name), config.update, config.dimension,
                                  config.query_budget, seed)
            frames.append(frame)
            if progress:
                last = frame.iloc[-1]
                print(f"{name:>12} seed {seed}: f {frame['f'].iloc[0]:.4g} -> {last['f']:.4g} "
                      f"in {int(last['step'])} steps, {last['seconds']:.2f} s")
    return pd.concat(frames, ignore_index=True)


def final_table(history: pd.DataFrame) -> pd.DataFrame:
    """Per estimator over seeds: start and final f (mean, min, max), steps, queries, seconds; best first."""
    ends = history.sort_values("step").groupby(["estimator", "seed"], sort=False)
    first, last = ends.first(), ends.last()
    runs = pd.DataFrame({"f_start": first["f"], "f_final": last["f"], "steps": last["step"],
                         "queries": last["queries"], "seconds": last["seconds"]}).reset_index()
    table = runs.groupby("estimator", sort=False).agg(
        f_start_mean=("f_start", "mean"), f_final_mean=("f_final", "mean"), f_final_min=("f_final", "min"),
        f_final_max=("f_final", "max"), steps=("steps", "mean"), queries=("queries", "max"),
        seconds=("seconds", "mean"), seeds=("seed", "count"))
    return table.sort_values("f_final_mean")


def runs_of(history: pd.DataFrame, estimators: Sequence[str] | None = None) -> dict[str, list[pd.DataFrame]]:
    """estimator -> its runs' rows (one frame per seed), in the order the estimators first appear."""
    names = list(dict.fromkeys(history["estimator"])) if estimators is None else list(estimators)
    return {name: [frame for _, frame in history[history["estimator"] == name].groupby("seed", sort=True)] for name in names}
