"""The engine boundary: what runners may call on an engine, and the pieces every engine shares.

An engine turns prompts x adapters into completions (with their token ids) and reports the call's
timing (``Engine``); what a run may read of any engine beside its calls (whether it batches
grids, where its engines run) is declared there too, with defaults on ``EngineBase``, the base class of
every engine. Engines that also score given tokens implement ``TokenScorer``. Chat prompts
are rendered and tokenised by one ``PromptEncoder`` so that every engine sees identical inputs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence, Union, runtime_checkable

from ..es import NOISE_DEVICE, Member, NoiseScheme, Sigma, perturb
from ..lora import AdapterWeights, LoraSpec, adapter_shapes
from ..seeds import derive_seed
from ..types import Completion, Prompt, PromptLike

@dataclass(frozen=True)
class SamplingSettings:
    """How to decode. ``temperature == 0`` is greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None  # per-request seeds derive from it (same prompt index -> same seed)
    ignore_eos: bool = False
    logprobs: bool = False  # return the log-prob of each sampled token

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def request_seed(self, prompt_index: int) -> int | None:
        """The seed of one request: every adapter sees the same seed for the same prompt (common random numbers)."""
        if self.seed is None:
            return None
        return derive_seed(self.seed, prompt_index)


@dataclass(frozen=True)
class Population:
    """ES members as an engine may take them: the mean adapter, the members' seeds and signs, and the
    noise scale. Engines that can regenerate noise where the weights live (vLLM slots written in
    place, Ray actors) take this instead of N adapters; the others call :meth:`adapters`.

    Member ``i`` is ``mean + sign_i * sigma * noise(seed_i)``, exactly as ``es.perturb`` makes it.
    """

    mean: AdapterWeights
    members: tuple[Member, ...]
    sigmas: Sigma
    noise_device: str = NOISE_DEVICE  # as resolved for this machine (``sizing.resolve_noise_device``)
    noise_scheme: NoiseScheme = "flat"

    def __len__(self) -> int:
        return len(self.members)

    def adapters(self) -> list[AdapterWeights]:
        """Every member's adapter, made on the host."""
        return [AdapterWeights(self.mean.spec, perturb(dict(self.mean.tensors), m, self.sigmas, self.noise_device,
                                                       self.noise_scheme))
                for m in self.members]

    def split(self, parts: int) -> list["Population"]:
        """Balanced contiguous blocks of members (antithetic pairs stay together where the sizes allow)."""
        if parts < 1 or parts > len(self.members):
            raise ValueError(f"cannot split {len(self.members)} members into {parts} blocks")
        return [dataclasses.replace(self, members=self.members[block]) for block in balanced_blocks(len(self.members), parts)]


def balanced_blocks(count: int, parts: int) -> list[slice]:
    """``count`` items in ``parts`` contiguous blocks whose sizes differ by at most one, larger first."""
    if parts < 1 or parts > max(count, 1):
        raise ValueError(f"cannot split {count} items into {parts} blocks")
    size, extra = divmod(count, parts)
    blocks, start = [], 0
    for index in range(parts):
        end = start + size + (index < extra)
        blocks.append(slice(start, end))
        start = end
    return blocks


AdapterList = Union[Sequence[Optional[AdapterWeights]], Population]


def materialize(adapters: AdapterList) -> list[AdapterWeights | None]:
    """Adapters as a list: a :class:`Population`'s members made on the host, anything else as given."""
    return adapters.adapters() if isinstance(adapters, Population) else list(adapters)


class CompletionTable(list):
    """Completions indexed ``[adapter][prompt]``, plus the call's timing record (seconds by phase:
    ``adapters_s`` moving adapter weights into the engine, ``generate_s`` decoding)."""

    def __init__(self, rows=(), timing: dict[str, float] | None = None):
        super().__init__(rows)
        self.timing: dict[str, float] = dict(timing or {})

    @property
    def num_tokens(self) -> int:
        """Generated tokens in the whole table (every adapter's every completion)."""
        return sum(c.num_tokens for row in self for c in row)


@runtime_checkable
class Engine(Protocol):
    """Prompts x adapters in, completions (with token ids) out; what every runner calls."""

    batches_grids: bool
    """Whether ``generate_grids`` serves several grids in one engine call (a run may then put its
    mean's greedy scoring into the population's call)."""
    engine_info: Sequence[dict]
    """Where each of its engines runs (host, node, card, SMs, tiles); empty for an engine in this process."""

    def generate(self, prompts: Sequence[PromptLike], adapters: AdapterList, sampling: SamplingSettings) -> CompletionTable:
        """Completions indexed ``[adapter][prompt]`` with the call's timing; ``None`` as an adapter is the
        base model; a :class:`Population` stands for its members, in order."""
        ...

    def generate_grids(
        self, grids: Sequence[tuple[Sequence[PromptLike], AdapterList, SamplingSettings]]
    ) -> list[CompletionTable]:
        """Several (prompts x adapters, sampling) grids, in one engine call where the engine can."""
        ...

    def prepare_population(self, spec: LoraSpec, population_size: int) -> None:
        """Set up what serves populations of ``population_size`` adapters of ``spec`` (vLLM's
        resident slots) before the first is sent; a run calls it when it opens."""
        ...

    def close(self) -> None:
        """Release the engine."""
        ...


@runtime_checkable
class TokenScorer(Protocol):
    """An engine that also tokenises prompts and scores given tokens (KL to the base, GRPO's inputs)."""

    def encode(self, prompt: PromptLike) -> list[int]:
        """Token ids of a rendered prompt."""
        ...

    def prompt_logprobs(
        self, prompt_token_ids: Sequence[Sequence[int]], completion_token_ids: Sequence[Sequence[int]],
        adapter: AdapterWeights | None = None,
    ) -> list[list[float]]:
        """Log-prob of each completion token given its prompt, under the base model or an adapter."""
        ...


@runtime_checkable
class WeightsEngine(Protocol):
    """An engine that serves ES members written into the model's own weights (full-parameter ES, EGGROLL)."""

    def resident_weights(self, target_modules, *, noise: str = "full", noise_rank: int = 1,
                         noise_scheme: str = "flat", layers_to_transform=None) -> Any:
        """A handle on the targeted weights with a float32 master of the mean beside them."""
        ...

    def lowrank_slots(self, spec: Any, num_slots: int) -> Any:
        """LoRA slots that serve EGGROLL's low-rank members in one call, or None where members go one at a time."""
        ...

    def run_members(self, weights: Any, members: Sequence[Member], sigma: float, prompts: Sequence[PromptLike],
                    sampling: SamplingSettings, score: tuple | None = None, slots: Any = None,
                    ) -> tuple[CompletionTable, CompletionTable | None, dict[str, float]]:
        """(members' completions, the mean's scoring completions or None, timing) for members of ``weights``."""
        ...


class EngineBase:
    """What every engine has beside its calls, with the defaults of one engine in this process that
    serves one grid per call; engines say otherwise where they differ."""

    batches_grids: bool = False
    engine_info: Sequence[dict] = ()
    start_seconds: float = float("nan")  # seconds the engine took to start (nan: not measured)
    adapter_transfer: str | None = None  # how adapters reach a vLLM engine ("in_place" slots or "files")
    lora_kernel_configs: Any = None  # tuned LoRA kernel tiles a GPU engine uses
    cudagraph_capture_sizes: Sequence[int] | None = None  # batch sizes a GPU engine captured graphs for
    last_call: dict | None = None  # the last call's own record (Ray: wall, transfer and per-engine seconds)

    def prepare_population(self, spec: LoraSpec, population_size: int) -> None:
        """Nothing to set up: this engine takes a population as it comes."""


class GridsOneByOne(EngineBase):
    """``generate_grids`` for engines without a cross-grid batch: one ``generate`` per grid."""

    def generate_grids(self, grids):
        """One table per grid, each from its own ``generate`` call."""
        return [self.generate(prompts, adapters, sampling) for prompts, adapters, sampling in grids]


class GridsInOneCall(EngineBase):
    """``generate`` for engines whose ``generate_grids`` serves every grid in one engine call."""

    batches_grids = True  # a run may put its mean's greedy scoring into the population's call

    def generate(self, prompts: Sequence[PromptLike], adapters: AdapterList = (None,),
                 sampling: SamplingSettings = SamplingSettings()) -> CompletionTable:
        """Completions indexed ``[adapter][prompt]``, from one engine call."""
        (table,) = self.generate_grids([(prompts, adapters, sampling)])
        return table


def as_prompt(prompt: PromptLike) -> Prompt | str:
    if isinstance(prompt, (Prompt, str)):
        return prompt
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in prompt):
        return Prompt(tuple(prompt))
    raise TypeError(f"a prompt must be a Prompt, a list of chat messages or a string, got {type(prompt).__name__}")


class PromptEncoder:
    """Chat template + tokenisation shared by both engines, so their inputs are identical."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def encode(self, prompt: PromptLike) -> list[int]:
        prompt = as_prompt(prompt)
        if isinstance(prompt, str):
            text = prompt
        else:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError("this model's tokenizer has no chat template: pass prompts as plain strings")
            text = self.tokenizer.apply_chat_template(list(prompt.messages), tokenize=False, add_generation_prompt=True)
            text += prompt.assistant_prefix
        # The template already holds the special tokens; adding them again would double the BOS.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render(self, prompt: PromptLike) -> str:
        """The exact text the model sees (for display)."""
        return self.tokenizer.decode(self.encode(prompt))


def check_adapters(adapters: Sequence[AdapterWeights | None], model_dir: Path, max_rank: int | None) -> None:
    """Refuse adapters whose rank exceeds the engine's or whose tensors do not fit the model."""
    checked: dict[Any, dict] = {}
    for adapter in adapters:
        if adapter is None:
            continue
        if max_rank is not None and adapter.spec.rank > max_rank:
            raise ValueError(
                f"adapter rank {adapter.spec.rank} exceeds the engine's max_lora_rank {max_rank}: "
                "start the engine with a larger max_lora_rank"
            )
        if adapter.spec not in checked:
            checked[adapter.spec] = adapter_shapes(model_dir, adapter.spec)
        expected = checked[adapter.spec]
        if set(adapter.tensors) != set(expected):
            extra = sorted(set(adapter.tensors) - set(expected))[:3]
            missing = sorted(set(expected) - set(adapter.tensors))[:3]
            raise ValueError(f"adapter tensors do not match the model: unexpected {extra}, missing {missing}")
        for name, shape in expected.items():
            if tuple(adapter.tensors[name].shape) != tuple(shape):
                raise ValueError(f"adapter tensor {name} has shape {tuple(adapter.tensors[name].shape)}, expected {shape}")


