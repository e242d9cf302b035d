"""Searchers whose state holds sample positions or a search distribution rather than seeds: relizo
(interpolation over fresh and reused samples), xnes and sepcmaes (search distributions)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from evolm_lib.es import population

from .coefficients import directions
from .config import EstimatorConfig
from .searchers import Objective, Step, check_x


@dataclass(frozen=True)
class RelizoState:
    """ReLIZO: the last step's centre and samples (positions and values), for reuse."""

    generation: int = 0
    center: torch.Tensor | None = None
    """Last centre x_{t-1} (d,)."""
    center_value: torch.Tensor | None = None
    """f(x_{t-1}), a 0-d tensor."""
    points: torch.Tensor | None = None
    """Last samples (m, d)."""
    values: torch.Tensor | None = None
    """f at the last samples (m,)."""


@dataclass(frozen=True)
class RelizoSearcher:
    """ReLIZO (Wang et al., NeurIPS 2024, "ReLIZO: Sample Reusable Linear Interpolation-based
    Zeroth-order Optimization", https://openreview.net/forum?id=yzviAnpvU6): the minimum-norm g that
    interpolates f(x + delta_i) - f(x) = delta_i . g over fresh samples and reused nearby old ones.

    Differences from the reference code: the reused samples are kept (the reference zeroes them
    before copying, so every reusing step divided by zero and was skipped); the reuse radius is
    reuse_radius * mu * sqrt(d), relative to a fresh sample's distance, instead of 2 x learning
    rate; directions come from seeds, so a run is reproducible.
    """

    config: EstimatorConfig
    seed: int

    def init(self, x0: torch.Tensor) -> RelizoState:
        """Nothing to reuse yet."""
        check_x(x0)
        return RelizoState()

    def step(self, objective: Objective, x: torch.Tensor, state: RelizoState) -> Step:
        """f(x), reuse up to floor(max_reuse_rate * n) old points within the radius, fill up with fresh ones."""
        check_x(x, None if state.center is None else state.center.shape[0])
        n, mu, d = self.config.num_queries, self.config.mu, x.shape[0]
        center_value = objective(x[None])[0]
        reused_points = x.new_zeros((0, d))
        reused_values = x.new_zeros((0,))
        if state.points is not None and self.config.reuse_radius > 0:
            candidates = torch.cat([state.points, state.center[None]])  # (m + 1, d)
            candidate_values = torch.cat([state.values, state.center_value.reshape(1)])
            distance = (candidates - x).norm(dim=1)
            radius = self.config.reuse_radius * mu * math.sqrt(d)
            # a candidate at x itself (a zero step) has no displacement to interpolate along
            usable = (distance < radius) & (distance > 1e-12 * radius)
            order = [int(i) for i in torch.argsort(distance) if usable[i]]
            keep = order[: int(self.config.max_reuse_rate * n)]
            reused_points, reused_values = candidates[keep], candidate_values[keep]
        fresh_count = n - reused_points.shape[0]
        seeds = [m.seed for m in population(self.seed, state.generation, fresh_count, antithetic=False)]
        fresh_points = x + mu * directions(seeds, d, x.dtype)
        fresh_values = objective(fresh_points)
        points = torch.cat([reused_points, fresh_points])  # (n, d)
        values = torch.cat([reused_values, fresh_values])
        displacement = points - x
        # minimum-norm solution of displacement @ g = values - f(x) (rank-deficient safe)
        solution = torch.linalg.lstsq(displacement, (values - center_value)[:, None], driver="gelsd").solution[:, 0]
        new_state = RelizoState(state.generation + 1, x, center_value, points, values)
        return Step(state=new_state, gradient=solution, info={"relizo/reused": float(reused_points.shape[0])})


@dataclass(frozen=True)
class XNESState:
    """xNES: search distribution N(x, sigma^2 B B^T)."""

    generation: int
    sigma: float
    """Global step size."""
    shape: torch.Tensor
    """B (d, d), det B = 1, in float32 (SHAPE_DTYPE)."""


# B is the only d x d tensor and each step streams it through memory three times; float32 halves
# that time and its memory (4 d^2 bytes). Its rounding error (float32's relative precision per step) is far
# below what a search distribution's shape needs; the mean and the samples stay in float64.
SHAPE_DTYPE = torch.float32


def xnes_utilities(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Rank utilities for n samples sorted BEST FIRST: max(0, ln(n/2 + 1) - ln k) normalised, minus 1/n."""
    k = torch.arange(1, n + 1, dtype=dtype)
    raw = torch.clamp(math.log(n / 2 + 1) - torch.log(k), min=0)
    return raw / raw.sum() - 1.0 / n  # decreasing: the best sample gets the largest utility; sums to 0


@dataclass(frozen=True)
class XNESSearcher:
    """Exponential natural ES with a full covariance (Glasmachers et al. 2010, "Exponential Natural
    Evolution Strategies", https://doi.org/10.1145/1830483.1830557), minimising.

    The mean moves towards the good samples: x += eta_mu * sigma * B sum_k u_k s_k, utilities
    decreasing from the best sample. (The reference code sorts best first but flips the
    utilities, so the best sample gets the lowest one and the search climbs instead of descending.)
    B's matrix-exponential update is computed exactly in its low-rank form (G_M = S^T diag(u) S has
    rank <= n): O(d^2 n) time a step and O(d^2) memory, B in float32 (SHAPE_DTYPE).
    """

    config: EstimatorConfig
    seed: int

    def init(self, x0: torch.Tensor) -> XNESState:
        """sigma = mu, B = I."""
        check_x(x0)
        return XNESState(0, float(self.config.mu), torch.eye(x0.shape[0], dtype=SHAPE_DTYPE))

    def _rates(self, d: int) -> tuple[float, float]:
        default = 3 * (3 + math.log(d)) / (5 * d * math.sqrt(d))
        eta_sigma = self.config.xnes_eta_sigma or default
        eta_shape = self.config.xnes_eta_shape or eta_sigma
        return eta_sigma, eta_shape

    def step(self, objective: Objective, x: torch.Tensor, state: XNESState) -> Step:
        """Sample n points, rank them, move the mean and adapt sigma and B."""
        check_x(x, state.shape.shape[0])
        n, d = self.config.num_queries, x.shape[0]
        seeds = [m.seed for m in population(self.seed, state.generation, n, antithetic=False)]
        s = directions(seeds, d, x.dtype)  # (n, d)
        s_low = s.to(SHAPE_DTYPE)
        offsets = (s_low @ state.shape.T).to(x.dtype)  # rows B s_k: the one product with B besides the update
        values = objective(x + state.sigma * offsets)  # z_k = x + sigma B s_k
        order = torch.argsort(values)  # best (lowest f) first
        s, s_low, offsets, utility = s[order], s_low[order], offsets[order], xnes_utilities(n, x.dtype)
        eta_sigma, eta_shape = self._rates(d)
        new_x = x + self.config.xnes_eta_mu * state.sigma * (utility @ offsets)  # B sum_k u_k s_k
        # G_M = sum_k u_k (s_k s_k^T - I) = S^T diag(u) S (the utilities sum to 0); G_B = G_M - g_sigma I
        g_sigma = float((utility * s.pow(2).sum(1)).sum()) / d  # tr(G_M) / d
        # expm(t S^T W S) = I + S^T phi(t W S S^T) t W S with phi(M) = (expm(M) - I) M^-1, exact for
        # any rank (expm(U C) = I + U phi(C U) C), so B's update costs O(d^2 n), never a d x d expm
        t = eta_shape / 2
        weighted = t * utility[:, None] * (s @ s.T)  # t W S S^T (n, n)
        block = torch.zeros((2 * n, 2 * n), dtype=x.dtype)
        block[:n, :n], block[:n, n:] = weighted, torch.eye(n, dtype=x.dtype)
        phi = torch.linalg.matrix_exp(block)[:n, n:]  # phi(M): top-right block of expm([[M, I], [0, 0]])
        kernel = phi * (t * utility)[None, :]  # phi(t W S S^T) t W
        scale = math.exp(-t * g_sigma)  # expm(-t g_sigma I) keeps det B = 1
        # B expm(t G_B) = scale * (B + (B S^T) kernel S), with B S^T = offsets^T (rows permuted alike)
        new_shape = torch.addmm(state.shape, (offsets.T @ kernel).to(SHAPE_DTYPE), s_low, beta=scale, alpha=scale)
        new_sigma = state.sigma * math.exp(eta_sigma / 2 * g_sigma)
        return Step(state=XNESState(state.generation + 1, new_sigma, new_shape), x=new_x, info={"xnes/sigma": new_sigma})


@dataclass(frozen=True)
class SepCMAState:
    """sepcmaes: the cmaes library's SepCMA optimizer (mutated in place by ask/tell; pickle it to store)."""

    optimizer: Any


@dataclass(frozen=True)
class SepCMASearcher:
    """Separable CMA-ES (Ros and Hansen 2008) through `cmaes.SepCMA`'s ask/tell; the point is its mean."""

    config: EstimatorConfig
    seed: int

    def init(self, x0: torch.Tensor) -> SepCMAState:
        """SepCMA at x0 with sigma = mu and population num_queries."""
        from cmaes import SepCMA

        check_x(x0)
        optimizer = SepCMA(mean=x0.detach().cpu().numpy().astype(np.float64), sigma=float(self.config.mu),
                           population_size=self.config.num_queries, seed=int(self.seed))
        return SepCMAState(optimizer)

    def step(self, objective: Objective, x: torch.Tensor, state: SepCMAState) -> Step:
        """One generation: ask population points, evaluate them together, tell."""
        check_x(x, state.optimizer.dim)
        optimizer = state.optimizer
        asked = np.stack([optimizer.ask() for _ in range(optimizer.population_size)])  # (n, d)
        values = objective(torch.from_numpy(asked).to(x.dtype))
        optimizer.tell(list(zip(asked, values.tolist())))
        return Step(state=state, x=torch.from_numpy(np.array(optimizer.mean)).to(x.dtype))
