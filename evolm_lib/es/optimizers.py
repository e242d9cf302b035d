"""SGD and Adam as ascent steps on a float32 master of the parameters, with their state and its
checkpoint form. Rewards are maximised: every step here ascends (evosax minimises; its formulas
have their sign flipped here). The arithmetic is torch.optim's functional SGD and Adam, run on
chunks of the flat master and its moment buffers (``_step``), or with ``formulas`` the formulas term
by term (``formulas_step``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Union

import torch
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from .layout import FlatParams, Layout, Params, flat_of, layout_of


def _check_common(learning_rate: float, weight_decay: float) -> None:
    """Raise ValueError on a non-positive learning rate or negative weight decay."""
    if not (learning_rate > 0 and math.isfinite(learning_rate)):
        raise ValueError(f"learning_rate must be > 0 and finite, got {learning_rate}")
    if not (weight_decay >= 0 and math.isfinite(weight_decay)):
        raise ValueError(f"weight_decay must be >= 0 and finite, got {weight_decay}")


@dataclass(frozen=True)
class SGDConfig:
    """SGD ascent with optional heavy-ball momentum and decoupled weight decay."""

    learning_rate: float
    """Step size multiplying the ES gradient."""
    momentum: float = 0.0
    """Heavy-ball coefficient in [0, 1); 0 disables the buffer."""
    weight_decay: float = 0.0
    """Decoupled decay: theta -= learning_rate * weight_decay * theta (equals L2 without momentum)."""
    formulas: bool = False
    """Step by the formulas term by term (``formulas_step``) instead of torch.optim's kernels."""

    def __post_init__(self) -> None:
        _check_common(self.learning_rate, self.weight_decay)
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")


@dataclass(frozen=True)
class AdamConfig:
    """Adam ascent with bias correction and decoupled (AdamW-style) weight decay."""

    learning_rate: float
    """Step size of the normalised update."""
    beta1: float = 0.9
    """Decay of the first-moment average, in [0, 1)."""
    beta2: float = 0.999
    """Decay of the second-moment average, in [0, 1)."""
    eps: float = 1e-8
    """Added to sqrt(v_hat) so coordinates with no signal do not divide by zero."""
    weight_decay: float = 0.0
    """Decoupled decay: theta -= learning_rate * weight_decay * theta."""
    formulas: bool = False
    """Step by the formulas term by term (``formulas_step``) instead of torch.optim's kernels."""

    def __post_init__(self) -> None:
        _check_common(self.learning_rate, self.weight_decay)
        for field_name in ("beta1", "beta2"):
            value = getattr(self, field_name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{field_name} must be in [0, 1), got {value}")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"eps must be > 0 and finite, got {self.eps}")


OptimizerConfig = Union[SGDConfig, AdamConfig]


@dataclass(frozen=True)
class OptimizerState:
    """Optimizer state: step count, float32 master parameters and moment buffers."""

    step: int
    """Updates applied so far."""
    master: Params
    """float32 copy of the parameters; the source of truth between steps."""
    first_moment: Params = field(default_factory=dict)
    """Adam m, or the SGD momentum buffer (empty for plain SGD)."""
    second_moment: Params = field(default_factory=dict)
    """Adam v (empty for SGD)."""


def _float32_copy(params: Mapping[str, torch.Tensor]) -> FlatParams:
    """A detached float32 copy, laid out flat (never an alias of the inputs)."""
    layout = layout_of(params)
    return FlatParams(flat_of(params, layout).detach().to(torch.float32, copy=True), layout)


def init_optimizer_state(config: OptimizerConfig, params: Params, copy: bool = True) -> OptimizerState:
    """Fresh state for `params`: step 0, a float32 master copy and zero moments (all laid out flat).
    ``copy=False`` adopts `params` as the master when it already is a float32 FlatParams (no second
    full-size copy: a model's own weights keep theirs beside the engine)."""
    adopt = not copy and isinstance(params, FlatParams) and params.flat.dtype == torch.float32
    master = params if adopt else _float32_copy(params)

    def zeros() -> FlatParams:
        return FlatParams(torch.zeros_like(master.flat), master.layout)

    if isinstance(config, AdamConfig):
        return OptimizerState(step=0, master=master, first_moment=zeros(), second_moment=zeros())
    if isinstance(config, SGDConfig):
        return OptimizerState(step=0, master=master, first_moment=zeros() if config.momentum > 0 else {})
    raise TypeError(f"unknown optimizer config {type(config).__name__}")


@torch.no_grad()
def apply_update(
    config: OptimizerConfig, state: OptimizerState, params: Params, gradient: Params
) -> tuple[Params, OptimizerState]:
    """One ascent step: new params (in the params' dtypes and devices) and the advanced state.

    The math runs on flat vectors (`FlatParams`): ``apply_update_in_place``'s steps on fresh copies of
    the master and the moments (the same bits; the state given is left as it was). The state it
    returns is flat, and so are the params when they all share one dtype and device."""
    # All math runs on the float32 master copy in `state`, the source of truth between steps: an
    # update of ~1e-5 on a weight of ~1 vanishes when added in bfloat16 (8 mantissa bits), but
    # accumulates in the master copy until it shows. `params` supplies names, dtypes and devices.
    if set(gradient) != set(params):
        raise ValueError(f"gradient and params name different tensors: {sorted(set(gradient) ^ set(params))}")
    # An empty master (e.g. restored from a checkpoint without one) falls back to params.
    master = state.master if state.master else _float32_copy(params)
    if set(master) != set(params):
        raise ValueError(f"state and params name different tensors: {sorted(set(master) ^ set(params))}")
    layout = layout_of(master)
    theta = _fresh(flat_of(master, layout), master, torch.float32)
    g = flat_of(gradient, layout).detach().to(device=theta.device, dtype=torch.float32)
    keeps_first, keeps_second = _kept_moments(config)
    first = _moment(state.first_moment, keeps_first, layout, theta)
    second = _moment(state.second_moment, keeps_second, layout, theta)
    first = None if first is None else _fresh(first, state.first_moment, torch.float32)
    second = None if second is None else _fresh(second, state.second_moment, torch.float32)
    _step_in_chunks(config, state.step + 1, theta, first, second, 0, g, IN_PLACE_CHUNK, None)
    new_master = FlatParams(theta, layout)

    if isinstance(params, FlatParams) and params.layout == layout:
        new_params: Params = new_master.to(params.flat.device, params.flat.dtype)
    else:
        kinds = {(tensor.device, tensor.dtype) for tensor in params.values()}
        if len(kinds) == 1:
            (device, dtype), = kinds
            new_params = new_master.to(device, dtype)
        else:
            new_params = {name: new_master[name].to(device=tensor.device, dtype=tensor.dtype)
                          for name, tensor in params.items()}
    new_state = replace(state, step=state.step + 1, master=new_master,
                        first_moment=FlatParams(first, layout) if first is not None else {},
                        second_moment=FlatParams(second, layout) if second is not None else {})
    return new_params, new_state


def _fresh(flat: torch.Tensor, source: Params, dtype: torch.dtype) -> torch.Tensor:
    """``flat`` in ``dtype`` as a tensor of its own: copied where it is ``source``'s own storage."""
    owned = isinstance(source, FlatParams) and flat is source.flat
    return flat.to(dtype, copy=owned)


def _kept_moments(config: OptimizerConfig) -> tuple[bool, bool]:
    """Whether the optimizer keeps a first and a second moment buffer."""
    if isinstance(config, AdamConfig):
        return True, True
    if isinstance(config, SGDConfig):
        return config.momentum > 0, False
    raise TypeError(f"unknown optimizer config {type(config).__name__}")


def _moment(buffers: Params, kept: bool, layout: Layout, theta: torch.Tensor,
            dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """A moment buffer the optimizer keeps, flat on theta's device (the buffer itself when it already
    is, in ``dtype``); a missing one (state made for another config, or restored without it) starts
    at 0. None where the optimizer keeps none."""
    if not kept:
        return None
    return flat_of(buffers, layout).to(theta.device, dtype) if buffers else torch.zeros_like(theta)


def formulas_step(config: OptimizerConfig, step: int, theta: torch.Tensor, g: torch.Tensor,
                  first: torch.Tensor | None, second: torch.Tensor | None):
    """(new master, new first moment, new second moment) by the textbook formulas, term by term in
    order (no fused multiply-adds), into new tensors; '+' ascends. The step of runs made before
    torch.optim's (``formulas``: their folders resume to the same rows) and the benchmark's reference."""
    lr = config.learning_rate
    if isinstance(config, AdamConfig):
        m = first * config.beta1 + g * (1 - config.beta1)
        v = second * config.beta2 + (g * (1 - config.beta2)) * g
        direction = (m / (1 - config.beta1**step)) / ((v / (1 - config.beta2**step)).sqrt() + config.eps)
    elif config.momentum > 0:
        m = direction = first * config.momentum + g
        v = None
    else:
        direction, m, v = g, None, None
    stepped = theta + direction * lr
    return (stepped - theta * (lr * config.weight_decay) if config.weight_decay else stepped), m, v


def _step(config: OptimizerConfig, step: int, theta: torch.Tensor, g: torch.Tensor, first: torch.Tensor | None,
          second: torch.Tensor | None) -> None:
    """Step number ``step`` (1 for the first) of torch.optim's functional SGD or Adam, in place on
    these float32 slices of the master, the gradient and the moments.

    torch.optim descends. It is handed the ascent gradient and the negated learning rate: that
    ascends, and its moment buffers stay averages of the ascent gradient, the form checkpoints keep
    (``maximize=True`` would store them negated, and outside the fused kernels negate a copy of the
    gradient first). Decoupled weight decay scales the pre-step master first, as torch.optim.AdamW
    does. Every element gets the same arithmetic wherever a slice starts or ends: fused kernels on a
    CUDA card (the faster there), foreach ones elsewhere (on a CPU the fused kernels' vectorised
    body and scalar tail round differently). ``python -m evolm_lib.benchmark optimizer`` measures
    both, and their bits."""
    if config.formulas:
        for buffer, value in zip((theta, first, second), formulas_step(config, step, theta, g, first, second)):
            if value is not None:
                buffer.copy_(value)
        return
    fused = theta.device.type == "cuda"
    if config.weight_decay:
        theta.mul_(1 - config.learning_rate * config.weight_decay)
    if isinstance(config, AdamConfig):
        # torch counts the step up before using it; fused kernels read it on the card (filled there:
        # no copy from the host per chunk)
        steps = [torch.full((), step - 1, dtype=torch.float32, device=theta.device if fused else "cpu")]
        adam([theta], [g], [first], [second], [], steps, amsgrad=False, beta1=config.beta1, beta2=config.beta2,
             lr=-config.learning_rate, weight_decay=0.0, eps=config.eps, maximize=False,
             foreach=not fused, fused=fused)
    elif isinstance(config, SGDConfig):
        sgd([theta], [g], [first], weight_decay=0.0, momentum=config.momentum, lr=-config.learning_rate,
            dampening=0.0, nesterov=False, maximize=False, foreach=not fused, fused=fused)
    else:
        raise TypeError(f"unknown optimizer config {type(config).__name__}")


def _step_in_chunks(config: OptimizerConfig, step: int, theta: torch.Tensor, first: torch.Tensor | None,
                    second: torch.Tensor | None, offset: int, g: torch.Tensor, chunk: int,
                    norms: list | None) -> None:
    """``_step`` over ``theta[offset:offset + len(g)]`` and its moments, ``chunk`` values at a time;
    ``norms`` (a list, or None) gets each chunk's L2 norm of the master's change, float32 differences
    summed in float64, from the chunk's old values kept aside in one buffer of a chunk."""
    old = torch.empty(min(chunk, g.numel()) if norms is not None else 0, dtype=torch.float32, device=theta.device)
    for start in range(0, g.numel(), chunk):
        part = slice(offset + start, offset + min(start + chunk, g.numel()))
        kept = old[:part.stop - part.start]
        if norms is not None:
            kept.copy_(theta[part])
        _step(config, step, theta[part], g[start:start + chunk], first[part] if first is not None else None,
              second[part] if second is not None else None)
        if norms is not None:  # old - new has the norm of new - old
            norms.append(torch.linalg.vector_norm(kept.sub_(theta[part]), dtype=torch.float64))


IN_PLACE_CHUNK = 1 << 24
"""Values an update steps at once: its temporaries are a few chunks (64 MB each in float32), not
copies of a master of billions of weights, and a chunk's launches stay few."""


@torch.no_grad()
def apply_update_in_place(config: OptimizerConfig, state: OptimizerState, gradient: torch.Tensor,
                          chunk: int = IN_PLACE_CHUNK) -> tuple[OptimizerState, float]:
    """``apply_update`` on a flat float32 state, written into its own buffers chunk by chunk, with the
    same bits; returns the advanced state (the same master object, changed) and the L2 norm of the
    master's change, the float32 differences summed in float64.

    For a master of billions of weights on an engine's card, beside which ``apply_update``'s copies
    of the master and moments may not fit (docs/measurements.md has both timed)."""
    theta = _flat_master(state).flat
    g = gradient.detach().reshape(-1)
    if g.numel() != theta.numel():
        raise ValueError(f"a gradient of {theta.numel()} values is needed, got {g.numel()}")
    g = g.to(device=theta.device, dtype=torch.float32)
    return apply_update_in_parts(config, state, [(slice(0, g.numel()), g)], chunk)


def _flat_master(state: OptimizerState) -> FlatParams:
    """The state's master, which an in-place update needs as one float32 vector."""
    master = state.master
    if not isinstance(master, FlatParams) or master.flat.dtype != torch.float32:
        raise TypeError("an in-place update needs a float32 FlatParams master (init_optimizer_state makes one)")
    return master


@torch.no_grad()
def apply_update_in_parts(config: OptimizerConfig, state: OptimizerState,
                          parts: Iterable[tuple[slice, torch.Tensor]],
                          chunk: int = IN_PLACE_CHUNK, part_norms: list | None = None) -> tuple[OptimizerState, float]:
    """``apply_update_in_place`` with the gradient given part by part: ``(where, values)`` pairs
    that together cover the flat master once, each part made only when it is reached (a weight's
    gradient regenerated from the members' seeds, so no gradient of every weight exists at once).
    Each part is applied in chunks of ``chunk`` values; every element gets the same arithmetic, so
    the master and buffers get the same bits however the gradient is cut. ``part_norms``, a list,
    gets the L2 norm of each part's change."""
    master = _flat_master(state)
    theta = master.flat
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")

    # the moments are updated in their own buffers where the state holds them flat in float32
    keeps_first, keeps_second = _kept_moments(config)
    first = _moment(state.first_moment, keeps_first, master.layout, theta, torch.float32)
    second = _moment(state.second_moment, keeps_second, master.layout, theta, torch.float32)
    step = state.step + 1
    norms, covered = [], 0
    # a master made under inference mode (an engine's worker) may only be written in place under it
    with torch.inference_mode(theta.is_inference()):
        for where, values in parts:
            values = values.detach().reshape(-1).to(device=theta.device, dtype=torch.float32)
            if where.stop - where.start != values.numel():
                raise ValueError(f"a gradient part for {where} has {values.numel()} values")
            covered += values.numel()
            first_chunk = len(norms)
            _step_in_chunks(config, step, theta, first, second, where.start, values, chunk, norms)
            if part_norms is not None:
                part_norms.append(float(torch.linalg.vector_norm(torch.stack(norms[first_chunk:]))) if values.numel() else 0.0)
    if covered != theta.numel():
        raise ValueError(f"the gradient's parts cover {covered} of the master's {theta.numel()} values")
    norm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
    advanced = replace(state, step=step, master=master,
                       first_moment=FlatParams(first, master.layout) if first is not None else {},
                       second_moment=FlatParams(second, master.layout) if second is not None else {})
    return advanced, norm


def optimizer_state_to(state: OptimizerState, device: str | torch.device) -> OptimizerState:
    """The same state with every buffer on `device`."""
    def moved(buffers: Params) -> Params:
        if isinstance(buffers, FlatParams):
            return buffers.to(device)
        return {name: tensor.to(device) for name, tensor in buffers.items()}

    return replace(state, master=moved(state.master), first_moment=moved(state.first_moment),
                   second_moment=moved(state.second_moment))


_STATE_PREFIXES = {"master": "master", "m": "first_moment", "v": "second_moment"}


def optimizer_state_to_tensors(state: OptimizerState) -> dict[str, torch.Tensor]:
    """Flat tensors for a safetensors file: "step", "master/<name>", "m/<name>", "v/<name>"."""
    # int64 with one element: safetensors stores it exactly and every reader handles 1-D.
    tensors: dict[str, torch.Tensor] = {"step": torch.tensor([state.step], dtype=torch.int64)}
    for prefix, attribute in _STATE_PREFIXES.items():
        buffers = getattr(state, attribute)
        if isinstance(buffers, FlatParams):  # one device-to-host copy, not one per tensor
            buffers = buffers.to("cpu", torch.float32)
        for name, tensor in buffers.items():
            # contiguous CPU clones: safetensors refuses shared or strided storage
            tensors[f"{prefix}/{name}"] = tensor.detach().to("cpu", torch.float32).contiguous().clone()
    return tensors


def optimizer_state_from_tensors(config: OptimizerConfig, tensors: Mapping[str, torch.Tensor]) -> OptimizerState:
    """Inverse of `optimizer_state_to_tensors`, checking the buffers `config` needs are present."""
    if "step" not in tensors:
        raise ValueError("optimizer tensors have no 'step' entry")
    step_tensor = tensors["step"]
    if step_tensor.numel() != 1:
        raise ValueError(f"'step' must hold one value, got shape {tuple(step_tensor.shape)}")
    groups: dict[str, Params] = {attribute: {} for attribute in _STATE_PREFIXES.values()}
    for key, tensor in tensors.items():
        if key == "step":
            continue
        prefix, sep, name = key.partition("/")
        if not sep or prefix not in _STATE_PREFIXES:
            raise ValueError(f"unexpected optimizer tensor {key!r}")
        groups[_STATE_PREFIXES[prefix]][name] = tensor.detach().to(torch.float32, copy=True)

    names = set(groups["master"]) or set(groups["first_moment"])
    needs_first = isinstance(config, AdamConfig) or (isinstance(config, SGDConfig) and config.momentum > 0)
    needs_second = isinstance(config, AdamConfig)
    for attribute, needed in (("first_moment", needs_first), ("second_moment", needs_second)):
        if needed and set(groups[attribute]) != names:
            raise ValueError(f"{attribute} buffers do not match the master tensors for {type(config).__name__}")
    return OptimizerState(step=int(step_tensor.reshape(-1)[0]), **groups)
