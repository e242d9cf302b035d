"""The engines' actors called together, and brought back when one is lost: ``EnginePool`` runs calls
on the actors at once; a call whose actor died is resubmitted once Ray has restarted it (and its
owner has given it back the state it held: ``on_restarted``), within the limits of a ``FaultPolicy``,
past which ``EngineLostError`` ends the call with nothing returned."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

from ..sizing import EngineSizing
from .actor import EngineActor, actor_env
from .cluster import import_ray

logger = logging.getLogger(__name__)


class EngineLostError(RuntimeError):
    """An engine (a Ray actor) kept failing: its shard was lost ``attempts`` times or it stayed dead.

    Nothing of the call was returned, so a run's last finished generation stands; start the run
    again to resume from its checkpoint."""


    def __init__(self, message: str, engine: int, attempts: int, actor_id: str | None = None):
        super().__init__(message)
        self.engine = engine
        self.attempts = attempts
        self.actor_id = actor_id


@dataclass(frozen=True)
class Recovered:
    """``on_restarted``'s answer where rebuilding a lost engine also redid its lost call (the state it
    was given back is the state after the call, as on the engines that finished it): the call is not
    resubmitted and ``result`` stands for its result."""

    result: Any = None


@dataclass(frozen=True)
class FaultPolicy:
    """How long lost engines are waited for."""

    max_restarts: int = 3
    "times Ray restarts an engine's actor that died"
    max_attempts: int = 3
    "losses of one call before the call fails (EngineLostError)"
    restart_timeout_s: float = 900.0
    "how long a restarted engine may take to answer again"
    start_timeout_s: float = 1800.0
    "how long the engines may take to start"

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")


class EnginePool:
    """Engine actors called together and brought back one by one: ``run`` sends calls to the actors
    at once and returns their results in order; a call whose actor died is resubmitted once Ray has
    restarted it. ``max_attempts`` losses of one call, or an actor that does not come back within
    ``restart_timeout_s`` (``policy``), raise :class:`EngineLostError`."""

    def __init__(self, actors: list, engine_info: list[dict], policy: FaultPolicy = FaultPolicy()):
        self.actors, self.engine_info, self.policy = list(actors), list(engine_info), policy
        self.faults: list[dict] = []  # one record per call lost to a dead engine
        self.on_submitted: Callable[["EnginePool", list[int]], None] | None = None  # test seam: runs after calls are submitted
        # Asked when a lost engine answers again, before its call is resubmitted; it may give the
        # engine back the state it held (a run's mean). None: resubmit the call; Recovered: the call's
        # effect is restored, take its result; a reason (the state could not be rebuilt): EngineLostError.
        self.on_restarted: Callable[[int], str | Recovered | None] | None = None

    @classmethod
    def start(cls, model: str, sizing: EngineSizing, options: dict, num_engines: int, placement: dict[str, float],
              policy: FaultPolicy = FaultPolicy(), env: dict[str, str] | None = None) -> "EnginePool":
        """``num_engines`` actors, each a ``VLLMEngine(model, sizing, **options)`` on ``placement``
        (a GPU, a share of one, or a CPU slice). Engines that share a card start one after another
        (vLLM's memory profiling at start would count a neighbour's allocations as its own) unless
        their KV cache is fixed (``kv_cache_gb``: vLLM then profiles no memory); engines on different
        cards or CPU slices start together (``start_waves``). ``env``: settings added to every actor's
        environment (``actor_env``), a restarted actor's too."""
        ray = import_ray()
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        start_timeout_s = policy.start_timeout_s
        deadline = time.monotonic() + start_timeout_s
        remote = ray.remote(EngineActor).options(max_restarts=policy.max_restarts, max_task_retries=0,
                                                 runtime_env={"env_vars": {**actor_env(placement, sizing.tensor_parallel_size), **(env or {})}},
                                                 **placement)
        actors = [remote.remote(index, model, sizing, options) for index in range(num_engines)]
        info: list[dict] = [{} for _ in actors]
        try:
            cards = ray.get([actor.card.remote() for actor in actors], timeout=start_timeout_s)
            for wave in start_waves(cards, together=sizing.kv_cache_gb is not None):
                answers = ray.get([actors[index].ready.remote() for index in wave],
                                  timeout=max(deadline - time.monotonic(), 1.0))
                for index, answer in zip(wave, answers):
                    info[index] = answer
        except GetTimeoutError:
            _kill(actors)
            raise TimeoutError(f"{num_engines} engines did not start within {start_timeout_s:g} s; the cluster has "
                               f"{ray.available_resources()} free of {ray.cluster_resources()}") from None
        except (RayActorError, RayTaskError) as error:
            _kill(actors)
            raise RuntimeError(f"an engine failed to start: {error}") from None
        except BaseException:
            _kill(actors)
            raise
        return cls(actors, info, policy)

    @property
    def num_engines(self) -> int:
        """Engines in the pool."""
        return len(self.actors)

    def run(self, calls: list[tuple[int, str, tuple]]) -> list:
        """Run ``(engine, method, args)`` calls at once and return their results in order."""
        ray = import_ray()
        from ray.exceptions import RayActorError

        results: list[Any] = [None] * len(calls)
        losses = [0] * len(calls)
        pending: dict = {}

        def submit(position: int) -> None:
            engine, method, args = calls[position]
            pending[getattr(self.actors[engine], method).remote(*args)] = position

        for position in range(len(calls)):
            submit(position)
        if self.on_submitted is not None:
            self.on_submitted(self, [engine for engine, _, _ in calls])
        while pending:
            (done,), _ = ray.wait(list(pending), num_returns=1)
            position = pending.pop(done)
            try:
                results[position] = ray.get(done)
            except RayActorError as error:  # the engine's process died with this call in flight
                engine, method, _ = calls[position]
                losses[position] += 1
                self.faults.append({"engine": engine, "method": method, "attempt": losses[position],
                                    "error": type(error).__name__, "time": time.time()})
                logger.warning("engine %d lost a %s call (attempt %d of %d): %s", engine, method, losses[position],
                               self.policy.max_attempts, _first_line(error))
                if losses[position] >= self.policy.max_attempts:
                    raise self._lost(engine, losses[position], f"its {method} call was lost {losses[position]} times", error)
                self._await_engine(engine, losses[position])
                why = self.on_restarted(engine) if self.on_restarted is not None else None
                if isinstance(why, Recovered):
                    results[position] = why.result
                    continue
                if why:
                    raise self._lost(engine, losses[position], why, error)
                submit(position)
        return results

    def _await_engine(self, engine: int, attempts: int) -> None:
        """Block until a restarted engine answers (its vLLM engine started again)."""
        ray = import_ray()
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

        timeout_s = self.policy.restart_timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.engine_info[engine] = ray.get(self.actors[engine].ready.remote(),
                                                   timeout=max(deadline - time.monotonic(), 1.0))
                return
            except ActorUnavailableError as error:  # still restarting: calls fail fast until it is back
                if time.monotonic() > deadline:
                    raise self._lost(engine, attempts, f"it did not come back within {timeout_s:g} s", error)
                time.sleep(1.0)
            except GetTimeoutError as error:
                raise self._lost(engine, attempts, f"it did not come back within {timeout_s:g} s", error)
            except RayActorError as error:  # dead for good: restarts used up, or its engine failed to start again
                raise self._lost(engine, attempts, "it is dead and Ray will not restart it (max_restarts used up)", error)
            except RayTaskError as error:  # back, but its engine failed to start again
                raise self._lost(engine, attempts, "its engine failed to start again", error)

    def _lost(self, engine: int, attempts: int, why: str, error: BaseException) -> EngineLostError:
        actor_id = self.actors[engine]._actor_id.hex()
        info = self.engine_info[engine] if engine < len(self.engine_info) else {}
        where = f"{info.get('host', '?')} pid {info.get('pid', '?')}"
        return EngineLostError(
            f"engine {engine} of {self.num_engines} (Ray actor {actor_id}, last on {where}) is lost: {why} "
            f"({type(error).__name__}: {_first_line(error)}). Nothing of this call was counted: a run keeps its last "
            "finished generation and resumes from its checkpoint when started again.",
            engine=engine, attempts=attempts, actor_id=actor_id,
        )

    def close(self) -> None:
        """Shut every engine down and end the actors."""
        if self.actors:
            ray = import_ray()
            try:
                ray.get([actor.close.remote() for actor in self.actors], timeout=60)
            except Exception:  # a dead or hung engine: killing its actor below frees it all the same
                pass
            _kill(self.actors)
        self.actors = []


def start_waves(cards: Sequence[Hashable | None], together: bool = False) -> list[list[int]]:
    """Engine indices grouped into the waves they start in, from the card each engine was given
    (None: a CPU slice, shared with no one): wave k holds the k-th engine of every card, so no two
    engines of one card start at once, and the engines of different cards (all CPU slices) start
    together. ``[a, a, b, None, b]`` -> ``[[0, 2, 3], [1, 4]]``. ``together``: every engine in one
    wave (their KV caches are fixed, so no engine's start measures the card's free memory)."""
    if together:
        return [list(range(len(cards)))] if cards else []
    waves: list[list[int]] = []
    seen: dict[Hashable, int] = {}  # card -> engines of it placed so far
    for index, card in enumerate(cards):
        wave = 0 if card is None else seen.get(card, 0)
        if card is not None:
            seen[card] = wave + 1
        if wave == len(waves):
            waves.append([])
        waves[wave].append(index)
    return waves


def _kill(actors: list) -> None:
    ray = import_ray()
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
