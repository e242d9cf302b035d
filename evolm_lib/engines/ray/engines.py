"""``RayEngines``: K vLLM engines in Ray actors behind the one ``Engine`` protocol (see the
package's docstring for how a call travels and what a lost engine costs)."""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Sequence

from ...es import Member
from ...lora import AdapterWeights, LoraSpec
from ...types import PromptLike
from ..base import AdapterList, CompletionTable, GridsInOneCall, SamplingSettings, balanced_blocks
from ..sizing import EngineSizing
from .actor import MPS_THREAD_PERCENTAGE_ENV
from .cluster import check_cluster_resources, check_ray_address, import_ray, shared_card_warning
from .pool import EngineLostError, EnginePool, FaultPolicy, Recovered
from .sharding import ShardPlan, plan_grid, plan_members, shard_sampling
from ..weights.ray import RaySlots, RayWeights

logger = logging.getLogger(__name__)


class RayEngines(GridsInOneCall):
    """K vLLM engines in Ray actors behind one ``Engine`` (and ``TokenScorer``): each call shared
    out by a :class:`ShardPlan` and run by an :class:`EnginePool`, which restarts lost engines and
    reruns their shards."""

    def __init__(self, model: str, sizing: EngineSizing | None = None, *, num_engines: int = 2,
                 engines_per_gpu: int | None = None, ray_address: str | None = None, cpus_per_engine: float = 1.0,
                 policy: FaultPolicy = FaultPolicy(), vllm_options: dict | None = None,
                 mps_thread_percentage: int | None = None, **sizes: Any):
        """Engine sizes are ``VLLMEngine``'s (``sizing``, or keyword ``sizes``), ``max_loras`` for
        the whole call: each engine holds its share; ``engines_per_gpu`` (None: the sizing's) engines
        share each GPU, each with its own copy of the weights (on a CPU cluster each engine takes a
        CPU slice whatever it says); ``vllm_options``: ``VLLMEngine``'s other keyword arguments;
        ``mps_thread_percentage``: each engine's share of its card's SMs under CUDA's MPS (None: unset).
        Every engine resolves ``model`` by itself, so a model name or a folder present on every machine."""
        # Everything that can be refused is refused before a cluster is joined or an actor created.
        if not isinstance(num_engines, int) or num_engines < 1:
            raise ValueError(f"num_engines must be an integer >= 1, got {num_engines!r}")
        if mps_thread_percentage is not None and not (isinstance(mps_thread_percentage, int) and 1 <= mps_thread_percentage <= 100):
            raise ValueError(f"mps_thread_percentage must be an integer from 1 to 100, got {mps_thread_percentage!r}")
        if engines_per_gpu is not None:
            sizes["engines_per_gpu"] = engines_per_gpu
        self.sizing = (sizing or EngineSizing()).replace(**sizes)
        self.engines_per_gpu = self.sizing.engines_per_gpu
        self.engine_sizing = self.sizing.shard(num_engines)
        self.num_engines = num_engines
        ray = import_ray()
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
            placement = check_cluster_resources(num_engines, ray.cluster_resources(), cpus_per_engine,
                                                self.engines_per_gpu, self.sizing.tensor_parallel_size)
            warning = shared_card_warning(self.engines_per_gpu, placement) if self._owns_ray and ray_address is None else None
            if warning:  # a local cluster: its engines meet MPS (or not) where this process would
                logger.warning(warning)
            env = {} if mps_thread_percentage is None else {MPS_THREAD_PERCENTAGE_ENV: str(mps_thread_percentage)}
            self.pool = EnginePool.start(str(model), self.engine_sizing, dict(vllm_options or {}), num_engines, placement,
                                         policy, env=env)
        except BaseException:
            self._shutdown_ray()
            raise
        self.start_seconds = time.perf_counter() - started
        # es_mode full / eggroll: what the engines keep between calls (means, EGGROLL's slots) by key,
        # each able to give a restarted engine its part back; and each engine's restarts
        self.held: dict[int, RayWeights | RaySlots] = {}
        # the last generate call's profile: its wall time in this process, the time to put its shared
        # adapters into the object store, and each engine's own timing (``engine_call_s``: its time in
        # the actor; ``adapters_s``, ``generate_s``: its engine's split)
        self.last_call: dict[str, Any] = {}
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

    # --- the engine protocol ------------------------------------------------------------------
    def generate_grids(self, grids: Sequence[tuple[Sequence[PromptLike], AdapterList, SamplingSettings]]) -> list[CompletionTable]:
        """Several grids in one call: every engine runs its share of all of them in ONE engine call;
        one complete ``[adapter][prompt]`` table per grid, or an error and nothing."""
        ray = import_ray()
        started = time.perf_counter()
        plan = ShardPlan.of(grids, self.num_engines, self.engine_sizing.max_loras)
        refs = [ray.put(adapter.to("cpu")) for adapter in plan.shared]  # each adapter (a population's mean) travels once
        put_s = time.perf_counter() - started
        calls = [(engine, "generate_grids", (work, *refs)) for engine, work in enumerate(plan.work) if work]
        results = dict(zip([engine for engine, _, _ in calls], self.pool.run(calls)))
        adapters_s = max((tables[0].timing.get("adapters_s", 0.0) for tables in results.values()), default=0.0)
        elapsed = time.perf_counter() - started
        self.last_call = {"wall_s": elapsed, "put_s": put_s,
                          "engines": {engine: dict(tables[0].timing) for engine, tables in results.items() if tables}}
        return plan.assemble(results, {"adapters_s": adapters_s, "generate_s": max(elapsed - adapters_s, 0.0)})

    def prepare_population(self, spec: LoraSpec, population_size: int) -> None:
        """Every engine's resident slots set up for its block of such a population (``ShardPlan``'s
        split); an engine restarted since sets its slots up in the first call that reaches it."""
        rows, _ = plan_grid(population_size, self.num_engines, self.num_engines, self.engine_sizing.max_loras)[0]
        self.pool.run([(engine, "prepare_population", (spec, rows.stop - rows.start)) for engine in range(self.num_engines)])

    def encode(self, prompt: PromptLike) -> list[int]:
        """Token ids of a rendered prompt (engine 0's tokenizer; every engine has the same)."""
        return self.pool.run([(0, "encode", (prompt,))])[0]

    def prompt_logprobs(self, prompt_token_ids: Sequence[Sequence[int]], completion_token_ids: Sequence[Sequence[int]],
                        adapter: AdapterWeights | None = None) -> list[list[float]]:
        """Log-prob of each completion token given its prompt, rows shared out over the engines."""
        ray = import_ray()
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
        """``VLLMEngine.run_members`` over the engines, in one concurrent call: engine ``e`` serves
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

    def _restarted(self, engine: int) -> str | Recovered | None:
        """The pool's question when a lost engine answers again: counted, and given back what it held
        (a run's mean, EGGROLL's slots: ``RayWeights.rebuild``) before its call is resubmitted; the
        reason where that fails."""
        self.restarts[engine] += 1
        recovered = None
        for key in sorted(self.held):  # a mean before the slots opened after it
            try:
                answer = self.held[key].rebuild(engine)
            except (RuntimeError, EngineLostError) as error:
                return f"it came back without the run's mean it held, and it could not be given back ({error})"
            recovered = recovered or answer
        return recovered

    def close(self) -> None:
        """Shut every engine down, end the actors, and leave a cluster these engines started."""
        if getattr(self, "pool", None) is not None:
            self.pool.close()
        self._shutdown_ray()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _shutdown_ray(self) -> None:
        if getattr(self, "_owns_ray", False):
            import_ray().shutdown()
            self._owns_ray = False
