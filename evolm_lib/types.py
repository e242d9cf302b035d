"""Small value types shared by every layer (no heavy imports here)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

Message = dict[str, str]  # {"role": "user" | "system" | "assistant", "content": str}


@dataclass(frozen=True)
class Prompt:
    """A chat prompt; `assistant_prefix` is appended after the rendered template (e.g. "<think>")."""

    messages: tuple[Message, ...]
    assistant_prefix: str = ""

    @classmethod
    def user(cls, text: str, system: str | None = None, assistant_prefix: str = "") -> "Prompt":
        """A prompt of one user turn (and an optional system turn)."""
        msgs: list[Message] = []
        if system:
            msgs.append({"role": "system", "content": system})
        msgs.append({"role": "user", "content": text})
        return cls(tuple(msgs), assistant_prefix)


# What engines accept as a prompt: a Prompt, chat messages, or a raw string (no chat template).
PromptLike = Union[Prompt, list, tuple, str]


@dataclass(frozen=True)
class Completion:
    """One generated completion."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" | "length"
    # log-probability of each sampled token under the model that sampled it (when asked for)
    logprobs: tuple[float, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class NotARunFolder(ValueError):
    """A path is not a run folder: no config.yaml or metrics.jsonl, or no rows in it."""
