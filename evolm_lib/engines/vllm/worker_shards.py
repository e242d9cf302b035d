"""Resident LoRA slots under tensor parallelism: which part of a full LoRA tensor each rank's slot holds.

With ``tensor_parallel_size`` > 1 every rank's LoRA layer holds a shard of each slot, as vLLM's file
loader puts it there (``set_lora``): column-parallel layers (q/k/v, gate/up, one slot tensor per
slice of a merged layer) keep lora_A whole and split lora_B along its output rows; row-parallel
layers (o_proj, down_proj) split lora_A along its input columns and keep lora_B whole. The k/v rows
of q/k/v follow the rank's KV-head group, and when there are fewer KV heads than ranks, several
ranks hold the same rows (vLLM replicates the heads).

The split is vLLM's own, not re-derived here: ``shard_positions`` hands each layer's
``slice_lora_a`` / ``slice_lora_b`` (what ``set_lora`` calls on a loaded file's full tensors) a
tensor of positions, once at set-up; what comes back are the positions this rank keeps. Every write
then draws the member's FULL noise from its seed exactly as on one rank (a LoRA is small), does the
same arithmetic, and selects these positions: a rank's slot holds, bit for bit, its part of what a
single rank would hold. The set-up's fingerprint check (``worker_slots``: every slot loaded by
vLLM's loader compared with the selected full tensors) checks the positions on every rank.

Not covered: ``fully_sharded_loras`` (S-LoRA layers that also split lora_A along the rank), refused
at set-up.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch


@dataclasses.dataclass
class SlotEntry:
    """Where one PEFT tensor lives in the engine: a slice of a LoRA module's stacked tensors, and
    the part of the full tensor this rank holds."""

    name: str
    module: str
    slice: int
    is_a: bool
    rank: int
    stacked: torch.Tensor  # (max_loras, 1, max_rank, in) for A, (max_loras, 1, out, max_rank) for B: this rank's shard
    full_shape: tuple[int, ...] = ()  # the PEFT tensor's own shape: (rank, in) for A, (out, rank) for B
    positions: torch.Tensor | None = None  # A: the input columns this rank holds, B: the output rows; None: all


def split_dim(is_a: bool) -> int:
    """The dimension a LoRA tensor is split along, counted from the end: lora_A (rank, in) along its
    input columns, lora_B (out, rank) along its output rows."""
    return -1 if is_a else -2


def _takes_slices(layer: Any) -> bool:
    """Whether the layer's slice methods take a list with one tensor per slice (merged layers)."""
    from vllm.lora.layers.column_parallel_linear import MergedColumnParallelLinearWithLoRA

    return isinstance(layer, MergedColumnParallelLinearWithLoRA)


def shard_positions(layer: Any, slice_index: int, is_a: bool, full_shape: Sequence[int]) -> torch.Tensor | None:
    """The positions along ``split_dim`` of a full LoRA tensor (``full_shape``: (rank, in) for A,
    (out, rank) for B, of slice ``slice_index``) that this rank's slot holds, read from the layer's
    own ``slice_lora_a`` / ``slice_lora_b``; None where the rank holds the whole tensor (one rank,
    or a dimension vLLM does not split)."""
    if int(getattr(layer, "tp_size", 1)) == 1:
        return None  # set_lora slices only under tensor parallelism
    size = int(full_shape[1] if is_a else full_shape[0])
    positions = torch.arange(size)
    probe = positions.view(1, size) if is_a else positions.view(size, 1)
    method = layer.slice_lora_a if is_a else layer.slice_lora_b
    if _takes_slices(layer):
        probes: list = [None] * int(layer.n_slices)
        probes[slice_index] = probe
        kept = method(probes)[slice_index]
    else:
        kept = method(probe)
    kept = kept.reshape(-1).clone()
    return None if torch.equal(kept, positions) else kept


def select_shard(full: torch.Tensor, positions: torch.Tensor | None, is_a: bool) -> torch.Tensor:
    """This rank's part of full LoRA tensors: ``full`` (..., rank, in) for A or (..., out, rank)
    for B (leading dimensions: members), the ``positions`` of ``shard_positions`` selected."""
    if positions is None:
        return full
    return full.index_select(full.dim() + split_dim(is_a), positions.to(full.device))


def write_full(entry: SlotEntry, slots: torch.Tensor, full: torch.Tensor) -> None:
    """Write several members' FULL LoRA tensors for one entry into their slots, each rank its shard.

    ``entry``: one of a resident slot set's entries (``_SlotSet.entries`` in ``worker_slots``, which
    ``LoRASlotsExtension._evolm_slot_set(key)`` returns); ``slots``: the slot indices, one per member,
    an int64 tensor on the slot tensors' device; ``full``: (members, rank, in) for a lora_A entry,
    (members, out, rank) for a lora_B entry, the whole tensor as one rank would hold it (B with the
    LoRA scaling already folded in), its rank ``entry.rank``. The rank's part (vLLM's split) is cast to
    the slot dtype and written in place into the existing slot tensor (addresses kept). Works on one
    rank alike (nothing is split there)."""
    expected = (entry.rank, entry.full_shape[1]) if entry.is_a else (entry.full_shape[0], entry.rank)
    if full.dim() != 3 or tuple(full.shape[1:]) != tuple(expected):
        raise ValueError(f"{entry.name}: full tensors of shape (members, {expected[0]}, {expected[1]}) are needed, "
                         f"got {tuple(full.shape)}")
    shard = select_shard(full, entry.positions, entry.is_a).to(entry.stacked.dtype)
    if entry.is_a:
        entry.stacked[slots, 0, : entry.rank] = shard
    else:
        entry.stacked[slots, 0, :, : entry.rank] = shard


def flat_positions(names: Sequence[str], shapes: Mapping[str, Sequence[int]], offsets: Sequence[int],
                   entries: Mapping[str, SlotEntry]) -> torch.Tensor | None:
    """The positions of this rank's shards in a member's flat vector (tensors in ``names`` order at
    ``offsets``, each ``shapes[name]``), in the same order: selecting them from a flat full member
    gives the flat vector of its shards. None where the rank holds every tensor whole."""
    if all(entries[name].positions is None for name in names):
        return None
    pieces = []
    for name, offset in zip(names, offsets):
        shape = tuple(int(d) for d in shapes[name])
        grid = torch.arange(offset, offset + int(torch.Size(shape).numel())).view(shape)
        entry = entries[name]
        pieces.append(select_shard(grid, entry.positions, entry.is_a).reshape(-1))
    return torch.cat(pieces)


def shard_shape(entry: SlotEntry) -> tuple[int, ...]:
    """The shape of this rank's part of the entry's full tensor."""
    shape = list(entry.full_shape)
    if entry.positions is not None:
        shape[len(shape) + split_dim(entry.is_a)] = int(entry.positions.numel())
    return tuple(shape)
