"""An estimator's settings, and the plain data of its queries: one generation's, and the past ones
an estimator keeps (stored in a checkpoint, so a resumed run is bit-exact)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from evolm_lib.es import Member

from .spec import get_estimator

BASELINES = ("single", "average")


@dataclass(frozen=True)
class EstimatorConfig:
    """An estimator and its settings (the ones it does not use are ignored)."""

    name: str
    """Registry name: see `ESTIMATORS`."""
    num_queries: int = 10
    """Queries per generation (perturbed points; twopoint: +/- pairs, so even)."""
    mu: float = 0.05
    """Perturbation scale (smoothing radius); xnes and sepcmaes start with this step size."""
    num_histories: int = 5
    """H: past generations reused by zoar and averaged by zohs (zoar needs H >= 1; zoar_0 is H = 0)."""
    baseline: str = "single"
    """zoo and reinforce: "single" (F(x), one extra query) or "average" (mean of the queries)."""
    expavg_beta: float = 0.9
    """zohs_expavg: decay of the running average of the estimates, in [0, 1)."""
    reuse_radius: float = 1.5
    """relizo: reuse last samples within reuse_radius * mu * sqrt(d) (a fresh sample's typical distance)."""
    max_reuse_rate: float = 0.5
    """relizo: at most floor(max_reuse_rate * num_queries) reused samples per step, in [0, 1)."""
    xnes_eta_mu: float = 1.0
    """xnes: learning rate of the mean."""
    xnes_eta_sigma: float | None = None
    """xnes: learning rate of the step size (None: 3 (3 + ln d) / (5 d sqrt d))."""
    xnes_eta_shape: float | None = None
    """xnes: learning rate of the shape matrix B (None: as xnes_eta_sigma)."""

    def __post_init__(self) -> None:
        spec = get_estimator(self.name)
        n = self.num_queries
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_queries must be a positive int, got {n!r}")
        if spec.antithetic and n % 2:
            raise ValueError(f"num_queries must be even for {self.name} (+/- pairs along num_queries // 2 directions), got {n}")
        if n < spec.min_queries:
            raise ValueError(f"num_queries must be >= {spec.min_queries} for {self.name}, got {n}")
        if not (self.mu > 0 and math.isfinite(self.mu)):
            raise ValueError(f"mu must be > 0 and finite, got {self.mu}")
        h = self.num_histories
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise ValueError(f"num_histories must be an int >= 0, got {h!r}")
        if self.name == "zoar" and h < 1:
            raise ValueError("num_histories must be >= 1 for zoar (the baseline-only variant without reuse is zoar_0)")
        if self.baseline not in BASELINES:
            raise ValueError(f"baseline must be one of {list(BASELINES)}, got {self.baseline!r}")
        if not 0.0 <= self.expavg_beta < 1.0:
            raise ValueError(f"expavg_beta must be in [0, 1), got {self.expavg_beta}")
        if not (self.reuse_radius >= 0 and math.isfinite(self.reuse_radius)):
            raise ValueError(f"reuse_radius must be >= 0 and finite, got {self.reuse_radius}")
        if not 0.0 <= self.max_reuse_rate < 1.0:
            raise ValueError(f"max_reuse_rate must be in [0, 1), got {self.max_reuse_rate}")
        for name in ("xnes_eta_mu", "xnes_eta_sigma", "xnes_eta_shape"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be > 0 and finite, got {value}")


# ----------------------------------------------------------------------------- generations and state


@dataclass(frozen=True)
class Generation:
    """One generation's queries: query j was at x + signs[j] * mu * u(seeds[j]) and gave values[j]."""

    seeds: tuple[int, ...]
    """Direction seed of each query (an antithetic pair repeats its seed)."""
    signs: tuple[int, ...]
    """+1 or -1 per query."""
    values: tuple[float, ...]
    """f at each query (minimised; the LLM runner passes -reward)."""
    center: float | None = None
    """f(x) at the unperturbed point, when the estimator queries it (vanilla, zoo/reinforce single, zohs)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
        object.__setattr__(self, "signs", tuple(int(s) for s in self.signs))
        object.__setattr__(self, "values", tuple(float(v) for v in self.values))
        if not self.seeds:
            raise ValueError("a generation needs at least one query")
        if not len(self.seeds) == len(self.signs) == len(self.values):
            raise ValueError(f"seeds, signs and values differ in length: {len(self.seeds)}, {len(self.signs)}, {len(self.values)}")
        if any(s not in (1, -1) for s in self.signs):
            raise ValueError(f"signs must be +1 or -1, got {sorted(set(self.signs))}")
        # one NaN value would turn the whole update into NaN
        if not all(math.isfinite(v) for v in self.values):
            raise ValueError("values contain non-finite numbers")
        if self.center is not None:
            object.__setattr__(self, "center", float(self.center))
            if not math.isfinite(self.center):
                raise ValueError(f"center must be finite, got {self.center}")

    @classmethod
    def from_members(cls, members: Sequence[Member], values: Sequence[float] | torch.Tensor, center: float | None = None) -> "Generation":
        """A generation from the LLM runner's members (seed, sign) and their values (f = -reward)."""
        values = torch.as_tensor(values).reshape(-1).tolist()
        return cls(tuple(m.seed for m in members), tuple(m.sign for m in members), tuple(values), center)

    def to_dict(self) -> dict[str, Any]:
        """Plain lists (JSON-safe; floats round-trip exactly through json)."""
        return {"seeds": list(self.seeds), "signs": list(self.signs), "values": list(self.values), "center": self.center}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Generation":
        """Inverse of `to_dict`."""
        return cls(tuple(data["seeds"]), tuple(data["signs"]), tuple(data["values"]), data.get("center"))


@dataclass(frozen=True)
class HistoryState:
    """The past generations a seed-population estimator keeps (oldest first; at most H of them)."""

    generations: tuple[Generation, ...] = ()
    """Past generations, oldest first."""

    def to_dict(self) -> dict[str, Any]:
        """{"generations": [{"seeds", "signs", "values", "center"}, ...]}: plain, JSON-safe."""
        return {"generations": [generation.to_dict() for generation in self.generations]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "HistoryState":
        """Inverse of `to_dict`."""
        return cls(tuple(Generation.from_dict(g) for g in data.get("generations", ())))
