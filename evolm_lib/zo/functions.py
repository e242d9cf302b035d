"""Synthetic test functions on torch tensors, batched over a population, with exact gradients.

Each function maps points (..., d) to values (...); its gradient maps (..., d) to (..., d). The
definitions are the textbook ones (Surjanovic and Bingham, "Virtual Library of Simulation
Experiments: Test Functions", https://www.sfu.ca/~ssurjano/optimization.html); every one has its
global minimum 0 at `minimiser(d)`. The zeroth-order estimators in `evolm_lib.zo.estimators`
MINIMISE these functions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

DTYPE = torch.float64  # ZO differences of f ~ 1e3 over mu ~ 1e-2 lose every digit in float32

# Ackley's constants (a, b, c) and Rastrigin's A: the textbook values.
ACKLEY_A, ACKLEY_B, ACKLEY_C = 20.0, 0.2, 2 * math.pi
RASTRIGIN_A = 10.0


def _check_points(x: torch.Tensor, name: str, min_dimension: int = 1) -> torch.Tensor:
    """x as a floating tensor (..., d), with d >= min_dimension."""
    x = torch.as_tensor(x)
    if not x.is_floating_point():
        x = x.to(DTYPE)
    if x.ndim == 0 or x.shape[-1] < min_dimension:
        raise ValueError(f"{name} needs points of dimension >= {min_dimension} (shape (..., d)), got shape {tuple(x.shape)}")
    return x


# ----------------------------------------------------------------------------- the functions


def quadratic(x: torch.Tensor) -> torch.Tensor:
    """0.5 * sum_i x_i^2."""
    x = _check_points(x, "quadratic")
    return 0.5 * x.pow(2).sum(-1)


def quadratic_gradient(x: torch.Tensor) -> torch.Tensor:
    """x."""
    return _check_points(x, "quadratic").clone()


def rosenbrock(x: torch.Tensor) -> torch.Tensor:
    """sum_{i<d} 100 (x_{i+1} - x_i^2)^2 + (1 - x_i)^2."""
    x = _check_points(x, "rosenbrock", min_dimension=2)  # one variable has no (x_i, x_{i+1}) pair
    head, tail = x[..., :-1], x[..., 1:]
    return (100 * (tail - head.pow(2)).pow(2) + (1 - head).pow(2)).sum(-1)


def rosenbrock_gradient(x: torch.Tensor) -> torch.Tensor:
    """Exact gradient of `rosenbrock`."""
    x = _check_points(x, "rosenbrock", min_dimension=2)
    head, tail = x[..., :-1], x[..., 1:]
    inner = tail - head.pow(2)  # (..., d-1)
    gradient = torch.zeros_like(x)
    gradient[..., :-1] += -400 * head * inner - 2 * (1 - head)
    gradient[..., 1:] += 200 * inner
    return gradient


def rastrigin(x: torch.Tensor) -> torch.Tensor:
    """A d + sum_i (x_i^2 - A cos(2 pi x_i)), A = 10."""
    x = _check_points(x, "rastrigin")
    return RASTRIGIN_A * x.shape[-1] + (x.pow(2) - RASTRIGIN_A * torch.cos(2 * math.pi * x)).sum(-1)


def rastrigin_gradient(x: torch.Tensor) -> torch.Tensor:
    """2 x_i + 2 pi A sin(2 pi x_i)."""
    x = _check_points(x, "rastrigin")
    return 2 * x + 2 * math.pi * RASTRIGIN_A * torch.sin(2 * math.pi * x)


def ackley(x: torch.Tensor) -> torch.Tensor:
    """-a exp(-b sqrt(mean x^2)) - exp(mean cos(c x)) + a + e, with a = 20, b = 0.2, c = 2 pi."""
    x = _check_points(x, "ackley")
    radius = x.pow(2).mean(-1).sqrt()
    waves = torch.cos(ACKLEY_C * x).mean(-1)
    return -ACKLEY_A * torch.exp(-ACKLEY_B * radius) - torch.exp(waves) + ACKLEY_A + math.e


def ackley_gradient(x: torch.Tensor) -> torch.Tensor:
    """Exact gradient of `ackley`; 0 at the origin, where the radius term has no derivative."""
    x = _check_points(x, "ackley")
    d = x.shape[-1]
    radius = x.pow(2).mean(-1, keepdim=True).sqrt()
    waves = torch.cos(ACKLEY_C * x).mean(-1, keepdim=True)
    # at x = 0 the cone tip of the radius term has no gradient; 0 (the minimiser's subgradient) instead of NaN
    safe_radius = torch.where(radius > 0, radius, torch.ones_like(radius))
    cone = torch.where(radius > 0, ACKLEY_A * ACKLEY_B * torch.exp(-ACKLEY_B * radius) * x / (d * safe_radius), torch.zeros_like(x))
    return cone + torch.exp(waves) * ACKLEY_C * torch.sin(ACKLEY_C * x) / d


def _levy_w(x: torch.Tensor) -> torch.Tensor:
    return 1 + (x - 1) / 4


def levy(x: torch.Tensor) -> torch.Tensor:
    """sin^2(pi w_1) + sum_{i<d} (w_i - 1)^2 [1 + 10 sin^2(pi w_i + 1)] + (w_d - 1)^2 [1 + sin^2(2 pi w_d)], w = 1 + (x - 1)/4."""
    x = _check_points(x, "levy")
    w = _levy_w(x)
    head, last = w[..., :-1], w[..., -1]
    first = torch.sin(math.pi * w[..., 0]).pow(2)
    middle = ((head - 1).pow(2) * (1 + 10 * torch.sin(math.pi * head + 1).pow(2))).sum(-1)
    end = (last - 1).pow(2) * (1 + torch.sin(2 * math.pi * last).pow(2))
    return first + middle + end


def levy_gradient(x: torch.Tensor) -> torch.Tensor:
    """Exact gradient of `levy` (chain rule through dw/dx = 1/4)."""
    x = _check_points(x, "levy")
    w = _levy_w(x)
    dw = torch.zeros_like(w)
    # sin^2(pi w_1)
    dw[..., 0] += 2 * math.pi * torch.sin(math.pi * w[..., 0]) * torch.cos(math.pi * w[..., 0])
    # (w_i - 1)^2 [1 + 10 sin^2(pi w_i + 1)] for i < d
    head = w[..., :-1]
    angle = math.pi * head + 1
    dw[..., :-1] += 2 * (head - 1) * (1 + 10 * torch.sin(angle).pow(2)) + (head - 1).pow(2) * 20 * math.pi * torch.sin(angle) * torch.cos(angle)
    # (w_d - 1)^2 [1 + sin^2(2 pi w_d)]
    last = w[..., -1]
    angle = 2 * math.pi * last
    dw[..., -1] += 2 * (last - 1) * (1 + torch.sin(angle).pow(2)) + (last - 1).pow(2) * 4 * math.pi * torch.sin(angle) * torch.cos(angle)
    return dw / 4


# ----------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class TestFunction:
    """A test function: values, exact gradient and global minimiser (the minimum is 0)."""

    __test__ = False  # not a pytest class, despite the name

    name: str
    """Registry name."""
    value: Callable[[torch.Tensor], torch.Tensor]
    """Points (..., d) -> values (...)."""
    gradient: Callable[[torch.Tensor], torch.Tensor]
    """Points (..., d) -> exact gradients (..., d)."""
    minimiser_value: float
    """Every coordinate of the global minimiser (0 or 1 for these functions)."""
    min_dimension: int = 1
    """Smallest dimension the definition makes sense for."""

    def minimiser(self, dimension: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
        """The global minimiser in `dimension` variables (f = 0 there)."""
        check_dimension(dimension, self)
        return torch.full((dimension,), self.minimiser_value, dtype=dtype)


FUNCTIONS: dict[str, TestFunction] = {
    "ackley": TestFunction("ackley", ackley, ackley_gradient, 0.0),
    "levy": TestFunction("levy", levy, levy_gradient, 1.0),
    "rosenbrock": TestFunction("rosenbrock", rosenbrock, rosenbrock_gradient, 1.0, min_dimension=2),
    "quadratic": TestFunction("quadratic", quadratic, quadratic_gradient, 0.0),
    "rastrigin": TestFunction("rastrigin", rastrigin, rastrigin_gradient, 0.0),
}


def get_function(name: str) -> TestFunction:
    """The registered test function `name`; ValueError listing the known ones otherwise."""
    if name not in FUNCTIONS:
        raise ValueError(f"function {name!r} is unknown; choose from {sorted(FUNCTIONS)}")
    return FUNCTIONS[name]


def check_dimension(dimension: int, function: TestFunction | None = None) -> None:
    """Raise ValueError unless `dimension` is a positive int (and large enough for `function`)."""
    if isinstance(dimension, bool) or not isinstance(dimension, int) or dimension < 1:
        raise ValueError(f"dimension must be a positive int, got {dimension!r}")
    if function is not None and dimension < function.min_dimension:
        raise ValueError(f"dimension must be >= {function.min_dimension} for {function.name}, got {dimension}")


def start_point(dimension: int, seed: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    """x0 ~ N(0, I_d) from `seed` (the same seed gives the same point on every machine)."""
    check_dimension(dimension)
    generator = torch.Generator().manual_seed(int(seed))
    # drawn in float64 whatever `dtype`, so the float32 start is the float64 one rounded
    return torch.randn(dimension, generator=generator, dtype=torch.float64).to(dtype)
