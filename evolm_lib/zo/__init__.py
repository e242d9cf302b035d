"""Zeroth-order estimators: a synthetic testbed, and the same estimators for LLM ES.

- `functions`: Ackley, Levy, Rosenbrock, Quadratic, Rastrigin on torch tensors (batched), with exact
  gradients and minimisers; `start_point(d, seed)`.
- `estimators`: the registry (`ESTIMATORS`), the coefficient interface over seeded directions
  (`coefficients`, `Generation`, `HistoryState`, `seeded_gradient`) and searchers for explicit x.
- `updates`: sgd, adam, radazo (descent).
- `run`: estimator x function x seed at an equal query budget; `plots`: figures; `benchmark`: timings.

Paper: Qiu, Xie, Yan, Yang, Shu 2025, "Zeroth-Order Optimization is Secretly Single-Step Policy
Optimization", https://arxiv.org/abs/2506.14460.

Sign convention: this package MINIMISES f. The LLM ES runner maximises reward; it passes
f = -reward and ascends along -g.
"""
from .estimators import (
    ESTIMATORS,
    EstimatorConfig,
    EstimatorSpec,
    Generation,
    HistoryState,
    coefficients,
    directions,
    get_estimator,
    make_searcher,
    needs_center,
    queries_per_step,
    query_members,
    seeded_gradient,
)
from .functions import FUNCTIONS, TestFunction, get_function, start_point
from .updates import UPDATE_RULES, UpdateConfig, UpdateState, apply_update, init_update_state

__all__ = [
    "ESTIMATORS",
    "EstimatorConfig",
    "EstimatorSpec",
    "Generation",
    "HistoryState",
    "coefficients",
    "directions",
    "get_estimator",
    "make_searcher",
    "needs_center",
    "queries_per_step",
    "query_members",
    "seeded_gradient",
    "FUNCTIONS",
    "TestFunction",
    "get_function",
    "start_point",
    "UPDATE_RULES",
    "UpdateConfig",
    "UpdateState",
    "apply_update",
    "init_update_state",
]
