"""Named parameter tensors laid out as one flat vector: ``Layout`` (where each tensor sits),
``FlatParams`` (a read-only mapping over views of the vector), and the norms and differences the
update reports. The update math, the noise and the slot writes work on the flat vector directly."""
from __future__ import annotations

import math
from functools import cached_property
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import torch

Params = Mapping[str, torch.Tensor]  # a dict, or a FlatParams (views of one flat vector)
Shapes = Mapping[str, tuple[int, ...]]

_BLOCK_ELEMENTS = 1 << 26  # float32 elements of noise drawn at once (256 MiB): bounds memory at any population


@dataclass(frozen=True)
class Layout:
    """Where each named tensor sits in a member's flat parameter vector: sorted names, back to back."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    total: int

    @classmethod
    def of(cls, shapes: Shapes) -> "Layout":
        names = tuple(sorted(shapes))
        dims = tuple(tuple(int(d) for d in shapes[name]) for name in names)
        offsets, total = [], 0
        for dim in dims:
            offsets.append(total)
            total += math.prod(dim)
        return cls(names, dims, tuple(offsets), total)

    def split(self, flat: torch.Tensor) -> Params:
        """Views of a (..., total) tensor as named tensors of shape (..., *shape); nothing is copied."""
        lead = tuple(flat.shape[:-1])
        return {name: flat[..., offset:offset + math.prod(shape)].view(*lead, *shape)
                for name, shape, offset in zip(self.names, self.shapes, self.offsets)}

    def repeat(self, values: Sequence[float], device: str | torch.device = "cpu") -> torch.Tensor:
        """One float32 value per tensor (in `names` order), repeated over that tensor's elements: (total,)."""
        counts = torch.tensor([math.prod(shape) for shape in self.shapes])
        return torch.repeat_interleave(torch.tensor(list(values), dtype=torch.float32), counts).to(device)

    def block_size(self) -> int:
        """How many members' noise to draw at once (at least one)."""
        return max(1, _BLOCK_ELEMENTS // max(1, self.total))

    @cached_property
    def positions(self) -> dict[str, int]:
        """Index of each name in `names`."""
        return {name: index for index, name in enumerate(self.names)}


class FlatParams(Mapping[str, torch.Tensor]):
    """Named tensors held as ONE flat vector laid out by `layout` (sorted names, back to back).

    It reads like a dict of tensors (the views are made on first access), but the update math, the
    norms and the slot writes work on `flat` directly: a handful of kernels per step, whatever the
    number of LoRA tensors (SmolLM2 has 420), instead of one operation (and one Python round) per
    tensor. Read-only as a mapping: the values are views, so writing into them writes `flat`."""

    def __init__(self, flat: torch.Tensor, layout: Layout):
        if flat.dim() != 1 or flat.numel() != layout.total:
            raise ValueError(f"a flat vector of {layout.total} elements is needed, got shape {tuple(flat.shape)}")
        self.flat, self.layout = flat, layout
        self._views: dict[str, torch.Tensor] | None = None

    @classmethod
    def of(cls, params: Mapping[str, torch.Tensor], layout: Layout | None = None) -> "FlatParams":
        """`params` laid out flat (itself when it already is, in that layout; else one copy)."""
        layout = layout or layout_of(params)
        return cls(flat_of(params, layout), layout)

    def _all(self) -> dict[str, torch.Tensor]:
        if self._views is None:
            self._views = self.layout.split(self.flat)
        return self._views

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._all()[name]

    def __contains__(self, name: object) -> bool:
        return name in self.layout.positions

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names)

    def __len__(self) -> int:
        return len(self.layout.names)

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> "FlatParams":
        """The same tensors on `device` / in `dtype` (itself when nothing changes)."""
        moved = self.flat.to(device=device, dtype=dtype)
        return self if moved is self.flat else FlatParams(moved, self.layout)

    def __getstate__(self) -> dict:  # pickled (Ray) without the cached views
        return {"flat": self.flat, "layout": self.layout}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["flat"], state["layout"])

    def __repr__(self) -> str:
        return f"FlatParams({len(self)} tensors, {self.layout.total} {self.flat.dtype} values on {self.flat.device})"


def layout_of(params: Mapping[str, torch.Tensor]) -> Layout:
    """The flat layout of `params`: a FlatParams' own, else the sorted-name layout of their shapes."""
    return params.layout if isinstance(params, FlatParams) else Layout.of(shapes_of(params))


def flat_of(params: Mapping[str, torch.Tensor], layout: Layout) -> torch.Tensor:
    """`params` as one vector in `layout`'s order: a FlatParams' own vector (no copy), else one cat."""
    if isinstance(params, FlatParams) and (params.layout is layout or params.layout == layout):
        return params.flat
    if len(params) != len(layout.names) or any(name not in params for name in layout.names):
        missing, extra = sorted(set(layout.names) - set(params))[:3], sorted(set(params) - set(layout.names))[:3]
        raise ValueError(f"tensors do not match the layout: missing {missing}, unexpected {extra}")
    for name, shape in zip(layout.names, layout.shapes):
        if tuple(params[name].shape) != shape:
            raise ValueError(f"{name} has shape {tuple(params[name].shape)}, the layout says {shape}")
    return torch.cat([params[name].reshape(-1) for name in layout.names])


def shapes_of(params: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """The `shapes` mapping of a set of parameters."""
    return {name: tuple(tensor.shape) for name, tensor in params.items()}


def difference(new: Params, old: Params) -> FlatParams:
    """new - old over all tensors, in float32 (e.g. the update a step made), laid out flat."""
    layout = layout_of(new)
    new_flat = flat_of(new, layout).float()
    return FlatParams(new_flat - flat_of(old, layout).to(new_flat.device, torch.float32), layout)


def update_norm(delta: Params) -> float:
    """Global L2 norm of an update (all tensors together): of the flat vector in float64 (FlatParams),
    or per-tensor norms in float32 (at least) combined in float64 (a dict)."""
    if isinstance(delta, FlatParams):
        return float(torch.linalg.vector_norm(delta.flat.detach(), dtype=torch.float64))
    tensors = [tensor.detach() if tensor.dtype in (torch.float32, torch.float64) else tensor.detach().float()
               for tensor in delta.values()]
    if not tensors:
        return 0.0
    # one multi-tensor norm and one device->host read, not one kernel and one read per tensor
    return float(torch.linalg.vector_norm(torch.stack([n.double() for n in torch._foreach_norm(tensors)])))
