"""Update rules for zeroth-order gradient estimates: sgd, adam and radazo (R-AdaZO).

Papers:
- Kingma and Ba 2015, "Adam: A Method for Stochastic Optimization", https://arxiv.org/abs/1412.6980
- Shu et al. 2025, "Refining Adaptive Zeroth-Order Optimization at Ease" (R-AdaZO): the second
  moment tracks the UPDATED first moment squared,
  v = beta2 v + (1 - beta2) m^2, not g^2; the averaged m is much less noisy than a ZO estimate g.

Sign convention: the zo package MINIMISES, so every rule descends: x <- x - lr * direction.

Bias correction (m / (1 - beta1^t), v / (1 - beta2^t)) is an option, off by default as in the
reference code of Qiu et al. 2025 (https://arxiv.org/abs/2506.14460). Without it, with the default
betas (0.9, 0.99), the first adam step is lr * sign(g) (m = 0.1 g, sqrt(v) = 0.1 |g|) and the first
radazo step is 10 * lr * sign(g) (m = 0.1 g, sqrt(v) = 0.01 |g|), up to eps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch

UPDATE_RULES = ("sgd", "adam", "radazo")


@dataclass(frozen=True)
class UpdateConfig:
    """An update rule and its settings."""

    rule: str = "radazo"
    """sgd, adam or radazo."""
    learning_rate: float = 1e-3
    """Step size."""
    beta1: float = 0.9
    """Decay of the first moment m, in [0, 1) (adam, radazo)."""
    beta2: float = 0.99
    """Decay of the second moment v, in [0, 1) (adam, radazo); 0.99 as in the reference code."""
    eps: float = 1e-8
    """Added to sqrt(v); >= 0 (0 only for hand-checked examples: a zero gradient would divide 0 by 0)."""
    bias_correction: bool = False
    """Divide m and v by (1 - beta^t) as in Adam; the reference code does not."""

    def __post_init__(self) -> None:
        if self.rule not in UPDATE_RULES:
            raise ValueError(f"update rule {self.rule!r} is unknown; choose from {list(UPDATE_RULES)}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be > 0 and finite, got {self.learning_rate}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if not (self.eps >= 0 and math.isfinite(self.eps)):
            raise ValueError(f"eps must be >= 0 and finite, got {self.eps}")


@dataclass(frozen=True)
class UpdateState:
    """Step count and moment buffers (None for sgd)."""

    step: int = 0
    """Updates applied so far."""
    first_moment: torch.Tensor | None = None
    """m (adam, radazo)."""
    second_moment: torch.Tensor | None = None
    """v (adam, radazo)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (int and tensors) for a checkpoint."""
        return {"step": self.step, "first_moment": self.first_moment, "second_moment": self.second_moment}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "UpdateState":
        """Inverse of `to_dict`."""
        return cls(step=int(data["step"]), first_moment=data.get("first_moment"), second_moment=data.get("second_moment"))


def init_update_state(config: UpdateConfig, x: torch.Tensor) -> UpdateState:
    """Step 0 with zero moments shaped like x (none for sgd)."""
    if config.rule == "sgd":
        return UpdateState()
    return UpdateState(step=0, first_moment=torch.zeros_like(x), second_moment=torch.zeros_like(x))


def apply_update(config: UpdateConfig, state: UpdateState, x: torch.Tensor, gradient: torch.Tensor) -> tuple[torch.Tensor, UpdateState]:
    """One descent step: the new x and the advanced state (inputs are not modified)."""
    if gradient.shape != x.shape:
        raise ValueError(f"gradient has shape {tuple(gradient.shape)} but x has shape {tuple(x.shape)}")
    step = state.step + 1
    g = gradient.to(x.dtype)
    if config.rule == "sgd":
        return x - config.learning_rate * g, replace(state, step=step)
    zero = torch.zeros_like(x)
    m_old = zero if state.first_moment is None else state.first_moment
    v_old = zero if state.second_moment is None else state.second_moment
    m = config.beta1 * m_old + (1 - config.beta1) * g
    # radazo: v follows the updated m, adam: the raw g
    square = m * m if config.rule == "radazo" else g * g
    v = config.beta2 * v_old + (1 - config.beta2) * square
    m_hat, v_hat = m, v
    if config.bias_correction:
        m_hat = m / (1 - config.beta1**step)
        v_hat = v / (1 - config.beta2**step)
    direction = m_hat / (v_hat.sqrt() + config.eps)
    return x - config.learning_rate * direction, UpdateState(step=step, first_moment=m, second_moment=v)
