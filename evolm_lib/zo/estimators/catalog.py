"""Every estimator of the registry: how it queries, what it estimates (its bias, tested in
tests/test_zo_estimators.py), and the searcher that runs it on an explicit x."""
from __future__ import annotations

from .coefficients import RULES
from .config import EstimatorConfig
from .sample_searchers import RelizoSearcher, SepCMASearcher, XNESSearcher
from .searchers import ExpavgSearcher, FirstOrderSearcher, Searcher, SeedSearcher
from .spec import EstimatorSpec, get_estimator, register


register(EstimatorSpec(
    "fo", "exact gradient: the first-order baseline",
    "exact. Charged num_queries queries per step, so it takes as many steps as es at the same budget.",
    False, FirstOrderSearcher, unbiased=True))
register(EstimatorSpec(
    "es", "no baseline: (1/(n mu)) sum_j F_j u_j",
    "unbiased for grad f_mu; no baseline, so the variance grows with f^2.",
    True, SeedSearcher, RULES["es"], unbiased=True))
register(EstimatorSpec(
    "vanilla", "baseline F(x): (1/(n mu)) sum_j (F_j - F(x)) u_j",
    "unbiased for grad f_mu (E[u] = 0 removes the baseline).",
    True, SeedSearcher, RULES["vanilla"], center="always", unbiased=True))
register(EstimatorSpec(
    "rl", "rank shaping: (1/(n mu)) sum_j (2 rank_j - (n - 1)) u_j, ties averaged",
    "biased: ranks replace values, so E[g] is not grad f_mu; where f is linear over the queries it is a "
    "positive multiple of grad f (a descent direction in expectation), its scale set by n, not by f.",
    True, SeedSearcher, RULES["rl"], min_queries=2))
register(EstimatorSpec(
    "zoo", "finite differences with a single (F(x)) or average (mean F_j) baseline",
    "single: unbiased for grad f_mu; average: E[g] = (1 - 1/n) grad f_mu (each query is part of its own baseline).",
    True, SeedSearcher, RULES["zoo"], center="baseline", min_queries=2))
register(EstimatorSpec(
    "reinforce", "REINFORCE on the policy N(x, mu^2 I) with a single or average baseline",
    "the same coefficients as zoo (Qiu et al. 2025, Theorem 2): single unbiased, average (1 - 1/n) grad f_mu.",
    True, SeedSearcher, RULES["zoo"], center="baseline", min_queries=2))
register(EstimatorSpec(
    "twopoint", "central differences along num_queries // 2 directions: (F+ - F-) / (2 mu) u",
    "unbiased for grad f_mu; f(x) is not queried, so the budget is num_queries, as es's.",
    True, SeedSearcher, RULES["twopoint"], antithetic=True, unbiased=True, min_queries=2))
register(EstimatorSpec(
    "zoar", "averaged baseline over the last H generations' queries, which it reuses; divides by the buffer length N",
    "biased: with fixed query points, E[g] = (1 - 1/N) sum_k (n_k / N) grad f_mu(x_k) over the buffered "
    "generations k (centres x_k, n_k queries); in a run the old x_k lag behind x (a lag like momentum's), "
    "and (1 - 1/N) comes from the averaged baseline. At a fixed point: (1 - 1/N) grad f_mu.",
    True, SeedSearcher, RULES["zoar"], uses_history=True, min_queries=2))
register(EstimatorSpec(
    "zoar_0", "zoar's averaged baseline without reuse (H = 0)",
    "E[g] = (1 - 1/n) grad f_mu: the same estimate as zoo with baseline average.",
    True, SeedSearcher, RULES["zoar"], min_queries=2))
register(EstimatorSpec(
    "zohs", "history smoothing: the mean of the last H + 1 vanilla estimates",
    "biased by lag: E[g] = mean over the H + 1 buffered generations of grad f_mu(x_k); unbiased at a fixed point.",
    True, SeedSearcher, RULES["zohs"], center="always", uses_history=True))
register(EstimatorSpec(
    "zohs_expavg", "exponential average (expavg_beta) of vanilla estimates",
    "biased by lag: E[g_t] = sum_k w_k grad f_mu(x_k), w_t = 1 - beta, w_(t-1) = beta (1 - beta), ..., the first "
    "generation taking the rest beta^(t-1); unbiased at a fixed point. Its state is a d-vector, so no coefficient form "
    "(in the LLM runner: vanilla plus an average of its gradients).",
    False, ExpavgSearcher, center="always"))
register(EstimatorSpec(
    "relizo", "least-squares interpolation over fresh and reused nearby samples",
    "biased: the minimum-norm interpolant; for m Gaussian samples in d > m dimensions and f linear, "
    "E[g] = (m / d) grad f (the projection on a random m-dimensional subspace); curvature adds O(|delta|) "
    "errors, larger for reused samples (up to reuse_radius * mu * sqrt(d) away).",
    False, RelizoSearcher, min_queries=1))
register(EstimatorSpec(
    "xnes", "natural ES with a full covariance (mean, sigma and B adapted)",
    "not a gradient estimator: a search distribution whose mean is the point.",
    False, XNESSearcher, min_queries=2))
register(EstimatorSpec(
    "sepcmaes", "separable CMA-ES through cmaes.SepCMA's ask/tell",
    "not a gradient estimator: a search distribution whose mean is the point.",
    False, SepCMASearcher, min_queries=2))


def make_searcher(config: EstimatorConfig, seed: int) -> Searcher:
    """The searcher that runs `config` on an explicit x, with its perturbations drawn from `seed`."""
    return get_estimator(config.name).searcher(config, int(seed))
