"""The conciseness task of Qiu et al. 2025, "Evolution Strategies at Scale: LLM Fine-Tuning
Beyond Reinforcement Learning" (https://arxiv.org/abs/2509.24372): answer in as many
characters as the short reference answer.
"""
from __future__ import annotations

import random

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

CAPITALS = (("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"), ("Egypt", "Cairo"),
            ("Peru", "Lima"), ("Cuba", "Havana"), ("Kenya", "Nairobi"), ("Norway", "Oslo"), ("Greece", "Athens"),
            ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Ireland", "Dublin"), ("Portugal", "Lisbon"),
            ("Russia", "Moscow"), ("China", "Beijing"), ("Germany", "Berlin"), ("Sweden", "Stockholm"),
            ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Chile", "Santiago"), ("Canada", "Ottawa"),
            ("Thailand", "Bangkok"), ("Belgium", "Brussels"), ("Hungary", "Budapest"))
OPPOSITES = (("hot", "Cold"), ("up", "Down"), ("big", "Small"), ("fast", "Slow"), ("light", "Dark"),
             ("happy", "Sad"), ("open", "Closed"), ("early", "Late"), ("full", "Empty"), ("hard", "Soft"),
             ("wet", "Dry"), ("old", "New"), ("rich", "Poor"), ("strong", "Weak"), ("high", "Low"),
             ("left", "Right"), ("win", "Lose"), ("buy", "Sell"), ("push", "Pull"), ("day", "Night"))
NUMBER_WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
                "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty")


def generated_pairs(seed: int = 0) -> list[tuple[str, str]]:
    """Short-answer questions made from templates (capitals, opposites, number words, small sums and
    products, the next letter), none of them one of TRAIN_PAIRS or EVAL_PAIRS, in an order shuffled by ``seed``."""
    pairs = [(f"What is the capital of {country}?", capital) for country, capital in CAPITALS]
    pairs += [(f"What is the opposite of '{word}'?", opposite) for word, opposite in OPPOSITES]
    pairs += [(f"Write the number '{word}' in digits.", str(i)) for i, word in enumerate(NUMBER_WORDS, start=1)]
    pairs += [(f"What is {a} + {b}?", str(a + b)) for a in range(1, 13) for b in range(a, 13)]
    pairs += [(f"What is {a} times {b}?", str(a * b)) for a in range(2, 10) for b in range(a, 10)]
    pairs += [(f"Which letter comes after '{c}' in the alphabet?", chr(ord(c) + 1).upper()) for c in "abcdefghijklmnopqrstuvwxy"]
    taken = {prompt for prompt, _ in TRAIN_PAIRS + EVAL_PAIRS}
    pairs = [pair for pair in pairs if pair[0] not in taken]
    random.Random(seed).shuffle(pairs)
    return pairs


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

    def __init__(self, num_eval: int = len(EVAL_PAIRS), num_validation: int = 0, shuffle_seed: int = 0):
        """`num_eval` held-out questions: the eight of EVAL_PAIRS, then generated ones (`generated_pairs`,
        shuffled by `shuffle_seed`; 108 gives a held-out score that rests on more than eight answers);
        `num_validation` generated questions after those are the validation set (the paper's training
        pool has two prompts, too few to carve from)."""
        generated = generated_pairs(shuffle_seed)
        extra = max(num_eval - len(EVAL_PAIRS), 0)
        if num_eval < 0 or num_validation < 0 or extra + num_validation > len(generated):
            raise ValueError(f"num_eval and num_validation: at least 0, and at most {len(EVAL_PAIRS) + len(generated)} "
                             f"questions in all ({len(generated)} generated beyond the eight), got {num_eval} and "
                             f"{num_validation}")
        self._eval = [*EVAL_PAIRS, *generated[:extra]][:num_eval]
        self._validation = generated[extra:extra + num_validation]

    def train_examples(self) -> list[Example]:
        """The paper's two training examples."""
        return [Example(prompt, target) for prompt, target in TRAIN_PAIRS]

    def eval_examples(self) -> list[Example]:
        """The held-out questions with short answers (EVAL_PAIRS' eight by default)."""
        return [Example(prompt, target) for prompt, target in self._eval]

    def validation_examples(self) -> list[Example]:
        """Generated questions for selecting settings, none of them held out or trained on."""
        return [Example(prompt, target) for prompt, target in self._validation]

    def reward(self, completion: str, example: Example) -> RewardResult:
        """Minus the character-length gap to the example's target."""
        return length_reward(completion, example.target)
