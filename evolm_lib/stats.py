"""Statistics for comparing methods across seeds: percentile bootstrap intervals, an exact permutation
test over seed labels, and Welch's t-test. Pure functions on numbers (numpy and the standard library;
no scipy: Student's t tail is computed here from the regularised incomplete beta function).

Methods, with where they are written down:
- percentile bootstrap interval: Efron & Tibshirani 1993, "An Introduction to the Bootstrap", ch. 13;
- two-sample permutation test of the difference of means (labels exchangeable under "no difference"):
  Good 2005, "Permutation, Parametric and Bootstrap Tests of Hypotheses", ch. 3; its Monte Carlo
  p-value (b + 1) / (m + 1): Phipson & Smyth 2010, https://arxiv.org/abs/1603.05766;
- Welch's t with Welch-Satterthwaite degrees of freedom: Welch 1947, Biometrika 34;
- the incomplete beta function by Lentz's continued fraction: Numerical Recipes, 3rd ed., section 6.4.

Every random draw takes a seed, so a table computed twice gives the same numbers.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

Statistic = Callable[..., "np.ndarray"]  # statistic(sample, axis=-1): np.mean, np.median, ...

MAX_EXACT_SPLITS = 100_000
"""The permutation test enumerates every split of the pooled values up to this many; above, it samples."""
_CHUNK_ELEMENTS = 2_000_000  # resamples drawn in blocks of about this many indices (16 MB), not all at once


def _values(values: Sequence[float] | np.ndarray, name: str = "values") -> np.ndarray:
    """A flat float array without NaN; fails naming ``name`` when it is empty or holds a NaN."""
    array = np.asarray(values, dtype=float).ravel()
    if array.size == 0:
        raise ValueError(f"{name}: no values")
    if np.isnan(array).any():
        raise ValueError(f"{name}: holds NaN (a run without a score?)")
    return array


def _check_level(level: float) -> None:
    if not 0 < level < 1:
        raise ValueError(f"level: a coverage between 0 and 1 (0.95 for a 95 % interval), got {level!r}")


def _percentile_interval(resampled: np.ndarray, level: float) -> tuple[float, float]:
    """(low, high): the (1 - level) / 2 and (1 + level) / 2 percentiles (numpy's linear interpolation)."""
    low, high = np.percentile(resampled, [100 * (1 - level) / 2, 100 * (1 + level) / 2])
    return float(low), float(high)


def _resampled(values: np.ndarray, num_resamples: int, rng: np.random.Generator, statistic: Statistic) -> np.ndarray:
    """``statistic`` of ``num_resamples`` samples of ``values`` drawn with replacement, each of its size."""
    n = values.size
    out = np.empty(num_resamples)
    block = max(1, _CHUNK_ELEMENTS // n)
    for start in range(0, num_resamples, block):
        count = min(block, num_resamples - start)
        indices = rng.integers(0, n, size=(count, n))  # (count, n)
        out[start:start + count] = statistic(values[indices], axis=1)
    return out


def bootstrap_interval(values: Sequence[float] | np.ndarray, level: float = 0.95, num_resamples: int = 10_000,
                       seed: int = 0, statistic: Statistic = np.mean) -> tuple[float, float, float]:
    """(estimate, low, high): ``statistic`` of ``values`` and its percentile bootstrap interval.

    Method: draw ``num_resamples`` samples of len(values) values with replacement (numpy's
    default_rng(seed), so the interval repeats), compute ``statistic(sample, axis=-1)`` of each, and
    take the (1 - level) / 2 and (1 + level) / 2 percentiles of those. The estimate is the statistic
    of the values themselves. Constant values give that constant three times; so does one value
    (a bootstrap of one value has no spread to show: that says nothing about the uncertainty).
    """
    _check_level(level)
    if num_resamples < 1:
        raise ValueError(f"num_resamples: at least 1, got {num_resamples}")
    array = _values(values)
    estimate = float(statistic(array))
    resampled = _resampled(array, num_resamples, np.random.default_rng(seed), statistic)
    low, high = _percentile_interval(resampled, level)
    return estimate, low, high


def bootstrap_difference(a: Sequence[float], b: Sequence[float], level: float = 0.95, num_resamples: int = 10_000,
                         seed: int = 0) -> tuple[float, float, float]:
    """(mean(a) - mean(b), low, high): the difference of means and its percentile bootstrap interval,
    each group resampled with replacement on its own (its size kept), numpy's default_rng(seed)."""
    _check_level(level)
    a, b = _values(a, "a"), _values(b, "b")
    rng = np.random.default_rng(seed)
    differences = _resampled(a, num_resamples, rng, np.mean) - _resampled(b, num_resamples, rng, np.mean)
    low, high = _percentile_interval(differences, level)
    return float(a.mean() - b.mean()), low, high


class PermutationTest(NamedTuple):
    """A two-sided permutation test's result."""

    p: float
    "share of splits whose |difference of means| is at least the observed one"
    exact: bool
    "True: every split was enumerated; False: a seeded Monte Carlo sample of splits"
    splits: int
    "splits enumerated (exact) or drawn (Monte Carlo)"
    smallest_p: float
    "the smallest p this test can give for these group sizes (2 / C(n + m, n) when n = m, else 1 / C)"


def permutation_test(a: Sequence[float], b: Sequence[float], max_exact: int = MAX_EXACT_SPLITS,
                     num_permutations: int = 100_000, seed: int = 0) -> PermutationTest:
    """Two-sided permutation test of mean(a) - mean(b) over group labels.

    Method: pool the n + m values; under "the method makes no difference" every assignment of n of
    them to group a is as likely as the observed one. p is the share of assignments whose
    |mean(a') - mean(b')| is at least the observed |mean(a) - mean(b)| (ties within a relative 1e-9
    count as at least: float sums in another order). All C(n + m, n) assignments, the observed one
    included, are enumerated when there are at most ``max_exact`` (5 vs 5 seeds: 252); otherwise
    ``num_permutations`` random ones are drawn with default_rng(seed) and p = (b + 1) / (m + 1),
    which is never 0 (Phipson & Smyth 2010). [1, 2, 3] vs [4, 5, 6]: only the observed split and its
    mirror reach |difference| 3, so p = 2 / 20 = 0.1.
    """
    a, b = _values(a, "a"), _values(b, "b")
    pooled = np.concatenate([a, b])
    n, m = a.size, b.size
    total = pooled.sum()
    observed = abs(a.sum() / n - (total - a.sum()) / m)
    tolerance = 1e-9 * max(1.0, float(np.abs(pooled).max()))
    count_all = math.comb(n + m, n)
    if count_all <= max_exact:
        chosen = np.array(list(itertools.combinations(range(n + m), n)), dtype=np.int64)  # (splits, n)
        sums = pooled[chosen].sum(axis=1)
        differences = np.abs(sums / n - (total - sums) / m)
        extreme = int(np.count_nonzero(differences >= observed - tolerance))
        smallest = (2 if n == m else 1) / count_all
        return PermutationTest(extreme / count_all, True, count_all, min(1.0, smallest))
    if num_permutations < 1:
        raise ValueError(f"num_permutations: at least 1, got {num_permutations}")
    rng = np.random.default_rng(seed)
    extreme = 0
    block = max(1, _CHUNK_ELEMENTS // (n + m))
    for start in range(0, num_permutations, block):
        count = min(block, num_permutations - start)
        order = rng.permuted(np.tile(np.arange(n + m), (count, 1)), axis=1)  # (count, n + m)
        sums = pooled[order[:, :n]].sum(axis=1)
        extreme += int(np.count_nonzero(np.abs(sums / n - (total - sums) / m) >= observed - tolerance))
    return PermutationTest((extreme + 1) / (num_permutations + 1), False, num_permutations,
                           1 / (num_permutations + 1))


# --------------------------------------------------------------------------- Welch's t


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) by the modified Lentz method (Numerical Recipes 6.4)."""
    tiny, epsilon = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for k in range(1, 1000):
        for numerator in (k * (b - k) * x / ((a + 2 * k - 1) * (a + 2 * k)),
                          -(a + k) * (a + b + k) * x / ((a + 2 * k) * (a + 2 * k + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < epsilon:
            return h
    raise ArithmeticError(f"incomplete beta I_{x}({a}, {b}): continued fraction did not converge")


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularised incomplete beta function (a, b > 0; 0 <= x <= 1), by its continued
    fraction, with the symmetry I_x(a, b) = 1 - I_(1-x)(b, a) where that converges faster."""
    if a <= 0 or b <= 0:
        raise ValueError(f"incomplete beta: a and b must be positive, got a={a}, b={b}")
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1 - x) / b


def student_t_two_sided_p(t: float, dof: float) -> float:
    """P(|T| >= |t|) for Student's t with ``dof`` degrees of freedom (not necessarily whole):
    I_(dof / (dof + t^2))(dof / 2, 1 / 2); the normal tail for infinite dof. dof 1: 1 - 2 atan|t| / pi."""
    if math.isnan(t) or math.isnan(dof) or dof <= 0:
        return math.nan
    if math.isinf(t):
        return 0.0
    if math.isinf(dof):
        return math.erfc(abs(t) / math.sqrt(2))
    return regularized_incomplete_beta(dof / 2, 0.5, dof / (dof + t * t))


class WelchTest(NamedTuple):
    """Welch's t-test's result (NaN throughout where it is undefined)."""

    t: float
    "(mean(a) - mean(b)) / sqrt(var(a) / n + var(b) / m), sample variances (n - 1)"
    dof: float
    "Welch-Satterthwaite degrees of freedom"
    p: float
    "two-sided p from Student's t with those degrees of freedom"


def welch_t_test(a: Sequence[float], b: Sequence[float]) -> WelchTest:
    """Welch's unequal-variance t-test of mean(a) = mean(b), two-sided.

    t = (mean(a) - mean(b)) / se with se^2 = s_a^2 / n + s_b^2 / m (sample variances, n - 1), dof =
    se^4 / ((s_a^2 / n)^2 / (n - 1) + (s_b^2 / m)^2 / (m - 1)), p from Student's t with those dof
    (computed here, not by scipy). It assumes each group's mean is near normal, which 5 seeds barely
    support: the permutation test is the one to decide on. NaN throughout when a group has fewer
    than two values or neither group varies (se = 0)."""
    a, b = _values(a, "a"), _values(b, "b")
    n, m = a.size, b.size
    if n < 2 or m < 2:
        return WelchTest(math.nan, math.nan, math.nan)
    share_a, share_b = a.var(ddof=1) / n, b.var(ddof=1) / m
    se2 = share_a + share_b
    if se2 == 0:
        return WelchTest(math.nan, math.nan, math.nan)
    t = float((a.mean() - b.mean()) / math.sqrt(se2))
    dof = float(se2 ** 2 / (share_a ** 2 / (n - 1) + share_b ** 2 / (m - 1)))
    return WelchTest(t, dof, student_t_two_sided_p(t, dof))


# --------------------------------------------------------------------------- the decision


@dataclass(frozen=True)
class SeedComparison:
    """Whether two methods differ by more than seed noise, from one value per seed of each."""

    difference: float
    "mean(a) - mean(b)"
    low: float
    "lower end of the bootstrap interval of the difference"
    high: float
    "upper end of that interval"
    level: float
    "the interval's coverage (0.95)"
    permutation: PermutationTest
    "the two-sided permutation test over seed labels: the decision"
    welch: WelchTest
    "Welch's t-test, for reference (assumes normal means)"
    alpha: float
    "significance level of the decision"

    @property
    def larger_than_seed_noise(self) -> bool:
        """True when the permutation test's p is below alpha (two-sided)."""
        return self.permutation.p < self.alpha


def compare_seeds(a: Sequence[float], b: Sequence[float], alpha: float = 0.05, level: float = 0.95,
                  num_resamples: int = 10_000, max_exact: int = MAX_EXACT_SPLITS, num_permutations: int = 100_000,
                  seed: int = 0) -> SeedComparison:
    """Compare per-seed values of two methods (e.g. 5 held-out accuracies each): the difference of
    means with its bootstrap interval (`bootstrap_difference`), the permutation test over seed labels
    (`permutation_test`, the decision: p < alpha) and Welch's t (`welch_t_test`)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha: a significance level between 0 and 1, got {alpha!r}")
    difference, low, high = bootstrap_difference(a, b, level=level, num_resamples=num_resamples, seed=seed)
    permutation = permutation_test(a, b, max_exact=max_exact, num_permutations=num_permutations, seed=seed)
    return SeedComparison(difference, low, high, level, permutation, welch_t_test(a, b), alpha)
