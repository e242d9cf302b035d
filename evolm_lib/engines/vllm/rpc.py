"""What crosses between the host and vLLM's worker, for resident LoRA slots and resident weights.

The host-side clients (``slots.ResidentSlots``, ``weights.EngineWeights``) call the worker
extension's methods (``worker.WorkerExtension``) through ``client.WorkerClient``. Both sides need
the pieces here: the errors a worker raises when it cannot host what was asked; tensors as plain data for an
engine in another process; optimizer settings in a plain form; and, for the slots, the stored form
of a tensor, the fingerprint adapter and the slot digests, defined once so both sides compute them
alike.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Mapping, Sequence

import torch

from ... import es

FINGERPRINT_SEED = 20261126
"""Seed of the random adapter every slot is loaded with and checked against at set-up."""


class WorkerUnsupported(RuntimeError):
    """The engine's worker cannot host resident slots or weights (one unsharded worker is needed)."""


class SlotsUnsupported(WorkerUnsupported):
    """The engine cannot host resident slots (missing extension or internals, or a check failed)."""


class WeightsUnsupported(WorkerUnsupported):
    """The engine's weights cannot be written in place (a layout or a vLLM internal this code does not know)."""


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype from its name ("float32", "bfloat16", ...)."""
    value = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


def stored_form(tensor: torch.Tensor, is_a: bool, file_dtype: torch.dtype, slot_dtype: torch.dtype, scaling: float) -> torch.Tensor:
    """A PEFT tensor as vLLM stores it after loading a file: cast to the file dtype, then to the
    LoRA dtype, and B multiplied by ``alpha / r`` in that dtype (``LoRALayerWeights.optimize``)."""
    stored = tensor.to(file_dtype).to(slot_dtype)
    if not is_a and scaling != 1:
        stored = stored * scaling
    return stored


def fingerprint_tensors(shapes: Mapping[str, Sequence[int]], seed: int = FINGERPRINT_SEED) -> dict[str, torch.Tensor]:
    """A random adapter (float32, CPU) both sides can rebuild: loaded through vLLM's file loader,
    it shows where each PEFT tensor lands and how it is scaled and rounded."""
    out = {}
    for name, shape in shapes.items():
        generator = torch.Generator().manual_seed(es.tensor_seed(seed, "fingerprint/" + name))
        # Scaled down: the engine runs one token with it while loading the slots.
        out[name] = torch.randn(tuple(shape), generator=generator, dtype=torch.float32) * 0.01
    return out


def _bytes_of(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).cpu().numpy().tobytes()


def pack_tensor(tensor: torch.Tensor) -> dict:
    """A tensor as plain data (dtype, shape, bytes): vLLM's RPC to an engine in another process
    delivers tensors nested in arguments as lists."""
    return {"dtype": str(tensor.dtype).replace("torch.", ""), "shape": list(tensor.shape), "data": _bytes_of(tensor)}


def unpack_tensor(value: Any) -> torch.Tensor:
    """The inverse of ``pack_tensor``; tensors pass through (in-process engines)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict) and "data" in value:
        raw = torch.frombuffer(bytearray(value["data"]), dtype=torch.uint8)
        return raw.view(torch_dtype(value["dtype"])).reshape(tuple(value["shape"]))
    raise TypeError(f"expected a tensor or a packed tensor, got {type(value).__name__}")


def digest(modules: Sequence[Sequence[Any]], region) -> str:
    """blake2b of every linear module's slot regions (A then B per slice, full padded width)."""
    hasher = hashlib.blake2b(digest_size=16)
    for module, a_shapes, _ in modules:
        for index in range(len(a_shapes)):
            hasher.update(_bytes_of(region(module, index, True)))
            hasher.update(_bytes_of(region(module, index, False)))
    return hasher.hexdigest()


def combine_digests(per_rank: Sequence[str]) -> str:
    """One digest of a slot held in shards by several tensor-parallel ranks (rank order): the rank's
    own digest on one rank, else blake2b of the ranks' digests."""
    if len(per_rank) == 1:
        return per_rank[0]
    hasher = hashlib.blake2b(digest_size=16)
    for value in per_rank:
        hasher.update(bytes.fromhex(value))
    return hasher.hexdigest()


def gather_shards(name: str, full_shape: Sequence[int], is_a: bool,
                  pieces: Sequence[tuple[torch.Tensor, Sequence[int] | None]]) -> torch.Tensor:
    """One full LoRA tensor (``full_shape``: (rank, in) for A, (out, rank) for B) from the parts the
    tensor-parallel ranks hold: each piece is (the rank's part, its positions along the split
    dimension, None: the whole tensor), as ``worker_slots``' read returns them. Every position must
    be held, and ranks that hold the same positions (vLLM replicates KV heads over ranks when there
    are fewer heads than ranks) must hold the same values."""
    dim = len(full_shape) - 1 if is_a else len(full_shape) - 2
    full = torch.zeros(tuple(full_shape), dtype=pieces[0][0].dtype)
    held = torch.zeros(full_shape[dim], dtype=torch.bool)
    for rank, (part, positions) in enumerate(pieces):
        index = torch.arange(full_shape[dim]) if positions is None else torch.as_tensor(list(positions), dtype=torch.long)
        if part.shape[dim] != index.numel():
            raise ValueError(f"{name}: rank {rank} holds {tuple(part.shape)}, not {index.numel()} positions along dim {dim}")
        again = held[index]
        if bool(again.any()) and not torch.equal(full.index_select(dim, index[again]), part.index_select(dim, again.nonzero().view(-1))):
            raise ValueError(f"{name}: rank {rank} holds other values than an earlier rank at the same positions")
        full.index_copy_(dim, index, part)
        held[index] = True
    if not bool(held.all()):
        raise ValueError(f"{name}: positions {(~held).nonzero().view(-1).tolist()[:5]} are held by no rank")
    return full


def optimizer_spec(config: es.OptimizerConfig) -> dict[str, Any]:
    """The plain form of an optimizer config that crosses into the worker."""
    kind = "adam" if isinstance(config, es.AdamConfig) else "sgd"
    return {"kind": kind, **dataclasses.asdict(config)}


def optimizer_from_spec(spec: Mapping[str, Any]) -> es.OptimizerConfig:
    """An optimizer config from its plain form ({"kind": "sgd" | "adam", fields...}), as RPCs carry it."""
    fields = {k: v for k, v in spec.items() if k != "kind"}
    if spec.get("kind") == "adam":
        return es.AdamConfig(**fields)
    if spec.get("kind") == "sgd":
        return es.SGDConfig(**fields)
    raise ValueError(f"unknown optimizer {spec.get('kind')!r}")
