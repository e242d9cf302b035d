"""Zeroth-order gradient estimators over seeded perturbations: one registry for the synthetic
testbed and the LLM ES runner.

Paper: Qiu, Xie, Yan, Yang, Shu 2025, "Zeroth-Order Optimization is Secretly Single-Step Policy
Optimization", https://arxiv.org/abs/2506.14460 (ZoAR: averaged baseline and query reuse; ZO
finite differences = REINFORCE with a baseline on the Gaussian policy N(x, mu^2 I)).

Convention, written once. The zo package MINIMISES f. A generation's query j is the point
x + s_j * mu * u(seed_j), with s_j = +1 or -1 and u(seed) ~ N(0, I) regenerated from its seed
exactly as the LLM runner regenerates member noise (`evolm_lib.es.member_noise`); F_j is f there.
A seed-population estimator turns the values into COEFFICIENTS c over seeds, and

    g = (1/mu) * sum_seed c_seed * u(seed)

estimates grad f_mu(x), the gradient of the Gaussian-smoothed f_mu(x) = E f(x + mu u) (on the
quadratic, grad f_mu = grad f). An update rule descends along g. The LLM runner maximises reward:
it passes F = -reward and ascends along -g (`evolm_lib.es.apply_update` ascends: give it -g).

Two kinds of estimator:
- seed_population=True: es, vanilla, rl, zoo, reinforce, twopoint, zoar, zoar_0, zohs. The core is
  the pure function `coefficients(config, current_generation, history_state)`; the state holds the
  last generations' seeds, signs and values as plain lists (`HistoryState.to_dict`), so a
  checkpoint stores it and a resumed run is bit-exact.
- seed_population=False: fo (exact gradient), zohs_expavg (a d-sized running average), relizo
  (explicit sample positions), xnes (a d x d covariance factor), sepcmaes (the cmaes optimizer).

Every estimator also has a `Searcher` (`make_searcher`) that runs it on an explicit vector x for the
synthetic testbed: `init(x0) -> state`, `step(objective, x, state) -> Step`.

Where this follows the issue rather than the paper's reference code (its optimizer/zo.py):
- queries: an estimator queries f(x) only when its formula uses it (vanilla, zoo/reinforce with
  the single baseline, zohs, zohs_expavg, relizo); the reference evaluates f(x) every step for
  logging, also for es, twopoint and zoar, which then cost num_queries + 1;
- rl: tied values share their average rank (the reference breaks ties by argsort order);
- xnes: the best sample gets the largest utility (the reference's flipped utilities climb);
- relizo: reused samples are kept (the reference zeroed them and skipped every reusing step);
- update rules: bias correction is an option (the reference has none; off by default).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np
import torch

from evolm_lib.es import Member, member_noise, population
from evolm_lib.es.core import NOISE_DEVICE, NoiseScheme, seeded_combination

Params = dict[str, torch.Tensor]
DIRECTION_NAME = "x"  # the one "tensor" of a synthetic point: u(seed) = member_noise(seed, {"x": (d,)})["x"]
BASELINES = ("single", "average")


# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class EstimatorConfig:
    """An estimator and its settings (the ones it does not use are ignored)."""

    name: str
    """Registry name: see `ESTIMATORS`."""
    num_queries: int = 10
    """Queries per generation (perturbed points; twopoint: +/- pairs, so even)."""
    mu: float = 0.05
    """Perturbation scale (smoothing radius); xnes and sepcmaes start with this step size."""
    num_histories: int = 5
    """H: past generations reused by zoar and averaged by zohs (zoar needs H >= 1; zoar_0 is H = 0)."""
    baseline: str = "single"
    """zoo and reinforce: "single" (F(x), one extra query) or "average" (mean of the queries)."""
    expavg_beta: float = 0.9
    """zohs_expavg: decay of the running average of the estimates, in [0, 1)."""
    reuse_radius: float = 1.5
    """relizo: reuse last samples within reuse_radius * mu * sqrt(d) (a fresh sample's typical distance)."""
    max_reuse_rate: float = 0.5
    """relizo: at most floor(max_reuse_rate * num_queries) reused samples per step, in [0, 1)."""
    xnes_eta_mu: float = 1.0
    """xnes: learning rate of the mean."""
    xnes_eta_sigma: float | None = None
    """xnes: learning rate of the step size (None: 3 (3 + ln d) / (5 d sqrt d))."""
    xnes_eta_shape: float | None = None
    """xnes: learning rate of the shape matrix B (None: as xnes_eta_sigma)."""

    def __post_init__(self) -> None:
        spec = get_estimator(self.name)
        n = self.num_queries
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_queries must be a positive int, got {n!r}")
        if spec.antithetic and n % 2:
            raise ValueError(f"num_queries must be even for {self.name} (+/- pairs along num_queries // 2 directions), got {n}")
        if n < spec.min_queries:
            raise ValueError(f"num_queries must be >= {spec.min_queries} for {self.name}, got {n}")
        if not (self.mu > 0 and math.isfinite(self.mu)):
            raise ValueError(f"mu must be > 0 and finite, got {self.mu}")
        h = self.num_histories
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise ValueError(f"num_histories must be an int >= 0, got {h!r}")
        if self.name == "zoar" and h < 1:
            raise ValueError("num_histories must be >= 1 for zoar (the baseline-only variant without reuse is zoar_0)")
        if self.baseline not in BASELINES:
            raise ValueError(f"baseline must be one of {list(BASELINES)}, got {self.baseline!r}")
        if not 0.0 <= self.expavg_beta < 1.0:
            raise ValueError(f"expavg_beta must be in [0, 1), got {self.expavg_beta}")
        if not (self.reuse_radius >= 0 and math.isfinite(self.reuse_radius)):
            raise ValueError(f"reuse_radius must be >= 0 and finite, got {self.reuse_radius}")
        if not 0.0 <= self.max_reuse_rate < 1.0:
            raise ValueError(f"max_reuse_rate must be in [0, 1), got {self.max_reuse_rate}")
        for name in ("xnes_eta_mu", "xnes_eta_sigma", "xnes_eta_shape"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be > 0 and finite, got {value}")


# ----------------------------------------------------------------------------- generations and state


@dataclass(frozen=True)
class Generation:
    """One generation's queries: query j was at x + signs[j] * mu * u(seeds[j]) and gave values[j]."""

    seeds: tuple[int, ...]
    """Direction seed of each query (an antithetic pair repeats its seed)."""
    signs: tuple[int, ...]
    """+1 or -1 per query."""
    values: tuple[float, ...]
    """f at each query (minimised; the LLM runner passes -reward)."""
    center: float | None = None
    """f(x) at the unperturbed point, when the estimator queries it (vanilla, zoo/reinforce single, zohs)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
        object.__setattr__(self, "signs", tuple(int(s) for s in self.signs))
        object.__setattr__(self, "values", tuple(float(v) for v in self.values))
        if not self.seeds:
            raise ValueError("a generation needs at least one query")
        if not len(self.seeds) == len(self.signs) == len(self.values):
            raise ValueError(f"seeds, signs and values differ in length: {len(self.seeds)}, {len(self.signs)}, {len(self.values)}")
        if any(s not in (1, -1) for s in self.signs):
            raise ValueError(f"signs must be +1 or -1, got {sorted(set(self.signs))}")
        # one NaN value would turn the whole update into NaN
        if not all(math.isfinite(v) for v in self.values):
            raise ValueError("values contain non-finite numbers")
        if self.center is not None:
            object.__setattr__(self, "center", float(self.center))
            if not math.isfinite(self.center):
                raise ValueError(f"center must be finite, got {self.center}")

    @classmethod
    def from_members(cls, members: Sequence[Member], values: Sequence[float] | torch.Tensor, center: float | None = None) -> "Generation":
        """A generation from the LLM runner's members (seed, sign) and their values (f = -reward)."""
        values = torch.as_tensor(values).reshape(-1).tolist()
        return cls(tuple(m.seed for m in members), tuple(m.sign for m in members), tuple(values), center)

    def to_dict(self) -> dict[str, Any]:
        """Plain lists (JSON-safe; floats round-trip exactly through json)."""
        return {"seeds": list(self.seeds), "signs": list(self.signs), "values": list(self.values), "center": self.center}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Generation":
        """Inverse of `to_dict`."""
        return cls(tuple(data["seeds"]), tuple(data["signs"]), tuple(data["values"]), data.get("center"))


@dataclass(frozen=True)
class HistoryState:
    """The past generations a seed-population estimator keeps (oldest first; at most H of them)."""

    generations: tuple[Generation, ...] = ()
    """Past generations, oldest first."""

    def to_dict(self) -> dict[str, Any]:
        """{"generations": [{"seeds", "signs", "values", "center"}, ...]}: plain, JSON-safe."""
        return {"generations": [generation.to_dict() for generation in self.generations]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "HistoryState":
        """Inverse of `to_dict`."""
        return cls(tuple(Generation.from_dict(g) for g in data.get("generations", ())))


# ----------------------------------------------------------------------------- coefficient rules
# Each rule maps (config, current generation, past generations) to per-query weights w_j for the
# generations it uses; query j then adds signs[j] * w_j to the coefficient of seeds[j].

Weights = list[tuple[Generation, list[float]]]


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def _centered_ranks64(values: Sequence[float]) -> list[float]:
    """Ranks scaled to [-0.5, 0.5], ties sharing their average rank, in float64."""
    # es.centered_ranks works in float32, where close values of a large f tie; ranks need float64
    r = torch.tensor(values, dtype=torch.float64)
    n = r.numel()
    ordered = torch.sort(r).values
    below = torch.searchsorted(ordered, r, right=False)
    at_or_below = torch.searchsorted(ordered, r, right=True)
    rank = (below + at_or_below - 1).to(torch.float64) / 2
    return (rank / (n - 1) - 0.5).tolist()


def _es_weights(config: EstimatorConfig, current: Generation, past: Sequence[Generation]) -> Weights:
    n = len(current.values)
    return [(current, [v / n for v in current.values])]


def _baseline_weights(current: Generation, baseline: float) -> Weights:
    n = len(current.values)
    return [(current, [(v - baseline) / n for v in current.values])]


def _vanilla_weights(config: EstimatorConfig, current: Generation, past: Sequence[Generation]) -> Weights:
    return _baseline_weights(current, current.center)


def _zoo_weights(config: EstimatorConfig, current: Generation, past: Sequence[Generation]) -> Weights:
    baseline = current.center if config.baseline == "single" else _mean(current.values)
    return _baseline_weights(current, baseline)


def _rl_weights(config: EstimatorConfig, current: Generation, past: Sequence[Generation]) -> Weights:
    # The reference's shaping 2 * rank - (n - 1) (worst query +(n-1), best -(n-1)), with ties
    # averaged (the reference breaks ties by argsort order): 2 (n - 1) * centred rank.
    n = len(current.values)
    return [(current, [2 * (n - 1) * rank / n for rank in _centered_ranks64(current.values)])]


def _twopoint_weights(config: EstimatorConfig, current: Generation, past: Sequence[Generation]) -> Weights:
    signs_of: dict[int, list[int]] = {}
    for seed, sign in zip(current.seeds, current.signs):
        signs_of.setdefault(seed, []).append(sign)
    unpaired = [seed for seed, signs in signs_of.items() if sorted(signs) != [-1, 1]]
    if unpaired:
        raise ValueError(f"twopoint needs each seed queried once with +1 and once with -1; seeds {unpaired[:5]} are not")
    # F_j / n with the signs: (F+ - F-) / n per direction = central difference / (2 mu), averaged
    # over n / 2 directions. F(x) cancels, so it is never queried.
    return _es_weights(config, current, past)


def _zoar_weights(config: EstimatorConfig, current: Generation, past: Sequence[Generation]) -> Weights:
    h = _history_length(config)
    buffer = [*past[-h:], current] if h else [current]
    values = [v for generation in buffer for v in generation.values]
    baseline, total = _mean(values), len(values)
    # divides by the buffer's length N, as the reference does
    return [(generation, [(v - baseline) / total for v in generation.values]) for generation in buffer]


def _zohs_weights(config: EstimatorConfig, current: Generation, past: Sequence[Generation]) -> Weights:
    h = _history_length(config)
    buffer = [*past[-h:], current] if h else [current]
    for generation in buffer:
        if generation.center is None:
            raise ValueError("zohs needs the centre value of every buffered generation (Generation.center)")
    weights = []
    for generation in buffer:
        n = len(generation.values)
        weights.append((generation, [(v - generation.center) / (n * len(buffer)) for v in generation.values]))
    return weights


def _history_length(config: EstimatorConfig) -> int:
    """Past generations the estimator keeps: H for zoar and zohs, 0 otherwise."""
    return config.num_histories if get_estimator(config.name).uses_history else 0


# ----------------------------------------------------------------------------- the coefficient interface


def needs_center(config: EstimatorConfig) -> bool:
    """True when the estimator queries f(x) itself (one extra query per generation)."""
    spec = get_estimator(config.name)
    if spec.center == "baseline":
        return config.baseline == "single"
    return spec.center == "always"


def queries_per_step(config: EstimatorConfig) -> int:
    """Most queries one step costs (fo is charged num_queries per exact gradient; see `ESTIMATORS`)."""
    if config.name == "relizo":
        return config.num_queries + 1  # f(x) and at most num_queries fresh samples
    return config.num_queries + int(needs_center(config))


def query_members(config: EstimatorConfig, base_seed: int, generation: int) -> list[Member]:
    """The generation's queries as (seed, sign) members: antithetic pairs for twopoint."""
    spec = get_estimator(config.name)
    return population(base_seed, generation, config.num_queries, antithetic=spec.antithetic)


def coefficients(
    config: EstimatorConfig, current: Generation, state: HistoryState = HistoryState()
) -> tuple[dict[int, float], HistoryState]:
    """Coefficients c over seeds (g = (1/mu) sum c_seed u(seed) estimates grad f) and the next state.

    Pure: the same inputs give the same floats. The coefficients cover the current generation's
    seeds and, for zoar and zohs, the seeds of the buffered past generations; a seed queried
    several times (an antithetic pair) gets the sum of its queries' signed weights.
    """
    spec = get_estimator(config.name)
    if not spec.seed_population:
        raise ValueError(
            f"{config.name} has no coefficient form (it needs explicit positions or a d-sized state); "
            f"seed-population estimators: {[n for n, s in ESTIMATORS.items() if s.seed_population]}"
        )
    if needs_center(config) and current.center is None:
        raise ValueError(f"{config.name} (baseline {config.baseline!r}) needs f(x): pass Generation(..., center=f(x))")
    coefficient: dict[int, float] = {}
    for generation, weights in spec.weights(config, current, state.generations):
        for seed, sign, weight in zip(generation.seeds, generation.signs, weights):
            coefficient[seed] = coefficient.get(seed, 0.0) + sign * weight
    h = _history_length(config)
    kept = (*state.generations, current)[-h:] if h else ()
    return coefficient, HistoryState(tuple(kept))


def seeded_gradient(
    coefficient: Mapping[int, float],
    shapes: Mapping[str, tuple[int, ...]],
    mu: float,
    dtype: torch.dtype = torch.float32,
    noise_device: str = NOISE_DEVICE,
    scheme: NoiseScheme = "flat",
) -> Params:
    """g = (1/mu) sum_seed c_seed * noise(seed) for every tensor, regenerating each seed's noise.

    This is how the LLM runner turns coefficients into a gradient over LoRA tensors (the noise is
    `es.member_noise` in the run's `scheme`, as for its members). It estimates grad f with
    f = -reward: ascend along -g.
    """
    if not (mu > 0 and math.isfinite(mu)):
        raise ValueError(f"mu must be > 0 and finite, got {mu}")
    if dtype == torch.float32:  # the LLM runner's case: blocked draws, one kernel per member with "flat"
        return seeded_combination(coefficient, shapes, {name: mu for name in shapes}, noise_device, scheme)
    gradient = {name: torch.zeros(tuple(shape), dtype=dtype, device=noise_device) for name, shape in shapes.items()}
    for seed, c in coefficient.items():
        if c == 0.0:
            continue  # e.g. a query equal to the baseline
        noise = member_noise(seed, shapes, device=noise_device)
        for name in gradient:
            gradient[name].add_(noise[name].to(dtype), alpha=c)
    for name in gradient:
        gradient[name].div_(mu)
    return gradient


def directions(seeds: Sequence[int], dimension: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Directions u(seed) as rows (len(seeds), dimension): the LLM runner's noise for a tensor named "x"."""
    shapes = {DIRECTION_NAME: (dimension,)}
    if not seeds:
        return torch.zeros((0, dimension), dtype=dtype)
    return torch.stack([member_noise(seed, shapes)[DIRECTION_NAME] for seed in seeds]).to(dtype)


# ----------------------------------------------------------------------------- searchers (explicit x)


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


def _check_x(x: torch.Tensor, dimension: int | None = None) -> None:
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
        _check_x(x0)
        return SeedState()

    def step(self, objective: Objective, x: torch.Tensor, state: SeedState) -> Step:
        """One generation: the estimate g at x and the advanced state."""
        _check_x(x)
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
        _check_x(x0)
        return None

    def step(self, objective: Objective, x: torch.Tensor, state: None) -> Step:
        """g = grad f(x)."""
        _check_x(x)
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
        _check_x(x0)
        return ExpavgState()

    def step(self, objective: Objective, x: torch.Tensor, state: ExpavgState) -> Step:
        """avg = g_1 at the first step, then beta * avg + (1 - beta) * g_t (as the reference)."""
        _check_x(x, None if state.average is None else state.average.shape[0])
        vanilla = replace(self.config, name="vanilla")
        current, unique, u = _query_generation(vanilla, objective, x, self.seed, state.generation, center=True)
        coefficient, _ = coefficients(vanilla, current)
        g = torch.tensor([coefficient[s] for s in unique], dtype=x.dtype) @ u / self.config.mu
        beta = self.config.expavg_beta
        average = g if state.average is None else beta * state.average + (1 - beta) * g
        return Step(state=ExpavgState(state.generation + 1, average), gradient=average)


@dataclass(frozen=True)
class RelizoState:
    """ReLIZO: the last step's centre and samples (positions and values), for reuse."""

    generation: int = 0
    center: torch.Tensor | None = None
    """Last centre x_{t-1} (d,)."""
    center_value: torch.Tensor | None = None
    """f(x_{t-1}), a 0-d tensor."""
    points: torch.Tensor | None = None
    """Last samples (m, d)."""
    values: torch.Tensor | None = None
    """f at the last samples (m,)."""


@dataclass(frozen=True)
class RelizoSearcher:
    """ReLIZO (Wang et al., NeurIPS 2024, "ReLIZO: Sample Reusable Linear Interpolation-based
    Zeroth-order Optimization", https://openreview.net/forum?id=yzviAnpvU6): the minimum-norm g that
    interpolates f(x + delta_i) - f(x) = delta_i . g over fresh samples and reused nearby old ones.

    Differences from the reference code: the reused samples are kept (the reference zeroes them
    before copying, so every reusing step divided by zero and was skipped); the reuse radius is
    reuse_radius * mu * sqrt(d), relative to a fresh sample's distance, instead of 2 x learning
    rate; directions come from seeds, so a run is reproducible.
    """

    config: EstimatorConfig
    seed: int

    def init(self, x0: torch.Tensor) -> RelizoState:
        """Nothing to reuse yet."""
        _check_x(x0)
        return RelizoState()

    def step(self, objective: Objective, x: torch.Tensor, state: RelizoState) -> Step:
        """f(x), reuse up to floor(max_reuse_rate * n) old points within the radius, fill up with fresh ones."""
        _check_x(x, None if state.center is None else state.center.shape[0])
        n, mu, d = self.config.num_queries, self.config.mu, x.shape[0]
        center_value = objective(x[None])[0]
        reused_points = x.new_zeros((0, d))
        reused_values = x.new_zeros((0,))
        if state.points is not None and self.config.reuse_radius > 0:
            candidates = torch.cat([state.points, state.center[None]])  # (m + 1, d)
            candidate_values = torch.cat([state.values, state.center_value.reshape(1)])
            distance = (candidates - x).norm(dim=1)
            radius = self.config.reuse_radius * mu * math.sqrt(d)
            # a candidate at x itself (a zero step) has no displacement to interpolate along
            usable = (distance < radius) & (distance > 1e-12 * radius)
            order = [int(i) for i in torch.argsort(distance) if usable[i]]
            keep = order[: int(self.config.max_reuse_rate * n)]
            reused_points, reused_values = candidates[keep], candidate_values[keep]
        fresh_count = n - reused_points.shape[0]
        seeds = [m.seed for m in population(self.seed, state.generation, fresh_count, antithetic=False)]
        fresh_points = x + mu * directions(seeds, d, x.dtype)
        fresh_values = objective(fresh_points)
        points = torch.cat([reused_points, fresh_points])  # (n, d)
        values = torch.cat([reused_values, fresh_values])
        displacement = points - x
        # minimum-norm solution of displacement @ g = values - f(x) (rank-deficient safe)
        solution = torch.linalg.lstsq(displacement, (values - center_value)[:, None], driver="gelsd").solution[:, 0]
        new_state = RelizoState(state.generation + 1, x, center_value, points, values)
        return Step(state=new_state, gradient=solution, info={"relizo/reused": float(reused_points.shape[0])})


@dataclass(frozen=True)
class XNESState:
    """xNES: search distribution N(x, sigma^2 B B^T)."""

    generation: int
    sigma: float
    """Global step size."""
    shape: torch.Tensor
    """B (d, d), det B = 1, in float32 (SHAPE_DTYPE)."""


# B is the only d x d tensor and each step streams it through memory three times; float32 halves
# that time and its memory (0.4 GB at d = 10,000). Its rounding (1e-7 relative a step) is far below
# what a search distribution's shape needs; the mean and the samples stay in float64.
SHAPE_DTYPE = torch.float32


def xnes_utilities(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Rank utilities for n samples sorted BEST FIRST: max(0, ln(n/2 + 1) - ln k) normalised, minus 1/n."""
    k = torch.arange(1, n + 1, dtype=dtype)
    raw = torch.clamp(math.log(n / 2 + 1) - torch.log(k), min=0)
    return raw / raw.sum() - 1.0 / n  # decreasing: the best sample gets the largest utility; sums to 0


@dataclass(frozen=True)
class XNESSearcher:
    """Exponential natural ES with a full covariance (Glasmachers et al. 2010, "Exponential Natural
    Evolution Strategies", https://doi.org/10.1145/1830483.1830557), minimising.

    The mean moves towards the good samples: x += eta_mu * sigma * B sum_k u_k s_k, utilities
    decreasing from the best sample. (The reference code sorts best first but flips the
    utilities, so the best sample gets the lowest one and it climbs: on a 10-d quadratic f went
    from 2.48 to 1.7e11 in 300 steps.) B's matrix-exponential update is computed exactly in its
    low-rank form (G_M = S^T diag(u) S has rank <= n): O(d^2 n) time a step and O(d^2) memory,
    B in float32 (0.4 GB at d = 10,000).
    """

    config: EstimatorConfig
    seed: int

    def init(self, x0: torch.Tensor) -> XNESState:
        """sigma = mu, B = I."""
        _check_x(x0)
        return XNESState(0, float(self.config.mu), torch.eye(x0.shape[0], dtype=SHAPE_DTYPE))

    def _rates(self, d: int) -> tuple[float, float]:
        default = 3 * (3 + math.log(d)) / (5 * d * math.sqrt(d))
        eta_sigma = self.config.xnes_eta_sigma or default
        eta_shape = self.config.xnes_eta_shape or eta_sigma
        return eta_sigma, eta_shape

    def step(self, objective: Objective, x: torch.Tensor, state: XNESState) -> Step:
        """Sample n points, rank them, move the mean and adapt sigma and B."""
        _check_x(x, state.shape.shape[0])
        n, d = self.config.num_queries, x.shape[0]
        seeds = [m.seed for m in population(self.seed, state.generation, n, antithetic=False)]
        s = directions(seeds, d, x.dtype)  # (n, d)
        s_low = s.to(SHAPE_DTYPE)
        offsets = (s_low @ state.shape.T).to(x.dtype)  # rows B s_k: the one product with B besides the update
        values = objective(x + state.sigma * offsets)  # z_k = x + sigma B s_k
        order = torch.argsort(values)  # best (lowest f) first
        s, s_low, offsets, utility = s[order], s_low[order], offsets[order], xnes_utilities(n, x.dtype)
        eta_sigma, eta_shape = self._rates(d)
        new_x = x + self.config.xnes_eta_mu * state.sigma * (utility @ offsets)  # B sum_k u_k s_k
        # G_M = sum_k u_k (s_k s_k^T - I) = S^T diag(u) S (the utilities sum to 0); G_B = G_M - g_sigma I
        g_sigma = float((utility * s.pow(2).sum(1)).sum()) / d  # tr(G_M) / d
        # expm(t S^T W S) = I + S^T phi(t W S S^T) t W S with phi(M) = (expm(M) - I) M^-1, exact for
        # any rank (expm(U C) = I + U phi(C U) C), so B's update costs O(d^2 n), never a d x d expm
        t = eta_shape / 2
        weighted = t * utility[:, None] * (s @ s.T)  # t W S S^T (n, n)
        block = torch.zeros((2 * n, 2 * n), dtype=x.dtype)
        block[:n, :n], block[:n, n:] = weighted, torch.eye(n, dtype=x.dtype)
        phi = torch.linalg.matrix_exp(block)[:n, n:]  # phi(M): top-right block of expm([[M, I], [0, 0]])
        kernel = phi * (t * utility)[None, :]  # phi(t W S S^T) t W
        scale = math.exp(-t * g_sigma)  # expm(-t g_sigma I) keeps det B = 1
        # B expm(t G_B) = scale * (B + (B S^T) kernel S), with B S^T = offsets^T (rows permuted alike)
        new_shape = torch.addmm(state.shape, (offsets.T @ kernel).to(SHAPE_DTYPE), s_low, beta=scale, alpha=scale)
        new_sigma = state.sigma * math.exp(eta_sigma / 2 * g_sigma)
        return Step(state=XNESState(state.generation + 1, new_sigma, new_shape), x=new_x, info={"xnes/sigma": new_sigma})


@dataclass(frozen=True)
class SepCMAState:
    """sepcmaes: the cmaes library's SepCMA optimizer (mutated in place by ask/tell; pickle it to store)."""

    optimizer: Any


@dataclass(frozen=True)
class SepCMASearcher:
    """Separable CMA-ES (Ros and Hansen 2008) through `cmaes.SepCMA`'s ask/tell; the point is its mean."""

    config: EstimatorConfig
    seed: int

    def init(self, x0: torch.Tensor) -> SepCMAState:
        """SepCMA at x0 with sigma = mu and population num_queries."""
        from cmaes import SepCMA

        _check_x(x0)
        optimizer = SepCMA(mean=x0.detach().cpu().numpy().astype(np.float64), sigma=float(self.config.mu),
                           population_size=self.config.num_queries, seed=int(self.seed))
        return SepCMAState(optimizer)

    def step(self, objective: Objective, x: torch.Tensor, state: SepCMAState) -> Step:
        """One generation: ask population points, evaluate them together, tell."""
        _check_x(x, state.optimizer.dim)
        optimizer = state.optimizer
        asked = np.stack([optimizer.ask() for _ in range(optimizer.population_size)])  # (n, d)
        values = objective(torch.from_numpy(asked).to(x.dtype))
        optimizer.tell(list(zip(asked, values.tolist())))
        return Step(state=state, x=torch.from_numpy(np.array(optimizer.mean)).to(x.dtype))


# ----------------------------------------------------------------------------- registry


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
    searcher: Callable[[EstimatorConfig, int], Any]
    """(config, seed) -> a searcher with init/step for an explicit x."""
    weights: Callable[[EstimatorConfig, Generation, Sequence[Generation]], Weights] | None = None
    """The coefficient rule (seed-population estimators)."""
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


def _register(spec: EstimatorSpec) -> None:
    ESTIMATORS[spec.name] = spec


_register(EstimatorSpec(
    "fo", "exact gradient: the first-order baseline",
    "exact. Charged num_queries queries per step, so it takes as many steps as es at the same budget.",
    False, FirstOrderSearcher, unbiased=True))
_register(EstimatorSpec(
    "es", "no baseline: (1/(n mu)) sum_j F_j u_j",
    "unbiased for grad f_mu; no baseline, so the variance grows with f^2.",
    True, SeedSearcher, _es_weights, unbiased=True))
_register(EstimatorSpec(
    "vanilla", "baseline F(x): (1/(n mu)) sum_j (F_j - F(x)) u_j",
    "unbiased for grad f_mu (E[u] = 0 removes the baseline).",
    True, SeedSearcher, _vanilla_weights, center="always", unbiased=True))
_register(EstimatorSpec(
    "rl", "rank shaping: (1/(n mu)) sum_j (2 rank_j - (n - 1)) u_j, ties averaged",
    "biased: ranks replace values, so E[g] is not grad f_mu; where f is linear over the queries it is a "
    "positive multiple of grad f (a descent direction in expectation), its scale set by n, not by f.",
    True, SeedSearcher, _rl_weights, min_queries=2))
_register(EstimatorSpec(
    "zoo", "finite differences with a single (F(x)) or average (mean F_j) baseline",
    "single: unbiased for grad f_mu; average: E[g] = (1 - 1/n) grad f_mu (each query is part of its own baseline).",
    True, SeedSearcher, _zoo_weights, center="baseline", min_queries=2))
_register(EstimatorSpec(
    "reinforce", "REINFORCE on the policy N(x, mu^2 I) with a single or average baseline",
    "the same coefficients as zoo (Qiu et al. 2025, Theorem 2): single unbiased, average (1 - 1/n) grad f_mu.",
    True, SeedSearcher, _zoo_weights, center="baseline", min_queries=2))
_register(EstimatorSpec(
    "twopoint", "central differences along num_queries // 2 directions: (F+ - F-) / (2 mu) u",
    "unbiased for grad f_mu; f(x) is not queried, so the budget is num_queries, as es's.",
    True, SeedSearcher, _twopoint_weights, antithetic=True, unbiased=True, min_queries=2))
_register(EstimatorSpec(
    "zoar", "averaged baseline over the last H generations' queries, which it reuses; divides by the buffer length N",
    "biased: with fixed query points, E[g] = (1 - 1/N) sum_k (n_k / N) grad f_mu(x_k) over the buffered "
    "generations k (centres x_k, n_k queries); in a run the old x_k lag behind x (a lag like momentum's), "
    "and (1 - 1/N) comes from the averaged baseline. At a fixed point: (1 - 1/N) grad f_mu.",
    True, SeedSearcher, _zoar_weights, uses_history=True, min_queries=2))
_register(EstimatorSpec(
    "zoar_0", "zoar's averaged baseline without reuse (H = 0)",
    "E[g] = (1 - 1/n) grad f_mu: the same estimate as zoo with baseline average.",
    True, SeedSearcher, _zoar_weights, min_queries=2))
_register(EstimatorSpec(
    "zohs", "history smoothing: the mean of the last H + 1 vanilla estimates",
    "biased by lag: E[g] = mean over the H + 1 buffered generations of grad f_mu(x_k); unbiased at a fixed point.",
    True, SeedSearcher, _zohs_weights, center="always", uses_history=True))
_register(EstimatorSpec(
    "zohs_expavg", "exponential average (expavg_beta) of vanilla estimates",
    "biased by lag: E[g_t] = sum_k w_k grad f_mu(x_k), w_t = 1 - beta, w_(t-1) = beta (1 - beta), ..., the first "
    "generation taking the rest beta^(t-1); unbiased at a fixed point. Its state is a d-vector, so no coefficient form "
    "(in the LLM runner: vanilla plus an average of its gradients).",
    False, ExpavgSearcher, center="always"))
_register(EstimatorSpec(
    "relizo", "least-squares interpolation over fresh and reused nearby samples",
    "biased: the minimum-norm interpolant; for m Gaussian samples in d > m dimensions and f linear, "
    "E[g] = (m / d) grad f (the projection on a random m-dimensional subspace); curvature adds O(|delta|) "
    "errors, larger for reused samples (up to reuse_radius * mu * sqrt(d) away).",
    False, RelizoSearcher, min_queries=1))
_register(EstimatorSpec(
    "xnes", "natural ES with a full covariance (mean, sigma and B adapted)",
    "not a gradient estimator: a search distribution whose mean is the point.",
    False, XNESSearcher, min_queries=2))
_register(EstimatorSpec(
    "sepcmaes", "separable CMA-ES through cmaes.SepCMA's ask/tell",
    "not a gradient estimator: a search distribution whose mean is the point.",
    False, SepCMASearcher, min_queries=2))


def get_estimator(name: str) -> EstimatorSpec:
    """The registry entry `name`; ValueError listing the known ones otherwise."""
    if name not in ESTIMATORS:
        raise ValueError(f"estimator {name!r} is unknown; choose from {list(ESTIMATORS)}")
    return ESTIMATORS[name]


def make_searcher(config: EstimatorConfig, seed: int) -> Searcher:
    """The searcher that runs `config` on an explicit x, with its perturbations drawn from `seed`."""
    return get_estimator(config.name).searcher(config, int(seed))
