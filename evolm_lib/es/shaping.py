"""Fitness shaping: every shaper maps rewards to the members' weights in the update, with the same
signature, so they are swappable and testable one by one. Rewards are maximised."""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def raw(rewards: torch.Tensor) -> torch.Tensor:
    """Rewards unchanged, as float32 (population,)."""
    return torch.as_tensor(rewards).to(torch.float32).clone()


def z_score(rewards: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(r - mean) / (std + eps) with the population std (unbiased=False), as in Qiu et al."""
    r = torch.as_tensor(rewards).to(torch.float32)  # (population,)
    centred = r - r.mean()
    # all-equal rewards: std is 0 and centred is 0, so zeros (zero update), not NaN
    return centred / (centred.pow(2).mean().sqrt() + eps)


def centered_ranks(rewards: torch.Tensor | Sequence[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Ranks scaled to [-0.5, 0.5] (Salimans et al. 2017); ties share their average rank. ``dtype``:
    the precision the values are compared in (float64 keeps close values of a large f apart)."""
    r = torch.as_tensor(rewards, dtype=dtype)  # (population,)
    n = r.numel()
    if n < 2:
        return torch.zeros_like(r)  # one member carries no ordering information
    ordered = torch.sort(r).values
    below = torch.searchsorted(ordered, r, right=False)  # members strictly worse
    at_or_below = torch.searchsorted(ordered, r, right=True)
    rank = (below + at_or_below - 1).to(dtype) / 2  # average 0-based rank over the tie
    return rank / (n - 1) - 0.5


def per_prompt_centering(rewards_matrix: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Centre each prompt over members, divide by the global std, then average over prompts."""
    matrix = torch.as_tensor(rewards_matrix).to(torch.float32)  # (population, prompts)
    if matrix.ndim != 2:
        raise ValueError(f"rewards_matrix must be (population, prompts), got shape {tuple(matrix.shape)}")
    # Removing each prompt's mean removes its difficulty, so easy prompts do not drown hard ones.
    centred = matrix - matrix.mean(dim=0, keepdim=True)
    # all-equal rewards: zeros, not NaN
    scaled = centred / (centred.pow(2).mean().sqrt() + eps)
    return scaled.mean(dim=1)  # (population,)


SHAPING: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "z_score": z_score,
    "centered_ranks": centered_ranks,
    "raw": raw,
    "per_prompt": per_prompt_centering,
}
_MATRIX_SHAPERS = frozenset({"per_prompt"})  # these take (population, prompts), not (population,)


def shape_fitness(name: str, rewards_matrix: torch.Tensor) -> torch.Tensor:
    """Fitness weights (population,) from rewards (population, prompts) by the shaper `name`."""
    if name not in SHAPING:
        raise ValueError(f"fitness shaping {name!r} is unknown; choose from {sorted(SHAPING)}")
    matrix = torch.as_tensor(rewards_matrix).to(torch.float32)
    if matrix.ndim == 1:
        matrix = matrix[:, None]  # one reward per member = one prompt
    if matrix.ndim != 2:
        raise ValueError(f"rewards_matrix must be (population, prompts), got shape {tuple(matrix.shape)}")
    if not torch.isfinite(matrix).all():
        # one NaN reward would turn the whole update into NaN
        raise ValueError("rewards_matrix contains non-finite values")
    if name in _MATRIX_SHAPERS:
        return SHAPING[name](matrix)
    return SHAPING[name](matrix.mean(dim=1))
