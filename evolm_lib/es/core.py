"""Evolution Strategies update math over named parameter tensors (LoRA adapters).

Each population member is an integer seed; its adapter is `mean + sign * sigma * noise(seed)`,
and the noise is regenerated wherever it is needed, so a population costs O(N) ints.

Papers:
- Qiu et al. 2025, "Evolution Strategies at Scale: LLM Fine-Tuning Beyond Reinforcement
  Learning", https://arxiv.org/abs/2509.24372 (update `theta += alpha/N * sum_i z_i eps_i`).
- Salimans et al. 2017, "Evolution Strategies as a Scalable Alternative to Reinforcement
  Learning", https://arxiv.org/abs/1703.03864 (antithetic sampling, centred ranks).

Sign convention, written once: rewards are MAXIMISED and every optimizer here ascends.
(evosax minimises fitness; formulas adapted from it have their sign flipped.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, Iterator, Literal, Mapping, Sequence, Union, get_args

import torch

from ..seeds import derive_seed

Params = Mapping[str, torch.Tensor]  # a dict, or a FlatParams (views of one flat vector)
Shapes = Mapping[str, tuple[int, ...]]
Sigma = Union[float, Mapping[str, float]]
GradientForm = Literal["qiu", "textbook"]


# ----------------------------------------------------------------------------- seeded noise


NoiseScheme = Literal["flat", "per_tensor"]
NOISE_SCHEMES: tuple[str, ...] = ("flat", "per_tensor")
NoiseDevice = Literal["cpu", "cuda"]
NOISE_DEVICE: NoiseDevice = "cpu"
"""Where noise is drawn unless asked otherwise: the CPU stream is the same bits on every machine."""
_BLOCK_ELEMENTS = 1 << 26  # float32 elements of noise drawn at once (256 MiB): bounds memory at any population


def tensor_seed(seed: int, name: str) -> int:
    """Stable 63-bit generator seed for one tensor of one member (blake2b of f"{seed}/{name}")."""
    return derive_seed(seed, name, bits=63)


def flat_seed(seed: int) -> int:
    """Stable 63-bit generator seed of a member's whole flat noise vector ("flat" scheme)."""
    return derive_seed(seed, "flat-noise", bits=63)


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


def check_noise_scheme(scheme: str) -> None:
    """Raise ValueError unless `scheme` is a known noise scheme."""
    if scheme not in NOISE_SCHEMES:
        raise ValueError(f"noise_scheme must be one of {list(NOISE_SCHEMES)}, got {scheme!r}")


def check_noise_device(device: str) -> None:
    """Raise ValueError unless `device` is where noise can be drawn ("cpu" or "cuda")."""
    if device not in get_args(NoiseDevice):
        raise ValueError(f"noise_device must be one of {list(get_args(NoiseDevice))}, got {device!r}")


def population_noise(seeds: Sequence[int], layout: Layout, device: str | torch.device = NOISE_DEVICE,
                     scheme: NoiseScheme = "flat") -> torch.Tensor:
    """Standard-normal noise (len(seeds), layout.total) in float32, one row per seed.

    "flat": one generator per member, seeded by `flat_seed(seed)`, draws the member's whole vector
      at once (tensors in `layout`'s sorted-name order): one kernel per member, whatever the number
      of LoRA tensors (SmolLM2 has 420).
    "per_tensor": one generator per (member, tensor), seeded by `tensor_seed(seed, name)`; a tensor's
      noise does not depend on the other tensors (the scheme of runs made before "flat" existed).
    Same seed, scheme and device type give the same bits. The default CPU stream is the same on every
    machine; CUDA's stream differs from the CPU's (reproducible on GPUs, not across CPU and GPU)."""
    check_noise_scheme(scheme)
    out = torch.empty((len(seeds), layout.total), dtype=torch.float32, device=device)
    for row, seed in zip(out, seeds):
        if scheme == "flat":
            generator = torch.Generator(device=device).manual_seed(flat_seed(int(seed)))
            torch.randn((layout.total,), generator=generator, out=row)
            continue
        for name, view in layout.split(row).items():
            # One generator per tensor, seeded by (seed, name): two same-shaped tensors get different
            # noise (the paper's code reseeds each tensor with the member seed, correlating them).
            generator = torch.Generator(device=device).manual_seed(tensor_seed(int(seed), name))
            view.copy_(torch.randn(view.shape, generator=generator, dtype=torch.float32, device=device))
    return out


def member_noise(seed: int, shapes: Shapes, dtype: torch.dtype = torch.float32, device: str | torch.device = NOISE_DEVICE,
                 scheme: NoiseScheme = "flat") -> Params:
    """Standard-normal noise for every tensor of a member; same seed (and device type) gives the same bits.

    Drawn in float32 so the bits do not depend on the target dtype (see `population_noise`)."""
    layout = Layout.of(shapes)
    noise = layout.split(population_noise([seed], layout, device, scheme)[0])
    return {name: noise[name].to(dtype) for name in shapes}


def shapes_of(params: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """The `shapes` mapping of a set of parameters."""
    return {name: tuple(tensor.shape) for name, tensor in params.items()}


# ----------------------------------------------------------------------------- population


@dataclass(frozen=True)
class Member:
    """One population member: a noise seed and the sign (+1 or -1) it is applied with."""

    seed: int
    """Seed of the member's noise (see `member_noise`)."""
    sign: int = 1
    """+1 or -1; antithetic pairs share a seed and differ in sign."""

    def __post_init__(self) -> None:
        if self.sign not in (1, -1):
            raise ValueError(f"sign must be +1 or -1, got {self.sign!r}")


def check_population_size(population_size: int, antithetic: bool) -> None:
    """Raise ValueError unless a population of this size can be drawn (antithetic: in +/- pairs, so even)."""
    if population_size < 1:
        raise ValueError(f"population_size must be >= 1, got {population_size}")
    if antithetic and population_size % 2:
        raise ValueError(f"population_size must be even with antithetic sampling (+/- pairs), got {population_size}; "
                         "use an even population or antithetic: false")


def population(
    base_seed: int, generation: int, population_size: int, antithetic: bool = True
) -> list[Member]:
    """Members of one generation, seeds derived from (base_seed, generation, index)."""
    check_population_size(population_size, antithetic)

    def seed_of(index: int) -> int:
        # 31 bits: fits any int32 consumer (vLLM request seeds, numpy, logging as int).
        return derive_seed(base_seed, generation, index)

    if antithetic:
        # Adjacent (s, +1), (s, -1): an evaluator that batches neighbours sees both halves of a pair.
        return [Member(seed_of(pair), sign) for pair in range(population_size // 2) for sign in (1, -1)]
    return [Member(seed_of(index), 1) for index in range(population_size)]


# ----------------------------------------------------------------------------- perturbation


def check_sigma(sigma: Sigma, names: Sequence[str] | None = None) -> None:
    """Raise ValueError unless sigma (scalar or per tensor) is positive and covers `names`."""
    if isinstance(sigma, Mapping):
        for name, value in sigma.items():
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"sigma[{name!r}] must be > 0 and finite, got {value}")
        missing = [name for name in (names or ()) if name not in sigma]
        if missing:
            raise ValueError(f"sigma has no entry for tensors {missing}")
    elif not (sigma > 0 and math.isfinite(sigma)):
        raise ValueError(f"sigma must be > 0 and finite, got {sigma}")


def sigma_of(sigma: Sigma, name: str) -> float:
    """Noise scale of one tensor."""
    return float(sigma[name]) if isinstance(sigma, Mapping) else float(sigma)


def perturb(mean: Params, member: Member, sigma: Sigma, noise_device: str = NOISE_DEVICE,
            scheme: NoiseScheme = "flat") -> Params:
    """A member's parameters: mean + sign * sigma_t * noise, in the mean's dtype and device."""
    check_sigma(sigma, list(mean))
    noise = member_noise(member.seed, shapes_of(mean), device=noise_device, scheme=scheme)
    perturbed: Params = {}
    for name, tensor in mean.items():
        step = (member.sign * sigma_of(sigma, name)) * noise[name].to(tensor.device)
        # Add in float32: sigma ~1e-3 noise partly rounds away if added in bfloat16.
        perturbed[name] = (tensor.float() + step).to(tensor.dtype)
    return perturbed


# ----------------------------------------------------------------------------- fitness shaping


def raw(rewards: torch.Tensor) -> torch.Tensor:
    """Rewards unchanged, as float32 (population,)."""
    return torch.as_tensor(rewards).to(torch.float32).clone()


def z_score(rewards: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(r - mean) / (std + eps) with the population std (unbiased=False), as in Qiu et al."""
    r = torch.as_tensor(rewards).to(torch.float32)  # (population,)
    centred = r - r.mean()
    # all-equal rewards: std is 0 and centred is 0, so zeros (zero update), not NaN
    return centred / (centred.pow(2).mean().sqrt() + eps)


def centered_ranks(rewards: torch.Tensor | Sequence[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Ranks scaled to [-0.5, 0.5] (Salimans et al. 2017); ties share their average rank. ``dtype``:
    the precision the values are compared in (float64 keeps close values of a large f apart)."""
    r = torch.as_tensor(rewards, dtype=dtype)  # (population,)
    n = r.numel()
    if n < 2:
        return torch.zeros_like(r)  # one member carries no ordering information
    ordered = torch.sort(r).values
    below = torch.searchsorted(ordered, r, right=False)  # members strictly worse
    at_or_below = torch.searchsorted(ordered, r, right=True)
    rank = (below + at_or_below - 1).to(dtype) / 2  # average 0-based rank over the tie
    return rank / (n - 1) - 0.5


def per_prompt_centering(rewards_matrix: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Centre each prompt over members, divide by the global std, then average over prompts."""
    matrix = torch.as_tensor(rewards_matrix).to(torch.float32)  # (population, prompts)
    if matrix.ndim != 2:
        raise ValueError(f"rewards_matrix must be (population, prompts), got shape {tuple(matrix.shape)}")
    # Removing each prompt's mean removes its difficulty, so easy prompts do not drown hard ones.
    centred = matrix - matrix.mean(dim=0, keepdim=True)
    # all-equal rewards: zeros, not NaN
    scaled = centred / (centred.pow(2).mean().sqrt() + eps)
    return scaled.mean(dim=1)  # (population,)


SHAPING: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "z_score": z_score,
    "centered_ranks": centered_ranks,
    "raw": raw,
    "per_prompt": per_prompt_centering,
}
_MATRIX_SHAPERS = frozenset({"per_prompt"})  # these take (population, prompts), not (population,)


def shape_fitness(name: str, rewards_matrix: torch.Tensor) -> torch.Tensor:
    """Fitness weights (population,) from rewards (population, prompts) by the shaper `name`."""
    if name not in SHAPING:
        raise ValueError(f"fitness shaping {name!r} is unknown; choose from {sorted(SHAPING)}")
    matrix = torch.as_tensor(rewards_matrix).to(torch.float32)
    if matrix.ndim == 1:
        matrix = matrix[:, None]  # one reward per member = one prompt
    if matrix.ndim != 2:
        raise ValueError(f"rewards_matrix must be (population, prompts), got shape {tuple(matrix.shape)}")
    if not torch.isfinite(matrix).all():
        # one NaN reward would turn the whole update into NaN
        raise ValueError("rewards_matrix contains non-finite values")
    if name in _MATRIX_SHAPERS:
        return SHAPING[name](matrix)
    return SHAPING[name](matrix.mean(dim=1))


# ----------------------------------------------------------------------------- gradient


def es_gradient(
    members: Sequence[Member],
    weights: torch.Tensor | Sequence[float],
    shapes: Shapes,
    sigma: Sigma,
    form: GradientForm = "qiu",
    noise_device: str = NOISE_DEVICE,
    scheme: NoiseScheme = "flat",
) -> Params:
    """ES ascent direction from members and fitness weights, regenerating each member's noise."""
    # "qiu": g = 1/N sum_i w_i sign_i eps_i, exactly Qiu et al. 2025 (theta += alpha/N sum z_i eps_i,
    #   sigma folded into the learning rate alpha).
    # "textbook": g = 1/(N sigma_t) sum_i w_i sign_i eps_i, an unbiased estimate of the gradient of
    #   the Gaussian-smoothed objective when w are raw rewards.
    # eps is standard normal in both (the perturbation was sigma_t * eps), also with per-tensor sigma.
    coefficient = member_coefficients(members, weights, form, sigma, list(shapes))
    n = len(members)
    scale = {name: n * sigma_of(sigma, name) if form == "textbook" else n for name in shapes}
    return seeded_combination(coefficient, shapes, scale, noise_device, scheme)


def member_coefficients(members: Sequence[Member], weights: torch.Tensor | Sequence[float], form: GradientForm,
                        sigma: Sigma, names: Sequence[str]) -> dict[int, float]:
    """seed -> sum of sign * weight over the members drawn from it, after checking the gradient's
    inputs: members sharing a seed (an antithetic pair) share their noise, drawn once with the
    combined coefficient w+ - w-."""
    if form not in ("qiu", "textbook"):
        raise ValueError(f"form must be 'qiu' or 'textbook', got {form!r}")
    check_sigma(sigma, list(names))
    w = torch.as_tensor(weights, dtype=torch.float64).reshape(-1)  # (population,)
    if len(members) == 0:
        raise ValueError("members must not be empty")
    if w.numel() != len(members):
        raise ValueError(f"weights has {w.numel()} entries but members has {len(members)}")
    coefficient: dict[int, float] = {}
    for member, weight in zip(members, w.tolist()):
        coefficient[member.seed] = coefficient.get(member.seed, 0.0) + member.sign * weight
    return coefficient


def seeded_combination(coefficient: Mapping[int, float], shapes: Shapes, divisor: Mapping[str, float],
                       noise_device: str = NOISE_DEVICE, scheme: NoiseScheme = "flat") -> Params:
    """sum_s coefficient[s] * noise(s) / divisor[name], per tensor, in float32 on `noise_device`
    (a FlatParams).

    The members' noise is drawn in blocks (bounded memory) and accumulated seed by seed in a fixed
    order, so the result is the same bits on every call (a resumed run stays bit-exact)."""
    layout = Layout.of(shapes)
    flat = torch.zeros(layout.total, dtype=torch.float32, device=noise_device)
    seeds = [seed for seed, c in coefficient.items() if c != 0.0]  # 0: e.g. a pair with equal rewards
    block = layout.block_size()
    for start in range(0, len(seeds), block):
        chunk = seeds[start:start + block]
        for seed, row in zip(chunk, population_noise(chunk, layout, noise_device, scheme)):
            if scheme == "flat":
                flat.add_(row, alpha=coefficient[seed])  # float32 accumulation into a fresh buffer
                continue
            # per_tensor: tensor by tensor, the very kernels runs made before "flat" used (a
            # vectorised add rounds a tensor's tail differently when the whole vector is one tensor)
            for total, part in zip(layout.split(flat).values(), layout.split(row).values()):
                total.add_(part, alpha=coefficient[seed])
    if scheme == "flat":  # one division for the whole vector (one value per tensor, repeated)
        values = [float(divisor[name]) for name in layout.names]
        if len(set(values)) == 1:
            flat.div_(values[0])
        else:
            flat.div_(layout.repeat(values, flat.device))
    else:
        for name, view in layout.split(flat).items():
            view.div_(divisor[name])
    return FlatParams(flat, layout)


# ----------------------------------------------------------------------------- optimizers


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


def apply_update(
    config: OptimizerConfig, state: OptimizerState, params: Params, gradient: Params
) -> tuple[Params, OptimizerState]:
    """One ascent step: new params (in the params' dtypes and devices) and the advanced state.

    The math runs on flat vectors (`FlatParams`), a dozen kernels whatever the number of tensors;
    the state it returns is flat, and so are the params when they all share one dtype and device."""
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
    theta = flat_of(master, layout).to(torch.float32)
    g = flat_of(gradient, layout).detach().to(device=theta.device, dtype=torch.float32)
    step = state.step + 1
    keeps_first, keeps_second = _kept_moments(config)
    direction, first, second = _direction(config, g, _moment(state.first_moment, keeps_first, layout, theta),
                                          _moment(state.second_moment, keeps_second, layout, theta), step)
    new_master = FlatParams(_stepped(config, theta, direction), layout)
    first = FlatParams(first, layout) if first is not None else {}
    second = FlatParams(second, layout) if second is not None else {}

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
    new_state = replace(state, step=step, master=new_master, first_moment=first, second_moment=second)
    return new_params, new_state


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


def _direction(config: OptimizerConfig, g: torch.Tensor, first: torch.Tensor | None, second: torch.Tensor | None,
               step: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(ascent direction, new first moment, new second moment) from the gradient and the old moments,
    elementwise on flat float32 vectors (None: a moment the optimizer keeps no buffer for)."""
    # Per element the arithmetic is the textbook formula, in order (no fused multiply-adds).
    if isinstance(config, AdamConfig):
        m = first * config.beta1 + g * (1 - config.beta1)
        v = second * config.beta2 + (g * (1 - config.beta2)) * g
        m_hat = m / (1 - config.beta1**step)
        v_hat = v / (1 - config.beta2**step)
        return m_hat / (v_hat.sqrt() + config.eps), m, v
    if isinstance(config, SGDConfig):
        if config.momentum > 0:
            direction = first * config.momentum + g
            return direction, direction, None
        return g, None, None
    raise TypeError(f"unknown optimizer config {type(config).__name__}")


def _stepped(config: OptimizerConfig, theta: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """The new master, elementwise: '+' is ascent (rewards are maximised). Decay is decoupled and uses
    the pre-step theta (without decay, x - theta * 0 is x: skipping it gives the same bits and saves
    two passes over the vector)."""
    lr = config.learning_rate
    stepped = theta + direction * lr
    return stepped - theta * (lr * config.weight_decay) if config.weight_decay else stepped


IN_PLACE_CHUNK = 1 << 24
"""Values ``apply_update_in_place`` updates at once: its temporaries are a few chunks (64 MB each in
float32), not copies of a master of billions of weights, and a chunk's launches stay few."""


@torch.no_grad()
def apply_update_in_place(config: OptimizerConfig, state: OptimizerState, gradient: torch.Tensor,
                          chunk: int = IN_PLACE_CHUNK) -> tuple[OptimizerState, float]:
    """``apply_update`` on a flat float32 state, written into its own buffers chunk by chunk, with the
    same bits; returns the advanced state (the same master object, changed) and the L2 norm of the
    master's change, the float32 differences summed in float64.

    For a master of billions of weights on an engine's card, beside which ``apply_update``'s
    full-size temporaries (a new master, the difference, its float64 copy for the norm: four times the
    master's memory) may not fit; alone it is no faster (docs/measurements.md). The elementwise maths is the same functions' (``_direction``, ``_stepped``); only
    the norm's summation order differs from the norm of a whole-vector difference."""
    master = state.master
    if not isinstance(master, FlatParams) or master.flat.dtype != torch.float32:
        raise TypeError("apply_update_in_place needs a float32 FlatParams master (init_optimizer_state makes one)")
    theta = master.flat
    g = gradient.detach().reshape(-1)
    if g.numel() != theta.numel():
        raise ValueError(f"a gradient of {theta.numel()} values is needed, got {g.numel()}")
    g = g.to(device=theta.device, dtype=torch.float32)
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")

    # the moments are updated in their own buffers where the state holds them flat in float32
    keeps_first, keeps_second = _kept_moments(config)
    first = _moment(state.first_moment, keeps_first, master.layout, theta, torch.float32)
    second = _moment(state.second_moment, keeps_second, master.layout, theta, torch.float32)
    step = state.step + 1
    norms = []
    # a master made under inference mode (an engine's worker) may only be written in place under it
    with torch.inference_mode(theta.is_inference()):
        for start in range(0, theta.numel(), chunk):
            part = slice(start, start + chunk)
            old = theta[part]
            direction, m, v = _direction(config, g[part], first[part] if first is not None else None,
                                         second[part] if second is not None else None, step)
            new = _stepped(config, old, direction)
            norms.append(torch.linalg.vector_norm(new.sub(old), dtype=torch.float64))
            old.copy_(new)
            if m is not None:
                first[part].copy_(m)
            if v is not None:
                second[part].copy_(v)
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
