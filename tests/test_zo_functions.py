"""Tests for evolm_lib.zo.functions: hand-checked values, minima, gradients against autograd."""
from __future__ import annotations

import math

import pytest
import torch

from evolm_lib.zo.functions import FUNCTIONS, get_function, start_point

NAMES = sorted(FUNCTIONS)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    """|actual - expected| <= atol + rtol |expected| everywhere (torch.testing imports torch.distributed: 4 s)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected.to(actual.dtype), rtol=rtol, atol=atol), (actual - expected).abs().max()


def value(name: str, *point: float) -> float:
    return float(get_function(name).value(torch.tensor(point, dtype=torch.float64)))


# ----------------------------------------------------------------------------- hand-checked values


def test_quadratic_by_hand():
    assert value("quadratic", 1, 2, 3) == 7.0  # 0.5 (1 + 4 + 9)


@pytest.mark.parametrize("point, expected", [((0, 0), 1.0), ((-1, 1), 4.0), ((1, 2), 100.0)])
def test_rosenbrock_by_hand(point, expected):
    # 100 (x2 - x1^2)^2 + (1 - x1)^2: (0,0) -> 0 + 1, (-1,1) -> 0 + 4, (1,2) -> 100 + 0
    assert value("rosenbrock", *point) == pytest.approx(expected, abs=1e-12)


def test_rastrigin_by_hand():
    assert value("rastrigin", 1, 1) == pytest.approx(2.0, abs=1e-12)  # 20 + 2 - 20 cos(2 pi)
    assert value("rastrigin", 0.5) == pytest.approx(20.25, abs=1e-12)  # 10 + 0.25 - 10 cos(pi)


def test_ackley_by_hand():
    # d = 1, x = 1: sqrt(mean x^2) = 1 and cos(2 pi) = 1, so f = -20 e^-0.2 - e + 20 + e = 20 (1 - e^-0.2)
    assert value("ackley", 1.0) == pytest.approx(20 * (1 - math.exp(-0.2)), abs=1e-12)


def test_levy_by_hand():
    # x = (0, 0): w = (0.75, 0.75); sin^2(0.75 pi) = 0.5;
    # (w1 - 1)^2 [1 + 10 sin^2(0.75 pi + 1)] + (w2 - 1)^2 [1 + sin^2(1.5 pi)] = 0.0625 (1 + 10 s) + 0.0625 * 2
    s = math.sin(0.75 * math.pi + 1) ** 2
    assert value("levy", 0, 0) == pytest.approx(0.5 + 0.0625 * (1 + 10 * s) + 0.125, abs=1e-12)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dimension", [2, 7, 1000])
def test_minimum_is_zero_at_the_minimiser(name, dimension):
    function = get_function(name)
    x_star = function.minimiser(dimension)
    assert float(function.value(x_star)) == pytest.approx(0.0, abs=1e-12)
    assert float(function.gradient(x_star).abs().max()) < 1e-12
    # and the minimiser is a strict local minimum: small moves raise f
    moved = x_star + 1e-3 * torch.randn(dimension, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert float(function.value(moved)) > float(function.value(x_star))


# ----------------------------------------------------------------------------- batching and gradients


@pytest.mark.parametrize("name", NAMES)
def test_batched_over_a_population(name):
    function = get_function(name)
    points = torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    batched = function.value(points)
    assert batched.shape == (4, 3)
    one_by_one = torch.stack([torch.stack([function.value(p) for p in row]) for row in points])
    assert_close(batched, one_by_one, rtol=0, atol=1e-12)
    assert function.gradient(points).shape == points.shape


@pytest.mark.parametrize("name", NAMES)
def test_gradient_matches_autograd(name):
    function = get_function(name)
    points = 2 * torch.randn(5, 9, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    points.requires_grad_(True)
    (expected,) = torch.autograd.grad(function.value(points).sum(), points)
    assert_close(function.gradient(points.detach()), expected, rtol=1e-10, atol=1e-10)


def test_ackley_gradient_is_zero_at_the_origin_not_nan():
    assert torch.equal(get_function("ackley").gradient(torch.zeros(3, dtype=torch.float64)), torch.zeros(3, dtype=torch.float64))


# ----------------------------------------------------------------------------- start points and bad input


def test_start_point_is_seeded_standard_normal():
    assert torch.equal(start_point(50, seed=3), start_point(50, seed=3))
    assert not torch.equal(start_point(50, seed=3), start_point(50, seed=4))
    many = start_point(100_000, seed=0)
    assert many.dtype == torch.float64
    assert abs(float(many.mean())) < 0.02 and abs(float(many.std()) - 1) < 0.02  # N(0, 1): 5 standard errors


def test_unknown_function_lists_the_known_ones():
    with pytest.raises(ValueError, match="function 'sphere' is unknown; choose from .*rosenbrock"):
        get_function("sphere")


def test_bad_dimensions_are_clear_errors():
    with pytest.raises(ValueError, match="dimension must be >= 2 for rosenbrock, got 1"):
        get_function("rosenbrock").minimiser(1)
    with pytest.raises(ValueError, match="rosenbrock needs points of dimension >= 2"):
        get_function("rosenbrock").value(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="dimension must be a positive int, got 0"):
        start_point(0, seed=0)
