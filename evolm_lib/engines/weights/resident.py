"""A model's own weights as the ES mean, written in place where they live.

Full-parameter ES (Qiu et al. 2025, https://arxiv.org/abs/2509.24372) and EGGROLL (Sarkar et al.
2025, https://arxiv.org/abs/2511.16652) both move the model's weights, not an adapter. This class
holds the targeted weights of a model that an engine serves (the tensors its kernels read) and:

- keeps a float32 master of the mean beside them (the source of truth: an update below bfloat16's
  resolution accumulates there instead of vanishing);
- writes a member, ``theta + sign * sigma * eps(seed)``, into the live tensors from its seed
  (full-rank noise, or EGGROLL's ``A B^T / sqrt(r)``), computed in float32 and cast once;
- restores the mean by copying the master back, never by subtracting the noise again (bfloat16
  add-then-subtract drifts a little every member);
- applies the update from the members' seeds and shaped fitness on the weights' own device
  (``es.es_gradient`` or ``es.lowrank.lowrank_gradient``, then ``es.apply_update`` on the master),
  so no full-size tensor crosses to the host.

The same object serves the HF engine (an ``nn.Module``'s parameters) and vLLM's worker (the model
runner's parameters, reached through ``collective_rpc``). Writes are ``copy_`` into the existing
tensors, so their addresses (and CUDA graphs captured over them) stay valid. ``MembersInPlace``
is how an engine in this process serves a list of members from them (``RayEngines`` runs it on
every engine, each on its block of members).
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

import torch

from pathlib import Path

from ... import es
from ...es import lowrank
from ...lora import LoraSpec, base_weight_shapes, target_weight_shapes
from ...types import PromptLike
from ..base import CompletionTable, SamplingSettings

NoiseForm = Literal["full", "lowrank"]


@dataclass(frozen=True)
class WeightSlice:
    """Where a live tensor sits in the model's whole weight (a card of a tensor-parallel engine holds
    a slice of it): the weight's whole shape, and the rows and columns of its matrix view
    (``es.matrix_shape``) that this tensor holds."""

    shape: tuple[int, ...]
    rows: slice = field(default_factory=lambda: slice(None))
    cols: slice = field(default_factory=lambda: slice(None))

    @property
    def whole(self) -> bool:
        """Whether the tensor is the whole weight."""
        n_rows, n_cols = es.matrix_shape(self.shape)
        return self.rows.indices(n_rows)[:2] == (0, n_rows) and self.cols.indices(n_cols)[:2] == (0, n_cols)


class ResidentWeights:
    """The targeted live weights of a model with a float32 master of the ES mean beside them."""

    def __init__(self, live: Mapping[str, torch.Tensor], *, scheme: es.NoiseScheme = "flat",
                 noise: NoiseForm = "full", noise_rank: int = 1, slices: Mapping[str, WeightSlice] | None = None):
        if not live:
            raise ValueError("no weights to write: the targeted modules matched no parameter")
        devices = {tensor.device for tensor in live.values()}
        if len(devices) != 1:
            raise ValueError(f"the targeted weights sit on several devices {sorted(map(str, devices))}")
        if noise not in ("full", "lowrank"):
            raise ValueError(f"noise must be 'full' or 'lowrank', got {noise!r}")
        self.device = devices.pop()
        self.scheme, self.noise, self.noise_rank = scheme, noise, noise_rank
        self.layout = es.Layout.of({name: tuple(tensor.shape) for name, tensor in live.items()})
        self.live = [live[name] for name in self.layout.names]  # in layout order
        self.slices = {name: (slices or {}).get(name, WeightSlice(tuple(live[name].shape))) for name in self.layout.names}
        if noise == "lowrank":
            lowrank.check_rank(noise_rank, self.whole_shapes)
        # the kept copy: float32, so the mean restores bit for bit and small updates accumulate
        flat = es.flat_of({name: live[name].detach() for name in self.layout.names}, self.layout)
        self.master = es.FlatParams(flat.to(torch.float32, copy=True), self.layout)
        self.optimizer_state: es.OptimizerState | None = None
        self.slice_norms: dict[str, float] = {}
        "each weight's (slice's) update norm of the last step"

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every targeted live tensor (a slice of its weight on a tensor-parallel card)."""
        return dict(zip(self.layout.names, self.layout.shapes))

    @property
    def whole_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every targeted weight, whole (what members' noise is defined over)."""
        return {name: part.shape for name, part in self.slices.items()}

    @property
    def streams(self) -> bool:
        """Whether members and updates are made weight by weight ("tiled" full-rank noise): no noise or
        gradient of every weight exists at once."""
        return self.noise == "full" and self.scheme == "tiled"

    def _tiled(self, seed: int, name: str) -> torch.Tensor:
        """eps(seed) over this tensor's slice of weight ``name``, float32, the live tensor's shape."""
        part = self.slices[name]
        values = es.tiled_noise(seed, name, part.shape, part.rows, part.cols, self.device)
        return values.view(self.layout.shapes[self.layout.positions[name]])

    def _check_full_noise(self) -> None:
        """Refuse to draw full-rank noise over slices of weights with a scheme that draws whole vectors
        (a sync that only loads and serves weights, as GRPO's, draws none)."""
        if self.sliced and not self.streams:
            first = min(name for name, part in self.slices.items() if not part.whole)
            raise ValueError(f"{first} is a slice of its weight (a tensor-parallel engine): full-rank noise needs "
                             f"noise_scheme 'tiled' there, which draws a slice's noise alone, not {self.scheme!r}")

    def _lowrank_slices(self) -> dict[str, tuple[slice, slice]]:
        return {name: (part.rows, part.cols) for name, part in self.slices.items()}

    # --- members ---------------------------------------------------------------------------------
    def member_noise(self, member: es.Member, sigma: float) -> torch.Tensor:
        """sign * sigma * eps(seed) over all targeted weights, float32, flat (layout order)."""
        if self.noise == "full":  # (tiled noise is written weight by weight: write_member)
            self._check_full_noise()
            flat = es.population_noise([member.seed], self.layout, self.device, self.scheme)[0]
            return flat.mul_(member.sign * float(sigma))
        delta = lowrank.member_delta(member, self.whole_shapes, self.noise_rank, float(sigma), self.device, self.scheme,
                                     slices=self._lowrank_slices())
        return torch.cat([delta[name].reshape(-1) for name in self.layout.names])

    @torch.no_grad()
    def write_member(self, member: es.Member, sigma: float) -> None:
        """Serve member theta + sign * sigma * eps(seed): computed in float32, cast once into place
        (weight by weight with "tiled" noise)."""
        if self.streams:
            step = member.sign * float(sigma)
            for name, live, mean in zip(self.layout.names, self.live, self.master.values()):
                live.copy_(self._tiled(member.seed, name).mul_(step).add_(mean))
            return
        values = self.member_noise(member, sigma).add_(self.master.flat)
        torch._foreach_copy_(self.live, list(self.layout.split(values).values()))

    @torch.no_grad()
    def restore(self) -> None:
        """Serve the mean again: the master copied back (cast), never noise subtracted."""
        torch._foreach_copy_(self.live, list(self.master.values()))

    def is_restored(self) -> bool:
        """Whether every live weight holds exactly the master cast to its dtype."""
        return all(torch.equal(live, mean.to(live.dtype)) for live, mean in zip(self.live, self.master.values()))

    # --- the update -------------------------------------------------------------------------------
    def gradient(self, members: Sequence[es.Member], weights: Sequence[float] | torch.Tensor, sigma: float,
                 form: es.GradientForm = "qiu") -> es.Params:
        """The ES ascent direction over the targeted weights, from seeds and shaped fitness, on their device."""
        if self.streams:
            flat = torch.cat([part.reshape(-1) for _, part in self._tiled_gradient(members, weights, sigma, form)])
            return es.FlatParams(flat, self.layout)
        if self.noise == "full":
            self._check_full_noise()
            return es.es_gradient(members, weights, self.shapes, sigma, form, self.device, self.scheme)
        flat = torch.empty(self.layout.total, dtype=torch.float32, device=self.device)
        lowrank.lowrank_gradient(members, weights, self.whole_shapes, self.noise_rank, sigma, form, self.device,
                                 self.scheme, out=self.layout.split(flat),  # straight into one flat vector
                                 slices=self._lowrank_slices())
        return es.FlatParams(flat, self.layout)

    def _tiled_gradient(self, members: Sequence[es.Member], weights: Sequence[float] | torch.Tensor, sigma: float,
                        form: es.GradientForm):
        """(where in the flat master, gradient) weight by weight: the members' tiled noise summed with
        their coefficients in seed order, as ``es.seeded_combination`` sums it, one weight at a time."""
        coefficient = es.member_coefficients(members, weights, form, sigma, self.layout.names)
        seeds = [seed for seed, c in coefficient.items() if c != 0.0]
        divisor = len(members) * (float(sigma) if form == "textbook" else 1.0)
        offset = 0
        for name, shape in zip(self.layout.names, self.layout.shapes):
            total = torch.zeros(shape, dtype=torch.float32, device=self.device)
            for seed in seeds:
                total.add_(self._tiled(seed, name), alpha=coefficient[seed])
            total.div_(divisor)
            yield slice(offset, offset + total.numel()), total
            offset += total.numel()

    @property
    def sliced(self) -> bool:
        """Whether this holds a slice of some weight (a card of a tensor-parallel engine)."""
        return not all(part.whole for part in self.slices.values())

    @torch.no_grad()
    def step(self, optimizer: es.OptimizerConfig, members: Sequence[es.Member], weights: Sequence[float] | torch.Tensor,
             sigma: float, form: es.GradientForm = "qiu") -> float:
        """One ES update of the mean where the weights live; the live weights then hold the new mean.
        Returns the update's L2 norm (float32 master, before the cast). Holding slices of weights,
        each weight's norm is kept in ``slice_norms`` too, so the cards' norms combine into the whole
        update's without counting twice what several cards hold."""
        if self.optimizer_state is None:
            self.optimizer_state = es.init_optimizer_state(optimizer, self.master, copy=False)
        gradient = None
        if self.streams:  # weight by weight: one weight's gradient at a time beside the master
            parts = self._tiled_gradient(members, weights, sigma, form)
        elif self.noise == "lowrank" and self.sliced:  # EGGROLL on a tensor-parallel card: weight by weight too
            by_weight = lowrank.lowrank_gradient_by_weight(members, weights, self.whole_shapes, self.noise_rank, sigma,
                                                           form, self.device, self.scheme, self._lowrank_slices())
            parts = ((slice(offset, offset + g.numel()), g) for offset, (_, g) in zip(self.layout.offsets, by_weight))
        else:
            gradient = es.flat_of(self.gradient(members, weights, sigma, form), self.layout)
            # in place: no full-size temporaries beside a master of billions of weights
            parts = [(slice(0, gradient.numel()), gradient)]
            if self.sliced:
                parts = [(slice(offset, offset + view.numel()), view.reshape(-1))
                         for offset, view in zip(self.layout.offsets, self.layout.split(gradient).values())]
        norms: list[float] = []
        self.optimizer_state, norm = es.apply_update_in_parts(optimizer, self.optimizer_state, parts, part_norms=norms)
        del gradient, parts  # their buffers go back to the allocator before the weights are rewritten
        self.slice_norms = dict(zip(self.layout.names, norms)) if len(norms) == len(self.layout.names) else {}
        self.master = self.optimizer_state.master
        self.restore()
        return norm

    @torch.no_grad()
    def load_master(self, flat: torch.Tensor) -> None:
        """Set the mean (e.g. from a snapshot) and serve it."""
        if flat.numel() != self.layout.total:
            raise ValueError(f"a mean of {self.layout.total} values is needed, got {flat.numel()}")
        self.master = es.FlatParams(flat.to(self.device, torch.float32).reshape(-1).clone(), self.layout)
        if self.optimizer_state is not None:
            self.optimizer_state = es.OptimizerState(self.optimizer_state.step, self.master,
                                                     self.optimizer_state.first_moment,
                                                     self.optimizer_state.second_moment)
        self.restore()

    def checksum(self) -> str:
        """SHA-256 of the float32 master's bytes (the same bits give the same digest on any machine)."""
        return hashlib.sha256(self.master.flat.detach().cpu().numpy().tobytes()).hexdigest()


def targeted_weights(named: Mapping[str, torch.Tensor], target_modules: Sequence[str] | str) -> dict[str, torch.Tensor]:
    """The 2-D weights of the modules a run targets: ``all`` for every parameter, else the weights
    whose module name ends in one of ``target_modules`` (e.g. q_proj, v_proj)."""
    if target_modules == "all":
        return dict(named)
    wanted = tuple(target_modules)
    picked = {name: tensor for name, tensor in named.items()
              if name.endswith(".weight") and name[: -len(".weight")].split(".")[-1] in wanted and tensor.dim() == 2}
    if not picked:
        raise ValueError(f"target_modules {list(wanted)} matched no 2-D weight of the model")
    return picked


def targeted_weight_shapes(model_dir: str | Path, target_modules: Sequence[str] | str,
                           layers_to_transform: Sequence[int] | None = None) -> dict[str, tuple[int, ...]]:
    """HF weight name -> shape of what a full-parameter or EGGROLL run moves: the weights of the LoRA
    target modules (in the chosen layers), or ``all``: every tensor of the model folder."""
    if target_modules == "all":
        return base_weight_shapes(model_dir, matrices_only=False)
    spec = LoraSpec(target_modules=tuple(target_modules), layers_to_transform=layers_to_transform)
    return dict(target_weight_shapes(model_dir, spec))


class HostWeights:
    """``ResidentWeights`` over a model in this process (the HF engine's), behind the interface of
    ``vllm.weights.EngineWeights``: members are served one at a time (EGGROLL's too, as dense deltas)."""

    def __init__(self, model, model_dir: str | Path, target_modules: Sequence[str] | str, *, noise: NoiseForm = "full",
                 noise_rank: int = 1, noise_scheme: es.NoiseScheme = "flat",
                 layers_to_transform: Sequence[int] | None = None):
        self.shapes = targeted_weight_shapes(model_dir, target_modules, layers_to_transform)
        params = dict(model.named_parameters())
        missing = sorted(set(self.shapes) - set(params))
        if missing:
            raise ValueError(f"the model has no parameter {missing[:3]} (it has e.g. {sorted(params)[:3]})")
        self.noise, self.noise_rank = noise, noise_rank
        self.resident = ResidentWeights({name: params[name] for name in self.shapes}, scheme=noise_scheme, noise=noise,
                                        noise_rank=noise_rank)

    def write_member(self, member: es.Member, sigma: float) -> float:
        """Serve one member; returns the write's seconds."""
        started = time.perf_counter()
        self.resident.write_member(member, sigma)
        return time.perf_counter() - started

    def restore(self) -> float:
        """Serve the mean again; returns the restore's seconds."""
        started = time.perf_counter()
        self.resident.restore()
        return time.perf_counter() - started

    def step(self, optimizer: es.OptimizerConfig, members: Sequence[es.Member], weights: Sequence[float],
             sigma: float, form: es.GradientForm = "qiu") -> dict:
        """The update in place: {"update_s", "update_norm"}."""
        started = time.perf_counter()
        norm = self.resident.step(optimizer, members, list(weights), sigma, form)
        return {"update_s": time.perf_counter() - started, "update_norm": norm}

    def checksum(self) -> dict:
        """{"master": SHA-256 of the float32 master, "restored": the model holds it exactly, "step"}."""
        state = self.resident.optimizer_state
        return {"master": self.resident.checksum(), "restored": self.resident.is_restored(),
                "step": 0 if state is None else state.step}

    def read(self) -> dict:
        """The master and optimizer buffers (copies)."""
        return snapshot_of(self.resident)

    def load(self, snapshot: Mapping[str, torch.Tensor]) -> None:
        """Serve the mean of a snapshot made by ``read``."""
        load_snapshot(self.resident, snapshot)

    def close(self) -> None:
        """Serve the mean (the model stays as it is: the HF engine owns it)."""
        self.resident.restore()


class MembersInPlace:
    """``run_members`` for engines in this process that serve ES members from their own weights:
    each member written into ``weights`` (``EngineWeights`` or ``HostWeights``) from its seed, its
    prompts generated by this engine, the mean restored; then ``score``'s prompts under the mean."""

    def run_members_one_by_one(self, weights, members: Sequence[es.Member], sigma: float,
                               prompts: Sequence[PromptLike], sampling: SamplingSettings,
                               score: tuple[Sequence[PromptLike], SamplingSettings] | None = None,
                               ) -> tuple[CompletionTable, CompletionTable | None, dict[str, float]]:
        """(``[member][prompt]`` table, the mean's one-row table or None, timing in seconds:
        ``adapters_s`` = ``adapters/write_s`` + ``adapters/restore_s``, and ``generate_s``)."""
        rows, write_s, restore_s, generate_s = [], 0.0, 0.0, 0.0
        for member in members:
            write_s += weights.write_member(member, sigma)
            started = time.perf_counter()
            rows.append(self.generate(prompts, [None], sampling)[0])
            generate_s += time.perf_counter() - started
            restore_s += weights.restore()
        scores = None
        if score is not None:
            started = time.perf_counter()
            scores = self.generate(score[0], [None], score[1])
            generate_s += time.perf_counter() - started
        timing = {"adapters_s": write_s + restore_s, "generate_s": generate_s,
                  "adapters/write_s": write_s, "adapters/restore_s": restore_s}
        return CompletionTable(rows), scores, timing


def snapshot_of(resident: ResidentWeights) -> dict:
    """The float32 master and the optimizer's step and buffers, on the host."""
    out = {"master": resident.master.flat.detach().cpu().clone()}
    state = resident.optimizer_state
    if state is not None:
        out["step"] = state.step
        for name in ("first_moment", "second_moment"):
            buffers = getattr(state, name)
            if isinstance(buffers, es.FlatParams):
                out[name] = buffers.flat.detach().cpu().clone()
    return out


def slice_bounds(resident: ResidentWeights) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
    """Name -> ((first row, end row), (first column, end column)) of the slice of each whole weight
    (``es.matrix_shape``) that ``resident`` holds, as plain numbers for a snapshot."""
    bounds = {}
    for name, part in resident.slices.items():
        n_rows, n_cols = es.matrix_shape(part.shape)
        bounds[name] = (tuple(part.rows.indices(n_rows)[:2]), tuple(part.cols.indices(n_cols)[:2]))
    return bounds


SNAPSHOT_BUFFERS = ("master", "first_moment", "second_moment")


def gather_snapshots(shapes: Mapping[str, Sequence[int]], snapshots: Sequence[Mapping]) -> dict:
    """One snapshot of the whole weights from the snapshots of the cards that hold slices of them
    (``snapshot_of`` with ``slices`` from ``slice_bounds``): each buffer laid out as a whole
    weights' snapshot (``es.Layout`` of ``shapes``), so a checkpoint does not depend on the cards."""
    layout = es.Layout.of({name: tuple(int(d) for d in shape) for name, shape in shapes.items()})
    out: dict = {key: snapshots[0][key] for key in snapshots[0] if key not in SNAPSHOT_BUFFERS and key != "slices"}
    for key in SNAPSHOT_BUFFERS:
        if key not in snapshots[0]:
            continue
        whole = torch.empty(layout.total, dtype=torch.float32)
        views = {name: view.view(es.matrix_shape(view.shape)) for name, view in layout.split(whole).items()}
        for snapshot in snapshots:
            held = {name: ((r0, r1), (c0, c1)) for name, ((r0, r1), (c0, c1)) in snapshot["slices"].items()}
            sizes = {name: (r1 - r0) * (c1 - c0) for name, ((r0, r1), (c0, c1)) in held.items()}
            card = es.Layout.of({name: (sizes[name],) for name in held})
            for name, values in card.split(snapshot[key].reshape(-1)).items():
                (r0, r1), (c0, c1) = held[name]
                views[name][r0:r1, c0:c1] = values.view(r1 - r0, c1 - c0)
        out[key] = whole
    return out


def cut_snapshot(resident: ResidentWeights, snapshot: Mapping) -> dict:
    """The slices ``resident`` holds of a snapshot of the whole weights (itself where it holds them whole)."""
    if all(part.whole for part in resident.slices.values()):
        return dict(snapshot)
    layout = es.Layout.of(resident.whole_shapes)
    out = {key: value for key, value in snapshot.items() if key not in SNAPSHOT_BUFFERS}
    for key in SNAPSHOT_BUFFERS:
        if key not in snapshot:
            continue
        whole = layout.split(torch.as_tensor(snapshot[key]).reshape(-1))
        out[key] = torch.cat([whole[name].reshape(es.matrix_shape(part.shape))[part.rows, part.cols].reshape(-1)
                              for name, part in ((n, resident.slices[n]) for n in resident.layout.names)])
    return out


def load_snapshot(resident: ResidentWeights, snapshot: Mapping[str, torch.Tensor]) -> None:
    """Set the mean and the optimizer's buffers from ``snapshot_of``'s form, and serve the mean; a
    snapshot without ``step`` is a mean no update has touched yet (the optimizer starts afresh)."""
    resident.load_master(snapshot["master"])
    if "step" not in snapshot:
        resident.optimizer_state = None
    else:
        def flat(name):
            value = snapshot.get(name)
            return es.FlatParams(value.to(resident.device, torch.float32), resident.layout) if value is not None else {}
        resident.optimizer_state = es.OptimizerState(int(snapshot["step"]), resident.master, flat("first_moment"),
                                                     flat("second_moment"))
