"""The Countdown task as used by Qiu et al. 2025, "Evolution Strategies at Scale: LLM Fine-Tuning
Beyond Reinforcement Learning" (https://arxiv.org/abs/2509.24372), after TinyZero: combine the
given numbers with + - * / to reach the target, thinking in <think> tags and answering in
<answer> tags. Reward = 0.1 * format + answer, as in the paper's `countdown/countdown_task.py`
(https://github.com/VsonicV/es-fine-tuning-paper): 1.1 for a right answer in the full format.

The default `answer_format="strict"` is the paper's rule: the format is read from "<think>" +
completion as is, and the last <answer> block may hold only digits, + - * /, parentheses and
spaces (its regex's `$` also lets one final newline through); each given number must be used
exactly once (a reused or missing number scores no answer) and the value must be within 1e-5 of
the target read as a float. `answer_format="lenient"` strips surrounding whitespace before both
checks and allows any whitespace inside the answer.

Deliberate differences from the paper's code:
- The answer is never run with `eval`: `safe_arith` parses it, so `**` and `//`, which pass the
  paper's character filter, score no answer, and so do answers longer than 200 characters or
  nested deeper than 20 parentheses (`safe_arith` limits; the paper has none and would hang on
  `9**9**9`).
- Every target is compared as a float. The paper's accelerated script does this, but its other
  training and evaluation scripts keep a target only when `str.isdigit()`, so there the puzzles
  with negative or non-integer targets can never be solved.
- NaN and infinite targets are refused (the paper scores them 0 for every answer).
- The tags are found with `str.find`, not regexes, so a reward takes linear time in the
  completion's length (the paper's regexes take quadratic time on repeated unclosed tags);
  the results are the same.
"""
from __future__ import annotations

import json
import math
import operator
import random
import re
import warnings
from collections import Counter
from collections.abc import Sequence
from numbers import Real
from pathlib import Path
from typing import Any

from evolm_lib.tasks.base import Example, RewardResult, Task, check_example_counts, register_task
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
"""|value - target| must be below this for the answer to count (the paper's 1e-5)."""
ANSWER_FORMATS = ("strict", "lenient")
"""strict: the paper's answer format; lenient: whitespace around and inside the answer allowed."""
PAPER_REPOSITORY = "https://github.com/VsonicV/es-fine-tuning-paper"
"""The paper's code; its 2,200 puzzles are PAPER_DATA_FILE there (academic licence: not shipped here)."""
PAPER_DATA_FILE = "countdown/data/countdown.json"
"""The paper's puzzles inside PAPER_REPOSITORY; pass the downloaded file as the task option `path`."""
GENERATED_DIFFICULTY = {"num_numbers": (3, 4), "max_number": 100, "max_target": 1000}
"""Defaults of the generated puzzles: 3 or 4 numbers from 1 to 100, a target from 1 to 1000."""

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_ANSWER_OPEN, _ANSWER_CLOSE = "<answer>", "</answer>"
_BETWEEN_BLOCKS = _THINK_CLOSE + "\n" + _ANSWER_OPEN
# ASCII digits only: \d would also take digits of other scripts, which are no numbers here
_STRICT_CHARACTERS = re.compile(r"[0-9+\-*/() ]+")
_LENIENT_CHARACTERS = re.compile(r"[0-9+\-*/()\s]+")
_CHARACTERS_ALLOWED = {
    "strict": "digits, + - * /, parentheses and spaces",
    "lenient": "digits, + - * /, parentheses and whitespace",
}
# a decimal number as text: no "nan", "inf", "1_000" or digits of other scripts
_NUMBER_TEXT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
# the generator divides only when exact, so floor division is exact division there
_OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}


def countdown_target_value(target: Any) -> float:
    """The target as a finite float; ValueError for text that is not a decimal number, NaN or infinity."""
    if isinstance(target, str) and _NUMBER_TEXT.fullmatch(target.strip()):
        value = float(target)
    elif isinstance(target, Real) and not isinstance(target, bool):
        try:
            value = float(target)
        except OverflowError:
            value = math.inf
    else:
        value = math.nan
    # a NaN target would make every comparison False, an infinite one every answer wrong
    if not math.isfinite(value):
        raise ValueError(f"countdown target must be a finite decimal number, got {target!r}")
    return value


def check_answer_format(answer_format: str) -> str:
    """The answer format if it is one of ANSWER_FORMATS, else a ValueError naming them."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {', '.join(ANSWER_FORMATS)}; got {answer_format!r}")
    return answer_format


def countdown_user_text(numbers: Sequence[int], target: int | float | str) -> str:
    """The user turn for a puzzle, worded as in the paper."""
    return (
        f"Using the numbers {list(numbers)}, create an equation that equals {target}. "
        "You can use basic arithmetic operations (+, -, *, /) and each number can only be used once. "
        "Show your work in <think> </think> tags. And return the final answer in <answer> </answer> tags, "
        "for example <answer> (1 + 2) / 3 </answer>."
    )


def countdown_example(numbers: Sequence[int], target: int | float | str, **extras: Any) -> Example:
    """An Example for a puzzle; extras (solution, context, id) go into `data` next to the numbers."""
    countdown_target_value(target)  # refuse a target no answer can reach before it is trained on
    target_text = str(target).strip()
    return Example(countdown_user_text(numbers, target_text), target_text, {"numbers": list(numbers), **extras})


def _has_block(text: str, opening: str, closing: str) -> bool:
    """Whether `opening`, then later `closing`, occur: re.search(opening + ".*?" + closing, DOTALL) in linear time."""
    start = text.find(opening)
    return start >= 0 and text.find(closing, start + len(opening)) >= 0


def _is_full_format(text: str) -> bool:
    """re.match(r"^<think>.*?</think>\\n<answer>.*?</answer>$", text, re.DOTALL), in linear time."""
    if not text.startswith(_THINK_OPEN):
        return False
    # without MULTILINE, `$` matches at the end and before a final newline
    body = text[:-1] if text.endswith("\n") else text
    if not body.endswith(_ANSWER_CLOSE):
        return False
    # the earliest "</think>\n<answer>" after the opening tag must end before the final closing tag
    return text.find(_BETWEEN_BLOCKS, len(_THINK_OPEN), len(body) - len(_ANSWER_CLOSE)) >= 0


def last_answer_block(text: str) -> str | None:
    """The last block re.findall(r"<answer>(.*?)</answer>", DOTALL) finds, in linear time; None if none."""
    last_close = text.rfind(_ANSWER_CLOSE)
    last_open = text.rfind(_ANSWER_OPEN, 0, last_close) if last_close >= 0 else -1
    if last_open < 0:
        return None
    # findall scans left to right, so its last match is the one that takes in `last_open`: it
    # opens at the first opening tag after the closing tag before `last_open` (tags cannot
    # overlap) and closes at the first closing tag after `last_open`
    previous_close = text.rfind(_ANSWER_CLOSE, 0, last_open)
    opening = text.find(_ANSWER_OPEN, previous_close + len(_ANSWER_CLOSE) if previous_close >= 0 else 0)
    closing = text.find(_ANSWER_CLOSE, last_open + len(_ANSWER_OPEN))
    return text[opening + len(_ANSWER_OPEN) : closing]


def format_score(completion: str, answer_format: str = "strict") -> float:
    """1.0 when "<think>" + completion is exactly a think block, a newline and an answer block; else 0.1 (think) + 0.5 (answer)."""
    # the prompt ends with "<think>", so the completion alone lacks the opening tag
    text = _THINK_OPEN + completion
    if check_answer_format(answer_format) == "lenient":
        text = text.strip()
    if _is_full_format(text):
        return 1.0
    score = 0.0
    if _has_block(text, _THINK_OPEN, _THINK_CLOSE):
        score += 0.1
    if _has_block(text, _ANSWER_OPEN, _ANSWER_CLOSE):
        score += 0.5
    return score


def answer_score(
    completion: str, numbers: Sequence[int], target: int | float | str, answer_format: str = "strict"
) -> tuple[float, str | None, str | None]:
    """(score, expression, failure reason): 1.0 when the last <answer> block uses each number once and reaches the target."""
    target_value = countdown_target_value(target)
    check_answer_format(answer_format)
    block = last_answer_block(completion)
    if block is None:
        return 0.0, None, "no <answer> block"
    expression = block.strip()
    if answer_format == "strict":
        # the paper's re.match(r"^[0-9+\-*/() ]+$", block): its `$` also lets one final newline through
        allowed = _STRICT_CHARACTERS.fullmatch(block[:-1] if block.endswith("\n") else block)
    else:
        allowed = _LENIENT_CHARACTERS.fullmatch(expression)
    if not allowed:
        return 0.0, expression, f"answer has characters other than {_CHARACTERS_ALLOWED[answer_format]}"
    expected = Counter(int(n) for n in numbers)
    try:
        # safe_arith refuses long text first, so a huge answer costs no more than its length check
        used = numbers_used(expression)
        if Counter(used) != expected:
            return 0.0, expression, f"uses numbers {sorted(used)}, expected {sorted(expected.elements())}"
        value = evaluate_expression(expression)
    except ZeroDivisionError:
        return 0.0, expression, "division by zero"
    except UnsafeExpressionError as error:
        return 0.0, expression, f"unsafe expression: {error}"
    if not abs(value - target_value) < TOLERANCE:
        return 0.0, expression, f"value {value:g} is not the target {target}"
    return 1.0, expression, None


def countdown_reward(
    completion: str, numbers: Sequence[int], target: int | float | str, answer_format: str = "strict"
) -> RewardResult:
    """0.1 * format score + answer score, with the parsed expression and the failure reason in details."""
    answer_value, expression, reason = answer_score(completion, numbers, target, answer_format)
    format_value = format_score(completion, answer_format)
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
    num_numbers: int | Sequence[int] = GENERATED_DIFFICULTY["num_numbers"],
    min_number: int = 1,
    max_number: int = GENERATED_DIFFICULTY["max_number"],
    max_target: int = GENERATED_DIFFICULTY["max_target"],
) -> list[Example]:
    """`n` distinct solvable puzzles: `num_numbers` numbers (a count, or counts drawn from) in
    [min_number, max_number], and a target in [1, max_target] made from all of them by + - * and exact /."""
    counts = [num_numbers] if isinstance(num_numbers, int) else list(num_numbers)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not counts or min(counts) < 2:
        raise ValueError(f"num_numbers must be at least 2, got {num_numbers}")
    if not 1 <= min_number <= max_number:
        raise ValueError(f"need 1 <= min_number <= max_number, got {min_number}, {max_number}")
    if max_target < 1:
        raise ValueError(f"max_target must be >= 1 (targets are positive integers), got {max_target}")
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
        raise ValueError(
            f"could only make {len(puzzles)} distinct puzzles of {n} with num_numbers={num_numbers}, numbers "
            f"{min_number} to {max_number} and targets 1 to {max_target}; widen the number ranges or raise max_target"
        )
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


def _as_list(value: Any) -> Any:
    """A sequence as a list (YAML gives [3, 4] where the default is (3, 4)); anything else as it is."""
    return list(value) if isinstance(value, (list, tuple)) else value


class CountdownDataError(ValueError):
    """Malformed entries in a countdown data file; `problems` lists (entry label, what is wrong) for each."""

    def __init__(self, message: str, problems: Sequence[tuple[str, str]] = ()):
        super().__init__(message)
        self.problems = list(problems)


class CountdownFileNotFoundError(FileNotFoundError, ValueError):
    """The countdown data file is missing (a ValueError too, so a config's validation reports it as a bad setting)."""


def load_countdown_json(path: str | Path, skip_malformed: bool = False) -> list[Example]:
    """Puzzles from the paper's countdown.json: a list of {"id", "numbers", "target", "solution", "context"}.

    Targets stay as the file writes them ("27.4") and are scored as floats. Every malformed entry is
    reported by its id (by its index when it has none) in one CountdownDataError; with
    `skip_malformed` they are left out with a warning instead.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        raise CountdownFileNotFoundError(
            f"countdown data file not found: {path}{where}; the paper's file is {PAPER_DATA_FILE} of {PAPER_REPOSITORY}"
        )
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        raise ValueError(f"{path}, line {line}, column {column}: not UTF-8 text (byte 0x{data[error.start]:02x}, "
                         f"{error.reason}); save the file as UTF-8") from None
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a non-empty JSON list of puzzles")
    examples: list[Example] = []
    problems: list[tuple[str, str]] = []
    first_index_of_id: dict[Any, int] = {}
    for index, entry in enumerate(entries):
        label = f"entry {index}"
        if isinstance(entry, dict) and "id" in entry:
            label = f"id {entry['id']}"
            key = json.dumps(entry["id"], sort_keys=True)  # ids may be any JSON value
            if key in first_index_of_id:
                problems.append((label, f"duplicate id (entries {first_index_of_id[key]} and {index})"))
                continue
            first_index_of_id[key] = index
        try:
            examples.append(_example_from_entry(entry))
        except ValueError as error:
            problems.append((label, str(error)))
    if problems:
        message = _malformed_message(path, problems, len(entries))
        if not skip_malformed or not examples:
            raise CountdownDataError(message, problems)
        warnings.warn(f"{message}; skipped", stacklevel=2)
    return examples


def _example_from_entry(entry: Any) -> Example:
    """The Example of one well-formed entry, or a ValueError saying what is wrong with it."""
    if not isinstance(entry, dict) or "numbers" not in entry or "target" not in entry:
        raise ValueError("needs 'numbers' and 'target'")
    numbers = entry["numbers"]
    # negative numbers cannot be written in an answer: a minus sign is an operator there
    if (
        not isinstance(numbers, list)
        or not numbers
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers)
    ):
        raise ValueError(f"'numbers' must be a non-empty list of non-negative integers, got {numbers!r}")
    target = entry["target"]
    try:
        countdown_target_value(target)
    except ValueError:
        raise ValueError(f"'target' must be a finite decimal number, got {target!r}") from None
    solution = entry.get("solution")
    if solution is not None and not isinstance(solution, str):
        raise ValueError(f"'solution' must be text or null, got {solution!r}")
    extras = {key: entry[key] for key in ("solution", "context", "id") if key in entry}
    return countdown_example(numbers, target, **extras)


def _malformed_message(path: Path, problems: Sequence[tuple[str, str]], total: int, shown: int = 20) -> str:
    """One message naming every malformed entry: the first `shown` with their reason, the rest by label."""
    lines = [f"{path}: {len(problems)} of {total} entries are malformed:"]
    lines += [f"  {label}: {reason}" for label, reason in problems[:shown]]
    if len(problems) > shown:
        lines.append(f"  and {', '.join(label for label, _ in problems[shown:])}")
    lines.append("(pass skip_malformed=True to leave them out with a warning)")
    return "\n".join(lines)


@register_task("countdown")
class CountdownTask(Task):
    """Countdown puzzles, generated from a seed or read from the paper's JSON file."""

    name = "countdown"
    success_threshold = 1.0  # the answer right: the format alone gives at most 0.1
    reward_label = "answer 0 or 1 + 0.1 x format"
    system_prompt = SYSTEM_PROMPT
    assistant_prefix = ASSISTANT_PREFIX

    def __init__(
        self,
        num_train: int = 200,
        num_eval: int = 100,
        seed: int = 0,
        path: str | Path | None = None,
        skip_malformed: bool = False,
        answer_format: str = "strict",
        num_numbers: int | Sequence[int] = GENERATED_DIFFICULTY["num_numbers"],
        max_number: int = GENERATED_DIFFICULTY["max_number"],
        max_target: int = GENERATED_DIFFICULTY["max_target"],
        num_validation: int = 0,
    ):
        """Train on the first `num_train` puzzles, evaluate on the next `num_eval` (from `path` when given, in file order);
        the `num_validation` puzzles after those are the validation puzzles (for tuning).

        `path`: a countdown.json in the paper's format (e.g. the paper's own, PAPER_DATA_FILE);
        without it, puzzles are generated from `seed`. `skip_malformed`: leave malformed entries
        out with a warning instead of failing. `answer_format`: "strict" (the paper's) or "lenient".
        The paper evaluates on the file's last 100 entries; here evaluation takes the entries
        right after the training ones.
        Generated puzzles only, to make them easier or harder: `num_numbers` numbers per puzzle
        (a count, or a list of counts drawn from), each from 1 to `max_number`, and targets from
        1 to `max_target` (e.g. 2 numbers up to 9 and targets up to 20 for a small model).
        """
        if num_train < 0 or num_eval < 0 or num_validation < 0:
            raise ValueError(f"num_train and num_eval must be >= 0, and num_validation too, got {num_train}, "
                             f"{num_eval}, {num_validation}")
        check_example_counts({"num_train": num_train, "num_eval": num_eval, "num_validation": num_validation})
        wanted = num_train + num_eval + num_validation
        self.answer_format = check_answer_format(answer_format)
        difficulty = {"num_numbers": num_numbers, "max_number": max_number, "max_target": max_target}
        if path is None:
            puzzles = generate_countdown_puzzles(wanted, seed, **difficulty)
        else:
            changed = [name for name, value in difficulty.items() if _as_list(value) != _as_list(GENERATED_DIFFICULTY[name])]
            if changed:
                # a file's puzzles are used as they are: a silently ignored setting would mislead
                raise ValueError(f"{', '.join(changed)} only apply to generated puzzles; leave them out with `path`")
            puzzles = load_countdown_json(path, skip_malformed=skip_malformed)
            if len(puzzles) < wanted:
                raise ValueError(
                    f"{path} has {len(puzzles)} puzzles, fewer than num_train + num_eval + num_validation = {wanted}"
                )
        self._train = puzzles[:num_train]
        self._eval = puzzles[num_train : num_train + num_eval]
        self._validation = puzzles[num_train + num_eval : wanted]

    def train_examples(self) -> list[Example]:
        """The training puzzles."""
        return list(self._train)

    def eval_examples(self) -> list[Example]:
        """The held-out puzzles (disjoint from the training ones when generated)."""
        return list(self._eval)

    def validation_examples(self) -> list[Example]:
        """The validation puzzles (after the training and held-out ones; disjoint from both when generated)."""
        return list(self._validation)

    def reward(self, completion: str, example: Example) -> RewardResult:
        """0.1 * format + answer for one completion."""
        return countdown_reward(completion, example.data["numbers"], example.target, self.answer_format)
