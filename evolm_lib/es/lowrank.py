"""EGGROLL: low-rank ES noise per weight matrix, with a full-rank update.

Member i perturbs each targeted weight matrix W (out, in) by sigma * E_i with

    E_i = A_i B_i^T / sqrt(r),    A_i (out, r), B_i (in, r) standard normal,

so every entry of E_i has unit variance, whatever the rank r (Sarkar et al. 2025, "Evolution
Strategies at the Hyperscale", https://arxiv.org/abs/2511.16652). E_i is served as the member's
LoRA slot (lora_B = sign * sigma * A_i / sqrt(r), lora_A = B_i^T), so the whole population is one
batched engine call. The update sums the members' low-rank noise into a full-rank step,

    g = 1/N sum_i w_i sign_i E_i = 1/(N sqrt(r)) A diag(c) B^T,

with A = [A_1 .. A_N] (out, N r), B likewise, and c each member's weight repeated over its r columns:
one matrix product per weight, never N dense matrices.

Like ``core``, the factors come from the member's seed (one generator per member draws all its
factors, in sorted-name order), rewards are maximised, and nothing here touches an engine.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from .core import (GradientForm, Layout, Member, NoiseScheme, Shapes, Sigma, check_sigma, member_coefficients,
                   population_noise, sigma_of)

# a factor's name in the member's flat factor vector: "<weight name>::a" (out, r) and "::b" (in, r)
_A, _B = "::a", "::b"


def check_rank(rank: int, shapes: Shapes) -> None:
    """Raise ValueError unless rank >= 1 and every targeted weight is a matrix at least that wide."""
    if not (isinstance(rank, int) and rank >= 1):
        raise ValueError(f"noise_rank must be an integer >= 1, got {rank!r}")
    for name, shape in shapes.items():
        if len(shape) != 2:
            raise ValueError(f"low-rank noise needs 2-D weights; {name} has shape {tuple(shape)}")
        if rank > min(shape):
            raise ValueError(f"noise_rank {rank} exceeds the smaller side of {name} {tuple(shape)}")


def factor_layout(shapes: Shapes, rank: int) -> Layout:
    """The layout of one member's factors: for each weight (out, in), A (out, r) and B (in, r)."""
    check_rank(rank, shapes)
    factors: dict[str, tuple[int, int]] = {}
    for name, (out_features, in_features) in shapes.items():
        factors[name + _A] = (int(out_features), rank)
        factors[name + _B] = (int(in_features), rank)
    return Layout.of(factors)


def member_factors(seeds: Sequence[int], shapes: Shapes, rank: int, device: str | torch.device = "cpu",
                   scheme: NoiseScheme = "flat") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each weight's factors for a block of members: name -> (A (members, out, r), B (members, in, r)),
    float32, regenerated from the seeds (the same bits wherever the same device type draws them)."""
    layout = factor_layout(shapes, rank)
    views = layout.split(population_noise(seeds, layout, device, scheme))  # name -> (members, rows, r)
    return {name: (views[name + _A], views[name + _B]) for name in shapes}


def member_delta(member: Member, shapes: Shapes, rank: int, sigma: Sigma, device: str | torch.device = "cpu",
                 scheme: NoiseScheme = "flat") -> dict[str, torch.Tensor]:
    """One member's dense perturbation sign * sigma * A B^T / sqrt(r) per weight (out, in), float32:
    the reference for what its LoRA slot must serve."""
    check_sigma(sigma, list(shapes))
    factors = member_factors([member.seed], shapes, rank, device, scheme)
    scale = 1.0 / math.sqrt(rank)
    return {name: (member.sign * sigma_of(sigma, name) * scale) * (a[0] @ b[0].T) for name, (a, b) in factors.items()}


def slot_factors(member: Member, shapes: Shapes, rank: int, sigma: Sigma, device: str | torch.device = "cpu",
                 scheme: NoiseScheme = "flat") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A member's perturbation as LoRA factors: name -> (lora_A (r, in), lora_B (out, r)) with
    lora_B @ lora_A = sign * sigma * A B^T / sqrt(r) (scaling 1: alpha = r)."""
    check_sigma(sigma, list(shapes))
    factors = member_factors([member.seed], shapes, rank, device, scheme)
    scale = 1.0 / math.sqrt(rank)
    return {name: (b[0].T.contiguous(), (member.sign * sigma_of(sigma, name) * scale) * a[0])
            for name, (a, b) in factors.items()}


def combine_factors(a: torch.Tensor, b: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """sum_i coefficients[i] * a[i] @ b[i]^T for a (members, out, r), b (members, in, r): (out, in),
    as ONE product of the concatenated factors, accumulated in float32."""
    members, out_features, rank = a.shape
    c = torch.as_tensor(coefficients, dtype=torch.float32, device=a.device).reshape(members, 1, 1)
    left = a.float().permute(1, 0, 2).reshape(out_features, members * rank)  # (out, N r)
    right = (b.float() * c).permute(1, 0, 2).reshape(b.shape[1], members * rank)  # (in, N r)
    return left @ right.T


def lowrank_gradient(members: Sequence[Member], weights: torch.Tensor | Sequence[float], shapes: Shapes, rank: int,
                     sigma: Sigma, form: GradientForm = "qiu", device: str | torch.device = "cpu",
                     scheme: NoiseScheme = "flat", block: int | None = None,
                     out: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The full-rank ES ascent direction from low-rank members: name -> (out, in) float32 on `device`
    (written into ``out``'s tensors when given, e.g. views of one flat vector: no copy afterwards).

    "qiu": 1/N sum_i w_i sign_i E_i (sigma folded into the learning rate, as in ``core.es_gradient``);
    "textbook": divided by sigma as well. Antithetic pairs share a seed and are drawn once, with the
    combined coefficient w+ - w-. Members are drawn in blocks (bounded memory), accumulated in a
    fixed order, so a resumed run gets the same bits."""
    coefficient = member_coefficients(members, weights, form, sigma, list(shapes))
    seeds = [seed for seed, c in coefficient.items() if c != 0.0]
    n = len(members)
    if out is not None:
        totals = {name: out[name].view(tuple(shape)).zero_() for name, shape in shapes.items()}
    else:
        totals = {name: torch.zeros(tuple(shape), dtype=torch.float32, device=device) for name, shape in shapes.items()}
    layout = factor_layout(shapes, rank)
    step = block or layout.block_size()
    for start in range(0, len(seeds), step):
        chunk = seeds[start:start + step]
        c = torch.tensor([coefficient[seed] for seed in chunk], dtype=torch.float32)
        for name, (a, b) in member_factors(chunk, shapes, rank, device, scheme).items():
            totals[name].add_(combine_factors(a, b, c))
    for name, total in totals.items():
        divisor = n * math.sqrt(rank) * (sigma_of(sigma, name) if form == "textbook" else 1.0)
        total.div_(divisor)
    return totals

