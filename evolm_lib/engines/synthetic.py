"""A deterministic stand-in engine for tests and examples: no model, same protocol.

Each completion's length grows with the squared distance of the adapter from a hidden target
adapter, so a length-based task (conciseness) turns into a quadratic objective. Rewards are
exactly reproducible, which is what resume tests need.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..es import member_noise
from ..lora import AdapterWeights
from ..types import Completion, PromptLike
from .base import CompletionTable, GridsOneByOne, SamplingSettings, materialize


class SyntheticEngine(GridsOneByOne):
    """Completion length = ``1 + round(length_scale * mean((adapter - target)^2))`` characters."""

    def __init__(self, target_seed: int = 123, target_scale: float = 0.05, length_scale: float = 20000.0):
        self.target_seed = target_seed
        self.target_scale = target_scale
        self.length_scale = length_scale
        self.calls = 0
        self._targets: dict[tuple, dict[str, torch.Tensor]] = {}

    def _target(self, adapter: AdapterWeights) -> dict[str, torch.Tensor]:
        key = tuple(sorted((k, tuple(v.shape)) for k, v in adapter.tensors.items()))
        if key not in self._targets:
            shapes = {k: tuple(v.shape) for k, v in adapter.tensors.items()}
            noise = member_noise(self.target_seed, shapes)
            self._targets[key] = {k: v * self.target_scale for k, v in noise.items()}
        return self._targets[key]

    def distance(self, adapter: AdapterWeights | None) -> float:
        """Mean squared distance per parameter of an adapter from the hidden target."""
        if adapter is None:
            return float("nan")
        target = self._target(adapter)
        total = sum(((adapter.tensors[k].float() - t) ** 2).sum() for k, t in target.items())
        return float(total) / sum(t.numel() for t in target.values())

    def generate(
        self, prompts: Sequence[PromptLike], adapters: Sequence[AdapterWeights | None] = (None,), sampling: SamplingSettings = SamplingSettings()
    ) -> CompletionTable:
        """Completions indexed ``[adapter][prompt]``; identical for every prompt."""
        self.calls += 1
        adapters = materialize(adapters)
        rows = []
        for adapter in adapters:
            distance = self.distance(adapter) if adapter is not None else 1.0
            length = 1 + min(int(round(self.length_scale * distance)), 4 * sampling.max_new_tokens)
            text = "x" * length
            completion = Completion(text, tuple([87] * length), "stop")
            rows.append([completion for _ in prompts])
        return CompletionTable(rows, {"adapters_s": 0.0, "generate_s": 0.0})

    def close(self) -> None:
        """Nothing to release."""
