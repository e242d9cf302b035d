"""How large a vLLM engine is, derived once from a run's settings, and where its noise is drawn.

One :class:`EngineSizing` is what every engine of a run is started with: the engine in this process
(``VLLMEvaluator``), each Ray actor's engine (``RayEvaluator``, each holding its share of the
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
from ..es.core import check_noise_device

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The LoRA ranks vLLM builds kernels for: an engine's slots are the next of these at or above max_lora_rank."""
ADAPTER_TRANSFERS: tuple[str, ...] = get_args(AdapterTransfer)
CPU_MEMORY_SHARE = 0.5
"""gpu_memory_utilization handed to vLLM on a CPU when it is not set (the KV cache has a fixed size there)."""


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

    def __post_init__(self) -> None:
        if not 1 <= self.max_lora_rank <= VLLM_LORA_RANKS[-1]:
            raise ValueError(f"max_lora_rank must be in 1..{VLLM_LORA_RANKS[-1]}, got {self.max_lora_rank}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if not isinstance(self.engines_per_gpu, int) or self.engines_per_gpu < 1:
            raise ValueError(f"engines_per_gpu must be an integer >= 1, got {self.engines_per_gpu!r}")
        if self.adapter_transfer not in ADAPTER_TRANSFERS:
            raise ValueError(f"adapter_transfer must be one of {', '.join(ADAPTER_TRANSFERS)}, got {self.adapter_transfer!r}")

    @classmethod
    def from_config(cls, config: CommonConfig, max_loras: int | None = None) -> "EngineSizing":
        """The engine a run's settings ask for. ``max_loras`` None: an ES population and one more
        slot for its mean, whose greedy scoring rides in the population's call; one adapter for GRPO."""
        if max_loras is None:
            population = getattr(config, "population_size", None)
            max_loras = population + 1 if population is not None else 1
        # EGGROLL serves each member's rank-noise_rank noise in a LoRA slot; the other modes their adapter
        rank = config.noise_rank if getattr(config, "es_mode", "lora") == "eggroll" else config.lora_rank
        return cls(max_loras=max_loras, max_lora_rank=rank, max_model_len=config.max_model_len,
                   dtype=config.dtype, gpu_memory_utilization=config.gpu_memory_utilization,
                   kv_cache_gb=config.kv_cache_gb, seed=config.seed, deterministic=config.deterministic,
                   engines_per_gpu=config.engines_per_gpu,
                   adapter_transfer=getattr(config, "adapter_transfer", _grpo_transfer(config)))

    def covering(self, configs: Iterable[CommonConfig]) -> "EngineSizing":
        """This sizing grown to serve each of these runs too (one engine shared by a sweep): the
        largest of their adapters per call and of their ranks."""
        sizings = [self, *(self.from_config(config) for config in configs)]
        return self.replace(max_loras=max(s.max_loras for s in sizings), max_lora_rank=max(s.max_lora_rank for s in sizings))

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
