"""Statistics for comparing methods across seeds, on ``scipy.stats`` and ``statsmodels``: what is kept
here is only what the libraries do not do (the degenerate cases a study meets, when to enumerate
every split, the smallest p a seed count allows, the decision, and which comparisons form the
corrected family).

Methods, with where they are written down and which library computes them:
- intervals across seeds by Student's t (``scipy.stats.t.interval``) and by the bias-corrected and
  accelerated (BCa) bootstrap (``scipy.stats.bootstrap``; Efron & Tibshirani 1993, "An Introduction
  to the Bootstrap", ch. 14: a 95 % percentile interval over 5 seeds covers far less than 95 %);
  below ``MIN_BOOTSTRAP_VALUES`` seeds only the t interval (``seed_interval``);
- the interquartile mean, the mean of the middle half (``scipy.stats.trim_mean(values, 0.25)``;
  Agarwal et al. 2021, "Deep RL at the Edge of the Statistical Precipice", arXiv 2108.13264);
- the two-sample permutation test of the difference of means over group labels
  (``scipy.stats.permutation_test``; Good 2005, ch. 3), exact when every split can be enumerated;
  its Monte Carlo p-value (b + 1) / (m + 1): Phipson & Smyth 2010, https://arxiv.org/abs/1603.05766;
- Welch's t-test (``scipy.stats.ttest_ind(equal_var=False)``; Welch 1947, Biometrika 34);
- Holm's step-down correction over a declared family of comparisons (``statsmodels.stats.multitest.
  multipletests(method="holm")``; Holm 1979, Scand. J. Statist. 6).

Every random draw takes a seed, so a table computed twice gives the same numbers.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

Statistic = Callable[..., "np.ndarray"]  # statistic(sample, axis=-1): np.mean, np.median, ...

MAX_EXACT_SPLITS = 200_000
"""The permutation test enumerates every split of the pooled values up to this many (10 against 10
seeds: C(20, 10) = 184,756, about a second and a half); above, it samples, and its p is then an
estimate that cannot fall below ``2 / (draws + 1)``, its floor."""
MIN_BOOTSTRAP_VALUES = 5
"""The fewest values a bootstrap interval across seeds is drawn from: below, a resample of 3 or 4
values takes so few distinct forms that the BCa interval's coverage means nothing, and Student's t
interval is given instead (``seed_interval``)."""
INTERVAL_METHODS = ("BCa", "percentile", "basic")
"""The bootstrap intervals scipy.stats.bootstrap computes; BCa by default."""


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


def _check_method(method: str) -> None:
    if method not in INTERVAL_METHODS:
        raise ValueError(f"method: one of {', '.join(INTERVAL_METHODS)}, got {method!r}")


@contextlib.contextmanager
def _nearly_constant_values_pass() -> Iterator[None]:
    """Values that differ only in their last bits (equal scores summed in another order) make scipy
    warn of precision loss in its moments; the interval or test it then gives is as narrow as the
    values, which is what they say, so the warning (printed into notebooks) is not passed on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Precision loss occurred in moment calculation", category=RuntimeWarning)
        yield


def t_interval(values: Sequence[float] | np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its Student's t interval, mean -/+ t_(n-1) s / sqrt(n)
    (``scipy.stats.t.interval``). Constant values and one value give the value three times."""
    import scipy.stats

    _check_level(level)
    array = _values(values)
    mean = float(array.mean())
    if array.size < 2 or np.all(array == array[0]):
        return mean, mean, mean
    with _nearly_constant_values_pass():
        low, high = scipy.stats.t.interval(level, df=array.size - 1, loc=mean, scale=scipy.stats.sem(array))
    return mean, float(low), float(high)


def bootstrap_interval(values: Sequence[float] | np.ndarray, level: float = 0.95, num_resamples: int = 10_000,
                       seed: int = 0, statistic: Statistic = np.mean, method: str = "BCa") -> tuple[float, float, float]:
    """(estimate, low, high): ``statistic`` of ``values`` and its bootstrap interval at ``level``
    (``scipy.stats.bootstrap`` with ``method``, BCa by default, numpy's default_rng(seed), so the
    interval repeats). Constant values give that constant three times; so does one value (a
    bootstrap of one value has no spread to show: that says nothing about the uncertainty). Where
    BCa is undefined scipy returns NaN ends, and so does this."""
    import scipy.stats

    _check_level(level)
    _check_method(method)
    if num_resamples < 1:
        raise ValueError(f"num_resamples: at least 1, got {num_resamples}")
    array = _values(values)
    estimate = float(statistic(array))
    if array.size < 2 or np.all(array == array[0]):
        return estimate, estimate, estimate
    with warnings.catch_warnings():  # degenerate resamples: scipy warns and gives NaN, which is reported as such
        warnings.simplefilter("ignore")
        result = scipy.stats.bootstrap((array,), statistic, confidence_level=level, n_resamples=num_resamples,
                                       method=method, rng=np.random.default_rng(seed), vectorized=True)
    return estimate, float(result.confidence_interval.low), float(result.confidence_interval.high)


def seed_interval(values: Sequence[float] | np.ndarray, level: float = 0.95, num_resamples: int = 10_000,
                  seed: int = 0) -> tuple[float, float, float, str]:
    """(mean, low, high, kind): the mean across seeds with its BCa bootstrap interval where there are
    at least ``MIN_BOOTSTRAP_VALUES`` values (kind "BCa"), else Student's t interval (kind "t"): no
    bootstrap over 3 seeds."""
    array = _values(values)
    if array.size < MIN_BOOTSTRAP_VALUES:
        return (*t_interval(array, level=level), "t")
    return (*bootstrap_interval(array, level=level, num_resamples=num_resamples, seed=seed), "BCa")


def interquartile_mean(values: Sequence[float] | np.ndarray, axis: int | None = None) -> "float | np.ndarray":
    """The mean of the middle half of the values (25 % trimmed from each end; ``scipy.stats.trim_mean``)."""
    import scipy.stats

    if axis is None:
        return float(scipy.stats.trim_mean(_values(values), 0.25))
    return scipy.stats.trim_mean(values, 0.25, axis=axis)


def _difference_of_means(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(a, axis=axis) - np.mean(b, axis=axis)


def bootstrap_difference(a: Sequence[float], b: Sequence[float], level: float = 0.95, num_resamples: int = 10_000,
                         seed: int = 0, method: str = "BCa") -> tuple[float, float, float]:
    """(mean(a) - mean(b), low, high): the difference of means and its bootstrap interval, each group
    resampled with replacement on its own (``scipy.stats.bootstrap``, unpaired, ``method``); two
    constant groups give the difference three times, a group of one value NaN ends."""
    import scipy.stats

    _check_level(level)
    _check_method(method)
    a, b = _values(a, "a"), _values(b, "b")
    difference = float(a.mean() - b.mean())
    if np.all(a == a[0]) and np.all(b == b[0]):
        return difference, difference, difference
    if a.size < 2 or b.size < 2:  # scipy resamples no group of one value: no interval
        return difference, math.nan, math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = scipy.stats.bootstrap((a, b), _difference_of_means, confidence_level=level, n_resamples=num_resamples,
                                       method=method, rng=np.random.default_rng(seed), vectorized=True)
    return difference, float(result.confidence_interval.low), float(result.confidence_interval.high)


class PermutationTest(NamedTuple):
    """A two-sided permutation test's result."""

    p: float
    "twice the smaller one-sided share of splits at least as extreme as the observed one (at most 1)"
    exact: bool
    "True: every split was enumerated; False: a seeded Monte Carlo sample of splits"
    splits: int
    "splits enumerated (exact) or drawn (Monte Carlo)"
    smallest_p: float
    "the smallest p this test can give for these group sizes (2 / C(n + m, n) exactly; 2 / (m + 1) sampled)"


def permutation_test(a: Sequence[float], b: Sequence[float], max_exact: int = MAX_EXACT_SPLITS,
                     num_permutations: int = 100_000, seed: int = 0) -> PermutationTest:
    """Two-sided permutation test of mean(a) - mean(b) over group labels (``scipy.stats.permutation_test``,
    independent samples).

    Under "the method makes no difference" every assignment of n of the pooled n + m values to group
    a is as likely as the observed one. All C(n + m, n) assignments are enumerated when there are at
    most ``max_exact`` (5 vs 5 seeds: 252); otherwise ``num_permutations`` random ones are drawn with
    default_rng(seed) and each one-sided share is (b + 1) / (m + 1), never 0. [1, 2, 3] vs [4, 5, 6]:
    one split of 20 is as low as the observed one, so p = 2 x 1 / 20 = 0.1. A group of one value
    gives p NaN (scipy asks for two per group).
    """
    import scipy.stats

    a, b = _values(a, "a"), _values(b, "b")
    count_all = math.comb(a.size + b.size, a.size)
    exact = count_all <= max_exact
    if not exact and num_permutations < 1:
        raise ValueError(f"num_permutations: at least 1, got {num_permutations}")
    splits = count_all if exact else num_permutations
    if a.size < 2 or b.size < 2:  # scipy refuses a group of one value: no p, as for Welch's t
        return PermutationTest(math.nan, exact, splits, min(1.0, 2 / count_all))
    result = scipy.stats.permutation_test((a, b), _difference_of_means, permutation_type="independent",
                                          vectorized=True, n_resamples=np.inf if exact else num_permutations,
                                          alternative="two-sided", rng=np.random.default_rng(seed))
    smallest = 2 / count_all if exact else 2 / (num_permutations + 1)
    return PermutationTest(float(result.pvalue), exact, splits, min(1.0, smallest))


class WelchTest(NamedTuple):
    """Welch's t-test's result (NaN throughout where it is undefined)."""

    t: float
    "(mean(a) - mean(b)) / sqrt(var(a) / n + var(b) / m), sample variances (n - 1)"
    dof: float
    "Welch-Satterthwaite degrees of freedom"
    p: float
    "two-sided p from Student's t with those degrees of freedom"


def welch_t_test(a: Sequence[float], b: Sequence[float]) -> WelchTest:
    """Welch's unequal-variance t-test of mean(a) = mean(b), two-sided (``scipy.stats.ttest_ind`` with
    ``equal_var=False``). It assumes each group's mean is near normal, which 5 seeds barely support:
    the permutation test is the one to decide on. NaN throughout when a group has fewer than two
    values or neither group varies."""
    import scipy.stats

    a, b = _values(a, "a"), _values(b, "b")
    if a.size < 2 or b.size < 2 or (a.var() == 0 and b.var() == 0):
        return WelchTest(math.nan, math.nan, math.nan)
    with _nearly_constant_values_pass():
        result = scipy.stats.ttest_ind(a, b, equal_var=False)
    return WelchTest(float(result.statistic), float(result.df), float(result.pvalue))


def welch_interval(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean(a) - mean(b), low, high): the difference of means with Welch's t interval
    (``scipy.stats.ttest_ind(equal_var=False).confidence_interval``); two constant groups give the
    difference three times, a group of one value NaN ends."""
    import scipy.stats

    _check_level(level)
    a, b = _values(a, "a"), _values(b, "b")
    difference = float(a.mean() - b.mean())
    if np.all(a == a[0]) and np.all(b == b[0]):
        return difference, difference, difference
    if a.size < 2 or b.size < 2:
        return difference, math.nan, math.nan
    with _nearly_constant_values_pass():
        interval = scipy.stats.ttest_ind(a, b, equal_var=False).confidence_interval(confidence_level=level)
    return difference, float(interval.low), float(interval.high)


def holm(pvalues: Sequence[float], alpha: float = 0.05) -> tuple[list[bool], list[float]]:
    """(rejected, adjusted p) of a family of tests by Holm's step-down correction
    (``statsmodels.stats.multitest.multipletests(method="holm")``): the k-th smallest p is multiplied
    by (m - k + 1), kept non-decreasing, capped at 1. An empty family gives two empty lists."""
    from statsmodels.stats.multitest import multipletests

    if not 0 < alpha < 1:
        raise ValueError(f"alpha: a significance level between 0 and 1, got {alpha!r}")
    if len(pvalues) == 0:
        return [], []
    rejected, adjusted, _, _ = multipletests(_values(pvalues, "pvalues"), alpha=alpha, method="holm")
    return [bool(r) for r in rejected], [float(p) for p in adjusted]


# --------------------------------------------------------------------------- the decision


@dataclass(frozen=True)
class SeedComparison:
    """Whether two methods differ by more than seed noise, from one value per seed of each."""

    difference: float
    "mean(a) - mean(b)"
    low: float
    "lower end of the interval of the difference (``interval``)"
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
    interval: str = "BCa"
    "how the interval was drawn: \"BCa\" (bootstrap, each side at least ``MIN_BOOTSTRAP_VALUES`` seeds) or \"t\" (Welch's)"

    @property
    def larger_than_seed_noise(self) -> bool:
        """True when the permutation test's p is below alpha (two-sided, uncorrected: a family of
        comparisons is corrected by ``holm``)."""
        return self.permutation.p < self.alpha


def compare_seeds(a: Sequence[float], b: Sequence[float], alpha: float = 0.05, level: float = 0.95,
                  num_resamples: int = 10_000, max_exact: int = MAX_EXACT_SPLITS, num_permutations: int = 100_000,
                  seed: int = 0, method: str = "BCa") -> SeedComparison:
    """Compare per-seed values of two methods (e.g. 5 held-out accuracies each): the difference of
    means with its bootstrap interval (`bootstrap_difference`; Welch's t interval where a side has
    fewer than ``MIN_BOOTSTRAP_VALUES`` seeds, `welch_interval`), the permutation test over seed
    labels (`permutation_test`, the decision: p < alpha) and Welch's t (`welch_t_test`)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha: a significance level between 0 and 1, got {alpha!r}")
    if min(len(a), len(b)) < MIN_BOOTSTRAP_VALUES:
        difference, low, high = welch_interval(a, b, level=level)
        kind = "t"
    else:
        difference, low, high = bootstrap_difference(a, b, level=level, num_resamples=num_resamples, seed=seed,
                                                     method=method)
        kind = method
    permutation = permutation_test(a, b, max_exact=max_exact, num_permutations=num_permutations, seed=seed)
    return SeedComparison(difference, low, high, level, permutation, welch_t_test(a, b), alpha, kind)
