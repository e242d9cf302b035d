"""LoRA adapters as named float32 tensors: shapes from a model folder, initialisation, noise scales,
and save/load in PEFT format (adapter_config.json + adapter_model.safetensors), which vLLM and peft load.

Names follow PEFT: ``base_model.model.<module path>.lora_A.weight`` with A of shape (rank, in_features)
and B of shape (out_features, rank); the adapter adds ``(alpha / rank) * B @ A`` to the module's weight.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .es import FlatParams, tensor_seed

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INIT_SCHEMES = ("peft_default", "random_ab")
NOISE_MODES = ("uniform", "per_layer")
_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class LoraSpec:
    """Which modules carry an adapter, and its rank and alpha."""

    target_modules: tuple[str, ...] = ALL_PROJECTIONS
    rank: int = 1
    alpha: float = 1.0
    layers_to_transform: tuple[int, ...] | None = None  # None: every layer

    def __post_init__(self) -> None:
        if not self.target_modules:
            raise ValueError("lora.target_modules must name at least one module")
        if self.rank < 1:
            raise ValueError(f"lora.rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha must be > 0, got {self.alpha}")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.layers_to_transform is not None:
            object.__setattr__(self, "layers_to_transform", tuple(int(i) for i in self.layers_to_transform))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def peft_config(self, base_model: str = "") -> dict:
        """The adapter_config.json that peft and vLLM read."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": 0.0,
            "target_modules": list(self.target_modules),
            "layers_to_transform": list(self.layers_to_transform) if self.layers_to_transform is not None else None,
            "layers_pattern": None,
            "bias": "none",
            "fan_in_fan_out": False,
            "modules_to_save": None,
            "use_rslora": False,
            "use_dora": False,
            "inference_mode": True,
            "rank_pattern": {},
            "alpha_pattern": {},
        }


@dataclass(frozen=True)
class AdapterWeights:
    """A LoRA adapter: its spec and its tensors (float32, PEFT names)."""

    spec: LoraSpec
    tensors: Mapping[str, torch.Tensor] = field(repr=False)

    def num_parameters(self) -> int:
        return sum(t.numel() for t in self.tensors.values())

    def to(self, device: str | torch.device) -> "AdapterWeights":
        """The same adapter with its tensors on `device` (itself when they are all there already)."""
        device = torch.device(device)
        if isinstance(self.tensors, FlatParams):  # one copy of the flat vector, not one per tensor
            moved = self.tensors.to(device)
            return self if moved is self.tensors else AdapterWeights(self.spec, moved)
        if all(t.device.type == device.type for t in self.tensors.values()):
            return self
        return AdapterWeights(self.spec, {name: t.to(device) for name, t in self.tensors.items()})


def _weight_files(model_dir: Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def base_weight_shapes(model_dir: str | Path, matrices_only: bool = True) -> dict[str, tuple[int, ...]]:
    """Every 2-D weight of a model folder (every tensor with ``matrices_only=False``), by name, read
    from the safetensors headers only."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in _weight_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                shape = tuple(handle.get_slice(key).get_shape())
                if len(shape) == 2 or not matrices_only:
                    shapes[key] = shape
    return shapes


def read_base_weights(model_dir: str | Path, names) -> dict[str, torch.Tensor]:
    """The named tensors of a model folder's safetensors files (the names it lacks are left out)."""
    wanted, out = set(names), {}
    for path in _weight_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                if key in wanted:
                    out[key] = handle.get_tensor(key)
    return out


def target_weight_shapes(model_dir: str | Path, spec: LoraSpec) -> dict[str, tuple[int, int]]:
    """Base weight name -> (out, in) for every module the spec targets, validated against the model
    (what an adapter adapts, and what full-parameter or EGGROLL ES perturbs)."""
    shapes = base_weight_shapes(model_dir)
    layers = sorted({int(m.group(1)) for k in shapes if (m := _LAYER.search(k))})
    available = sorted({k.rsplit(".", 2)[-2] for k in shapes if _LAYER.search(k) and k.endswith(".weight")})
    missing = [t for t in spec.target_modules if t not in available]
    if missing:
        raise ValueError(
            f"lora.target_modules {missing} not found in the model at {model_dir}; it has: {', '.join(available)}"
        )
    if spec.layers_to_transform is not None:
        bad = [i for i in spec.layers_to_transform if i not in layers]
        if bad:
            raise ValueError(f"lora.layers_to_transform {bad} out of range: the model has layers 0..{layers[-1]}")
    chosen = set(spec.layers_to_transform) if spec.layers_to_transform is not None else set(layers)
    out = {}
    for key, shape in shapes.items():
        match = _LAYER.search(key)
        if not match or int(match.group(1)) not in chosen or not key.endswith(".weight"):
            continue
        if key.rsplit(".", 2)[-2] in spec.target_modules:
            out[key] = shape
    return dict(sorted(out.items(), key=lambda kv: (int(_LAYER.search(kv[0]).group(1)), kv[0])))


def _peft_name(weight_key: str, which: str) -> str:
    return f"base_model.model.{weight_key[: -len('.weight')]}.lora_{which}.weight"


def adapter_shapes(model_dir: str | Path, spec: LoraSpec) -> dict[str, tuple[int, int]]:
    """PEFT tensor name -> shape for every A and B the spec creates on this model."""
    shapes: dict[str, tuple[int, int]] = {}
    for key, (out_features, in_features) in target_weight_shapes(model_dir, spec).items():
        shapes[_peft_name(key, "A")] = (spec.rank, in_features)
        shapes[_peft_name(key, "B")] = (out_features, spec.rank)
    return shapes


def base_weight_magnitudes(model_dir: str | Path, spec: LoraSpec) -> dict[str, float]:
    """PEFT tensor name -> mean |W| of the base weight that tensor's module adapts (A and B share it)."""
    targets = target_weight_shapes(model_dir, spec)
    means: dict[str, float] = {}
    for path in _weight_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                if key in targets:
                    means[key] = handle.get_tensor(key).float().abs().mean().item()
    out = {}
    for key in targets:
        out[_peft_name(key, "A")] = means[key]
        out[_peft_name(key, "B")] = means[key]
    return out


def layer_of(name: str) -> int:
    """The transformer layer index a tensor name belongs to."""
    match = _LAYER.search(name)
    if not match:
        raise ValueError(f"no layer index in {name!r}")
    return int(match.group(1))


def module_of(name: str) -> str:
    """The projection a PEFT tensor name adapts (q_proj, ...)."""
    return name.split(".lora_")[0].rsplit(".", 1)[-1]


def init_adapter(
    spec: LoraSpec,
    shapes: Mapping[str, tuple[int, int]],
    scheme: str = "peft_default",
    seed: int = 0,
    magnitudes: Mapping[str, float] | None = None,
    init_scale: float = 1.0,
) -> AdapterWeights:
    """A fresh adapter.

    ``peft_default``: A ~ kaiming-uniform (PEFT's default), B = 0, so the adapter starts as the base
    model and first perturbations act through B. ``random_ab``: A and B both normal with a per-layer
    std of ``init_scale * mean|W|`` of the layer's base weight (needs ``magnitudes``).
    """
    if scheme not in INIT_SCHEMES:
        raise ValueError(f"lora init scheme must be one of {INIT_SCHEMES}, got {scheme!r}")
    if scheme == "random_ab" and magnitudes is None:
        raise ValueError("init scheme 'random_ab' needs the base weight magnitudes")
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        generator = torch.Generator().manual_seed(tensor_seed(seed, "init/" + name))
        if scheme == "peft_default":
            if ".lora_B." in name:
                tensors[name] = torch.zeros(shape, dtype=torch.float32)
            else:
                bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)) as nn.Linear/PEFT
                tensors[name] = (torch.rand(shape, generator=generator, dtype=torch.float32) * 2 - 1) * bound
        else:
            std = init_scale * magnitudes[name]
            tensors[name] = torch.randn(shape, generator=generator, dtype=torch.float32) * std
    return AdapterWeights(spec, tensors)


def noise_scales(
    shapes: Iterable[str], sigma: float, mode: str = "uniform", magnitudes: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Noise std per tensor: ``sigma`` everywhere, or ``sigma * mean|W|`` of each layer's base weight."""
    if sigma <= 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    if mode not in NOISE_MODES:
        raise ValueError(f"noise mode must be one of {NOISE_MODES}, got {mode!r}")
    if mode == "uniform":
        return {name: float(sigma) for name in shapes}
    if magnitudes is None:
        raise ValueError("noise mode 'per_layer' needs the base weight magnitudes")
    return {name: float(sigma * magnitudes[name]) for name in shapes}


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, copied when it is a view into a larger storage (a FlatParams' tensors are):
    safetensors refuses tensors that share memory."""
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor


def save_adapter(adapter: AdapterWeights, path: str | Path, base_model: str = "", dtype=torch.float32) -> Path:
    """Write an adapter in PEFT format; returns the folder."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(adapter.spec.peft_config(base_model), indent=1))
    tensors = adapter.tensors
    if isinstance(tensors, FlatParams):  # one device-to-host copy, not one per tensor
        tensors = tensors.to("cpu", dtype)
    save_file({k: _own_storage(v.detach().to("cpu", dtype).contiguous()) for k, v in tensors.items()},
              str(path / "adapter_model.safetensors"))
    return path


def load_adapter(path: str | Path) -> AdapterWeights:
    """Read an adapter written by :func:`save_adapter` or by peft."""
    path = Path(path)
    config = json.loads((path / "adapter_config.json").read_text())
    targets = config["target_modules"]
    if isinstance(targets, str):
        raise ValueError(f"{path}: target_modules given as a regex ({targets!r}) is not supported")
    layers = config.get("layers_to_transform")
    if isinstance(layers, int):
        layers = [layers]
    spec = LoraSpec(tuple(targets), int(config["r"]), float(config["lora_alpha"]), tuple(layers) if layers else None)
    tensors = {k: v.float() for k, v in load_file(str(path / "adapter_model.safetensors")).items()}
    return AdapterWeights(spec, tensors)


def noise_below_resolution(tensors: Mapping[str, torch.Tensor], sigmas: Mapping[str, float], dtype: torch.dtype,
                           ulps: float = 4.0) -> list[tuple[str, float, float]]:
    """Tensors whose noise scale is within ``ulps`` units in the last place of ``dtype`` at the tensor's
    typical magnitude: (name, sigma, ulp at rms |value|). An engine in that dtype rounds such a
    perturbation away in part (bfloat16, sigma 1.5e-4 on A near 0.04: up to 42 % of it), so the
    members it serves are not the ones the update assumes."""
    if dtype == torch.float32 or dtype == torch.float64:
        return []
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10}.get(dtype, 23)
    found = []
    for name, tensor in tensors.items():
        rms = float(tensor.float().pow(2).mean().sqrt())
        if rms == 0.0:  # B = 0 at PEFT's init: the noise lands on zeros, which the dtype represents exactly
            continue
        ulp = 2.0 ** (math.floor(math.log2(rms)) - mantissa_bits)
        if sigmas[name] < ulps * ulp:
            found.append((name, float(sigmas[name]), ulp))
    return found

