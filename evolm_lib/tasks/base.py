"""Task protocol, example and reward types, and the task registry.

A task is data plus a reward. Rewards are maximised and see the completion only
(never prompt + completion), so ES and GRPO score the very same text.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from evolm_lib.types import Prompt


@dataclass(frozen=True)
class Example:
    """One task example: the user text, the reference target, and per-example extras."""

    prompt: str
    """User text of the example (the task builds the chat messages from it)."""
    target: str
    """Reference answer as text (a countdown target is a number written as text)."""
    data: Mapping[str, Any] = field(default_factory=dict)
    """Per-example extras the reward needs, e.g. {"numbers": [3, 5, 7]}."""

    def __post_init__(self) -> None:
        # a private copy: a caller mutating its dict later must not change the example
        object.__setattr__(self, "data", dict(self.data))


@dataclass(frozen=True)
class RewardResult:
    """A scalar reward and the pieces it was made from (for logs and tests)."""

    value: float
    details: dict[str, Any] = field(default_factory=dict)


class Task:
    """Base class of tasks: examples, chat prompts and a reward; subclasses override `reward`."""

    name: str = ""
    system_prompt: str | None = None
    """System message put before every user turn (None: no system turn)."""
    assistant_prefix: str = ""
    """Text the assistant turn starts with; the completion continues it."""
    success_threshold: float | None = None
    """Reward at or above which a completion counts as solved (None: the task has no such notion)."""
    reward_label: str = "task reward"
    """The reward in words with its unit, for axis labels, e.g. "-|length difference|, chars"."""
    heldout_measure: str = "success"
    """What a held-out score of this task is by default: "success" (share of problems solved) for
    right-or-wrong answers, "reward" (mean reward) where almost nothing reaches the threshold and the
    reward's size is the result (conciseness: an exact length is rare, a shorter gap is progress)."""

    def train_examples(self) -> list[Example]:
        """Examples the optimiser sees."""
        raise NotImplementedError

    def eval_examples(self) -> list[Example]:
        """Held-out examples for evaluation."""
        raise NotImplementedError

    def validation_examples(self) -> list[Example]:
        """Examples for selecting settings (tuning), disjoint from the held-out ones; none unless the
        task's ``num_validation`` option carves some from its training pool."""
        return []

    def prompt(self, example: Example) -> Prompt:
        """Chat messages for one example."""
        return Prompt.user(example.prompt, system=self.system_prompt, assistant_prefix=self.assistant_prefix)

    def reward(self, completion: str, example: Example) -> RewardResult:
        """Reward of one completion (the generated text only) for one example."""
        raise NotImplementedError

    def reward_fn(self, completions: Sequence[Any], examples: Sequence[Example], **unused: Any) -> list[float]:
        """Rewards of a batch, TRL-style: `completions[i]` answers `examples[i]`; extra keywords are ignored."""
        if len(completions) != len(examples):
            raise ValueError(f"got {len(completions)} completions for {len(examples)} examples")
        return [float(self.reward(completion_text(c), e).value) for c, e in zip(completions, examples)]

    def __repr__(self) -> str:
        return f"<Task {self.name!r}>"


def completion_text(completion: Any) -> str:
    """The text of a completion given as a string, a `Completion`, or TRL's conversational form."""
    if isinstance(completion, str):
        return completion
    text = getattr(completion, "text", None)
    if isinstance(text, str):
        return text
    # TRL's conversational completions are [{"role": "assistant", "content": "..."}]
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], Mapping):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"cannot read completion text from {type(completion).__name__}")


def mean_reward(task: Task, completions: Sequence[Any], examples: Sequence[Example]) -> float:
    """Mean reward of a batch (0.0 for an empty batch)."""
    rewards = task.reward_fn(completions, examples)
    return sum(rewards) / len(rewards) if rewards else 0.0


# ---------------------------------------------------------------- registry

TaskFactory = Callable[..., Task]
_REGISTRY: dict[str, TaskFactory] = {}


def register_task(name: str) -> Callable[[TaskFactory], TaskFactory]:
    """Decorator registering a task factory (a Task subclass or a function) under `name`."""

    def decorate(factory: TaskFactory) -> TaskFactory:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"task {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return decorate


def list_tasks() -> list[str]:
    """Names of the registered tasks, sorted."""
    return sorted(_REGISTRY)


def task_options(name: str) -> dict[str, Any]:
    """The options a task accepts and their defaults (`inspect.Parameter.empty` when required)."""
    factory = _factory(name)
    return {
        parameter.name: parameter.default
        for parameter in inspect.signature(factory).parameters.values()
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    }


def get_task(name: str, **options: Any) -> Task:
    """Build the task registered under `name` with the given options."""
    factory = _factory(name)
    parameters = inspect.signature(factory).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in parameters):
        accepted = task_options(name)
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            # checked here so the message names the task and what it does accept
            raise TypeError(
                f"task {name!r} has no option {', '.join(map(repr, unknown))}; "
                f"accepted options: {', '.join(accepted) or '(none)'}"
            )
    task = factory(**options)
    if not task.name:
        task.name = name
    return task


def _factory(name: str) -> TaskFactory:
    """The registered factory for `name`, or a ValueError listing the known names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(list_tasks())}") from None


EXAMPLE_HOST_BYTES = 2**10
"""Host memory one generated example (prompt, target, data and its objects) takes at least."""


def check_example_counts(counts: Mapping[str, int], host_bytes: int | None = None) -> None:
    """Refuse example counts (``{"num_train": 10**9, ...}``) whose examples this machine's memory
    (``psutil``'s total, or ``host_bytes``) cannot hold, before any is made: a ValueError naming the
    largest count and the largest value of it that fits."""
    total = sum(counts.values())
    if host_bytes is None:
        import psutil

        host_bytes = int(psutil.virtual_memory().total)
    if total * EXAMPLE_HOST_BYTES <= host_bytes:
        return
    name = max(counts, key=counts.get)
    room = max(host_bytes // EXAMPLE_HOST_BYTES - (total - counts[name]), 0)
    raise ValueError(f"{name}={counts[name]:,} is more than this machine can hold: {total:,} examples need at least "
                     f"{total * EXAMPLE_HOST_BYTES / 2**30:.3g} GiB of host memory (this machine has "
                     f"{host_bytes / 2**30:.3g} GiB); the largest {name} that fits is {room:,}")
