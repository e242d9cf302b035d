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

The pieces: `spec` (the registry's entry and lookup), `config` (settings, generations, history),
`coefficients` (the coefficient rules and the gradient over seeded directions), `searchers` and
`sample_searchers` (explicit x), `catalog` (every estimator's entry, `make_searcher`).

Where this differs from the paper's reference code (its optimizer/zo.py):
- queries: an estimator queries f(x) only when its formula uses it (vanilla, zoo/reinforce with
  the single baseline, zohs, zohs_expavg, relizo); the reference evaluates f(x) every step for
  logging, also for es, twopoint and zoar, which then cost num_queries + 1;
- rl: tied values share their average rank (the reference breaks ties by argsort order);
- xnes: the best sample gets the largest utility (the reference's flipped utilities climb);
- relizo: reused samples are kept (the reference zeroed them and skipped every reusing step);
- update rules: bias correction is an option (the reference has none; off by default).
"""
from __future__ import annotations

from .catalog import make_searcher
from .coefficients import (
    DIRECTION_NAME,
    RULES,
    Params,
    Weights,
    coefficients,
    directions,
    needs_center,
    queries_per_step,
    query_members,
    seeded_gradient,
)
from .config import BASELINES, EstimatorConfig, Generation, HistoryState
from .sample_searchers import (
    SHAPE_DTYPE,
    RelizoSearcher,
    RelizoState,
    SepCMASearcher,
    SepCMAState,
    XNESSearcher,
    XNESState,
    xnes_utilities,
)
from .searchers import (
    ExpavgSearcher,
    ExpavgState,
    FirstOrderSearcher,
    Objective,
    Searcher,
    SeedSearcher,
    SeedState,
    Step,
)
from .spec import ESTIMATORS, EstimatorSpec, get_estimator

__all__ = [
    "make_searcher", "DIRECTION_NAME", "RULES", "Params", "Weights", "coefficients", "directions", "needs_center",
    "queries_per_step", "query_members", "seeded_gradient", "BASELINES", "EstimatorConfig", "Generation",
    "HistoryState", "SHAPE_DTYPE", "RelizoSearcher", "RelizoState", "SepCMASearcher", "SepCMAState", "XNESSearcher",
    "XNESState", "xnes_utilities", "ExpavgSearcher", "ExpavgState", "FirstOrderSearcher", "Objective", "Searcher",
    "SeedSearcher", "SeedState", "Step", "ESTIMATORS", "EstimatorSpec", "get_estimator",
]
