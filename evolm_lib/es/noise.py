"""Seeded noise and populations: a member is an integer seed and a sign; its noise is regenerated
from the seed wherever it is needed, so a population costs O(N) ints.

Salimans et al. 2017, "Evolution Strategies as a Scalable Alternative to Reinforcement Learning",
https://arxiv.org/abs/1703.03864 (antithetic sampling).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence, Union, get_args

import torch

from ..seeds import derive_seed
from .layout import Layout, Params, Shapes, shapes_of

Sigma = Union[float, Mapping[str, float]]
NoiseScheme = Literal["flat", "per_tensor", "tiled"]
NOISE_SCHEMES: tuple[str, ...] = ("flat", "per_tensor", "tiled")
TILE = 2048
"""Side of the square tiles the "tiled" scheme draws a weight's noise in (4M values, 16 MiB a tile)."""
NoiseDevice = Literal["cpu", "cuda"]
NOISE_DEVICE: NoiseDevice = "cpu"
"""Where noise is drawn unless asked otherwise: the CPU stream is the same bits on every machine."""


def tensor_seed(seed: int, name: str) -> int:
    """Stable 63-bit generator seed for one tensor of one member (blake2b of f"{seed}/{name}")."""
    return derive_seed(seed, name, bits=63)


def flat_seed(seed: int) -> int:
    """Stable 63-bit generator seed of a member's whole flat noise vector ("flat" scheme)."""
    return derive_seed(seed, "flat-noise", bits=63)


def tile_seed(seed: int, name: str, row_tile: int, col_tile: int) -> int:
    """Stable 63-bit generator seed of one tile of one tensor of one member ("tiled" scheme)."""
    return derive_seed(seed, name, row_tile, col_tile, bits=63)


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """A tensor seen as the matrix its tiles cover: (rows, the other dimensions together); a vector is one row."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, int(shape[0])
    return int(shape[0]), math.prod(int(d) for d in shape[1:])


def tiled_noise(seed: int, name: str, shape: Sequence[int], rows: slice = slice(None), cols: slice = slice(None),
                device: str | torch.device = NOISE_DEVICE) -> torch.Tensor:
    """Standard-normal noise of the block ``[rows, cols]`` of tensor ``name`` (seen as ``matrix_shape``),
    float32, drawing only the TILE x TILE tiles the block overlaps.

    Tile (i, j) is one ``torch.randn`` of its own generator, seeded by ``tile_seed(seed, name, i, j)``,
    so a value depends on the seed, the tensor and its position, never on what else is drawn: a card
    that holds a slice of a weight (vLLM's tensor parallelism splits rows or columns) makes exactly
    that slice's values, the same bits as the whole tensor drawn on one card of the same type."""
    n_rows, n_cols = matrix_shape(shape)
    r0, r1, _ = rows.indices(n_rows)
    c0, c1, _ = cols.indices(n_cols)
    out = torch.empty((max(r1 - r0, 0), max(c1 - c0, 0)), dtype=torch.float32, device=device)
    generator = torch.Generator(device=device)
    for i in range(r0 // TILE, -(-r1 // TILE)):
        top, bottom = i * TILE, min((i + 1) * TILE, n_rows)
        for j in range(c0 // TILE, -(-c1 // TILE)):
            left, right = j * TILE, min((j + 1) * TILE, n_cols)
            generator.manual_seed(tile_seed(int(seed), name, i, j))
            tile = torch.randn((bottom - top, right - left), generator=generator, dtype=torch.float32, device=device)
            a, b = max(top, r0), min(bottom, r1)  # the overlap of the tile and the block
            c, d = max(left, c0), min(right, c1)
            out[a - r0:b - r0, c - c0:d - c0] = tile[a - top:b - top, c - left:d - left]
    return out


def check_noise_scheme(scheme: str) -> None:
    """Raise ValueError unless `scheme` is a known noise scheme."""
    if scheme not in NOISE_SCHEMES:
        raise ValueError(f"noise_scheme must be one of {list(NOISE_SCHEMES)}, got {scheme!r}")


def check_noise_device(device: str) -> None:
    """Raise ValueError unless `device` is where noise can be drawn ("cpu" or "cuda")."""
    if device not in get_args(NoiseDevice):
        raise ValueError(f"noise_device must be one of {list(get_args(NoiseDevice))}, got {device!r}")


def population_noise(seeds: Sequence[int], layout: Layout, device: str | torch.device = NOISE_DEVICE,
                     scheme: NoiseScheme = "flat") -> torch.Tensor:
    """Standard-normal noise (len(seeds), layout.total) in float32, one row per seed.

    "flat": one generator per member, seeded by `flat_seed(seed)`, draws the member's whole vector
      at once (tensors in `layout`'s sorted-name order): one kernel per member, whatever the number
      of LoRA tensors (SmolLM2 has 420).
    "per_tensor": one generator per (member, tensor), seeded by `tensor_seed(seed, name)`; a tensor's
      noise does not depend on the other tensors (the scheme of runs made before "flat" existed).
    "tiled": one generator per (member, tensor, TILE x TILE tile) (`tiled_noise`): any slice of a
      tensor can be drawn on its own, which tensor-parallel engines and tensor-by-tensor updates need.
    Same seed, scheme and device type give the same bits. The default CPU stream is the same on every
    machine; CUDA's stream differs from the CPU's (reproducible on GPUs, not across CPU and GPU)."""
    check_noise_scheme(scheme)
    out = torch.empty((len(seeds), layout.total), dtype=torch.float32, device=device)
    for row, seed in zip(out, seeds):
        if scheme == "flat":
            generator = torch.Generator(device=device).manual_seed(flat_seed(int(seed)))
            torch.randn((layout.total,), generator=generator, out=row)
            continue
        if scheme == "tiled":
            for name, view in layout.split(row).items():
                view.copy_(tiled_noise(int(seed), name, view.shape, device=device).view(view.shape))
            continue
        for name, view in layout.split(row).items():
            # One generator per tensor, seeded by (seed, name): two same-shaped tensors get different
            # noise (the paper's code reseeds each tensor with the member seed, correlating them).
            generator = torch.Generator(device=device).manual_seed(tensor_seed(int(seed), name))
            view.copy_(torch.randn(view.shape, generator=generator, dtype=torch.float32, device=device))
    return out


def member_noise(seed: int, shapes: Shapes, dtype: torch.dtype = torch.float32, device: str | torch.device = NOISE_DEVICE,
                 scheme: NoiseScheme = "flat") -> Params:
    """Standard-normal noise for every tensor of a member; same seed (and device type) gives the same bits.

    Drawn in float32 so the bits do not depend on the target dtype (see `population_noise`)."""
    layout = Layout.of(shapes)
    noise = layout.split(population_noise([seed], layout, device, scheme)[0])
    return {name: noise[name].to(dtype) for name in shapes}


# ----------------------------------------------------------------------------- population


@dataclass(frozen=True)
class Member:
    """One population member: a noise seed and the sign (+1 or -1) it is applied with."""

    seed: int
    """Seed of the member's noise (see `member_noise`)."""
    sign: int = 1
    """+1 or -1; antithetic pairs share a seed and differ in sign."""

    def __post_init__(self) -> None:
        if self.sign not in (1, -1):
            raise ValueError(f"sign must be +1 or -1, got {self.sign!r}")


def check_population_size(population_size: int, antithetic: bool) -> None:
    """Raise ValueError unless a population of this size can be drawn (antithetic: in +/- pairs, so even)."""
    if population_size < 1:
        raise ValueError(f"population_size must be >= 1, got {population_size}")
    if antithetic and population_size % 2:
        raise ValueError(f"population_size must be even with antithetic sampling (+/- pairs), got {population_size}; "
                         "use an even population or antithetic: false")


def population(
    base_seed: int, generation: int, population_size: int, antithetic: bool = True
) -> list[Member]:
    """Members of one generation, seeds derived from (base_seed, generation, index)."""
    check_population_size(population_size, antithetic)

    def seed_of(index: int) -> int:
        # 31 bits: fits any int32 consumer (vLLM request seeds, numpy, logging as int).
        return derive_seed(base_seed, generation, index)

    if antithetic:
        # Adjacent (s, +1), (s, -1): an engine that batches neighbours sees both halves of a pair.
        return [Member(seed_of(pair), sign) for pair in range(population_size // 2) for sign in (1, -1)]
    return [Member(seed_of(index), 1) for index in range(population_size)]


# ----------------------------------------------------------------------------- perturbation


def check_sigma(sigma: Sigma, names: Sequence[str] | None = None) -> None:
    """Raise ValueError unless sigma (scalar or per tensor) is positive and covers `names`."""
    if isinstance(sigma, Mapping):
        for name, value in sigma.items():
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"sigma[{name!r}] must be > 0 and finite, got {value}")
        missing = [name for name in (names or ()) if name not in sigma]
        if missing:
            raise ValueError(f"sigma has no entry for tensors {missing}")
    elif not (sigma > 0 and math.isfinite(sigma)):
        raise ValueError(f"sigma must be > 0 and finite, got {sigma}")


def sigma_of(sigma: Sigma, name: str) -> float:
    """Noise scale of one tensor."""
    return float(sigma[name]) if isinstance(sigma, Mapping) else float(sigma)


def perturb(mean: Params, member: Member, sigma: Sigma, noise_device: str = NOISE_DEVICE,
            scheme: NoiseScheme = "flat") -> Params:
    """A member's parameters: mean + sign * sigma_t * noise, in the mean's dtype and device."""
    check_sigma(sigma, list(mean))
    noise = member_noise(member.seed, shapes_of(mean), device=noise_device, scheme=scheme)
    perturbed: Params = {}
    for name, tensor in mean.items():
        step = (member.sign * sigma_of(sigma, name)) * noise[name].to(tensor.device)
        # Add in float32: sigma ~1e-3 noise partly rounds away if added in bfloat16.
        perturbed[name] = (tensor.float() + step).to(tensor.dtype)
    return perturbed
