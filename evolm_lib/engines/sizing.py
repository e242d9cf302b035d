"""How large a vLLM engine is, derived once from a run's settings, and where its noise is drawn.

One :class:`EngineSizing` is what every engine of a run is started with: the engine in this process
(``VLLMEngine``), each Ray actor's engine (``RayEngines``, each holding its share of the
adapters), and the pre-run check (``preflight.check_engine_settings``), so the memory the check
tests is the memory the engine asks for. Its defaults are the run settings' own (``evolm_lib.config``).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, get_args

from ..config import CPU_KV_CACHE_GB, GPU_MEMORY_SHARE, AdapterTransfer, CommonConfig, ESConfig
from ..es import check_noise_device

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The LoRA ranks vLLM builds kernels for: an engine's slots are the next of these at or above max_lora_rank."""
ADAPTER_TRANSFERS: tuple[str, ...] = get_args(AdapterTransfer)
CPU_MEMORY_SHARE = 0.5
"""gpu_memory_utilization handed to vLLM on a CPU when it is not set (the KV cache has a fixed size there)."""
ES_MODES = ("lora", "full", "eggroll")
"""What an engine's population calls serve (``ESConfig.es_mode``; GRPO's engines serve LoRA adapters)."""


def largest_call(config: CommonConfig, train: int, held_out: int, validation: int = 0) -> int:
    """Requests in the largest engine call of a run (the sequences decoded at once), from its settings
    and its task's train, held-out and validation problem counts.

    Scoring: every scoring set in one greedy call (train + held-out + validation; the held-out score
    at the end is a part of it). ES: the population's call, population_size x prompts per member
    (prompts_per_step, at most the train set), with the scoring riding in it when ``score_in_population``;
    es_mode full serves one member a call. GRPO: group_size x prompts."""
    prompts = min(config.prompts_per_step or train, train)
    scoring = train + held_out + validation
    population = getattr(config, "population_size", None)
    if population is None:  # GRPO
        return max(getattr(config, "group_size", 1) * prompts, scoring)
    members = 1 if getattr(config, "es_mode", "lora") == "full" else population
    riding = scoring if getattr(config, "score_in_population", False) else 0
    return max(members * prompts + riding, scoring)


def cudagraph_capture_sizes(largest_batch: int, max_num_seqs: int) -> list[int]:
    """The batch sizes to capture CUDA graphs for, for an engine whose largest call decodes
    ``largest_batch`` sequences: the powers of two below it and the batch itself, so a step of a call
    whose sequences are finishing pads to a captured size at most twice as large. None above
    ``max_num_seqs`` (vLLM never schedules more sequences in a step)."""
    if largest_batch < 1 or max_num_seqs < 1:
        raise ValueError(f"largest_batch and max_num_seqs must be >= 1, got {largest_batch} and {max_num_seqs}")
    top = min(largest_batch, max_num_seqs)
    return sorted({1 << k for k in range(top.bit_length()) if 1 << k < top} | {top})


def _setting(name: str) -> Any:
    """The run settings' default of one field: a bare engine and a run start alike."""
    return ESConfig.model_fields[name].default


@dataclass(frozen=True)
class EngineMemory:
    """What an engine asks of its device: the share vLLM may take, and a fixed KV cache (None: from the share)."""

    gpu_memory_utilization: float
    kv_cache_gb: float | None

    @property
    def kv_cache_bytes(self) -> int | None:
        """The fixed KV cache in bytes (None: vLLM sizes it from ``gpu_memory_utilization``)."""
        return None if self.kv_cache_gb is None else int(self.kv_cache_gb * 2**30)


def _task_sizes(config: CommonConfig) -> tuple[int, int, int]:
    """(train, held-out, validation) problem counts of a run's task."""
    from ..tasks import get_task

    task = get_task(config.task, **config.task_options)
    return len(task.train_examples()), len(task.eval_examples()), len(task.validation_examples())


def _grpo_transfer(config: CommonConfig) -> str:
    """A GRPO engine: one adapter a call travels as a file; a policy of the model's own weights
    (``policy_weights: full``) needs the worker extension that writes them in place, and an engine
    whose prefix cache is off (in_place turns it off), or base requests would reuse stale KV blocks."""
    return "in_place" if getattr(config, "policy_weights", "lora") == "full" else "files"


@dataclass(frozen=True)
class EngineSizing:
    """The sizes a vLLM engine is started with. ``from_config`` derives them from a run's settings."""

    max_loras: int = 8
    "adapters one call serves (an ES run: its population and the mean riding along)"
    max_lora_rank: int = 8
    "largest adapter rank the engine serves"
    max_model_len: int = _setting("max_model_len")
    "longest prompt + completion"
    dtype: str = _setting("dtype")
    "weights and LoRA dtype"
    gpu_memory_utilization: float | None = _setting("gpu_memory_utilization")
    "memory share (None: GPU_MEMORY_SHARE on a GPU; see ``memory``)"
    kv_cache_gb: float | None = _setting("kv_cache_gb")
    "fixed KV cache in GiB (None: from the memory share on a GPU, CPU_KV_CACHE_GB on a CPU)"
    seed: int = _setting("seed")
    "the engine's sampling seed"
    adapter_transfer: str = _setting("adapter_transfer")
    "in_place: populations written into resident LoRA slots; files: an adapter file per member"
    deterministic: bool = _setting("deterministic")
    "GPU engines: vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1), started before vLLM loads them"
    engines_per_gpu: int = _setting("engines_per_gpu")
    "engines sharing one GPU: each takes GPU_MEMORY_SHARE / engines_per_gpu when gpu_memory_utilization is unset"
    es_mode: str = "lora"
    "what its population calls serve: lora (adapters), eggroll (rank-r noise in LoRA slots), full (one member at a time); picks the LoRA kernel tiles"
    largest_batch: int | None = None
    "requests of the run's largest call (``largest_call``): CUDA graphs are captured up to it; None: vLLM's default sizes"
    tensor_parallel_size: int = _setting("tensor_parallel_size")
    "cards (on a CPU: processes, each on its own cores) the engine's weights are split over (vLLM's tensor parallelism)"

    def __post_init__(self) -> None:
        if not 1 <= self.max_lora_rank <= VLLM_LORA_RANKS[-1]:
            raise ValueError(f"max_lora_rank must be in 1..{VLLM_LORA_RANKS[-1]}, got {self.max_lora_rank}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if not isinstance(self.engines_per_gpu, int) or self.engines_per_gpu < 1:
            raise ValueError(f"engines_per_gpu must be an integer >= 1, got {self.engines_per_gpu!r}")
        if self.adapter_transfer not in ADAPTER_TRANSFERS:
            raise ValueError(f"adapter_transfer must be one of {', '.join(ADAPTER_TRANSFERS)}, got {self.adapter_transfer!r}")
        if self.es_mode not in ES_MODES:
            raise ValueError(f"es_mode must be one of {', '.join(ES_MODES)}, got {self.es_mode!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.largest_batch is not None and self.largest_batch < 1:
            raise ValueError(f"largest_batch must be >= 1 (or None), got {self.largest_batch}")

    @classmethod
    def from_config(cls, config: CommonConfig, max_loras: int | None = None) -> "EngineSizing":
        """The engine a run's settings ask for. ``max_loras`` None: an ES population and one more
        slot for its mean, whose greedy scoring rides in the population's call; one adapter for GRPO."""
        if max_loras is None:
            population = getattr(config, "population_size", None)
            max_loras = population + 1 if population is not None else 1
        # EGGROLL serves each member's rank-noise_rank noise in a LoRA slot; the other modes their adapter
        es_mode = getattr(config, "es_mode", "lora")
        rank = config.noise_rank if es_mode == "eggroll" else config.lora_rank
        return cls(max_loras=max_loras, max_lora_rank=rank, max_model_len=config.max_model_len,
                   dtype=config.dtype, gpu_memory_utilization=config.gpu_memory_utilization,
                   kv_cache_gb=config.kv_cache_gb, seed=config.seed, deterministic=config.deterministic,
                   engines_per_gpu=config.engines_per_gpu,
                   adapter_transfer=getattr(config, "adapter_transfer", _grpo_transfer(config)), es_mode=es_mode,
                   largest_batch=largest_call(config, *_task_sizes(config)),
                   tensor_parallel_size=config.tensor_parallel_size)

    def covering(self, configs: Iterable[CommonConfig]) -> "EngineSizing":
        """This sizing grown to serve each of these runs too (one engine shared by a sweep): the
        largest of their adapters per call, of their ranks and of their calls (its own es_mode kept)."""
        sizings = [self, *(self.from_config(config) for config in configs)]
        batches = [s.largest_batch for s in sizings]
        return self.replace(max_loras=max(s.max_loras for s in sizings), max_lora_rank=max(s.max_lora_rank for s in sizings),
                            largest_batch=None if None in batches else max(batches))

    def replace(self, **changes: Any) -> "EngineSizing":
        """A copy with some sizes changed (checked again)."""
        return dataclasses.replace(self, **changes)

    def shard(self, num_engines: int) -> "EngineSizing":
        """The sizing of each of ``num_engines`` engines that share every call: its part of the adapters."""
        return self.replace(max_loras=math.ceil(self.max_loras / num_engines))

    def memory(self, on_gpu: bool) -> EngineMemory:
        """The memory share and KV cache this engine asks for on a GPU (where engines_per_gpu engines
        split the default share of the card) or a CPU."""
        kv_cache_gb = self.kv_cache_gb
        if kv_cache_gb is None and self.gpu_memory_utilization is None and not on_gpu:
            kv_cache_gb = CPU_KV_CACHE_GB
        share = self.gpu_memory_utilization
        if share is None:
            share = GPU_MEMORY_SHARE / self.engines_per_gpu if on_gpu else CPU_MEMORY_SHARE
        return EngineMemory(share, kv_cache_gb)

    @property
    def engine_lora_rank(self) -> int:
        """The rank of vLLM's LoRA slots: the smallest rank vLLM supports that holds ``max_lora_rank``."""
        return next(r for r in VLLM_LORA_RANKS if r >= self.max_lora_rank)

    @property
    def engine_loras(self) -> int:
        """vLLM's ``max_loras``: the adapter files of a call plus a zero adapter that stands in for the
        base model in mixed calls, and with resident slots as many again, pinned (their own zero slot)."""
        return (self.max_loras + 1) * (2 if self.adapter_transfer == "in_place" else 1)


def resolve_noise_device(requested: str, cuda: bool | None = None) -> str:
    """Where an ES run draws its noise on this machine: ``requested``, but "cuda" without a GPU falls
    back to "cpu" with a warning. Every user of the noise (members, update, resident slots) takes
    the value returned here, so they all draw the same bits."""
    check_noise_device(requested)
    if cuda is None:
        from ..env import has_cuda

        cuda = has_cuda()
    if requested == "cuda" and not cuda:
        warnings.warn("noise_device is 'cuda' but this machine has no GPU: noise is drawn on the CPU instead "
                      "(other bits than on a GPU, so a run resumed across CPU and GPU draws other members)",
                      stacklevel=3)
        return "cpu"
    if requested == "cpu" and cuda:
        warnings.warn("noise_device is 'cpu' on a machine with a GPU: every generation draws the population's "
                      "noise on the host, seconds a generation for large models (docs: Measurements); "
                      "noise_device: cuda is much faster (same bits on every GPU, not across CPU and GPU)",
                      stacklevel=3)
    return requested
