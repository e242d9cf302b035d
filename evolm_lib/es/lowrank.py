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

from .gradient import GradientForm, member_coefficients
from .layout import Layout, Shapes
from .noise import Member, NoiseScheme, Sigma, check_sigma, population_noise, sigma_of

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


Slices = Mapping[str, tuple[slice, slice]]
"""Weight name -> (rows, columns) of it that a card of a tensor-parallel engine holds; a name not
given is whole. The factors are drawn whole (r x (out + in) values) and cut, so a slice's noise is
the whole weight's noise there."""


def _cut(a: torch.Tensor, b: torch.Tensor, name: str, slices: Slices | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A (..., out, r) and B (..., in, r) cut to the rows and columns of ``name`` in ``slices``."""
    if slices is None or name not in slices:
        return a, b
    rows, cols = slices[name]
    return a[..., rows, :], b[..., cols, :]


def member_delta(member: Member, shapes: Shapes, rank: int, sigma: Sigma, device: str | torch.device = "cpu",
                 scheme: NoiseScheme = "flat", slices: Slices | None = None) -> dict[str, torch.Tensor]:
    """One member's dense perturbation sign * sigma * A B^T / sqrt(r) per weight (out, in), float32
    (over each weight's slice in ``slices``): the reference for what its LoRA slot must serve."""
    check_sigma(sigma, list(shapes))
    factors = member_factors([member.seed], shapes, rank, device, scheme)
    scale = 1.0 / math.sqrt(rank)
    out = {}
    for name, (a, b) in factors.items():
        a, b = _cut(a, b, name, slices)
        out[name] = (member.sign * sigma_of(sigma, name) * scale) * (a[0] @ b[0].T)
    return out


def slot_factors(member: Member, shapes: Shapes, rank: int, sigma: Sigma, device: str | torch.device = "cpu",
                 scheme: NoiseScheme = "flat") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A member's perturbation as LoRA factors: name -> (lora_A (r, in), lora_B (out, r)) with
    lora_B @ lora_A = sign * sigma * A B^T / sqrt(r) (scaling 1: alpha = r)."""
    check_sigma(sigma, list(shapes))
    factors = member_factors([member.seed], shapes, rank, device, scheme)
    scale = 1.0 / math.sqrt(rank)
    return {name: (b[0].T.contiguous(), (member.sign * sigma_of(sigma, name) * scale) * a[0])
            for name, (a, b) in factors.items()}


def _concatenated(a: torch.Tensor, b: torch.Tensor, coefficients: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A (..., out, N r), (B diag(c))^T (..., N r, in)): the members' factors side by side, float32."""
    *lead, members, out_features, rank = a.shape
    c = torch.as_tensor(coefficients, dtype=torch.float32, device=a.device).reshape(members, 1, 1)
    left = a.float().transpose(-3, -2).reshape(*lead, out_features, members * rank)  # (..., out, N r)
    right = (b.float() * c).transpose(-3, -2).reshape(*lead, b.shape[-2], members * rank)  # (..., in, N r)
    return left, right.transpose(-1, -2)


def combine_factors(a: torch.Tensor, b: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
    """sum_i coefficients[i] * a[..., i] @ b[..., i]^T for a (..., members, out, r), b (..., members, in, r):
    (..., out, in), as ONE product of the concatenated factors (a batched one for leading dimensions,
    e.g. a group of same-shaped weights), accumulated in float32."""
    left, right = _concatenated(a, b, coefficients)
    return left @ right


def shape_groups(shapes: Shapes) -> dict[tuple[int, ...], list[str]]:
    """Weight names grouped by shape (each group in sorted-name order): one batched product per group."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for name in sorted(shapes):
        groups.setdefault(tuple(int(d) for d in shapes[name]), []).append(name)
    return groups


def _stacked_view(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The same-shaped ``views`` as one (len(views), *shape) view of their common storage, where they
    sit at equal distances in it (each layer's copy of a projection in a flat vector); else None."""
    first = views[0]
    if not all(v.is_contiguous() and v.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               for v in views):
        return None
    offsets = [v.storage_offset() for v in views]
    step = offsets[1] - offsets[0] if len(offsets) > 1 else first.numel()
    if step < first.numel() or any(b - a != step for a, b in zip(offsets, offsets[1:])):
        return None
    return first.as_strided((len(views), *first.shape), (step, *first.stride()), offsets[0])


def _held_shape(shape: Sequence[int], rows: slice, cols: slice) -> tuple[int, int]:
    """The shape of the rows and columns of a (out, in) weight that a card holds."""
    out_features, in_features = (int(d) for d in shape)
    return len(range(*rows.indices(out_features))), len(range(*cols.indices(in_features)))


def lowrank_gradient_by_weight(members: Sequence[Member], weights: torch.Tensor | Sequence[float], shapes: Shapes,
                               rank: int, sigma: Sigma, form: GradientForm = "qiu", device: str | torch.device = "cpu",
                               scheme: NoiseScheme = "flat", slices: Slices | None = None):
    """``lowrank_gradient`` one weight at a time: yields (name, its gradient) in sorted-name order
    (over each weight's slice in ``slices``), the members' factors drawn once (r x (out + in) values
    a member), so only one weight's full-rank gradient exists at a time beside them. A product per
    weight rather than per group of same-shaped weights: equal to ``lowrank_gradient`` to float32
    rounding, not bit for bit."""
    coefficient = member_coefficients(members, weights, form, sigma, list(shapes))
    seeds = [seed for seed, c in coefficient.items() if c != 0.0]
    factors = member_factors(seeds, shapes, rank, device, scheme) if seeds else {}
    c = torch.tensor([coefficient[seed] for seed in seeds], dtype=torch.float32)
    for name in sorted(shapes):
        if seeds:
            total = combine_factors(*_cut(*factors[name], name, slices), c)
        else:  # every coefficient zero (e.g. equal antithetic rewards): a zero update
            rows, cols = (slices or {}).get(name, (slice(None), slice(None)))
            total = torch.zeros(_held_shape(shapes[name], rows, cols), dtype=torch.float32, device=device)
        yield name, total.div_(len(members) * math.sqrt(rank) * (sigma_of(sigma, name) if form == "textbook" else 1.0))


def lowrank_gradient_per_matrix(members: Sequence[Member], weights: torch.Tensor | Sequence[float], shapes: Shapes,
                                rank: int, sigma: Sigma, form: GradientForm = "qiu", device: str | torch.device = "cpu",
                                scheme: NoiseScheme = "flat", block: int | None = None) -> dict[str, torch.Tensor]:
    """``lowrank_gradient`` one weight matrix at a time (a product and an add per matrix): the reference
    the batched path is checked and timed against."""
    coefficient = member_coefficients(members, weights, form, sigma, list(shapes))
    seeds = [seed for seed, c in coefficient.items() if c != 0.0]
    totals = {name: torch.zeros(tuple(shape), dtype=torch.float32, device=device) for name, shape in shapes.items()}
    step = block or factor_layout(shapes, rank).block_size()
    for start in range(0, len(seeds), step):
        chunk = seeds[start:start + step]
        c = torch.tensor([coefficient[seed] for seed in chunk], dtype=torch.float32)
        for name, (a, b) in member_factors(chunk, shapes, rank, device, scheme).items():
            totals[name].add_(combine_factors(a, b, c))
    for name, total in totals.items():
        total.div_(len(members) * math.sqrt(rank) * (sigma_of(sigma, name) if form == "textbook" else 1.0))
    return totals


def lowrank_gradient(members: Sequence[Member], weights: torch.Tensor | Sequence[float], shapes: Shapes, rank: int,
                     sigma: Sigma, form: GradientForm = "qiu", device: str | torch.device = "cpu",
                     scheme: NoiseScheme = "flat", block: int | None = None,
                     out: Mapping[str, torch.Tensor] | None = None, slices: Slices | None = None) -> dict[str, torch.Tensor]:
    """The full-rank ES ascent direction from low-rank members: name -> (out, in) float32 on `device`
    (written into ``out``'s tensors when given, e.g. views of one flat vector: no copy afterwards).

    "qiu": 1/N sum_i w_i sign_i E_i (sigma folded into the learning rate, as in ``core.es_gradient``);
    "textbook": divided by sigma as well. Antithetic pairs share a seed and are drawn once, with the
    combined coefficient w+ - w-. Members are drawn in blocks (bounded memory), accumulated in a
    fixed order, so a resumed run gets the same bits. With ``slices``, each weight's slice only (a
    card of a tensor-parallel engine): the products are of cut factors, so their sums may round
    otherwise than the whole weight's in the last bits."""
    coefficient = member_coefficients(members, weights, form, sigma, list(shapes))
    seeds = [seed for seed, c in coefficient.items() if c != 0.0]
    n = len(members)
    held = {name: _held_shape(shape, *(slices or {}).get(name, (slice(None), slice(None)))) for name, shape in shapes.items()}
    if out is not None:
        totals = {name: out[name].view(held[name]) for name in shapes}
    else:
        flat = torch.empty(sum(math.prod(shape) for shape in held.values()), dtype=torch.float32, device=device)
        totals = Layout.of(held).split(flat)
    groups = shape_groups(held)
    # each group's totals as one (matrices, out, in) tensor: a view where they sit at equal distances
    # (a product written in place), else a buffer copied out at the end
    stacked = {key: _stacked_view([totals[name] for name in names]) for key, names in groups.items()}
    buffers = {key: torch.empty((len(groups[key]), *key), dtype=torch.float32, device=device)
               for key, view in stacked.items() if view is None}
    step = block or factor_layout(shapes, rank).block_size()
    chunks = [seeds[start:start + step] for start in range(0, len(seeds), step)]
    if not chunks:  # every coefficient zero (e.g. equal antithetic rewards): a zero update
        for key in groups:
            (stacked[key] if stacked[key] is not None else buffers[key]).zero_()
    for index, chunk in enumerate(chunks):
        c = torch.tensor([coefficient[seed] for seed in chunk], dtype=torch.float32)
        factors = member_factors(chunk, shapes, rank, device, scheme)
        for key, names in groups.items():
            cut = [_cut(*factors[name], name, slices) for name in names]
            a = torch.stack([pair[0] for pair in cut])  # (matrices, members, out, r)
            b = torch.stack([pair[1] for pair in cut])  # (matrices, members, in, r)
            target = stacked[key] if stacked[key] is not None else buffers[key]  # (matrices, out, in)
            if index == 0:  # the first block is the sum so far: its product written straight in
                target.baddbmm_(*_concatenated(a, b, c), beta=0.0)
            else:  # later blocks add their product, as the per-matrix path does
                target.add_(combine_factors(a, b, c))
    for key, names in groups.items():
        target = stacked[key] if stacked[key] is not None else buffers[key]
        divisors = [n * math.sqrt(rank) * (sigma_of(sigma, name) if form == "textbook" else 1.0) for name in names]
        if len(set(divisors)) == 1:
            target.div_(divisors[0])
        else:  # textbook form with a sigma per weight
            for matrix, divisor in zip(target.unbind(0), divisors):
                matrix.div_(divisor)
        if key in buffers:
            torch._foreach_copy_([totals[name] for name in names], list(target.unbind(0)))
    return totals

