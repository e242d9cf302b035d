"""The ES ascent direction from members and their fitness weights, regenerating each member's noise.

Qiu et al. 2025, "Evolution Strategies at Scale: LLM Fine-Tuning Beyond Reinforcement Learning",
https://arxiv.org/abs/2509.24372 (update ``theta += alpha/N * sum_i z_i eps_i``).
"""
from __future__ import annotations

from typing import Literal, Mapping, Sequence

import torch

from .layout import FlatParams, Layout, Params, Shapes
from .noise import NOISE_DEVICE, Member, NoiseScheme, Sigma, check_sigma, population_noise, sigma_of

GradientForm = Literal["qiu", "textbook"]


def es_gradient(
    members: Sequence[Member],
    weights: torch.Tensor | Sequence[float],
    shapes: Shapes,
    sigma: Sigma,
    form: GradientForm = "qiu",
    noise_device: str = NOISE_DEVICE,
    scheme: NoiseScheme = "flat",
) -> Params:
    """ES ascent direction from members and fitness weights, regenerating each member's noise."""
    # "qiu": g = 1/N sum_i w_i sign_i eps_i, exactly Qiu et al. 2025 (theta += alpha/N sum z_i eps_i,
    #   sigma folded into the learning rate alpha).
    # "textbook": g = 1/(N sigma_t) sum_i w_i sign_i eps_i, an unbiased estimate of the gradient of
    #   the Gaussian-smoothed objective when w are raw rewards.
    # eps is standard normal in both (the perturbation was sigma_t * eps), also with per-tensor sigma.
    coefficient = member_coefficients(members, weights, form, sigma, list(shapes))
    n = len(members)
    scale = {name: n * sigma_of(sigma, name) if form == "textbook" else n for name in shapes}
    return seeded_combination(coefficient, shapes, scale, noise_device, scheme)


def member_coefficients(members: Sequence[Member], weights: torch.Tensor | Sequence[float], form: GradientForm,
                        sigma: Sigma, names: Sequence[str]) -> dict[int, float]:
    """seed -> sum of sign * weight over the members drawn from it, after checking the gradient's
    inputs: members sharing a seed (an antithetic pair) share their noise, drawn once with the
    combined coefficient w+ - w-."""
    if form not in ("qiu", "textbook"):
        raise ValueError(f"form must be 'qiu' or 'textbook', got {form!r}")
    check_sigma(sigma, list(names))
    w = torch.as_tensor(weights, dtype=torch.float64).reshape(-1)  # (population,)
    if len(members) == 0:
        raise ValueError("members must not be empty")
    if w.numel() != len(members):
        raise ValueError(f"weights has {w.numel()} entries but members has {len(members)}")
    coefficient: dict[int, float] = {}
    for member, weight in zip(members, w.tolist()):
        coefficient[member.seed] = coefficient.get(member.seed, 0.0) + member.sign * weight
    return coefficient


def seeded_combination(coefficient: Mapping[int, float], shapes: Shapes, divisor: Mapping[str, float],
                       noise_device: str = NOISE_DEVICE, scheme: NoiseScheme = "flat") -> Params:
    """sum_s coefficient[s] * noise(s) / divisor[name], per tensor, in float32 on `noise_device`
    (a FlatParams).

    The members' noise is drawn in blocks (bounded memory) and accumulated seed by seed in a fixed
    order, so the result is the same bits on every call (a resumed run stays bit-exact)."""
    layout = Layout.of(shapes)
    flat = torch.zeros(layout.total, dtype=torch.float32, device=noise_device)
    seeds = [seed for seed, c in coefficient.items() if c != 0.0]  # 0: e.g. a pair with equal rewards
    block = layout.block_size()
    for start in range(0, len(seeds), block):
        chunk = seeds[start:start + block]
        for seed, row in zip(chunk, population_noise(chunk, layout, noise_device, scheme)):
            if scheme == "flat":
                flat.add_(row, alpha=coefficient[seed])  # float32 accumulation into a fresh buffer
                continue
            # per_tensor: tensor by tensor, the very kernels runs made before "flat" used (a
            # vectorised add rounds a tensor's tail differently when the whole vector is one tensor)
            for total, part in zip(layout.split(flat).values(), layout.split(row).values()):
                total.add_(part, alpha=coefficient[seed])
    if scheme == "flat":  # one division for the whole vector (one value per tensor, repeated)
        values = [float(divisor[name]) for name in layout.names]
        if len(set(values)) == 1:
            flat.div_(values[0])
        else:
            flat.div_(layout.repeat(values, flat.device))
    else:
        for name, view in layout.split(flat).items():
            view.div_(divisor[name])
    return FlatParams(flat, layout)
