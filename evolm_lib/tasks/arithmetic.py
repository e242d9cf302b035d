"""Arithmetic: "What is 47 + 38? Answer with only the number.", problems generated from a seed.

A verifiable task a small model can start on and still has room to move on (its base accuracy per
kind of problem is in docs/tasks.md). Reward 1 when the completion's answer is the result, else 0.

Problems: each operand has exactly `digits` digits (one digit: 0 to 9; two digits: 10 to 99; a
pair gives each operand its own), the operation is drawn from `operations` (+ - *), and a
subtraction may have a negative result. No problem appears twice, counting "3 + 5" and "5 + 3"
(or "3 * 5" and "5 * 3") as one, so the train and held-out splits never share a problem. The
held-out problems are the first `num_eval` of the seed's problems and the training ones the next
`num_train`: the held-out set stays the same when the training set grows.

The answer rule. The answer is the LAST number in the completion: worked answers end on the
result ("47 + 38 = 85", "The answer is 85."), while the operands come before it. The number is
read back from the completion's last ASCII digit:
1. Digits: the run of ASCII digits 0-9 that ends there (digits of other scripts are no digits).
2. Decimals: if a "." comes right before that run, the run is a fraction and the digits before
   the "." (maybe none) are the whole part. A number counts only when its fraction is all zeros:
   "85.0" and "85.00" are 85, "85.5" and ".5" are not whole numbers. A full stop after the number
   ("is 85.") is no decimal point, because it follows the last digit.
3. Thousands separators: the comma only. Reading back from a last group of exactly three digits,
   a comma joins the group before it when that group has three digits (and reading goes on) or
   one or two (and it is the first group): "1,234" and "1,234,567.0" are 1234 and 1234567. Any
   other comma separates numbers: "12,34" ends with 34, "1234,567" with 567. A space, a dot or
   an apostrophe never groups digits: "1 234" ends with 234.
4. Sign: a "-" (or the minus sign U+2212) right before the number makes it negative, unless a
   digit or ")" comes right before that minus, where it is a subtraction: "= -35", "=-35" and
   "-35" are -35; "47-5" and "(4+3)-5" end with 5; "- 5", with a space, is 5. A "+" changes nothing.
5. Leading zeros do not count: "085" is 85, "-0" and "000" are 0.
No exponents or fractions: "1e3" ends with 3 and "3/4" with 4; numbers written in words are no
numbers. The completion is never run. Reading the number takes linear time in the completion's
length (C-level scans of the reversed text, no int() of the digits), so a megabyte of digits
scores in milliseconds.
"""
from __future__ import annotations

import operator
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from evolm_lib.tasks.base import Example, RewardResult, Task, check_example_counts, register_task

OPERATIONS = ("+", "-", "*")
"""The operations a problem may use, as they appear in the prompt."""
COMMUTATIVE = frozenset("+*")
"""Operations where "a op b" and "b op a" are the same problem."""
PROMPT_TEMPLATE = "What is {a} {operation} {b}? Answer with only the number."
"""The user turn of a problem."""
_RESULTS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_MINUS_SIGNS = frozenset("-\u2212")
_DIGIT_CHARACTERS = frozenset("0123456789")
_SUBTRACTION_BEFORE = _DIGIT_CHARACTERS | {")"}
"""Characters after which a minus is a subtraction, not a sign."""
_DIGIT = re.compile(r"[0-9]")
# a single character class repeated: one left-to-right pass, nothing to backtrack into
_DIGIT_RUN = re.compile(r"[0-9]*")
# read in the reversed text from just before a three-digit group: ",ddd" groups of exactly three
# digits, then maybe a first group of one or two; "1234,567" stops at the comma. Atomic groups: each
# step takes four characters or fails, and nothing is ever tried again
_EARLIER_GROUPS = re.compile(r"(?>,[0-9]{3}(?![0-9]))*+(?>,[0-9]{1,2}(?![0-9]))?+")
_SHOWN = 40
"""Longest answer text kept in a reward's details (a megabyte of digits is shortened)."""


@dataclass(frozen=True)
class ReadNumber:
    """The number the answer rule read: sign, whole digits without leading zeros or commas, fraction digits."""

    negative: bool
    whole: str
    """Digits of the whole part, leading zeros dropped ("0" for zero)."""
    fraction: str
    """Digits after the decimal point as written ("" when there is none)."""

    @property
    def is_whole(self) -> bool:
        """Whether the number is an integer (no fraction, or one of zeros only)."""
        return not self.fraction.strip("0")

    def text(self) -> str:
        """The number in canonical form: "-35", "85", "12.5" (a whole number's zero fraction dropped)."""
        fraction = self.fraction.rstrip("0")
        zero = self.whole == "0" and not fraction
        sign = "-" if self.negative and not zero else ""
        return f"{sign}{self.whole}" + (f".{fraction}" if fraction else "")


def last_number(completion: str) -> ReadNumber | None:
    """The completion's answer by the module's rule (its last number), None when it has no digit."""
    length = len(completion)
    # runs that end at a forward index are read as runs that start there in the reversed text
    reversed_text = completion[::-1]
    found = _DIGIT.search(reversed_text)
    if found is None:
        return None

    def reach_back(pattern: re.Pattern[str], end: int) -> int:
        """Characters `pattern` takes reading backwards from just before forward index `end`."""
        return pattern.match(reversed_text, length - end).end() - (length - end)

    whole_end = length - found.start()
    start = whole_end - reach_back(_DIGIT_RUN, whole_end)
    fraction = ""
    if start > 0 and completion[start - 1] == ".":
        fraction = completion[start:whole_end]
        whole_end = start - 1
        start = whole_end - reach_back(_DIGIT_RUN, whole_end)
    if whole_end - start == 3:
        # thousands separators: earlier comma groups join a last group of exactly three digits
        start -= reach_back(_EARLIER_GROUPS, start)
    # the sign sits before the first digit, or before the "." of a number like ".5" (then `start` is the ".")
    negative = (
        start > 0
        and completion[start - 1] in _MINUS_SIGNS
        and not (start > 1 and completion[start - 2] in _SUBTRACTION_BEFORE)
    )
    whole = completion[start:whole_end].replace(",", "").lstrip("0") or "0"
    return ReadNumber(negative, whole, fraction)


def arithmetic_reward(completion: str, result: int | str) -> RewardResult:
    """1.0 when the completion's last number equals the integer `result`, else 0.0; the number read and why in details."""
    expected = result_text(result)
    number = last_number(completion)
    if number is None:
        return RewardResult(0.0, {"answer": None, "expected": expected, "reason": "no number"})
    answer = number.text()
    if not number.is_whole:
        reason = f"answer {_shorten(answer)} is not a whole number"
    elif answer != expected:
        reason = f"answer {_shorten(answer)} is not {expected}"
    else:
        reason = None
    return RewardResult(float(reason is None), {"answer": _shorten(answer), "expected": expected, "reason": reason})


def result_text(result: int | str) -> str:
    """An integer result as canonical text ("85", "-35"); ValueError for anything that is not an integer."""
    if isinstance(result, int) and not isinstance(result, bool):
        return str(result)
    if isinstance(result, str) and re.fullmatch(r"[+-]?[0-9]+", result.strip()):
        return str(int(result))
    raise ValueError(f"an arithmetic result must be an integer or its decimal text, got {result!r}")


def _shorten(text: str) -> str:
    """The text, or its ends and its length when longer than _SHOWN characters (details stay small)."""
    if len(text) <= _SHOWN:
        return text
    half = _SHOWN // 2
    return f"{text[:half]}...{text[-half:]} ({len(text)} characters)"


# ---------------------------------------------------------------- problems


def operand_range(digits: int) -> range:
    """The operands with exactly `digits` digits: 0-9 for one digit, 10-99 for two, 100-999 for three..."""
    return range(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


def check_digits(digits: int | Sequence[int]) -> tuple[int, int]:
    """Digits of the first and second operand from one count or a pair; ValueError naming the setting."""
    pair = (digits, digits) if isinstance(digits, int) and not isinstance(digits, bool) else digits
    if (
        isinstance(pair, (str, bytes))
        or not isinstance(pair, Sequence)
        or len(pair) != 2
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in pair)
    ):
        raise ValueError(f"digits must be a count >= 1 or a pair of counts [first, second], got {digits!r}")
    return int(pair[0]), int(pair[1])


def check_operations(operations: str | Sequence[str]) -> tuple[str, ...]:
    """The operations as a tuple of "+", "-", "*" (from "+-" or ["+", "-"]); ValueError naming the setting."""
    chosen = tuple(operations) if isinstance(operations, (str, Sequence)) else None
    if not chosen or any(op not in OPERATIONS for op in chosen) or len(set(chosen)) != len(chosen):
        raise ValueError(
            f"operations must be distinct ones of {' '.join(OPERATIONS)} (e.g. \"+-\" or [\"+\", \"*\"]), got {operations!r}"
        )
    return chosen


def count_problems(digits: int | Sequence[int], operations: str | Sequence[str]) -> int:
    """How many different problems the options allow, "a + b" and "b + a" (and "a * b", "b * a") counted once."""
    first_digits, second_digits = check_digits(digits)
    first, second = len(operand_range(first_digits)), len(operand_range(second_digits))
    total = 0
    for operation in check_operations(operations):
        if operation in COMMUTATIVE and first_digits == second_digits:
            total += first * (first + 1) // 2  # unordered pairs, a number with itself included
        else:
            total += first * second  # ordered pairs (operands of different lengths never swap into each other)
    return total


def problem_key(operation: str, a: int, b: int) -> tuple[str, int, int]:
    """What makes two problems the same: the operation and operands, unordered for + and *."""
    return (operation, min(a, b), max(a, b)) if operation in COMMUTATIVE else (operation, a, b)


def arithmetic_example(a: int, operation: str, b: int) -> Example:
    """The Example of "a operation b": the prompt, the result as text, and the operands and operation in `data`."""
    if operation not in _RESULTS:
        raise ValueError(f"operation must be one of {' '.join(OPERATIONS)}, got {operation!r}")
    prompt = PROMPT_TEMPLATE.format(a=a, operation=operation, b=b)
    return Example(prompt, str(_RESULTS[operation](a, b)), {"operands": [a, b], "operation": operation})


def generate_arithmetic_problems(
    n: int, seed: int, digits: int | Sequence[int] = 2, operations: str | Sequence[str] = "+"
) -> list[Example]:
    """`n` different problems from `seed`: an operation drawn uniformly from `operations`, then each operand uniformly.

    Every prefix of the list is the list for a smaller `n` (the same seed gives the same first problems).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    first, second = (operand_range(d) for d in check_digits(digits))
    chosen = check_operations(operations)
    available = count_problems(digits, chosen)
    if n > available:
        raise ValueError(
            f"asked for {n} different problems, but digits={digits!r} and operations={''.join(chosen)!r} "
            f"allow only {available}: use more digits or operations, or fewer problems"
        )
    rng = random.Random(seed)
    seen: set[tuple[str, int, int]] = set()
    problems: list[Example] = []
    # n <= available, so this ends; near `available` it draws about available * ln(available) times
    while len(problems) < n:
        operation = rng.choice(chosen)
        a = rng.randrange(first.start, first.stop)
        b = rng.randrange(second.start, second.stop)
        key = problem_key(operation, a, b)
        if key in seen:
            continue
        seen.add(key)
        problems.append(arithmetic_example(a, operation, b))
    return problems


@register_task("arithmetic")
class ArithmeticTask(Task):
    """Generated arithmetic problems answered with a number; reward 1 for the right result, else 0."""

    name = "arithmetic"
    success_threshold = 1.0  # the reward is 0 or 1: accuracy is the share of 1s
    reward_label = "right answer, 0 or 1"

    def __init__(
        self,
        num_train: int = 200,
        num_eval: int = 100,
        seed: int = 0,
        digits: int | Sequence[int] = 2,
        operations: str | Sequence[str] = "+",
        num_validation: int = 0,
    ):
        """Problems from `seed`: the first `num_eval` are held out, the next `num_train` train, the
        next `num_validation` are the validation problems (for tuning; the training ones stay the same
        whatever `num_validation` is).

        `digits`: digits of each operand (2: 10 to 99), or a pair [first, second] (e.g. [2, 1]).
        `operations`: the operations drawn from, any of + - * ("+-*" or ["+", "-", "*"]).
        No problem is in both splits, nor twice in one ("3 + 5" and "5 + 3" are the same problem).
        """
        if num_train < 0 or num_eval < 0 or num_validation < 0:
            raise ValueError(f"num_train and num_eval must be >= 0, and num_validation too, got {num_train}, "
                             f"{num_eval}, {num_validation}")
        check_example_counts({"num_train": num_train, "num_eval": num_eval, "num_validation": num_validation})
        self.digits = check_digits(digits)
        self.operations = check_operations(operations)
        problems = generate_arithmetic_problems(num_eval + num_train + num_validation, seed, digits, operations)
        # held-out first: the evaluation problems stay the same whatever num_train is
        self._eval = problems[:num_eval]
        self._train = problems[num_eval:num_eval + num_train]
        self._validation = problems[num_eval + num_train:]

    def train_examples(self) -> list[Example]:
        """The training problems."""
        return list(self._train)

    def eval_examples(self) -> list[Example]:
        """The held-out problems (none of them is a training problem)."""
        return list(self._eval)

    def validation_examples(self) -> list[Example]:
        """The validation problems (neither training nor held-out ones)."""
        return list(self._validation)

    def reward(self, completion: str, example: Example) -> RewardResult:
        """1 when the completion's last number is the example's result, else 0."""
        return arithmetic_reward(completion, example.target)
