"""The memory one card holds for an engine's shard of a model, planned before anything starts.

Every number is in bytes and comes from the model's parameter shapes alone (``model_shapes``:
transformers builds the model on the meta device, which takes no memory and gives every
architecture's names and shapes exactly, a tied output head counted once) and a run's settings
(``PlanSettings``). ``memory_plan`` sums the terms a card holds (``MemoryPlan``),
``smallest_tensor_parallel_size`` finds the fewest cards an engine's weights must be split over, and
``check_memory_plan`` refuses a run whose plan does not fit, naming ``tensor_parallel_size``.

How vLLM's tensor parallelism (Megatron-style) splits each tensor over ``tp`` ranks (``shard_shape``):

- column-parallel layers (q_proj, gate_proj, up_proj: weight and bias) split their output rows;
- k_proj and v_proj hold whole KV heads: num_key_value_heads / tp a rank, or, with fewer KV heads
  than ranks, one head a rank (each KV head replicated tp / num_key_value_heads times);
- row-parallel layers (o_proj, down_proj) split their input columns; their biases are replicated;
- the vocabulary (embed_tokens, lm_head: any matrix with vocab_size rows) is padded to a multiple
  of 64 rows (vLLM's VocabParallelEmbedding), then its rows split;
- every other 1-D tensor (the norms) is replicated on every rank.

Approximations, named: a matrix of a module not listed above is taken as split evenly (and given
LoRA slots if it sits in a block: dense models; a mixture of experts' slots differ); attention
layers are num_hidden_layers (a hybrid model's non-attention layers would hold no KV cache); the
allowance (``ENGINE_ALLOWANCE_BYTES``) stands for the CUDA context, CUDA graphs, NCCL
buffers and activations of each engine rank, not measured; GRPO's trainer is not sharded (it holds
whole float32 copies on one card, the first of its engine's) and its activations are not counted.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..config import ConfigError
from ..lora import ALL_PROJECTIONS
from .sizing import EngineSizing

GIB = 2**30
BLOCK_TOKENS = 16
"""vLLM allocates the KV cache in blocks of this many tokens."""
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1}
ENGINE_ALLOWANCE_BYTES = 2 * GIB
"""What one GPU engine takes beside its weights and KV cache, allowed for rather than measured: the
CUDA context, CUDA graphs, activations and vLLM's buffers."""


def model_config(model_dir: str | Path) -> dict[str, Any]:
    """The model's config.json (its text part for multimodal models)."""
    data = json.loads((Path(model_dir) / "config.json").read_text())
    return {**data, **data.get("text_config", {})} if isinstance(data.get("text_config"), dict) else data


VOCAB_PADDING = 64
"""vLLM pads the vocabulary of its embedding and output head to a multiple of this many rows."""
PLAN_MODES = ("lora", "full", "eggroll", "grpo_lora", "grpo_full")
"""ES modes (es_mode) and GRPO's two policies (policy_weights lora, full)."""
NOISE_SCHEMES = ("tiled", "flat", "per_tensor")
OPTIMIZERS = ("sgd", "adam")
_COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj"}
_ROW = {"o_proj", "down_proj"}
_KV = {"k_proj", "v_proj"}
_LAYER = re.compile(r"\.layers\.(\d+)\.")


# --------------------------------------------------------------------------- the model's shapes

@functools.lru_cache(maxsize=16)
def _shapes_of(config_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    data = json.loads(config_json)
    model_type = data.pop("model_type")
    config = AutoConfig.for_model(model_type, **data)
    with torch.device("meta"):  # shapes only: no tensor is allocated
        model = AutoModelForCausalLM.from_config(config)
    # named_parameters drops a tied output head: it is the embedding, counted once
    return tuple((name, tuple(param.shape)) for name, param in model.named_parameters())


def model_shapes(config: Mapping[str, Any] | str | Path) -> dict[str, tuple[int, ...]]:
    """HF weight name -> shape of a model, from its config.json dict (or a model folder holding
    one), through transformers' own model class built on the meta device."""
    data = model_config(config) if isinstance(config, (str, Path)) else dict(config)
    if isinstance(data.get("text_config"), dict):  # a multimodal model: its language model (where transformers has one)
        data = data["text_config"]
    if "model_type" not in data:
        raise ValueError("the model's config has no model_type: transformers cannot tell its architecture")
    return dict(_shapes_of(json.dumps(data, sort_keys=True, default=str)))


@dataclass(frozen=True, eq=False)
class ModelShape:
    """A model's name, config.json dict and parameter shapes: all a plan reads of it."""

    name: str
    config: Mapping[str, Any]
    shapes: Mapping[str, tuple[int, ...]]

    @classmethod
    def of(cls, config: Mapping[str, Any] | str | Path, name: str | None = None) -> "ModelShape":
        """The shape of a config.json dict or a model folder."""
        data = model_config(config) if isinstance(config, (str, Path)) else dict(config)
        return cls(name or (Path(config).name if isinstance(config, (str, Path)) else data.get("model_type", "model")),
                   data, model_shapes(data))

    @property
    def layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def kv_heads(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.heads)

    @property
    def head_dim(self) -> int:
        return int(self.config.get("head_dim") or self.config["hidden_size"] // self.heads)

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one rank holds: its share, or one whole head when there are fewer heads than ranks."""
        return max(1, math.ceil(self.kv_heads / tp))

    def shard_shape(self, name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
        """The part of weight ``name`` one of ``tp`` ranks holds (the module's docstring says how vLLM splits it)."""
        parts = name.split(".")
        module, kind = parts[-2 if len(parts) > 1 else 0], parts[-1]
        if len(shape) == 2 and shape[0] == self.vocab_size:
            return (math.ceil(math.ceil(shape[0] / VOCAB_PADDING) * VOCAB_PADDING / tp), shape[1])
        if module in _KV:  # whole heads: rows of one head times the heads of a rank
            return (shape[0] // self.kv_heads * self.kv_heads_per_rank(tp), *shape[1:])
        if module in _COLUMN:
            return (math.ceil(shape[0] / tp), *shape[1:])
        if module in _ROW:
            return (shape[0], math.ceil(shape[1] / tp)) if kind == "weight" and len(shape) == 2 else shape
        if len(shape) <= 1:
            return shape
        return (math.ceil(shape[0] / tp), *shape[1:])  # approximation: an unknown matrix split evenly

    def shard_values(self, shapes: Mapping[str, tuple[int, ...]], tp: int) -> int:
        """Values of ``shapes`` one rank holds."""
        return sum(math.prod(self.shard_shape(name, shape, tp)) for name, shape in shapes.items())

    def tensor_parallel_sizes(self, cards: int) -> list[int]:
        """The tensor_parallel_size values vLLM accepts for this model on ``cards`` cards: powers of two
        up to ``cards`` that divide num_attention_heads, and the KV heads (or are divided by them)."""
        sizes = [1 << k for k in range(max(cards, 1).bit_length()) if 1 << k <= cards]
        return [tp for tp in sizes if self.heads % tp == 0 and (self.kv_heads % tp == 0 or tp % self.kv_heads == 0)]


def select_weights(model: ModelShape, target_modules: tuple[str, ...] | str,
                   layers_to_transform: tuple[int, ...] | None = None) -> dict[str, tuple[int, ...]]:
    """The weights a run moves (ES full, eggroll) or trains (GRPO full), as ``lora.target_weight_shapes``
    picks them from a folder: every parameter for "all", else the 2-D weights of the target modules
    in the chosen layers."""
    if target_modules == "all":
        return dict(model.shapes)
    chosen = None if layers_to_transform is None else set(layers_to_transform)
    out = {name: shape for name, shape in model.shapes.items()
           if (match := _LAYER.search(name)) and name.endswith(".weight") and len(shape) == 2
           and name.rsplit(".", 2)[-2] in target_modules and (chosen is None or int(match.group(1)) in chosen)}
    if not out:
        raise ConfigError(f"target_modules {list(target_modules)} (layers {layers_to_transform or 'all'}) match no weight "
                          f"of {model.name}", [("target_modules", "matches no weight of the model")])
    return out


def slot_weights(model: ModelShape) -> dict[str, tuple[int, ...]]:
    """The weights vLLM gives LoRA slots: every linear layer of the blocks (the engine starts without
    target modules, so vLLM makes slots for all the ones it supports, whatever an adapter targets)."""
    return {name: shape for name, shape in model.shapes.items()
            if _LAYER.search(name) and name.endswith(".weight") and len(shape) == 2}


# --------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class PlanSettings:
    """A run's settings that size its engines' memory (``plan_for_run`` reads them off a config)."""

    mode: str = "lora"
    "lora, full, eggroll (es_mode); grpo_lora, grpo_full (GRPO's policy_weights)"
    dtype: str = "bfloat16"
    "the engine's weights and LoRA slots"
    tensor_parallel_size: int = 1
    "cards one engine's weights are split over"
    engines_per_card: int = 1
    "engines that share each card (engines_per_gpu), each with its own shard"
    population: int = 16
    "ES members of a generation (its engine's LoRA slots)"
    lora_rank: int = 1
    "LoRA rank (the slots' rank, but in eggroll)"
    noise_rank: int = 1
    "eggroll: each member's noise rank (the slots' rank)"
    optimizer: str = "sgd"
    "ES: sgd or adam"
    momentum: float = 0.0
    "ES sgd: momentum > 0 keeps a buffer"
    noise_scheme: str = "tiled"
    "ES full and eggroll: tiled draws tensor by tensor; flat and per_tensor draw over every moved value"
    sequences: int = 16
    "sequences one engine decodes at once"
    max_model_len: int = 1024
    "tokens of each sequence's KV cache"
    target_modules: tuple[str, ...] | str = ALL_PROJECTIONS
    "the weights moved (ES full, eggroll) or trained (GRPO full); all: every parameter"
    layers_to_transform: tuple[int, ...] | None = None
    "layers of those weights (None: all)"
    beta: float = 0.0
    "GRPO: KL coefficient (> 0 with policy_weights full keeps a float32 reference model)"
    allowance: int = ENGINE_ALLOWANCE_BYTES
    "CUDA context, CUDA graphs, activations of each engine rank"

    def __post_init__(self) -> None:
        checks = [("mode", self.mode in PLAN_MODES, f"one of {', '.join(PLAN_MODES)}"),
                  ("dtype", self.dtype in DTYPE_BYTES, f"one of {', '.join(DTYPE_BYTES)}"),
                  ("optimizer", self.optimizer in OPTIMIZERS, f"one of {', '.join(OPTIMIZERS)}"),
                  ("noise_scheme", self.noise_scheme in NOISE_SCHEMES, f"one of {', '.join(NOISE_SCHEMES)}")]
        checks += [(name, isinstance(getattr(self, name), int) and getattr(self, name) >= 1, "an integer >= 1")
                   for name in ("tensor_parallel_size", "engines_per_card", "population", "lora_rank", "noise_rank",
                                "sequences", "max_model_len")]
        bad = [(name, f"must be {what}, got {getattr(self, name)!r}") for name, ok, what in checks if not ok]
        if bad:
            raise ConfigError("; ".join(f"{name}: {message}" for name, message in bad), bad)

    @property
    def moves_weights(self) -> bool:
        """ES full or eggroll: the engine keeps a float32 master of the moved weights."""
        return self.mode in ("full", "eggroll")


TERMS = {
    "weights": ("the weights", "split them over more cards (tensor_parallel_size)"),
    "master": ("the float32 master of the moved weights", "move fewer weights (es_weights, target_modules, layers_to_transform)"),
    "optimizer": ("the optimizer's buffers", "use optimizer sgd without momentum"),
    "temporaries": ("one member's noise and the gradient", "set noise_scheme tiled"),
    "lora_slots": ("the LoRA slots", "lower population_size or the rank"),
    "kv_cache": ("the KV cache", "decode fewer sequences at once or lower max_model_len"),
    "allowance": ("CUDA context, graphs and activations", "run fewer engines a card"),
    "trainer": ("the trainer's float32 model and AdamW state", "train fewer weights (grpo_weights, target_modules), or beta 0"),
}
"""term -> (what it is, in words; what makes it smaller)."""
_GRPO_MASTER = ("the engine's float32 copy of the trained weights", "train fewer weights (grpo_weights, target_modules)")


def term_words(name: str, mode: str) -> tuple[str, str]:
    """(what term ``name`` is, what makes it smaller) for a plan of ``mode``."""
    return _GRPO_MASTER if name == "master" and mode == "grpo_full" else TERMS[name]


@dataclass(frozen=True)
class MemoryPlan:
    """What one card holds: ``engines_per_card`` engine shards and, for GRPO, the trainer. Each field is bytes."""

    model: ModelShape
    settings: PlanSettings
    weights: int
    """One engine shard's weights in the engine's dtype: each tensor's ``shard_shape`` (replicated norms,
    row-parallel biases and KV heads counted whole on every rank; the vocabulary padded to 64 rows)."""
    master: int
    """ES full / eggroll: the float32 master of the moved weights' shards (4 bytes a value). GRPO full:
    the engine's float32 copy of the trained weights' shards, written in place after each step."""
    optimizer: int
    """ES full / eggroll: the optimizer's buffers over the moved shards, 4 bytes a value each: adam 2
    (its moments), sgd with momentum 1, plain sgd 0."""
    temporaries: int
    """ES full: float32 noise and gradient. noise_scheme tiled draws tensor by tensor, a shard only its
    slice: two copies of the largest moved shard. flat and per_tensor draw one member's noise over
    every moved value, and its gradient as large (tensor_parallel_size 1 only). eggroll: its full-rank
    update, over every moved value at tensor_parallel_size 1, a weight's slice at a time above."""
    lora_slots: int
    """vLLM's LoRA slots (``EngineSizing.engine_loras`` of them, ES: the population, its mean and
    a zero adapter, twice with slots written in place) at the slot rank (``EngineSizing.engine_lora_rank``),
    over every linear layer of the blocks: A (rank x in) and B (out x rank) each, in the engine's dtype;
    a column-parallel layer splits B's rows, a row-parallel one A's columns (vLLM without fully sharded LoRA)."""
    kv_cache: int
    """K and V of ``sequences`` x max_model_len tokens (whole blocks of 16): 2 x layers x the rank's KV
    heads (``ModelShape.kv_heads_per_rank``) x head_dim x dtype bytes a token."""
    allowance: int
    """CUDA context, CUDA graphs and activations (``ENGINE_ALLOWANCE_BYTES``), allowed for, not measured."""
    trainer: int
    """GRPO, on the first card of its engine only (not sharded). policy_weights full: the float32 model
    (twice with beta > 0: the reference), each trained weight's gradient and AdamW's two moments (with
    the engine's copy above, ``preflight.policy_weights_bytes``). lora: the float32 model and the
    adapter's values, gradients and moments. 0 for ES."""

    @property
    def per_engine(self) -> int:
        """Bytes of one engine's shard on a card."""
        return (self.weights + self.master + self.optimizer + self.temporaries + self.lora_slots + self.kv_cache
                + self.allowance)

    @property
    def total(self) -> int:
        """Bytes the busiest card holds: its engines' shards and the trainer."""
        return self.settings.engines_per_card * self.per_engine + self.trainer

    def terms(self) -> dict[str, int]:
        """term -> bytes on the card (every engine sharing it counted)."""
        engines = self.settings.engines_per_card
        return {name: getattr(self, name) * (1 if name == "trainer" else engines) for name in TERMS}

    def dominant(self) -> str:
        """The largest term (name in TERMS)."""
        return max(self.terms().items(), key=lambda kv: kv[1])[0]

    def describe(self) -> str:
        """"21.6 GiB a card (the weights 14.2 GiB, ...)" for messages; terms of 0 left out."""
        parts = ", ".join(f"{term_words(name, self.settings.mode)[0]} {_gib(value)}" for name, value in self.terms().items() if value)
        engines = self.settings.engines_per_card
        shards = f" for {engines} engines" if engines > 1 else ""
        return f"{_gib(self.total)} a card{shards} ({parts})"

    def at(self, tensor_parallel_size: int) -> "MemoryPlan":
        """The same run with its engines split over ``tensor_parallel_size`` cards."""
        return memory_plan(self.model, dataclasses.replace(self.settings, tensor_parallel_size=tensor_parallel_size))


def _gib(value: float) -> str:
    return f"{value / GIB:.3g} GiB"


def check_tensor_parallel(model: ModelShape, tp: int) -> None:
    """Refuse a tensor_parallel_size vLLM cannot split this model's attention over."""
    if model.heads % tp or (model.kv_heads % tp and tp % model.kv_heads):
        raise ConfigError(
            f"tensor_parallel_size={tp} does not split {model.name}'s attention: it needs num_attention_heads "
            f"({model.heads}) divisible by it and num_key_value_heads ({model.kv_heads}) a multiple or divisor of it",
            [("tensor_parallel_size", f"does not divide num_attention_heads={model.heads}")])


def memory_plan(model: ModelShape, settings: PlanSettings) -> MemoryPlan:
    """The bytes one card holds for ``settings`` (each term's docstring in ``MemoryPlan`` says where it comes from)."""
    tp, mode, dtype = settings.tensor_parallel_size, settings.mode, DTYPE_BYTES[settings.dtype]
    check_tensor_parallel(model, tp)
    weights = dtype * model.shard_values(model.shapes, tp)
    master = optimizer = temporaries = trainer = 0
    if settings.moves_weights:
        if settings.mode == "full" and settings.noise_scheme != "tiled" and tp > 1:
            raise ConfigError(
                f"noise_scheme={settings.noise_scheme} draws one member's noise over every moved weight at once, which "
                f"an engine split over tensor_parallel_size={tp} cards cannot slice: set noise_scheme tiled",
                [("noise_scheme", f"tiled with tensor_parallel_size={tp}")])
        moved = select_weights(model, settings.target_modules, settings.layers_to_transform)
        values = model.shard_values(moved, tp)
        master = 4 * values
        buffers = 2 if settings.optimizer == "adam" else (1 if settings.momentum > 0 else 0)
        optimizer = 4 * buffers * values
        if mode == "eggroll" and tp == 1:  # the full-rank update of every moved value at once
            temporaries = 4 * values
        elif mode == "eggroll":  # split over cards: a weight's slice at a time (the factors are small)
            temporaries = 4 * max(math.prod(model.shard_shape(n, s, tp)) for n, s in moved.items())
        elif settings.noise_scheme == "tiled":
            temporaries = 2 * 4 * max(math.prod(model.shard_shape(n, s, tp)) for n, s in moved.items())
        else:
            temporaries = 2 * 4 * values
    elif mode == "grpo_full":
        trained = select_weights(model, settings.target_modules, settings.layers_to_transform)
        master = 4 * model.shard_values(trained, tp)  # the engine's copy, written in place
        whole = sum(math.prod(s) for s in model.shapes.values())
        trainer = 4 * (whole * (2 if settings.beta > 0 else 1) + 3 * sum(math.prod(s) for s in trained.values()))
    elif mode == "grpo_lora":
        adapted = select_weights(model, settings.target_modules, settings.layers_to_transform)
        adapter = settings.lora_rank * sum(sum(s) for s in adapted.values())
        trainer = 4 * sum(math.prod(s) for s in model.shapes.values()) + 4 * 4 * adapter
    rank = settings.noise_rank if mode == "eggroll" else settings.lora_rank
    if mode.startswith("grpo"):
        sizing = EngineSizing(max_loras=1, max_lora_rank=rank,
                              adapter_transfer="in_place" if mode == "grpo_full" else "files")
    else:
        sizing = EngineSizing(max_loras=settings.population + 1, max_lora_rank=rank, adapter_transfer="in_place")
    slot = sizing.engine_lora_rank * sum(sum(model.shard_shape(n, s, tp)) for n, s in slot_weights(model).items())
    lora_slots = sizing.engine_loras * slot * dtype
    tokens = settings.sequences * math.ceil(settings.max_model_len / BLOCK_TOKENS) * BLOCK_TOKENS
    kv_cache = 2 * model.layers * model.kv_heads_per_rank(tp) * model.head_dim * dtype * tokens
    return MemoryPlan(model, settings, weights, master, optimizer, temporaries, lora_slots, kv_cache,
                      settings.allowance, trainer)


def smallest_tensor_parallel_size(model: ModelShape, settings: PlanSettings, card_bytes: int, cards: int) -> int | None:
    """The smallest tensor_parallel_size (a power of two up to ``cards`` that splits the model's
    attention) whose plan fits ``card_bytes`` a card; None when none does."""
    for tp in model.tensor_parallel_sizes(cards):
        if tp > 1 and settings.mode == "full" and settings.noise_scheme != "tiled":
            break  # flat and per_tensor noise cannot be split
        if memory_plan(model, dataclasses.replace(settings, tensor_parallel_size=tp)).total <= card_bytes:
            return tp
    return None


def check_memory_plan(plan: MemoryPlan, card_bytes: int, cards: int) -> MemoryPlan:
    """Refuse, before any engine starts, a plan that does not fit: a tensor_parallel_size beyond the
    ``cards`` present, or a card of ``card_bytes`` too small for its share; the ConfigError names the
    smallest tensor_parallel_size that fits, or, where none up to ``cards`` does, what takes most."""
    settings, model = plan.settings, plan.model
    tp = settings.tensor_parallel_size
    fits = smallest_tensor_parallel_size(model, settings, card_bytes, cards)
    if tp > cards:
        hint = f"; tensor_parallel_size={fits} fits" if fits else ""
        raise ConfigError(f"tensor_parallel_size={tp} splits each engine over {tp} cards, but {cards} are present: "
                          f"set tensor_parallel_size <= {cards}{hint}",
                          [("tensor_parallel_size", f"at most {cards} (the cards present), got {tp}")])
    if plan.total <= card_bytes:
        return plan
    card = f"a card of {_gib(card_bytes)}"
    if fits is not None:
        raise ConfigError(f"tensor_parallel_size={tp}: {model.name} in mode {settings.mode} needs {plan.describe()}, more "
                          f"than {card}: set tensor_parallel_size={fits} ({_gib(plan.at(fits).total)} a card)",
                          [("tensor_parallel_size", f"at least {fits} for {card}, got {tp}")])
    if settings.mode == "full" and settings.noise_scheme != "tiled":
        tiled = smallest_tensor_parallel_size(model, dataclasses.replace(settings, noise_scheme="tiled"), card_bytes, cards)
        if tiled is not None:
            raise ConfigError(f"{model.name} in mode {settings.mode} needs {plan.describe()}, more than {card}: set "
                              f"noise_scheme tiled and tensor_parallel_size={tiled}",
                              [("noise_scheme", "tiled"), ("tensor_parallel_size", f"at least {tiled}")])
    most = max([1, *model.tensor_parallel_sizes(cards)])
    widest = plan.at(most) if settings.noise_scheme == "tiled" or settings.mode != "full" else plan
    name = widest.dominant()
    what, advice = term_words(name, settings.mode)
    engines = ", or lower engines_per_gpu" if settings.engines_per_card > 1 else ""
    raise ConfigError(f"{model.name} in mode {settings.mode} fits {card} at no tensor_parallel_size up to the {cards} "
                      f"cards present: at tensor_parallel_size={widest.settings.tensor_parallel_size} it needs "
                      f"{widest.describe()}; the largest part is {what} ({_gib(widest.terms()[name])}): {advice}{engines}",
                      [("tensor_parallel_size", f"none up to {cards} fits {card}")])


def plan_for_run(config, model: str | Path | ModelShape, sequences: int) -> MemoryPlan:
    """The plan of a run's settings (an ESConfig or GRPOConfig) on a model folder, config dict or
    ModelShape, for ``sequences`` sequences an engine decodes at once."""
    shape = model if isinstance(model, ModelShape) else ModelShape.of(model)
    if hasattr(config, "es_mode"):
        mode = config.es_mode
    else:
        mode = "grpo_full" if getattr(config, "policy_weights", "lora") == "full" else "grpo_lora"
    targets, layers = config.weight_targets() if mode != "lora" else (config.target_modules, config.layers_to_transform)
    on_ray = config.engine_host == "ray"
    settings = PlanSettings(
        mode=mode, dtype=config.dtype, tensor_parallel_size=getattr(config, "tensor_parallel_size", 1),
        engines_per_card=config.engines_per_gpu if on_ray else 1, population=getattr(config, "population_size", 1),
        lora_rank=config.lora_rank, noise_rank=getattr(config, "noise_rank", 1),
        optimizer=getattr(config, "optimizer", "sgd"), momentum=getattr(config, "momentum", 0.0),
        noise_scheme=getattr(config, "noise_scheme", "tiled"), sequences=max(1, sequences),
        max_model_len=config.max_model_len, target_modules=targets,
        layers_to_transform=None if layers is None else tuple(layers), beta=getattr(config, "beta", 0.0))
    return memory_plan(shape, settings)
