"""A resident LoRA population written in place inside vLLM: the host-side client.

The file path (``adapters.AdapterFiles``) writes every member adapter to a file and gives it a new
LoRA name and id each call, so vLLM reloads the whole population every generation. Here N LoRA slots
are loaded ONCE under fixed names and ids and pinned; every generation the worker rewrites their
weights in place from the members' seeds (``worker_slots.LoRASlotsExtension``, which runs inside
the engine). Only the mean adapter's tensors and the members' (seed, sign) pairs cross the process
boundary.

``ResidentSlots`` loads the slots, has the worker write them every generation and hands out
one ``LoRARequest`` per member. ``supported(llm)`` says whether an engine can host it, so a caller
can fall back to files with a logged warning; ``PopulationSlots`` is that fallback for an engine.
What the slots must match, and the vLLM versions read, are in ``worker_slots``.

The slots hold exactly what the file path would load (the worker checks a fingerprint adapter at
set-up, and ``checksums`` compares slots with the host's ``es.perturb`` tensors bit for bit), but
greedy completions need not repeat the file path's token for token on a GPU, whose LoRA kernels do
not repeat bit for bit across batch layouts. docs/measurements.md has the comparison with files.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

import torch

from ... import es
from ...lora import AdapterWeights, LoraSpec, adapter_shapes, save_adapter
from ..base import Population, PromptEncoder
from .requests import RequestGrid, requests_aborted_if_cut, run_requests
from .client import WorkerClient
from .rpc import (FINGERPRINT_SEED, SlotsUnsupported, WorkerUnsupported, combine_digests, digest, fingerprint_tensors,
                  pack_tensor, stored_form, torch_dtype)
from .worker import EXTENSION

__all__ = ["EXTENSION", "PopulationSlots", "ResidentSlots", "SlotsUnsupported", "describe", "supported"]

logger = logging.getLogger(__name__)

SLOT_NAME = "evolm-slot-{}"
ZERO_SLOT_NAME = "evolm-slot-zero"
# Fixed LoRA ids, far above the file path's counter (which starts at 1); within int32.
FIRST_SLOT_ID = 1_000_000_000
LOWRANK_SLOT_ID = 7_000_000
"""First LoRA id of EGGROLL's resident slots (the population slots and adapter files use others)."""


def _engine_in_process(llm) -> bool:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    return type(core).__name__ == "InprocClient"


def _prefix_caching(llm) -> bool:
    """Whether the engine caches KV blocks by prefix (True where that cannot be read: reset anyway)."""
    try:
        return bool(llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)
    except AttributeError:
        return True


def describe(llm) -> dict:
    """What the engine's worker reports: vLLM version, device, slot dtype, ``max_loras``,
    ``max_lora_rank``, slot ids, pinned ids and LoRA linear modules (``ok`` False with a ``reason``
    where it cannot host slots)."""
    return WorkerClient(llm).slots_describe()


def supported(llm) -> tuple[bool, str]:
    """Whether this vLLM engine can host a resident population, and why (not)."""
    try:
        lora_config = llm.llm_engine.vllm_config.lora_config
    except AttributeError:
        lora_config = "unknown"
    if lora_config is None:
        return False, "LoRA is not enabled on this engine (enable_lora=True)"
    try:
        info = describe(llm)
    except WorkerUnsupported as error:
        return False, str(error)
    except Exception as error:
        return False, (f"the worker extension is not installed (start the engine with worker_extension_cls={EXTENSION!r}): "
                       f"{type(error).__name__}: {error}")
    if not info.get("ok"):
        return False, info.get("reason", "the worker reported a problem")
    return True, (f"vLLM {info['vllm_version']} on {info['device']}, {info['slot_dtype']}, max_loras {info['max_loras']}, "
                  f"max_lora_rank {info['max_lora_rank']}, {len(info['modules'])} LoRA linear modules")


class ResidentSlots:
    """N LoRA slots resident in a vLLM engine, rewritten in place every generation.

    ``llm`` must have been started with ``worker_extension_cls=EXTENSION``, ``enable_lora=True``
    and ``max_loras >= num_slots + 1`` (the +1 is a zero adapter for base requests); adapters
    passed through files in the same engine need further free slots. ``dtype`` is the dtype the
    file path writes adapters in (the engine dtype).
    """

    def __init__(self, llm, spec: LoraSpec, num_slots: int, model_dir: str | Path, dtype: str = "float32", *,
                 first_id: int = FIRST_SLOT_ID, workdir: str | Path | None = None):
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        ok, reason = supported(llm)
        if not ok:
            raise SlotsUnsupported(reason)
        info = describe(llm)
        if spec.rank > info["max_lora_rank"]:
            raise ValueError(f"adapter rank {spec.rank} exceeds the engine's max_lora_rank {info['max_lora_rank']}: "
                             "start the engine with a larger max_lora_rank")
        free = info["max_loras"] - len(info["pinned"])
        if num_slots + 1 > free:
            raise ValueError(f"{num_slots} slots + 1 zero slot need {num_slots + 1} free LoRA slots but the engine has "
                             f"{free} (max_loras {info['max_loras']}, {len(info['pinned'])} pinned): start it with a larger max_loras")
        self.llm, self.spec, self.num_slots, self.model_dir, self.dtype = llm, spec, num_slots, Path(model_dir), dtype
        self.worker = WorkerClient(llm)  # every call into the engine's worker extension
        self.shapes = adapter_shapes(self.model_dir, spec)
        self.flat_layout = es.Layout.of(self.shapes)  # the order the mean travels in, flat
        self.key = int(first_id)
        self.ids = [first_id + i for i in range(num_slots + 1)]  # the last one is the zero slot
        self.names = [SLOT_NAME.format(i) for i in range(num_slots)] + [ZERO_SLOT_NAME]
        self._in_process = _engine_in_process(llm)
        self._prefix_caching = _prefix_caching(llm)
        self._written = 0
        self._mean_written = False  # whether the slot after the members holds the mean (write(..., with_mean=True))
        self._encoder = None
        folder = Path(tempfile.mkdtemp(prefix="evolm-slots-", dir=workdir))
        try:
            fingerprint = AdapterWeights(spec, fingerprint_tensors(self.shapes))
            path = save_adapter(fingerprint, folder / "fingerprint", base_model=str(self.model_dir), dtype=torch_dtype(dtype))
            # The folder is deleted once loaded: a slot vLLM tried to reload would fail loudly, not serve stale weights.
            self._requests = [LoRARequest(name, lora_id, str(path)) for name, lora_id in zip(self.names, self.ids)]
            with requests_aborted_if_cut(self.llm):
                self.llm.generate([{"prompt_token_ids": [0]}] * len(self._requests), SamplingParams(max_tokens=1, temperature=0.0),
                                  lora_request=self._requests, use_tqdm=False)
            # one layout per tensor-parallel rank: its shards' shapes, and where they sit in the full tensors
            self.layouts = self.worker.slots_setup(self.key, self.ids, self.shapes, spec.alpha, spec.rank, dtype,
                                                   FINGERPRINT_SEED)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self.slot_dtype = torch_dtype(info["slot_dtype"])
        self.info = info
        self._reset_prefix_cache()

    # -- writing

    def write(self, mean: AdapterWeights, members: Sequence[es.Member], sigmas: es.Sigma, noise_device: str = es.NOISE_DEVICE,
              noise_scheme: es.NoiseScheme = "flat", with_mean: bool = False) -> dict[str, float]:
        """Slot i <- mean + sign_i * sigma * noise(seed_i), regenerated on the engine; with ``with_mean``
        the slot after the members holds the mean itself (``mean_request()``); returns timings."""
        if mean.spec != self.spec:
            raise ValueError(f"the mean adapter's spec {mean.spec} differs from the slots' {self.spec}")
        # The mean in one piece, checked against the slots' tensors (a FlatParams' own vector: no copy).
        flat = es.flat_of(mean.tensors, self.flat_layout).detach()
        if not members:
            raise ValueError("members must not be empty")
        if len(members) + with_mean > self.num_slots:
            raise ValueError(f"{len(members)} members{' and the mean' if with_mean else ''} but only "
                             f"{self.num_slots} resident slots")
        if not all(isinstance(m, es.Member) for m in members):
            raise TypeError("members must be es.Member values")
        es.check_sigma(sigmas, list(self.shapes))
        es.check_noise_device(noise_device)
        es.check_noise_scheme(noise_scheme)
        started = time.perf_counter()
        payload = flat if self._in_process else pack_tensor(flat)  # another process: plain bytes
        sigma_arg = {k: float(v) for k, v in sigmas.items()} if isinstance(sigmas, Mapping) else float(sigmas)
        rows = [[m.seed, m.sign] for m in members]
        if with_mean:
            rows.append([members[-1].seed, 0])  # sign 0: mean + 0 * noise, the mean exactly (its seed's draw is shared)
        result = self.worker.slots_write(self.key, payload, rows, sigma_arg, noise_device, noise_scheme)
        self._written = len(members)
        self._mean_written = with_mean
        self._reset_prefix_cache()
        return {"slots_write_s": float(result["write_s"]), "slots_call_s": time.perf_counter() - started}

    def mark_written(self, count: int) -> None:
        """Record that another writer (EGGROLL's factors, ``weights.EngineWeights.write_slots``)
        filled the first ``count`` slots: they are served by ``lora_requests()`` from now on."""
        if not 1 <= count <= self.num_slots:
            raise ValueError(f"{count} written slots for {self.num_slots} resident slots")
        self._written, self._mean_written = count, False
        self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> None:
        # Cached KV blocks are keyed by LoRA name, which is fixed here: stale after every write.
        if not self._prefix_caching:
            return  # nothing cached (VLLMEngine starts in-place engines without a prefix cache)
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM could not reset its prefix cache (requests still running?): slots would serve stale KV")

    # -- serving

    def lora_requests(self) -> list:
        """One ``LoRARequest`` per member of the last write, in member order."""
        if not self._written:
            raise RuntimeError("no members written yet: call write() first")
        return list(self._requests[: self._written])

    def mean_request(self):
        """The ``LoRARequest`` of the mean adapter, written by the last ``write(..., with_mean=True)``."""
        if not self._mean_written:
            raise RuntimeError("the mean was not written: call write(..., with_mean=True) first")
        return self._requests[self._written]

    def base_request(self):
        """A resident all-zero adapter: the base model inside calls that also serve slots."""
        return self._requests[-1]

    def generate(self, prompts: Sequence, sampling, *, with_base: bool = False):
        """Completions ``[member][prompt]`` (+ a last base row if ``with_base``) in one engine call."""
        if self._encoder is None:
            self._encoder = PromptEncoder(self.llm.get_tokenizer())
        requests = self.lora_requests() + ([self.base_request()] if with_base else [])
        (table,) = run_requests(self.llm, [RequestGrid([self._encoder.encode(p) for p in prompts], requests, sampling)])
        return table

    # -- inspection

    def checksums(self) -> list[str]:
        """Digest of each member slot's bytes, to compare with ``expected_checksum``."""
        return self.worker.slots_checksums(self.key)[: self.num_slots]

    def expected_checksum(self, tensors: Mapping[str, torch.Tensor]) -> str:
        """The digest a slot holding these PEFT tensors (float32, e.g. from ``es.perturb``) must have
        (each tensor-parallel rank's part of them in its shard)."""
        return combine_digests([self._expected_digest(tensors, layout) for layout in self.layouts])

    def _expected_digest(self, tensors: Mapping[str, torch.Tensor], layout: Mapping) -> str:
        """The digest of one rank's shard of a slot holding these tensors."""
        scaling = float(layout["scaling"])
        placed = {}
        for name, (module, index, is_a) in layout["entries"].items():
            stored = stored_form(tensors[name].detach().cpu(), is_a, torch_dtype(self.dtype), self.slot_dtype, scaling)
            positions = layout["shards"][name]
            if positions is not None:  # the rank's part (worker_shards.select_shard)
                stored = stored.index_select(stored.dim() - (1 if is_a else 2), torch.tensor(positions, dtype=torch.long))
            placed[(module, index, is_a)] = stored

        slot_shapes = {module: (a, b) for module, a, b in layout["modules"]}

        def region(module, index, is_a):
            full = torch.zeros(tuple(slot_shapes[module][0 if is_a else 1][index]), dtype=self.slot_dtype)
            value = placed.get((module, index, is_a))
            if value is not None:
                if is_a:
                    full[: value.shape[0]] = value
                else:
                    full[:, : value.shape[1]] = value
            return full

        return digest(layout["modules"], region)

    def read(self, index: int) -> dict[str, torch.Tensor]:
        """Slot ``index``'s tensors by PEFT name as the engine serves them (B includes alpha / r),
        whole: under tensor parallelism gathered from every rank's shard."""
        if not 0 <= index <= self.num_slots:
            raise IndexError(f"slot {index} out of range 0..{self.num_slots} (the last is the zero slot)")
        kinds = {name: (self.shapes[name], is_a) for name, (_, _, is_a) in self.layouts[0]["entries"].items()}
        return self.worker.slots_read(self.key, index, not self._in_process, kinds)

    def close(self) -> None:
        """Unpin and unload the slots (the engine keeps running)."""
        if self.llm is not None:
            self.worker.slots_release(self.key)
            self.llm.reset_prefix_cache()
            self.llm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----------------------------------------------------------------------------- populations in resident slots


class PopulationSlots:
    """The resident LoRA slots (``ResidentSlots``) populations are written into, set up by ``prepare``
    when a run opens (again when a run of another adapter layout opens on the same engine). Where the
    engine cannot host them, ``prepare`` says so once (a warning) and files serve from then on."""

    def __init__(self, llm, model_dir: Path, dtype: str, num_slots: int, workdir: Path, enabled: bool):
        self.llm, self.model_dir, self.dtype, self.num_slots, self.workdir = llm, model_dir, dtype, num_slots, workdir
        self.enabled = enabled
        self._resident = None

    def prepare(self, spec: LoraSpec, population_size: int):
        """The slots populations of ``population_size`` adapters of ``spec`` are written into, set up
        now where the slots held are of another spec (or none are); None where files serve them."""
        if not self.enabled:
            return None
        if self._resident is not None and self._resident.spec != spec:
            self.close()
        if self._resident is None:
            try:
                self._resident = ResidentSlots(self.llm, spec, self.num_slots, self.model_dir, self.dtype,
                                               workdir=self.workdir)
            except SlotsUnsupported as error:
                logger.warning("resident LoRA slots unavailable (%s): writing adapter files instead", error)
                self.enabled = False
                return None
        return self._checked(population_size)

    def for_population(self, population: Population):
        """The slots set up for this population's spec, or None (files) where they cannot serve. A
        population no slots were prepared for (a caller that did not call ``prepare``) has them set
        up here, before it is written."""
        if not self.enabled:
            return None
        if self._resident is None or self._resident.spec != population.mean.spec:
            return self.prepare(population.mean.spec, len(population))
        return self._checked(len(population))

    def _checked(self, population_size: int):
        if population_size > self.num_slots:
            raise ValueError(f"a population of {population_size} exceeds the engine's max_loras={self.num_slots}: "
                             "start the engine with max_loras >= the population size")
        return self._resident

    @property
    def resident(self):
        """The slots set up so far (a ``ResidentSlots``), or None."""
        return self._resident

    def close(self) -> None:
        """Release the slots inside the engine (which keeps running)."""
        if self._resident is not None:
            self._resident.close()
        self._resident = None

    def forget(self) -> None:
        """Drop the slots without releasing them: the engine is going away."""
