"""Seed-population estimators: the coefficient rules over seeds (`coefficients`), what a generation
queries, and the gradient those coefficients make over seeded directions."""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from evolm_lib.es import Member, centered_ranks, member_noise, population
from evolm_lib.es import NOISE_DEVICE, NoiseScheme, seeded_combination

from .config import EstimatorConfig, Generation, HistoryState
from .spec import ESTIMATORS, Weights, get_estimator

Params = dict[str, torch.Tensor]
DIRECTION_NAME = "x"  # the one "tensor" of a synthetic point: u(seed) = member_noise(seed, {"x": (d,)})["x"]


# ----------------------------------------------------------------------------- coefficient rules
# Each rule maps (config, current generation, past generations) to per-query weights w_j for the
# generations it uses; query j then adds signs[j] * w_j to the coefficient of seeds[j].



def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


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
    # averaged (the reference breaks ties by argsort order): 2 (n - 1) * centred rank. The ranks are
    # taken in float64: in float32, close values of a large f would tie.
    n = len(current.values)
    ranks = centered_ranks(current.values, dtype=torch.float64).tolist()
    return [(current, [2 * (n - 1) * rank / n for rank in ranks])]


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


# the coefficient rules by name, for the registry (`catalog`): reinforce shares zoo's, zoar_0 zoar's
RULES = {"es": _es_weights, "vanilla": _vanilla_weights, "zoo": _zoo_weights, "rl": _rl_weights,
         "twopoint": _twopoint_weights, "zoar": _zoar_weights, "zohs": _zohs_weights}


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
