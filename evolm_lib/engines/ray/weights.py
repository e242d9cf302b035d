"""The model's own weights as the ES mean (``es_mode`` full and eggroll) inside every engine: each
engine keeps its own float32 master of the same mean, updated from seeds and shaped fitness, so no
full-size tensor crosses the network but a snapshot (read from one engine, loaded into all)."""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Mapping, Sequence

from ... import es
from ...es.core import Member
from .cluster import import_ray
from .pool import EngineLostError

logger = logging.getLogger(__name__)


class RayWeights:
    """The targeted weights of every engine (each an ``EngineWeights`` in its actor) as one client,
    with the interface ``ModelWeights`` uses: each engine keeps its own float32 master of the same mean.
    ``step`` sends the seeds and shaped fitness to every engine (each computes the same update),
    ``load`` sends a snapshot to every engine (once through the object store), ``read`` and
    ``checksum`` come from engine 0 (``checksums``: every engine's)."""

    def __init__(self, evaluator: "RayEvaluator", key: int, target_modules, options: dict):
        self.evaluator, self.key, self.target_modules, self.options = evaluator, key, target_modules, dict(options)
        self.noise, self.noise_rank = options["noise"], options["noise_rank"]
        self.restarts: list[int] = []  # each engine's restart count when its weights were set up
        results = self._open(range(evaluator.num_engines))
        self.shapes: dict[str, tuple[int, ...]] = {name: tuple(shape) for name, shape in results[0]["shapes"].items()}
        self.info = [r["info"] for r in results]

    def _open(self, engines) -> list:
        engines = list(engines)
        pool = self.evaluator.pool
        try:
            results = pool.run([(e, "weights_open", (self.key, self.target_modules, self.options)) for e in engines])
        except BaseException:
            with contextlib.suppress(Exception):  # the engines that took it give it back; the first error stands
                self.close()
            raise
        self.restarts = list(self.evaluator.restarts)
        self.evaluator.means.add(self.key)
        return results

    def lost_engines(self) -> list[int]:
        """Engines that restarted since they took this mean (and so no longer hold it)."""
        return [e for e, count in enumerate(self.restarts) if count != self.evaluator.restarts[e]]

    def check_whole(self) -> None:
        """Raise EngineLostError where an engine no longer holds this mean."""
        lost = self.lost_engines()
        if lost:
            raise EngineLostError(
                f"engine {lost[0]} of {self.evaluator.num_engines} restarted since it took this run's mean (es_mode "
                f"{'full' if self.noise == 'full' else 'eggroll'}) and lost it: close the run and open it again, "
                "which resumes from its checkpoint and sets the mean up on every engine", engine=lost[0], attempts=0)

    def _every_engine(self, method: str, *args) -> list:
        self.check_whole()
        return self.evaluator.pool.run([(e, method, (self.key, *args)) for e in range(self.evaluator.num_engines)])

    def step(self, optimizer: es.OptimizerConfig, members: Sequence[Member], weights: Sequence[float], sigma: float,
             form: es.GradientForm = "qiu") -> dict:
        """The same update on every engine, from seeds and shaped fitness: {"update_s" (the slowest), "update_norm"}."""
        results = self._every_engine("weights_step", optimizer, list(members), [float(w) for w in weights],
                                     float(sigma), form)
        norms = [r["update_norm"] for r in results]
        if len(set(norms)) > 1:  # the same seeds and fitness on engines that draw other bits (other hardware)
            logger.warning("the engines' updates differ (norms %s): their means drift apart", norms)
        return {"update_s": max(r["update_s"] for r in results), "update_norm": norms[0]}

    def read(self) -> dict:
        """Engine 0's master and optimizer buffers on the host (a full-size snapshot)."""
        return self.evaluator.pool.run([(0, "weights_read", (self.key,))])[0]

    def load(self, snapshot: Mapping[str, Any]) -> None:
        """Every engine serves the mean of ``snapshot``; an engine that restarted since (and lost its
        master) gets its weights set up again first."""
        lost = self.lost_engines()
        if lost:
            self._open(lost)
        ray = import_ray()
        shared = ray.put(dict(snapshot))  # full size: sent once, each engine reads it from the object store
        self._every_engine("weights_load", shared)

    def checksums(self) -> list[dict]:
        """Every engine's {"master": SHA-256 of its float32 master, "restored", "step"}, in engine order."""
        return self._every_engine("weights_checksum")

    def checksum(self) -> dict:
        """Engine 0's checksum; raises RuntimeError where another engine's master differs."""
        every = self.checksums()
        differing = [e for e, c in enumerate(every) if c != every[0]]
        if differing:
            raise RuntimeError(f"the engines' means differ: engine {differing[0]} holds {every[differing[0]]}, "
                               f"engine 0 {every[0]}")
        return every[0]

    def close(self) -> None:
        """Every engine serves its mean and releases its master."""
        self.evaluator.means.discard(self.key)
        if self.evaluator.pool.actors:
            self.evaluator.pool.run([(e, "weights_close", (self.key,)) for e in range(self.evaluator.num_engines)])


class RaySlots:
    """EGGROLL's resident LoRA slots, a block on every engine (``sizes[e]`` slots on engine ``e``) for
    the members that engine serves."""

    def __init__(self, evaluator: "RayEvaluator", key: int, spec, sizes: list[int]):
        self.evaluator, self.key, self.spec, self.sizes = evaluator, key, spec, list(sizes)
        try:
            evaluator.pool.run([(e, "lowrank_open", (key, spec, size)) for e, size in enumerate(self.sizes)])
        except BaseException:
            with contextlib.suppress(Exception):
                self.close()
            raise

    def close(self) -> None:
        """Release every engine's slots."""
        if self.evaluator.pool.actors:
            self.evaluator.pool.run([(e, "lowrank_close", (self.key,)) for e in range(len(self.sizes))])
