"""The Countdown task as used by Qiu et al. 2025, "Evolution Strategies at Scale: LLM Fine-Tuning
Beyond Reinforcement Learning" (https://arxiv.org/abs/2509.24372), after TinyZero: combine the
given numbers with + - * / to reach the target, thinking in <think> tags and answering in
<answer> tags. Reward = 0.1 * format + answer, as in the paper's `countdown_task.py`.
"""
from __future__ import annotations

import json
import operator
import random
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from evolm_lib.tasks.base import Example, RewardResult, Task, register_task
from evolm_lib.tasks.safe_arith import UnsafeExpressionError, evaluate_expression, numbers_used

SYSTEM_PROMPT = (
    "You are a helpful assistant. You first think about the reasoning process in the mind "
    "and then provide the user with the answer."
)
ASSISTANT_PREFIX = "Let me solve this step by step.\n<think>"
"""Start of the assistant turn: the completion begins inside the think block."""

FORMAT_WEIGHT = 0.1
"""Weight of the format score in the total reward (the answer score has weight 1)."""
TOLERANCE = 1e-5
"""Largest |value - target| that still counts as reaching the target."""

_FULL_FORMAT = re.compile(r"^<think>.*?</think>\n<answer>.*?</answer>$", re.DOTALL)
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# ASCII digits only: \d would also take digits of other scripts, which are no numbers here
_ANSWER_CHARACTERS = re.compile(r"^[0-9+\-*/()\s]+$")
# the generator divides only when exact, so floor division is exact division there
_OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}


def countdown_user_text(numbers: Sequence[int], target: int | str) -> str:
    """The user turn for a puzzle, worded as in the paper."""
    return (
        f"Using the numbers {list(numbers)}, create an equation that equals {target}. "
        "You can use basic arithmetic operations (+, -, *, /) and each number can only be used once. "
        "Show your work in <think> </think> tags. And return the final answer in <answer> </answer> tags, "
        "for example <answer> (1 + 2) / 3 </answer>."
    )


def countdown_example(numbers: Sequence[int], target: int | str, **extras: Any) -> Example:
    """An Example for a puzzle; extras (solution, context) go into `data` next to the numbers."""
    return Example(countdown_user_text(numbers, target), str(target), {"numbers": list(numbers), **extras})


def format_score(completion: str) -> float:
    """1.0 when "<think>" + completion is exactly a think block, a newline and an answer block; else 0.1 (think) + 0.5 (answer)."""
    # the prompt ends with "<think>", so the completion alone lacks the opening tag
    text = ("<think>" + completion).strip()
    if _FULL_FORMAT.match(text):
        return 1.0
    score = 0.0
    if _THINK_BLOCK.search(text):
        score += 0.1
    if _ANSWER_BLOCK.search(text):
        score += 0.5
    return score


def answer_score(completion: str, numbers: Sequence[int], target: int | float | str) -> tuple[float, str | None, str | None]:
    """(score, expression, failure reason): 1.0 when the last <answer> block uses each number once and reaches the target."""
    blocks = _ANSWER_BLOCK.findall(completion)
    if not blocks:
        return 0.0, None, "no <answer> block"
    expression = blocks[-1].strip()
    if not _ANSWER_CHARACTERS.match(expression):
        return 0.0, expression, "answer has characters other than digits, + - * / and parentheses"
    try:
        target_value = float(target)
        used = numbers_used(expression)
        if Counter(used) != Counter(int(n) for n in numbers):
            return 0.0, expression, f"uses numbers {sorted(used)}, expected {sorted(int(n) for n in numbers)}"
        value = evaluate_expression(expression)
    except ZeroDivisionError:
        return 0.0, expression, "division by zero"
    except UnsafeExpressionError as error:
        return 0.0, expression, f"unsafe expression: {error}"
    except ValueError:
        return 0.0, expression, f"target {target!r} is not a number"
    if abs(value - target_value) >= TOLERANCE:
        return 0.0, expression, f"value {value:g} is not the target {target}"
    return 1.0, expression, None


def countdown_reward(completion: str, numbers: Sequence[int], target: int | float | str) -> RewardResult:
    """0.1 * format score + answer score, with the parsed expression and the failure reason in details."""
    format_value = format_score(completion)
    answer_value, expression, reason = answer_score(completion, numbers, target)
    return RewardResult(
        value=FORMAT_WEIGHT * format_value + answer_value,
        details={
            "format_score": format_value,
            "answer_score": answer_value,
            "expression": expression,
            "reason": reason,
        },
    )


def generate_countdown_puzzles(
    n: int,
    seed: int,
    num_numbers: int | Sequence[int] = (3, 4),
    min_number: int = 1,
    max_number: int = 100,
    max_target: int = 1000,
) -> list[Example]:
    """`n` distinct solvable puzzles: random numbers, and a positive integer target made from all of them."""
    counts = [num_numbers] if isinstance(num_numbers, int) else list(num_numbers)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not counts or min(counts) < 2:
        raise ValueError(f"num_numbers must be at least 2, got {num_numbers}")
    if not 1 <= min_number <= max_number:
        raise ValueError(f"need 1 <= min_number <= max_number, got {min_number}, {max_number}")
    rng = random.Random(seed)
    seen: set[tuple[tuple[int, ...], int]] = set()
    puzzles: list[Example] = []
    # generous, yet finite when the ranges admit too few distinct puzzles
    for _ in range(1000 * (n + 1)):
        if len(puzzles) == n:
            break
        numbers = [rng.randint(min_number, max_number) for _ in range(rng.choice(counts))]
        solution, target = _random_solution(numbers, rng)
        key = (tuple(sorted(numbers)), target)
        if not 1 <= target <= max_target or key in seen:
            continue
        seen.add(key)
        puzzles.append(countdown_example(numbers, target, solution=solution))
    if len(puzzles) < n:
        raise ValueError(f"could only make {len(puzzles)} distinct puzzles of {n}; widen the number ranges")
    return puzzles


def _random_solution(numbers: Sequence[int], rng: random.Random) -> tuple[str, int]:
    """A random expression using every number once, and its integer value."""
    # (text, value, is_atom): composite parts get parentheses when combined
    parts = [(str(number), number, True) for number in numbers]
    while len(parts) > 1:
        first, second = rng.sample(range(len(parts)), 2)
        (left, left_value, left_atom), (right, right_value, right_atom) = parts[first], parts[second]
        operation = rng.choice("+-*/")
        # only exact division: intermediate values stay integers, as a person would play
        if operation == "/" and (right_value == 0 or left_value % right_value != 0):
            operation = rng.choice("+-*")
        value = _OPERATIONS[operation](left_value, right_value)
        left = left if left_atom else f"({left})"
        right = right if right_atom else f"({right})"
        parts = [part for index, part in enumerate(parts) if index not in (first, second)]
        parts.append((f"{left} {operation} {right}", value, False))
    return parts[0][0], parts[0][1]


def load_countdown_json(path: str | Path) -> list[Example]:
    """Puzzles from the paper's countdown.json: a list of {"context", "numbers", "target", "solution"}."""
    with open(path, encoding="utf-8") as file:
        try:
            entries = json.load(file)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a non-empty JSON list of puzzles")
    examples = []
    for index, entry in enumerate(entries):
        where = f"{path}: entry {index}"
        if not isinstance(entry, dict) or "numbers" not in entry or "target" not in entry:
            raise ValueError(f"{where}: needs 'numbers' and 'target'")
        numbers = entry["numbers"]
        if not isinstance(numbers, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
            raise ValueError(f"{where}: 'numbers' must be a list of integers, got {numbers!r}")
        target = str(entry["target"]).strip()
        if not re.fullmatch(r"-?[0-9]+", target):
            raise ValueError(f"{where}: 'target' must be an integer, got {entry['target']!r}")
        extras = {key: entry[key] for key in ("solution", "context") if key in entry}
        examples.append(countdown_example(numbers, target, **extras))
    return examples


@register_task("countdown")
class CountdownTask(Task):
    """Countdown puzzles, generated from a seed or read from the paper's JSON file."""

    name = "countdown"
    system_prompt = SYSTEM_PROMPT
    assistant_prefix = ASSISTANT_PREFIX

    def __init__(self, num_train: int = 200, num_eval: int = 100, seed: int = 0, path: str | Path | None = None):
        """Train on the first `num_train` puzzles, evaluate on the next `num_eval` (from `path` when given, in file order)."""
        if num_train < 0 or num_eval < 0:
            raise ValueError(f"num_train and num_eval must be >= 0, got {num_train}, {num_eval}")
        if path is None:
            puzzles = generate_countdown_puzzles(num_train + num_eval, seed)
        else:
            puzzles = load_countdown_json(path)
            if len(puzzles) < num_train + num_eval:
                raise ValueError(
                    f"{path} has {len(puzzles)} puzzles, fewer than num_train + num_eval = {num_train + num_eval}"
                )
        self._train = puzzles[:num_train]
        self._eval = puzzles[num_train : num_train + num_eval]

    def train_examples(self) -> list[Example]:
        """The training puzzles."""
        return list(self._train)

    def eval_examples(self) -> list[Example]:
        """The held-out puzzles (disjoint from the training ones when generated)."""
        return list(self._eval)

    def reward(self, completion: str, example: Example) -> RewardResult:
        """0.1 * format + answer for one completion."""
        return countdown_reward(completion, example.data["numbers"], example.target)
