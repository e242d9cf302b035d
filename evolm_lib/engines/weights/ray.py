"""The model's own weights as the ES mean (``es_mode`` full and eggroll) inside every engine: each
engine keeps its own float32 master of the same mean, updated from seeds and shaped fitness, so no
full-size tensor crosses the network but a snapshot (read from one engine, loaded into all).

An engine that Ray restarted comes back without the mean: ``rebuild`` gives it back before its lost
call is resubmitted, from an engine that still holds it (its master and optimizer buffers, read
after the call in flight there), or where none does from the run folder's newest snapshot and seed
log (``replay_source``), and checks it by checksum against the other engines."""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Mapping, Sequence

from ... import es
from ...es import Member
from ..ray.cluster import import_ray
from ..ray.pool import EngineLostError, Recovered

# A run folder's way to the mean without a live engine: (the newest snapshot, the seed log's updates
# after it as ``RayWeights.step`` arguments: optimizer, members, shaped fitness, sigma, form).
ReplaySource = Callable[[], tuple[dict, list[tuple]]]

logger = logging.getLogger(__name__)


class RayWeights:
    """The targeted weights of every engine (each an ``EngineWeights`` in its actor) as one client,
    with the interface ``ModelWeights`` uses: each engine keeps its own float32 master of the same mean.
    ``step`` sends the seeds and shaped fitness to every engine (each computes the same update),
    ``load`` sends a snapshot to every engine (once through the object store), ``read`` and
    ``checksum`` come from engine 0 (``checksums``: every engine's)."""

    def __init__(self, ray_engines: "RayEngines", key: int, target_modules, options: dict):
        self.ray_engines, self.key, self.target_modules, self.options = ray_engines, key, target_modules, dict(options)
        self.noise, self.noise_rank = options["noise"], options["noise_rank"]
        self.restarts: list[int] = list(ray_engines.restarts)  # each engine's restart count when its weights were set up
        self.steps = 0  # the optimizer steps the mean has taken (its snapshot's "step")
        self._in_flight: str | None = None  # "step" or "load" while one runs (a lost engine's call may be it)
        self.replay_source: ReplaySource | None = None  # set by the run that owns the mean (ModelWeights)
        self.rebuilds: list[dict] = []  # one record per engine given the mean back: engine, source, checksum
        self._faults_seen = len(ray_engines.pool.faults)  # the pool's lost calls ``load`` has looked at
        results = self._open(range(ray_engines.num_engines))
        self.shapes: dict[str, tuple[int, ...]] = {name: tuple(shape) for name, shape in results[0]["shapes"].items()}
        self.info = [r["info"] for r in results]

    def _open(self, engines) -> list:
        engines = list(engines)
        pool = self.ray_engines.pool
        try:
            results = pool.run([(e, "weights_open", (self.key, self.target_modules, self.options)) for e in engines])
        except BaseException:
            with contextlib.suppress(Exception):  # the engines that took it give it back; the first error stands
                self.close()
            raise
        for engine in engines:
            self.restarts[engine] = self.ray_engines.restarts[engine]
        self.ray_engines.held[self.key] = self
        return results

    def lost_engines(self) -> list[int]:
        """Engines that restarted since they took this mean (and so no longer hold it)."""
        return [e for e, count in enumerate(self.restarts) if count != self.ray_engines.restarts[e]]

    def check_whole(self) -> None:
        """Give the mean back to every engine that restarted since it took it (``rebuild``); raise
        EngineLostError where that fails."""
        for engine in self.lost_engines():
            try:
                self.rebuild(engine)
            except RuntimeError as error:
                raise EngineLostError(
                    f"engine {engine} of {self.ray_engines.num_engines} restarted since it took this run's mean (es_mode "
                    f"{'full' if self.noise == 'full' else 'eggroll'}) and it could not be given back ({error}): close "
                    "the run and open it again, which resumes from its checkpoint and sets the mean up on every engine",
                    engine=engine, attempts=0) from None

    def rebuild(self, engine: int) -> Recovered | None:
        """Give a restarted engine this mean back: the master and optimizer buffers of an engine that
        holds it, or the run folder's newest snapshot and seed log where none does; then every
        engine's checksum must agree. ``Recovered`` where the state given back is that after the step
        in flight (the lost call is done), None where the lost call must be resubmitted."""
        pool = self.ray_engines.pool
        others = [e for e in range(self.ray_engines.num_engines) if e != engine and e not in self.lost_engines()]
        # an engine lost at the same moment may have restarted before the pool saw its call fail: ask
        held = pool.run([(e, "weights_held", (self.key,)) for e in others]) if others else []
        live = [e for e, holds in zip(others, held) if holds]
        pool.run([(engine, "weights_open", (self.key, self.target_modules, self.options))])
        if live:
            source = f"engine {live[0]}"
            snapshot = pool.run([(live[0], "weights_read", (self.key,))])[0]  # queued after its call in flight
            pool.run([(engine, "weights_load", (self.key, import_ray().put(snapshot)))])
            steps = int(snapshot.get("step", 0))
        elif self.replay_source is not None:
            source = "the newest snapshot and the seed log"
            snapshot, updates = self.replay_source()
            pool.run([(engine, "weights_load", (self.key, import_ray().put(dict(snapshot))))])
            for optimizer, members, weights, sigma, form in updates:
                pool.run([(engine, "weights_step", (self.key, optimizer, list(members), list(weights), sigma, form))])
            steps = int(snapshot.get("step", 0)) + len(updates)
        else:
            raise RuntimeError("no other engine holds the mean and the run folder gave no snapshot and seed log")
        self.restarts[engine] = self.ray_engines.restarts[engine]
        # the master and step must agree ("restored" says what an engine serves at that instant: a
        # member, mid-call); a load in flight sets every engine again, so only the rebuilt one is checked
        compared = [engine] if self._in_flight == "load" else [engine, *live]
        checks = [{k: c[k] for k in ("master", "step")}
                  for c in pool.run([(e, "weights_checksum", (self.key,)) for e in compared])]
        if any(check != checks[0] for check in checks) or checks[0]["step"] != steps:
            raise RuntimeError(f"engine {engine} rebuilt from {source} holds {checks[0]}, the others {checks[1:]}")
        # the state read is that before the call in flight, or after it where it was this mean's step
        # (a load in flight is resubmitted whatever was read: it sets everything again)
        done = self._in_flight == "step" and steps == self.steps + 1
        if self._in_flight != "load" and steps != self.steps + int(done):
            raise RuntimeError(f"engine {engine} rebuilt from {source} has taken {steps} steps, the mean {self.steps}")
        self.rebuilds.append({"engine": engine, "source": source, "checksum": checks[0]["master"], "step": steps})
        logger.warning("engine %d was given the mean back from %s (step %d, checksum %s, equal on %d engines)",
                       engine, source, steps, checks[0]["master"][:12], len(checks))
        return Recovered(None) if done else None

    def _every_engine(self, method: str, *args) -> list:
        self.check_whole()
        return self.ray_engines.pool.run([(e, method, (self.key, *args)) for e in range(self.ray_engines.num_engines)])

    def step(self, optimizer: es.OptimizerConfig, members: Sequence[Member], weights: Sequence[float], sigma: float,
             form: es.GradientForm = "qiu") -> dict:
        """The same update on every engine, from seeds and shaped fitness: {"update_s" (the slowest), "update_norm"}."""
        self._in_flight = "step"
        try:
            results = self._every_engine("weights_step", optimizer, list(members), [float(w) for w in weights],
                                         float(sigma), form)
        finally:
            self._in_flight = None
        self.steps += 1
        results = [r for r in results if r is not None]  # an engine rebuilt after the step: the others' results
        norms = [r["update_norm"] for r in results]
        if len(set(norms)) > 1:  # the same seeds and fitness on engines that draw other bits (other hardware)
            logger.warning("the engines' updates differ (norms %s): their means drift apart", norms)
        return {"update_s": max(r["update_s"] for r in results), "update_norm": norms[0]}

    def read(self) -> dict:
        """Engine 0's master and optimizer buffers on the host (a full-size snapshot)."""
        return self.ray_engines.pool.run([(0, "weights_read", (self.key,))])[0]

    def load(self, snapshot: Mapping[str, Any]) -> None:
        """Every engine serves the mean of ``snapshot``; an engine that restarted since (and lost its
        master) gets its weights set up again first: one whose restart ``RayEngines`` counted, and one
        that lost a call and says it holds none (Ray restarted it after a loss the pool gave up on,
        which nobody counted: the run that lost it then closes through here). Only an engine that lost
        a call since the last load is asked (GRPO on the model's weights loads every step)."""
        pool = self.ray_engines.pool
        faulted = sorted({fault["engine"] for fault in pool.faults[self._faults_seen:]})
        self._faults_seen = len(pool.faults)
        held = pool.run([(e, "weights_held", (self.key,)) for e in faulted]) if faulted else []
        lost = sorted(set(self.lost_engines()) | {e for e, holds in zip(faulted, held) if not holds})
        if lost:
            self._open(lost)
        ray = import_ray()
        shared = ray.put(dict(snapshot))  # full size: sent once, each engine reads it from the object store
        self._in_flight = "load"
        try:
            self._every_engine("weights_load", shared)
        finally:
            self._in_flight = None
        self.steps = int(snapshot.get("step", 0))

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
        self.ray_engines.held.pop(self.key, None)
        if self.ray_engines.pool.actors:
            self.ray_engines.pool.run([(e, "weights_close", (self.key,)) for e in range(self.ray_engines.num_engines)])


class RaySlots:
    """EGGROLL's resident LoRA slots, a block on every engine (``sizes[e]`` slots on engine ``e``) for
    the members that engine serves."""

    def __init__(self, ray_engines: "RayEngines", key: int, spec, sizes: list[int]):
        self.ray_engines, self.key, self.spec, self.sizes = ray_engines, key, spec, list(sizes)
        try:
            ray_engines.pool.run([(e, "lowrank_open", (key, spec, size)) for e, size in enumerate(self.sizes)])
        except BaseException:
            with contextlib.suppress(Exception):
                self.close()
            raise
        ray_engines.held[key] = self

    def rebuild(self, engine: int) -> None:
        """Give a restarted engine its block of slots back (they hold no state between calls)."""
        self.ray_engines.pool.run([(engine, "lowrank_open", (self.key, self.spec, self.sizes[engine]))])

    def close(self) -> None:
        """Release every engine's slots."""
        self.ray_engines.held.pop(self.key, None)
        if self.ray_engines.pool.actors:
            self.ray_engines.pool.run([(e, "lowrank_close", (self.key,)) for e in range(len(self.sizes))])
