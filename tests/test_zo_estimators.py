"""Tests for evolm_lib.zo.estimators: hand-computed coefficients, the stated means over many draws
on the quadratic, descent on Rosenbrock and Ackley, the reference code's defects, bad input."""
from __future__ import annotations

import json
import math

import pytest
import torch

from evolm_lib import es
from evolm_lib.zo.estimators import (
    ESTIMATORS,
    EstimatorConfig,
    Generation,
    HistoryState,
    SeedState,
    coefficients,
    directions,
    make_searcher,
    needs_center,
    queries_per_step,
    query_members,
    seeded_gradient,
    xnes_utilities,
)
from evolm_lib.zo.functions import get_function, start_point
from evolm_lib.zo.run import CountingObjective, run_estimator
from evolm_lib.zo.updates import UpdateConfig, apply_update, init_update_state

SEED_POPULATION = ["es", "vanilla", "rl", "zoo", "reinforce", "twopoint", "zoar", "zoar_0", "zohs"]
QUADRATIC = get_function("quadratic")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    """|actual - expected| <= atol + rtol |expected| everywhere (torch.testing imports torch.distributed: 4 s)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected.to(actual.dtype), rtol=rtol, atol=atol), (actual - expected).abs().max()


def coefficient_dict(name: str, current: Generation, state: HistoryState = HistoryState(), **settings) -> dict[int, float]:
    return coefficients(EstimatorConfig(name, **settings), current, state)[0]


def assert_coefficients(actual: dict[int, float], expected: dict[int, float]) -> None:
    assert list(actual) == list(expected)
    for seed in expected:
        assert actual[seed] == pytest.approx(expected[seed], abs=1e-12), seed


# ----------------------------------------------------------------------------- the registry


def test_registry_names_and_kinds():
    assert list(ESTIMATORS) == ["fo", "es", "vanilla", "rl", "zoo", "reinforce", "twopoint", "zoar", "zoar_0",
                                "zohs", "zohs_expavg", "relizo", "xnes", "sepcmaes"]
    assert [name for name, spec in ESTIMATORS.items() if spec.seed_population] == SEED_POPULATION
    for spec in ESTIMATORS.values():
        assert spec.summary and spec.bias
        assert (spec.weights is not None) == spec.seed_population


@pytest.mark.parametrize("name, baseline, expected", [
    ("es", "single", 10), ("vanilla", "single", 11), ("rl", "single", 10), ("zoo", "single", 11),
    ("zoo", "average", 10), ("reinforce", "average", 10), ("twopoint", "single", 10), ("zoar", "single", 10),
    ("zoar_0", "single", 10), ("zohs", "single", 11), ("zohs_expavg", "single", 11), ("relizo", "single", 11),
    ("xnes", "single", 10), ("sepcmaes", "single", 10), ("fo", "single", 10),
])
def test_queries_per_step(name, baseline, expected):
    assert queries_per_step(EstimatorConfig(name, num_queries=10, baseline=baseline)) == expected


# ----------------------------------------------------------------------------- hand-computed coefficients
# Queries at seeds 11, 22, 33 (sign +1) with f = 1, 2, 4 and f(x) = 3; n = 3.

CURRENT = Generation(seeds=(11, 22, 33), signs=(1, 1, 1), values=(1.0, 2.0, 4.0), center=3.0)


def test_es_coefficients_by_hand():
    assert_coefficients(coefficient_dict("es", CURRENT), {11: 1 / 3, 22: 2 / 3, 33: 4 / 3})


@pytest.mark.parametrize("name", ["vanilla", "zoo", "reinforce"])
def test_single_baseline_coefficients_by_hand(name):
    # (F - F(x)) / n = (1 - 3, 2 - 3, 4 - 3) / 3
    assert_coefficients(coefficient_dict(name, CURRENT), {11: -2 / 3, 22: -1 / 3, 33: 1 / 3})


@pytest.mark.parametrize("name", ["zoo", "reinforce", "zoar_0"])
def test_average_baseline_coefficients_by_hand(name):
    # mean F = 7/3: (1 - 7/3, 2 - 7/3, 4 - 7/3) / 3
    assert_coefficients(coefficient_dict(name, CURRENT, baseline="average"), {11: -4 / 9, 22: -1 / 9, 33: 5 / 9})


def test_rl_coefficients_by_hand_with_ties_averaged():
    # ranks 0, 1, 2 -> 2 rank - (n - 1) = -2, 0, 2, over n = 3
    assert_coefficients(coefficient_dict("rl", CURRENT), {11: -2 / 3, 22: 0.0, 33: 2 / 3})
    tied = Generation((11, 22, 33), (1, 1, 1), (1.0, 1.0, 4.0))  # ranks 0.5, 0.5, 2 -> -1, -1, 2
    assert_coefficients(coefficient_dict("rl", tied), {11: -1 / 3, 22: -1 / 3, 33: 2 / 3})
    # ranks ignore the scale of f (the stated bias: its size is set by n, not by f)
    scaled = Generation((11, 22, 33), (1, 1, 1), (10.0, 20.0, 40.0))
    assert_coefficients(coefficient_dict("rl", scaled), coefficient_dict("rl", CURRENT))


def test_twopoint_coefficients_by_hand():
    # pairs (5: f+ = 3, f- = 1) and (9: f+ = 0, f- = 4): (f+ - f-) / n with n = 4 queries
    pairs = Generation(seeds=(5, 5, 9, 9), signs=(1, -1, 1, -1), values=(3.0, 1.0, 0.0, 4.0))
    assert_coefficients(coefficient_dict("twopoint", pairs, num_queries=4), {5: 0.5, 9: -1.0})


def test_an_antithetic_pair_shares_one_coefficient():
    pair = Generation(seeds=(7, 7), signs=(1, -1), values=(5.0, 3.0))
    assert_coefficients(coefficient_dict("es", pair, num_queries=2), {7: 1.0})  # (5 - 3) / 2


def test_zoar_coefficients_by_hand():
    past = Generation((1, 2), (1, 1), (0.0, 2.0))
    current = Generation((3, 4), (1, 1), (4.0, 6.0))
    config = EstimatorConfig("zoar", num_queries=2, num_histories=1)
    coefficient, state = coefficients(config, current, HistoryState((past,)))
    # buffer N = 4 queries with mean 3: (F - 3) / 4
    assert_coefficients(coefficient, {1: -0.75, 2: -0.25, 3: 0.25, 4: 0.75})
    assert state == HistoryState((current,))  # H = 1: only the newest generation is kept
    # H = 2 keeps both; zoar_0 keeps none
    assert coefficients(EstimatorConfig("zoar", num_queries=2, num_histories=2), current, HistoryState((past,)))[1].generations == (past, current)
    assert coefficients(EstimatorConfig("zoar_0", num_queries=2), current, HistoryState((past,)))[1] == HistoryState()


def test_zohs_coefficients_by_hand():
    past = Generation((1, 2), (1, 1), (0.0, 2.0), center=1.0)
    current = Generation((3, 4), (1, 1), (4.0, 6.0), center=5.0)
    # each generation's vanilla weights (F - centre) / n, averaged over K = 2 generations
    coefficient = coefficient_dict("zohs", current, HistoryState((past,)), num_queries=2, num_histories=1)
    assert_coefficients(coefficient, {1: -0.25, 2: 0.25, 3: -0.25, 4: 0.25})


def test_state_is_plain_data_and_survives_json():
    config = EstimatorConfig("zoar", num_queries=3, num_histories=2)
    state = HistoryState()
    for generation in range(4):
        members = query_members(config, base_seed=5, generation=generation)
        current = Generation.from_members(members, [0.1 * generation + j / 7 for j in range(3)])
        _, state = coefficients(config, current, state)
    text = json.dumps(state.to_dict())
    assert HistoryState.from_dict(json.loads(text)) == state
    assert len(state.generations) == 2


# ----------------------------------------------------------------------------- coefficients -> gradient


def test_seeded_gradient_is_the_searchers_gradient_and_es_gradients():
    """g = (1/mu) sum c u(seed): the searcher's cached directions, seeded_gradient (what the LLM runner
    calls) and es.es_gradient with weights c * N and sigma = mu all agree."""
    config = EstimatorConfig("zoar", num_queries=4, num_histories=2, mu=0.3)
    x = start_point(6, seed=1)
    objective = CountingObjective(QUADRATIC, 6)
    searcher = make_searcher(config, seed=9)
    state = searcher.init(x)
    for _ in range(3):
        before = state
        step = searcher.step(objective, x, state)
        state = step.state
    members = query_members(config, 9, before.generation)
    current = Generation.from_members(members, QUADRATIC.value(x + 0.3 * directions([m.seed for m in members], 6)))
    coefficient, _ = coefficients(config, current, before.history)
    assert len(coefficient) == 12  # this generation's 4 seeds and the 2 buffered generations' 8
    ours = seeded_gradient(coefficient, {"x": (6,)}, mu=0.3, dtype=torch.float64)["x"]
    assert_close(ours, step.gradient, rtol=1e-6, atol=1e-6)  # float32 noise bits, float64 sums
    members_of = [es.Member(seed) for seed in coefficient]
    theirs = es.es_gradient(members_of, [c * len(members_of) for c in coefficient.values()], {"x": (6,)}, sigma=0.3, form="textbook")["x"]
    assert_close(theirs.double(), step.gradient, rtol=1e-5, atol=1e-5)


def test_resume_from_plain_state_is_bit_exact():
    config, update = EstimatorConfig("zoar", num_queries=5, num_histories=3), UpdateConfig()

    def advance(x, state, update_state, steps, searcher):
        objective = CountingObjective(get_function("rosenbrock"), x.shape[0])
        for _ in range(steps):
            step = searcher.step(objective, x, state)
            x, update_state = apply_update(update, update_state, x, step.gradient)
            state = step.state
        return x, state, update_state

    searcher = make_searcher(config, seed=4)
    x0 = start_point(20, seed=4)
    straight, _, _ = advance(x0, searcher.init(x0), init_update_state(update, x0), 12, searcher)
    x, state, update_state = advance(x0, searcher.init(x0), init_update_state(update, x0), 7, searcher)
    saved = json.loads(json.dumps(state.to_dict()))  # the direction cache is not saved
    restored = SeedState.from_dict(saved)
    assert restored.cache == () and restored.history == state.history
    resumed, _, _ = advance(x.clone(), restored, type(update_state).from_dict(update_state.to_dict()), 5, searcher)
    assert torch.equal(resumed, straight)


# ----------------------------------------------------------------------------- means over many draws
# On the quadratic grad f_mu = grad f = x for every mu, so mu = 0.5 keeps the variance low. The
# seed-population estimators are drawn through `coefficients` with directions from one big normal
# draw (seed -> row), which is fast; the searchers' own directions are checked against the same
# coefficients above.

X = torch.tensor([1.0, -2.0, 1.5, -1.0, 2.0], dtype=torch.float64)
X_OLD = torch.tensor([-1.0, 0.5, 2.0, 1.0, -0.5], dtype=torch.float64)
DRAWS = 1000
CHI2_LIMIT = 25.0  # 5 degrees of freedom: P(chi2 > 25) ~ 1.4e-4


def draw_coefficient_estimates(config: EstimatorConfig, points: list[torch.Tensor], draws: int = DRAWS) -> torch.Tensor:
    """Estimates (draws, d) of the last of a run of generations at points[0], points[1], ... (not moving)."""
    d = points[0].shape[0]
    rows = torch.randn(draws, len(points), config.num_queries, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    estimates = []
    for draw in range(draws):
        state, direction = HistoryState(), {}
        for k, point in enumerate(points):
            members = query_members(config, base_seed=draw, generation=k)
            for j, seed in enumerate(dict.fromkeys(m.seed for m in members)):
                direction[seed] = rows[draw, k, j]
            queried = torch.stack([point + config.mu * m.sign * direction[m.seed] for m in members])
            center = float(QUADRATIC.value(point)) if needs_center(config) else None
            current = Generation.from_members(members, QUADRATIC.value(queried), center)
            coefficient, state = coefficients(config, current, state)
        estimates.append(sum(c * direction[seed] for seed, c in coefficient.items()) / config.mu)
    return torch.stack(estimates)


def draw_searcher_estimates(config: EstimatorConfig, points: list[torch.Tensor], draws: int) -> torch.Tensor:
    """The same through a searcher (seed = draw), for the estimators without a coefficient form."""
    estimates = []
    for draw in range(draws):
        searcher = make_searcher(config, seed=1000 + draw)
        objective = CountingObjective(QUADRATIC, points[0].shape[0])
        state = searcher.init(points[0])
        for point in points:
            step = searcher.step(objective, point, state)
            state = step.state
        estimates.append(step.gradient)
    return torch.stack(estimates)


def chi2(estimates: torch.Tensor, expected: torch.Tensor) -> float:
    """Sum over coordinates of ((mean - expected) / standard error)^2."""
    mean = estimates.mean(0)
    error = estimates.std(0) / math.sqrt(estimates.shape[0])
    return float(((mean - expected) / error).pow(2).sum())


UNBIASED = [("es", {}), ("vanilla", {}), ("zoo", {}), ("reinforce", {}), ("twopoint", {})]


@pytest.mark.parametrize("name, settings", UNBIASED, ids=[u[0] for u in UNBIASED])
def test_unbiased_estimators_average_to_the_gradient(name, settings):
    estimates = draw_coefficient_estimates(EstimatorConfig(name, num_queries=4, mu=0.5, **settings), [X])
    assert chi2(estimates, X) < CHI2_LIMIT


@pytest.mark.parametrize("name", ["zoo", "reinforce", "zoar_0"])
def test_averaged_baseline_is_scaled_by_one_minus_one_over_n(name):
    estimates = draw_coefficient_estimates(EstimatorConfig(name, num_queries=4, mu=0.5, baseline="average"), [X])
    assert chi2(estimates, (1 - 1 / 4) * X) < CHI2_LIMIT
    assert chi2(estimates, X) > 4 * CHI2_LIMIT  # the bias is visible at this many draws


def test_zoar_bias_at_a_fixed_point_and_with_lagging_queries():
    config = EstimatorConfig("zoar", num_queries=4, mu=0.5, num_histories=1)
    fixed = draw_coefficient_estimates(config, [X, X])  # N = 8 buffered queries, all at X
    assert chi2(fixed, (1 - 1 / 8) * X) < CHI2_LIMIT
    lagging = draw_coefficient_estimates(config, [X_OLD, X])  # the reused generation was queried at X_OLD
    assert chi2(lagging, (1 - 1 / 8) * (X_OLD + X) / 2) < CHI2_LIMIT
    assert chi2(lagging, X) > 4 * CHI2_LIMIT


def test_zohs_is_unbiased_at_a_fixed_point_and_lags_otherwise():
    config = EstimatorConfig("zohs", num_queries=4, mu=0.5, num_histories=1)
    assert chi2(draw_coefficient_estimates(config, [X, X]), X) < CHI2_LIMIT
    lagging = draw_coefficient_estimates(config, [X_OLD, X])
    assert chi2(lagging, (X_OLD + X) / 2) < CHI2_LIMIT
    assert chi2(lagging, X) > 4 * CHI2_LIMIT


def test_zohs_expavg_weights_are_exponential():
    config = EstimatorConfig("zohs_expavg", num_queries=4, mu=0.5, expavg_beta=0.5)
    assert chi2(draw_searcher_estimates(config, [X, X], 600), X) < CHI2_LIMIT
    lagging = draw_searcher_estimates(config, [X_OLD, X], 600)  # w_2 = 1 - beta, the first generation beta
    assert chi2(lagging, 0.5 * X_OLD + 0.5 * X) < CHI2_LIMIT
    assert chi2(lagging, X) > 4 * CHI2_LIMIT


def test_rl_mean_points_along_the_gradient():
    estimates = draw_coefficient_estimates(EstimatorConfig("rl", num_queries=4, mu=0.01), [X])
    mean = estimates.mean(0)
    assert float(torch.nn.functional.cosine_similarity(mean, X, dim=0)) > 0.99


def test_relizo_without_reuse_is_the_gradient_projected_on_n_of_d_dimensions():
    x = torch.cat([X, -X[:3]])  # d = 8
    estimates = draw_searcher_estimates(EstimatorConfig("relizo", num_queries=4, mu=1e-3), [x], 1000)
    # chi2 over 8 coordinates: P(chi2_8 > 32) ~ 1e-4
    assert chi2(estimates, (4 / 8) * x) < 32
    assert chi2(estimates, x) > 4 * 32


# ----------------------------------------------------------------------------- descent within a budget
# Fixed start: start_point(100, seed=0). Every estimator uses radazo (lr 1e-3), mu = 0.05, 10 queries
# a generation, and must cut f by 10% within 1,000 queries. es has no baseline: its variance grows
# with f^2 (f ~ 6e4 on Rosenbrock here), so it gets mu = 1 and 5,000 queries, and must cut f by 1% on
# Rosenbrock; on Ackley (f ~ 5.5 on a wide plateau) it moved f by 0.2-2% over seeds 0-3, so there it
# must only lower f.

DESCENT = {("es", "rosenbrock"): (5_000, 1.0, 0.99), ("es", "ackley"): (5_000, 1.0, 1.0)}  # (budget, mu, f_end / f_start)


@pytest.mark.parametrize("function", ["rosenbrock", "ackley"])
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_every_estimator_lowers_rosenbrock_and_ackley(name, function):
    budget, mu, ratio = DESCENT.get((name, function), (1_000, 0.05, 0.9))
    history = run_estimator(function, EstimatorConfig(name, mu=mu), UpdateConfig(), 100, budget, seed=0)
    start, end = history["f"].iloc[0], history["f"].iloc[-1]
    assert budget - queries_per_step(EstimatorConfig(name)) < history["queries"].iloc[-1] <= budget
    assert end < ratio * start, (start, end)


@pytest.mark.parametrize("name, budget", [("xnes", 4_000), ("sepcmaes", 1_500)])
def test_search_distributions_reach_the_quadratic_minimum(name, budget):
    """(The reference's xNES climbed instead: 2.48 to 1.7e11 on a 10-d quadratic in 300 steps.)"""
    history = run_estimator("quadratic", EstimatorConfig(name, num_queries=10), UpdateConfig(), 10, budget, seed=0)
    assert history["f"].iloc[0] > 1 and history["f"].iloc[-1] < 1e-6


# ----------------------------------------------------------------------------- the reference's defects


def test_xnes_utilities_reward_the_best_sample():
    # n = 4: max(0, ln 3 - ln k) = (ln 3, ln 1.5, 0, 0), normalised, minus 1/4
    raw = torch.tensor([math.log(3), math.log(1.5), 0.0, 0.0], dtype=torch.float64)
    assert_close(xnes_utilities(4), raw / raw.sum() - 0.25, rtol=0, atol=1e-15)
    assert float(xnes_utilities(7).sum()) == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize("d, n", [(6, 4), (3, 8)])
def test_xnes_low_rank_update_is_the_matrix_exponential(d, n):
    config = EstimatorConfig("xnes", num_queries=n, xnes_eta_shape=0.7, xnes_eta_sigma=0.3)
    searcher = make_searcher(config, seed=3)
    x = start_point(d, seed=3)
    state = searcher.init(x)
    shape = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64))[0]
    shape[:, 0] *= torch.linalg.det(shape).sign()  # a rotation: det 1
    state = type(state)(state.generation, 0.4, shape.float())  # B is kept in float32
    shape = state.shape.double()
    step = searcher.step(CountingObjective(QUADRATIC, d), x, state)
    s = directions([m.seed for m in es.population(3, 0, n, antithetic=False)], d)
    order = torch.argsort(QUADRATIC.value(x + 0.4 * s @ shape.T))
    s, utility = s[order], xnes_utilities(n)
    g_m = sum(u * (torch.outer(v, v) - torch.eye(d, dtype=torch.float64)) for u, v in zip(utility, s))
    g_sigma = float(torch.trace(g_m)) / d
    expected_shape = shape @ torch.linalg.matrix_exp(0.35 * (g_m - g_sigma * torch.eye(d, dtype=torch.float64)))
    assert_close(step.state.shape.double(), expected_shape, rtol=1e-5, atol=1e-6)  # float32 rounding
    assert step.state.sigma == pytest.approx(0.4 * math.exp(0.15 * g_sigma), rel=1e-12)
    assert_close(step.x, x + 0.4 * shape @ (utility @ s), rtol=1e-6, atol=1e-6)
    assert float(torch.linalg.det(step.state.shape.double())) == pytest.approx(1.0, abs=1e-5)


def test_relizo_reuses_samples_and_descends():
    # the reference zeroed the reused samples, so every reusing step divided by zero and was skipped
    history = run_estimator("quadratic", EstimatorConfig("relizo"), UpdateConfig(), 100, 2_000, seed=0)
    reused = history["relizo/reused"].dropna()
    assert (reused == 5).mean() > 0.9  # floor(0.5 * 10) reused on almost every step
    assert history["f"].notna().all() and history["f"].iloc[-1] < 0.9 * history["f"].iloc[0]
    assert history["step"].iloc[-1] > 2_000 // 11  # reuse buys steps: 6 new queries a step, not 11
    never = run_estimator("quadratic", EstimatorConfig("relizo", reuse_radius=0.0), UpdateConfig(), 100, 2_000, seed=0)
    assert (never["relizo/reused"].dropna() == 0).all()


# ----------------------------------------------------------------------------- bad input


def test_unknown_estimator_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"estimator 'zoarr' is unknown; choose from \['fo', 'es', .*'sepcmaes'\]"):
        EstimatorConfig("zoarr")


def test_twopoint_needs_an_even_query_budget():
    with pytest.raises(ValueError, match="num_queries must be even for twopoint"):
        EstimatorConfig("twopoint", num_queries=7)
    with pytest.raises(ValueError, match="twopoint needs each seed queried once with \\+1 and once with -1"):
        coefficients(EstimatorConfig("twopoint", num_queries=2), Generation((1, 2), (1, 1), (0.0, 1.0)))


def test_zoar_needs_a_history():
    with pytest.raises(ValueError, match="num_histories must be >= 1 for zoar .*zoar_0"):
        EstimatorConfig("zoar", num_histories=0)


@pytest.mark.parametrize("settings, message", [
    ({"name": "es", "num_queries": 0}, "num_queries must be a positive int"),
    ({"name": "rl", "num_queries": 1}, "num_queries must be >= 2 for rl"),
    ({"name": "es", "mu": 0.0}, "mu must be > 0"),
    ({"name": "zoo", "baseline": "median"}, "baseline must be one of"),
    ({"name": "relizo", "max_reuse_rate": 1.0}, "max_reuse_rate must be in"),
])
def test_bad_settings_name_the_setting(settings, message):
    with pytest.raises(ValueError, match=message):
        EstimatorConfig(**settings)


def test_dimension_mismatches_are_clear_errors():
    with pytest.raises(ValueError, match=r"x0 has shape \(5,\) but dimension is 6"):
        run_estimator("quadratic", EstimatorConfig("es"), UpdateConfig(), 6, 100, x0=torch.zeros(5))
    config = EstimatorConfig("zoar", num_queries=2, num_histories=2)
    searcher = make_searcher(config, seed=0)
    step = searcher.step(CountingObjective(QUADRATIC, 4), torch.ones(4, dtype=torch.float64), searcher.init(torch.ones(4)))
    with pytest.raises(ValueError, match="the history's directions have dimension 4 but x has dimension 5"):
        searcher.step(CountingObjective(QUADRATIC, 5), torch.ones(5, dtype=torch.float64), step.state)
    xnes = make_searcher(EstimatorConfig("xnes", num_queries=4), seed=0)
    with pytest.raises(ValueError, match="x has dimension 5 but the searcher's state has dimension 4"):
        xnes.step(CountingObjective(QUADRATIC, 5), torch.ones(5, dtype=torch.float64), xnes.init(torch.ones(4, dtype=torch.float64)))


def test_coefficients_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match="relizo has no coefficient form"):
        coefficients(EstimatorConfig("relizo"), CURRENT)
    with pytest.raises(ValueError, match=r"vanilla \(baseline 'single'\) needs f\(x\)"):
        coefficients(EstimatorConfig("vanilla"), Generation((1,), (1,), (2.0,)))
    with pytest.raises(ValueError, match="values contain non-finite numbers"):
        Generation((1, 2), (1, 1), (0.0, float("nan")))


def test_benchmark_prints_a_row_per_estimator_and_the_cmaes_loop(capsys):
    from evolm_lib.zo import benchmark

    assert benchmark.main(["--dimension", "12", "--num-queries", "4", "--repeats", "1"]) == 0
    table = capsys.readouterr().out.split("\n\n")[-1].splitlines()
    assert table[0].split()[:3] == ["estimator", "wall", "ms"]
    assert [line.split()[0] for line in table[1:]] == [*ESTIMATORS, "cmaes.SepCMA"]
    assert benchmark.main(["--estimators", "es,nope", "--dimension", "12"]) == 2
