"""Scoring any adapter on a task's prompts: greedy reward on train and held-out examples."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .evaluators import Evaluator, SamplingSettings
from .lora import AdapterWeights
from .tasks import Example, Task
from .types import Completion


@dataclass(frozen=True)
class AdapterScore:
    """Rewards of one adapter on a list of examples."""

    rewards: tuple[float, ...]
    completions: tuple[Completion, ...]

    @property
    def mean(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else float("nan")

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.completions)


def score_adapters(
    evaluator: Evaluator,
    task: Task,
    adapter: AdapterWeights | None,
    example_sets: Sequence[Sequence[Example]],
    max_new_tokens: int,
) -> list[AdapterScore]:
    """Greedy rewards of one adapter on several example lists, in ONE engine call."""
    flat = [example for examples in example_sets for example in examples]
    sampling = SamplingSettings(max_new_tokens=max_new_tokens, temperature=0.0)
    completions = evaluator.generate([task.prompt(e) for e in flat], [adapter], sampling)[0]
    rewards = task.reward_fn([c.text for c in completions], flat)
    scores, start = [], 0
    for examples in example_sets:
        end = start + len(examples)
        scores.append(AdapterScore(tuple(rewards[start:end]), tuple(completions[start:end])))
        start = end
    return scores
