"""Tests for evolm_lib.stats on values computed by hand: t and bootstrap (BCa, percentile) intervals,
the interquartile mean, the permutation test over seed labels (exact and Monte Carlo), Welch's t-test,
Holm's correction and the seed comparison."""
from __future__ import annotations

import math

import numpy as np
import pytest

from evolm_lib import stats


# ----------------------------------------------------------------------------- bootstrap


def test_bootstrap_interval_of_constant_data_is_that_constant():
    assert stats.bootstrap_interval([3.0] * 5) == (3.0, 3.0, 3.0)
    assert stats.bootstrap_interval([0.1] * 7) == pytest.approx((0.1, 0.1, 0.1))
    assert stats.bootstrap_interval([2.5]) == (2.5, 2.5, 2.5)  # one value: no spread to resample


def test_bootstrap_interval_of_two_values_spans_them():
    # a resampled mean of [0, 1] is 0, 0.5 or 1 with chances 1/4, 1/2, 1/4: the 2.5 and 97.5
    # percentiles of 10,000 of them are 0 and 1 (each end holds about 25 % of the draws)
    assert stats.bootstrap_interval([0.0, 1.0]) == (0.5, 0.0, 1.0)
    # at level 0.4 the ends are the 30th and 70th percentiles: both 0.5 (it holds the middle 50 %)
    assert stats.bootstrap_interval([0.0, 1.0], level=0.4) == (0.5, 0.5, 0.5)


def test_bootstrap_interval_repeats_with_the_seed_and_moves_without_it():
    values = [1, 0, 1, 1, 0, 1, 0, 1, 1, 1, 0, 0, 1]
    first = stats.bootstrap_interval(values, seed=3)
    assert stats.bootstrap_interval(values, seed=3) == first
    assert stats.bootstrap_interval(values, seed=4) != first
    estimate, low, high = first
    assert estimate == pytest.approx(8 / 13) and 0 <= low < estimate < high <= 1
    # every bootstrap mean of 13 zeros and ones is a multiple of 1/13; numpy's percentile may
    # interpolate between two neighbours, so the ends lie on a grid of 1/26 at worst
    assert (low * 26) == pytest.approx(round(low * 26)) and (high * 26) == pytest.approx(round(high * 26))


def test_bootstrap_interval_with_another_statistic_and_its_errors():
    # median of resamples of [1, 2, 100]: the median is 100 only when two of three draws are 100
    # (7/27 of the time), so the 95 % interval reaches it; the estimate is the median, 2
    estimate, low, high = stats.bootstrap_interval([1.0, 2.0, 100.0], statistic=np.median)
    assert (estimate, low, high) == (2.0, 1.0, 100.0)
    with pytest.raises(ValueError, match="level"):
        stats.bootstrap_interval([1.0, 2.0], level=95)
    with pytest.raises(ValueError, match="no values"):
        stats.bootstrap_interval([])
    with pytest.raises(ValueError, match="NaN"):
        stats.bootstrap_interval([1.0, math.nan])
    with pytest.raises(ValueError, match="num_resamples"):
        stats.bootstrap_interval([1.0, 2.0], num_resamples=0)


def test_bootstrap_difference_on_hand_computed_cases():
    # b never varies; a's resampled mean is 0, 0.5 or 1 (as above)
    assert stats.bootstrap_difference([0.0, 1.0], [0.0, 0.0]) == (0.5, 0.0, 1.0)
    assert stats.bootstrap_difference([2.0, 2.0], [1.0, 1.0]) == (1.0, 1.0, 1.0)
    # a* in {0.75, 0.875, 1}, b* in {0.125, 0.1875, 0.25}: the extreme differences 0.5 and 0.875
    # each come with chance 1/16 = 6.25 % > 2.5 %, so they are the interval's ends
    assert stats.bootstrap_difference([1.0, 0.75], [0.25, 0.125]) == (0.6875, 0.5, 0.875)
    assert stats.bootstrap_difference([1, 2, 3], [4, 5, 6], seed=1) == stats.bootstrap_difference([1, 2, 3], [4, 5, 6], seed=1)


# ----------------------------------------------------------------------------- permutation test


def test_permutation_test_exact_on_tiny_samples():
    # 20 splits of {1..6} into three and three: only {1,2,3} and {4,5,6} reach |difference| 3
    result = stats.permutation_test([1, 2, 3], [4, 5, 6])
    assert result == stats.PermutationTest(p=0.1, exact=True, splits=20, smallest_p=0.1)
    # 5 vs 5 seeds fully apart: 2 of C(10, 5) = 252 splits
    result = stats.permutation_test([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    assert result.p == pytest.approx(2 / 252) and result.splits == 252 and result.smallest_p == pytest.approx(2 / 252)


def test_permutation_test_counts_splits_as_extreme_by_hand():
    # {0, 3, 1, 5}, two and two: differences of the six splits are -1.5 (observed), -3.5, 0.5,
    # -0.5, 3.5, 1.5: four have |difference| >= 1.5
    assert stats.permutation_test([0, 3], [1, 5]).p == pytest.approx(4 / 6)
    # equal means: every split is as extreme
    assert stats.permutation_test([0, 3], [1, 2]).p == 1.0
    assert stats.permutation_test([1, 1], [1, 1]).p == 1.0
    # unequal sizes: 2 vs 3, C(5, 2) = 10 splits; a = {4, 5} of {4, 5, 1, 1, 1} has the largest
    # difference 4.5 - 1 = 3.5, reached by that split alone: two-sided p = 2 x min(1/10, 1) = 1/5
    result = stats.permutation_test([4, 5], [1, 1, 1])
    assert (result.p, result.smallest_p) == (pytest.approx(0.2), pytest.approx(0.2))
    # a group of one value: scipy gives no test, and neither does this
    assert math.isnan(stats.permutation_test([4], [1, 1, 1]).p)
    # floating sums in another order still count as ties
    assert stats.permutation_test([0.1, 0.2], [0.3, 0.4]).p == pytest.approx(2 / 6)


def test_permutation_test_monte_carlo_when_splits_are_too_many():
    result = stats.permutation_test([1, 2, 3], [4, 5, 6], max_exact=10, num_permutations=20_000, seed=5)
    assert not result.exact and result.splits == 20_000
    assert result.p == pytest.approx(0.1, abs=0.01)  # 2/20 exactly; the sample's error ~ 0.002
    assert result.smallest_p == pytest.approx(2 / 20_001)
    assert stats.permutation_test([1, 2, 3], [4, 5, 6], max_exact=10, num_permutations=20_000, seed=5) == result
    # a sample that never reaches the observed split (1 in 184,756 does) still gives p > 0: each
    # one-sided share is (b + 1) / (m + 1), the two-sided p twice the smaller: 2 x 1 / 1000
    far = stats.permutation_test(list(range(10)), list(range(100, 110)), max_exact=0, num_permutations=999, seed=1)
    assert far.p == pytest.approx(2 / 1000)


# ----------------------------------------------------------------------------- Student's t and Welch


@pytest.mark.parametrize("values, level, half_width", [
    # dof 1 (Cauchy): the quantile is tan(pi (q - 1/2)); [1, 3]: s = sqrt(2), se = 1
    ([1.0, 3.0], 0.95, math.tan(math.pi * 0.475)),
    ([1.0, 3.0], 0.5, math.tan(math.pi * 0.25)),  # = 1
    # dof 2: the quantile is (2q - 1) / sqrt(2 q (1 - q)); [1, 2, 3]: s = 1, se = 1 / sqrt(3)
    ([1.0, 2.0, 3.0], 0.95, 0.95 / math.sqrt(2 * 0.975 * 0.025) / math.sqrt(3)),
    ([1.0, 2.0, 3.0], 0.8, 0.8 / math.sqrt(2 * 0.9 * 0.1) / math.sqrt(3)),
])
def test_t_interval_matches_closed_form_quantiles(values, level, half_width):
    mean = sum(values) / len(values)
    assert stats.t_interval(values, level) == pytest.approx((mean, mean - half_width, mean + half_width), rel=1e-12)


def test_t_interval_of_constant_or_single_values_is_the_value():
    assert stats.t_interval([0.25] * 4) == (0.25, 0.25, 0.25)
    assert stats.t_interval([7.0]) == (7.0, 7.0, 7.0)
    with pytest.raises(ValueError, match="level"):
        stats.t_interval([1.0, 2.0], level=1.5)


def test_bca_interval_matches_the_exact_bootstrap_computed_by_hand():
    # n = 4: all 4^4 = 256 resamples are equally likely, so the BCa interval (Efron & Tibshirani,
    # ch. 14) can be computed here from the exact bootstrap distribution, independently of scipy:
    # bias z0 from the share of resampled means below the mean, acceleration from the jackknife
    import itertools
    from statistics import NormalDist

    values = [0.0, 1.0, 2.0, 7.0]
    mean = sum(values) / 4
    means = sorted(sum(sample) / 4 for sample in itertools.product(values, repeat=4))
    normal = NormalDist()
    z0 = normal.inv_cdf(sum(m < mean for m in means) / len(means))
    jackknife = [(sum(values) - v) / 3 for v in values]
    centre = sum(jackknife) / 4
    acceleration = sum((centre - j) ** 3 for j in jackknife) / (6 * sum((centre - j) ** 2 for j in jackknife) ** 1.5)
    ends = []
    for z in (normal.inv_cdf(0.05), normal.inv_cdf(0.95)):  # a 90 % interval
        share = normal.cdf(z0 + (z0 + z) / (1 - acceleration * (z0 + z)))
        ends.append(float(np.quantile(means, share, method="inverted_cdf")))  # the distribution's own quantile
    estimate, low, high = stats.bootstrap_interval(values, level=0.9, num_resamples=200_000, seed=1)
    assert estimate == mean
    # 200,000 draws against the exact distribution: the ends agree to the distribution's grid (1/4)
    assert (low, high) == pytest.approx(ends, abs=0.25)
    percentile = stats.bootstrap_interval(values, level=0.9, num_resamples=200_000, seed=1, method="percentile")
    assert percentile[1:] == pytest.approx(np.quantile(means, [0.05, 0.95], method="inverted_cdf"), abs=0.25)
    with pytest.raises(ValueError, match="method"):
        stats.bootstrap_interval(values, method="bca")


def test_interquartile_mean_is_the_mean_of_the_middle_half():
    # 8 values: the lowest two (-50, 1) and highest two (6, 100) are trimmed, mean of 2, 3, 4, 5 = 3.5
    assert stats.interquartile_mean([100, 1, 2, 3, 4, 5, 6, -50]) == 3.5
    assert stats.interquartile_mean([1.0, 2.0, 3.0, 4.0]) == 2.5


def test_holm_adjusts_a_family_by_hand():
    # sorted p 0.01, 0.03, 0.04 times 3, 2, 1: 0.03, 0.06, 0.04 -> non-decreasing 0.03, 0.06, 0.06
    rejected, adjusted = stats.holm([0.01, 0.04, 0.03], alpha=0.05)
    assert adjusted == pytest.approx([0.03, 0.06, 0.06]) and rejected == [True, False, False]
    # capped at 1; an empty family is empty
    assert stats.holm([0.6, 0.7])[1] == pytest.approx([1.0, 1.0])
    assert stats.holm([]) == ([], [])
    with pytest.raises(ValueError, match="alpha"):
        stats.holm([0.1], alpha=2)


def test_welch_t_test_by_hand():
    # means 2 and 5, both variances 1: se = sqrt(2/3), t = -3 / se = -3.674, dof = (2/3)^2 / (2 (1/3)^2 / 2) = 4;
    # dof 4: F(t) = 1/2 + 3/8 x/sqrt(1 + x^2/4) (1 - x^2 / (12 (1 + x^2/4))) gives p = 0.021312
    result = stats.welch_t_test([1, 2, 3], [4, 5, 6])
    x = 3 / math.sqrt(2 / 3)
    cdf = 0.5 + 3 / 8 * x / math.sqrt(1 + x * x / 4) * (1 - x * x / (12 * (1 + x * x / 4)))
    assert result.t == pytest.approx(-x) and result.dof == pytest.approx(4.0)
    assert result.p == pytest.approx(2 * (1 - cdf)) and result.p == pytest.approx(0.021312, abs=1e-6)
    # one group constant: se^2 = var(a) / 2 = 1/64, t = 0.375 / 0.125 = 3, dof = 1 (all from a)
    result = stats.welch_t_test([1.0, 0.75], [0.5, 0.5])
    assert (result.t, result.dof) == pytest.approx((3.0, 1.0))
    assert result.p == pytest.approx(1 - 2 * math.atan(3) / math.pi)


def test_welch_interval_by_hand():
    # means 2 and 5, variances 1: se = sqrt(2/3), dof 4, t_(0.975, 4) = 2.776445 (tables)
    difference, low, high = stats.welch_interval([1, 2, 3], [4, 5, 6])
    half = 2.776445 * math.sqrt(2 / 3)
    assert difference == -3 and (low, high) == pytest.approx((-3 - half, -3 + half), abs=1e-5)
    assert stats.welch_interval([1.0, 1.0], [2.0, 2.0]) == (-1.0, -1.0, -1.0)
    assert all(math.isnan(v) for v in stats.welch_interval([1.0], [2.0, 3.0])[1:])


def test_seed_interval_gives_t_below_five_seeds_and_bca_from_five():
    # three seeds: no bootstrap; Student's t, dof 2: half width (2q - 1) / sqrt(2 q (1 - q)) x s / sqrt(3)
    mean, low, high, kind = stats.seed_interval([1.0, 2.0, 3.0])
    half = 0.95 / math.sqrt(2 * 0.975 * 0.025) / math.sqrt(3)
    assert kind == "t" and (mean, low, high) == pytest.approx((2.0, 2.0 - half, 2.0 + half))
    five = [0.1, 0.4, 0.2, 0.5, 0.3]
    assert stats.seed_interval(five) == (*stats.bootstrap_interval(five), "BCa")
    assert stats.MIN_BOOTSTRAP_VALUES == 5


def test_permutation_test_enumerates_ten_against_ten():
    # C(20, 10) = 184,756 splits, all enumerated; only the observed split and its mirror are as extreme
    result = stats.permutation_test(list(range(10)), list(range(100, 110)))
    assert result.exact and result.splits == 184_756
    assert result.p == pytest.approx(2 / 184_756) == result.smallest_p


def test_welch_t_test_is_nan_where_undefined():
    assert all(math.isnan(v) for v in stats.welch_t_test([1.0], [2.0, 3.0]))
    assert all(math.isnan(v) for v in stats.welch_t_test([1.0, 1.0], [2.0, 2.0]))


# ----------------------------------------------------------------------------- the decision


def test_compare_seeds_decides_by_the_permutation_p():
    apart = stats.compare_seeds([0.8, 0.82, 0.79, 0.81, 0.83], [0.6, 0.62, 0.61, 0.59, 0.63])
    assert apart.difference == pytest.approx(0.2) and apart.permutation.p == pytest.approx(2 / 252)
    assert apart.larger_than_seed_noise and apart.low < 0.2 < apart.high and apart.level == 0.95
    assert apart.welch.p < 1e-6
    mixed = stats.compare_seeds([0.8, 0.6, 0.7, 0.65, 0.75], [0.7, 0.62, 0.68, 0.74, 0.66])
    assert not mixed.larger_than_seed_noise and mixed.permutation.p > 0.05 and mixed.low < 0 < mixed.high
    # two seeds each can never show it: the smallest p is 2 / C(4, 2) = 1/3
    few = stats.compare_seeds([1.0, 0.75], [0.25, 0.125])
    assert few.permutation.p == pytest.approx(1 / 3) == few.permutation.smallest_p and not few.larger_than_seed_noise
    # two seeds a side are too few for a bootstrap: Welch's t interval, difference -/+ t_(0.975, dof) se
    import scipy.stats

    half = scipy.stats.t.ppf(0.975, 25 / 17) * math.sqrt(5) / 16
    assert few.interval == "t" and (few.low, few.high) == pytest.approx((0.6875 - half, 0.6875 + half))
    assert apart.interval == "BCa"
    # welch: se^2 = 0.03125/2 + 0.0078125/2 = 5/256, t = (11/16) / (sqrt(5)/16) = 11/sqrt(5), dof = 25/17
    assert (few.welch.t, few.welch.dof) == pytest.approx((11 / math.sqrt(5), 25 / 17))
    # a looser alpha changes the decision, not the p
    assert stats.compare_seeds([1.0, 0.75], [0.25, 0.125], alpha=0.5).larger_than_seed_noise
    with pytest.raises(ValueError, match="alpha"):
        stats.compare_seeds([1.0], [2.0], alpha=5)


def test_values_equal_but_for_their_last_bits_give_a_narrow_interval_and_no_warning():
    import warnings as _warnings

    values = [0.1 + 0.2, 0.3, 0.3, 0.1 + 0.2]  # 0.30000000000000004 and 0.3: one score summed two ways
    with _warnings.catch_warnings():
        _warnings.simplefilter("error")
        mean, low, high = stats.t_interval(values)
        stats.welch_t_test(values, [0.3, 0.3 + 1e-17, 0.1 + 0.2])
    assert low <= mean <= high and high - low < 1e-15
