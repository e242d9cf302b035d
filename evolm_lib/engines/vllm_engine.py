"""vLLM as the engine: a whole population (N adapters x M prompts) in ONE batched call."""
from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from typing import Sequence

from ..env import apply_engine_defaults
from ..lora import AdapterWeights, save_adapter
from ..quiet import engine_load_options
from ..types import Completion, PromptLike
from .base import AdapterList, CompletionTable, Population, PromptEncoder, SamplingSettings, check_adapters, materialize
from .vllm_slots import EXTENSION as SLOTS_EXTENSION, completion_from_vllm, sampling_params
from .workarounds import base_as_zero_adapter, fresh_cuda_graph_pool, vllm_cpu_prompt_logprobs_fix

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM's multi-LoRA Triton kernel tiles tuned by scripts/tune_lora_kernels.py, one file pair per GPU model
LORA_KERNEL_CONFIGS = Path(__file__).resolve().parent / "lora_kernel_configs"
ADAPTER_TRANSFERS = ("in_place", "files")
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


def _default_adapter_root() -> Path:
    # RAM-backed where it exists: a population is written every generation.
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class VLLMEvaluator:
    """One vLLM engine with LoRA enabled; every (adapter x prompt) request of a call goes into ONE generate."""

    batches_grids = True  # generate_grids puts every grid's requests into ONE generate

    # vLLM keeps process-wide state (parallel groups) that shutting one engine down tears down for
    # every other engine in the process, and an engine that is garbage-collected shuts down by
    # itself: closed engines are kept (not collected) until the last live one closes.
    _live_engines = 0
    _retired: list = []

    def __init__(
        self,
        model: str | Path,
        *,
        max_lora_rank: int = 8,
        max_loras: int = 8,
        max_model_len: int = 1024,
        dtype: str = "float32",
        gpu_memory_utilization: float | None = None,
        kv_cache_gb: float | None = None,
        seed: int = 0,
        enforce_eager: bool | None = None,
        max_num_seqs: int | None = None,
        adapter_transfer: str = "in_place",
        adapter_root: str | Path | None = None,
        lora_kernel_configs: str | Path | None = "auto",
        engine_kwargs: dict | None = None,
    ):
        """``enforce_eager`` None: eager on CPU (no compilation), CUDA graphs on a GPU.
        ``max_num_seqs`` None: every request of a population call in one batch (at least 256).
        ``adapter_transfer``: "in_place" writes a population's members into resident LoRA slots
        inside the engine (falls back to files, with a warning, where the engine cannot host them);
        "files" writes every member to an adapter file with a new LoRA id each call.
        ``lora_kernel_configs``: tuned tiles for vLLM's LoRA kernels on a GPU (see
        :func:`lora_kernel_folder`; "auto" uses those shipped for the H100 in population engines)."""
        from ..models import resolve_model

        if max_lora_rank < 1 or max_lora_rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"max_lora_rank must be in 1..{VLLM_LORA_RANKS[-1]}, got {max_lora_rank}")
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if adapter_transfer not in ADAPTER_TRANSFERS:
            raise ValueError(f"adapter_transfer must be one of {', '.join(ADAPTER_TRANSFERS)}, got {adapter_transfer!r}")
        self.model_dir = resolve_model(str(model))
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.dtype = dtype
        apply_engine_defaults()
        import torch
        from vllm import LLM

        on_gpu = torch.cuda.is_available()
        engine_kwargs = {**engine_load_options(), **(engine_kwargs or {})}  # no loading bar in notebooks
        if kv_cache_gb is None and gpu_memory_utilization is None and not on_gpu:
            # On CPU vLLM sizes the KV cache as a share of RAM minus what the process already holds,
            # which fails or wastes memory depending on the process; a fixed size is predictable.
            kv_cache_gb = 1.0
        if kv_cache_gb is not None:
            engine_kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
        if gpu_memory_utilization is None:
            # leaves room on the card for a GRPO policy (transformers + AdamW) beside the engine
            gpu_memory_utilization = 0.6 if on_gpu else 0.5
        if enforce_eager is None:
            enforce_eager = not on_gpu  # CUDA graphs: 3-4x the eager tokens/s on an H200
        if max_num_seqs is None:
            max_num_seqs = 256 if not on_gpu else 1024
        self.lora_kernel_configs = None
        if on_gpu:
            self.lora_kernel_configs = lora_kernel_folder(lora_kernel_configs, torch.cuda.get_device_name(), max_loras)
            _use_lora_kernel_folder(self.lora_kernel_configs)
        self.adapter_transfer = adapter_transfer
        if adapter_transfer == "in_place":
            engine_kwargs.setdefault("worker_extension_cls", SLOTS_EXTENSION)
            # Resident slots keep their names, so cached KV blocks go stale at every write and would
            # have to be reset each generation (a Python pass over every KV block: 8 ms a generation
            # on an H100). Nothing in a population call shares a prefix (each request has its own
            # adapter), so the cache is off; a user who turns it on gets the reset.
            engine_kwargs.setdefault("enable_prefix_caching", False)
        # file adapters (+1: the zero adapter that stands in for the base model in mixed calls), and
        # with resident slots as many again, pinned (+1: their own zero slot)
        engine_loras = (max_loras + 1) * (2 if adapter_transfer == "in_place" else 1)
        engine_rank = next(r for r in VLLM_LORA_RANKS if r >= max_lora_rank)
        started = time.perf_counter()
        self.llm = LLM(
            model=str(self.model_dir),
            dtype=dtype,
            seed=seed,
            enable_lora=True,
            max_lora_rank=engine_rank,
            max_loras=engine_loras,
            max_cpu_loras=2 * engine_loras,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            max_num_seqs=max_num_seqs,
            **engine_kwargs,
        )
        self.start_seconds = time.perf_counter() - started
        VLLMEvaluator._live_engines += 1
        self.encoder = PromptEncoder(self.llm.get_tokenizer())
        self._adapter_root = Path(adapter_root) if adapter_root else _default_adapter_root()
        self._workdir = Path(tempfile.mkdtemp(prefix="evolm-adapters-", dir=self._adapter_root))
        # A kernel restarted or a script that never calls close() must not leave adapters in RAM.
        weakref.finalize(self, shutil.rmtree, str(self._workdir), True)
        # vLLM caches adapters by int id and its prefix cache by name: every adapter version gets new ones.
        self._ids = itertools.count(1)
        self._resident = None  # ResidentPopulation, made on the first population call

    def _slots_for(self, population: Population):
        """The resident slots to write this population into, or None (files) where they cannot serve."""
        if self.adapter_transfer != "in_place":
            return None
        if self._resident is not None and self._resident.spec != population.mean.spec:
            self._resident.close()
            self._resident = None
        if self._resident is None:
            from .vllm_slots import ResidentPopulation, SlotsUnsupported

            try:
                self._resident = ResidentPopulation(self.llm, population.mean.spec, self.max_loras, self.model_dir,
                                                    self.dtype, workdir=self._workdir)
            except SlotsUnsupported as error:
                logger.warning("resident LoRA slots unavailable (%s): writing adapter files instead", error)
                self.adapter_transfer = "files"
                return None
        if len(population) > self.max_loras:
            raise ValueError(f"a population of {len(population)} exceeds the engine's max_loras={self.max_loras}: "
                             "start the evaluator with max_loras >= the population size")
        return self._resident

    @property
    def _torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def _lora_requests(self, adapters: Sequence[AdapterWeights | None]):
        from vllm.lora.request import LoRARequest

        requests, paths, seen = [], [], {}
        for adapter in adapters:
            if adapter is None:
                requests.append(None)
                continue
            if id(adapter) in seen:  # the same object twice in one call: one adapter, one slot
                requests.append(seen[id(adapter)])
                continue
            lora_id = next(self._ids)
            # Written in the engine's dtype: the engine would round to it anyway, and at GPU scale
            # float32 doubles the bytes written per generation.
            path = save_adapter(adapter, self._workdir / f"a{lora_id}", base_model=str(self.model_dir), dtype=self._torch_dtype)
            paths.append(path)
            requests.append(LoRARequest(f"evolm-{lora_id}", lora_id, str(path)))
            seen[id(adapter)] = requests[-1]
        return requests, paths

    def generate(
        self,
        prompts: Sequence[PromptLike],
        adapters: Sequence[AdapterWeights | None] = (None,),
        sampling: SamplingSettings = SamplingSettings(),
    ) -> CompletionTable:
        """Completions indexed ``[adapter][prompt]``, from one batched engine call."""
        (completions,) = self.generate_grids([(prompts, adapters, sampling)])
        return completions

    def generate_grids(self, grids: Sequence[tuple[Sequence[PromptLike], AdapterList, SamplingSettings]]) -> list[CompletionTable]:
        """Several (prompts x adapters, sampling) grids in ONE engine call, e.g. a population and the
        greedy scoring of its mean adapter; returns one ``[adapter][prompt]`` table per grid. A
        :class:`Population` goes into the resident slots (written in place from its seeds) when the
        engine hosts them; every other adapter travels as a file."""
        t0 = time.perf_counter()
        timing: dict[str, float] = {}
        resident, resident_mean, plans, file_adapters = None, None, [], []
        # The population's own mean, listed in another grid (its greedy scoring riding along), is
        # served from the slot after the members' instead of an adapter file.
        listed_elsewhere = {id(a) for _, adapters, _ in grids if not isinstance(adapters, Population)
                            for a in adapters if a is not None}
        for prompts, adapters, sampling in grids:
            slots = self._slots_for(adapters) if isinstance(adapters, Population) and resident is None else None
            if slots is not None:
                with_mean = id(adapters.mean) in listed_elsewhere and len(adapters) < slots.num_slots
                timing.update(slots.write(adapters.mean, adapters.members, adapters.sigmas, adapters.noise_device,
                                          adapters.noise_scheme, with_mean=with_mean))
                resident, resident_mean = slots, adapters.mean if with_mean else None
                plans.append((prompts, sampling, slots.lora_requests(), True))
            else:
                plans.append((prompts, sampling, materialize(adapters), False))
        for _, _, adapters, in_slots in plans:
            if not in_slots:
                file_adapters.extend(a for a in adapters if a is None or a is not resident_mean)
        distinct = len({id(a) for a in file_adapters if a is not None})
        if distinct > self.max_loras:
            raise ValueError(
                f"{distinct} adapters in one call but the engine holds max_loras={self.max_loras}: "
                "start the evaluator with max_loras >= the population size"
            )
        check_adapters(file_adapters, self.model_dir, self.max_lora_rank)
        if resident is not None:  # base requests beside slots: the resident zero slot (see base_as_zero_adapter)
            file_requests, paths = self._lora_requests(file_adapters)
            file_requests = [resident.base_request() if r is None else r for r in file_requests]
        else:
            file_requests, paths = self._lora_requests(base_as_zero_adapter(file_adapters))
        t1 = time.perf_counter()
        inputs, params, loras, shapes = [], [], [], []
        by_file = iter(file_requests)
        for prompts, sampling, adapters, in_slots in plans:
            if in_slots:
                requests = adapters  # LoRA requests of resident slots
            else:
                requests = [resident.mean_request() if resident_mean is not None and a is resident_mean else next(by_file)
                            for a in adapters]
            token_prompts = [{"prompt_token_ids": self.encoder.encode(p)} for p in prompts]
            per_prompt = [sampling_params(sampling, i) for i in range(len(prompts))]
            for request in requests:
                inputs.extend(token_prompts)
                params.extend(per_prompt)
                loras.extend([request] * len(prompts))
            shapes.append((len(requests), len(prompts), sampling.logprobs))
        try:
            outputs = self.llm.generate(inputs, params, lora_request=loras, use_tqdm=False)
        finally:
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)
        t3 = time.perf_counter()
        timing.update({"adapters_s": t1 - t0, "generate_s": t3 - t1})
        tables, start = [], 0
        for num_adapters, num_prompts, logprobs in shapes:
            flat = [completion_from_vllm(o.outputs[0], logprobs) for o in outputs[start : start + num_adapters * num_prompts]]
            tables.append(CompletionTable([flat[i * num_prompts : (i + 1) * num_prompts] for i in range(num_adapters)], timing))
            start += num_adapters * num_prompts
        return tables

    def prompt_logprobs(
        self, prompt_token_ids: Sequence[Sequence[int]], completion_token_ids: Sequence[Sequence[int]], adapter: AdapterWeights | None = None
    ) -> list[list[float]]:
        """Log-prob of each completion token given its prompt, under the base model or an adapter (for KL)."""
        from vllm import SamplingParams

        check_adapters([adapter], self.model_dir, self.max_lora_rank)
        lora_requests, paths = self._lora_requests([adapter])
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        inputs = [{"prompt_token_ids": list(p) + list(c)} for p, c in zip(prompt_token_ids, completion_token_ids)]
        try:
            with vllm_cpu_prompt_logprobs_fix():
                outputs = self.llm.generate(inputs, params, lora_request=lora_requests[0], use_tqdm=False)
        finally:
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)
        result = []
        for out, p, c in zip(outputs, prompt_token_ids, completion_token_ids):
            entries = out.prompt_logprobs[len(p) :]
            result.append([entry[token].logprob for entry, token in zip(entries, c)])
        return result

    def encode(self, prompt: PromptLike) -> list[int]:
        """Token ids of a rendered prompt."""
        return self.encoder.encode(prompt)

    def close(self) -> None:
        """Shut the engine down and delete the adapter folder."""
        self._resident = None
        shutil.rmtree(self._workdir, ignore_errors=True)
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
        import gc

        gc.collect()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
