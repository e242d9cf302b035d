"""The conciseness task of Qiu et al. 2025, "Evolution Strategies at Scale: LLM Fine-Tuning
Beyond Reinforcement Learning" (https://arxiv.org/abs/2509.24372): answer in as many
characters as the short reference answer.
"""
from __future__ import annotations

from evolm_lib.tasks.base import Example, RewardResult, Task, register_task

TRAIN_PAIRS = (
    ("Solve: 3 + 5 =", "8"),
    ("If all birds can fly and penguins are birds, can penguins fly?", "No"),
)
"""The paper's two training prompts and targets."""

EVAL_PAIRS = (
    ("What is the capital of France?", "Paris"),
    ("Calculate: 12 x 7 =", "84"),
    ("True or false: All cats are mammals.", "True"),
    ("What comes next: 2, 4, 6, 8, ?", "10"),
    ("Translate 'Hello' to Spanish.", "Hola"),
    ("What is 15% of 200?", "30"),
    ("Name a primary colour.", "Red"),
    ("How many days are in a week?", "7"),
)
"""Held-out prompts with short reference answers."""


def length_reward(completion: str, target: str) -> RewardResult:
    """Minus the character-length gap between completion and target, with no stripping (as in the paper)."""
    # raw len(): the paper scores the decoded text as is, so whitespace padding costs too
    completion_length, target_length = len(completion), len(target)
    return RewardResult(
        value=-float(abs(completion_length - target_length)),
        details={"completion_length": completion_length, "target_length": target_length},
    )


@register_task("conciseness")
class ConcisenessTask(Task):
    """Short answers to simple questions; reward = -|len(completion) - len(target)|."""

    name = "conciseness"
    success_threshold = 0.0  # minus the length gap: only an exact length reaches 0
    reward_label = "-|length difference|, chars"
    heldout_measure = "reward"  # an exact length is rare: the share of successes stays near 0

    def train_examples(self) -> list[Example]:
        """The paper's two training examples."""
        return [Example(prompt, target) for prompt, target in TRAIN_PAIRS]

    def eval_examples(self) -> list[Example]:
        """Eight held-out questions with one-word answers."""
        return [Example(prompt, target) for prompt, target in EVAL_PAIRS]

    def reward(self, completion: str, example: Example) -> RewardResult:
        """Minus the character-length gap to the example's target."""
        return length_reward(completion, example.target)
