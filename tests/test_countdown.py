"""Tests of Countdown on the paper's data format: loading, float targets, malformed entries, the strict and
lenient answer formats, linear-time rewards, the `path` task option through a config, and the difficulty
of generated puzzles (numbers per puzzle, largest number, largest target), checked by an exhaustive solver."""
from __future__ import annotations

import itertools
import json
import math
import re
import time
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evolm_lib.config import ConfigError, ESConfig
from evolm_lib.tasks import countdown_reward, evaluate_expression, get_task, load_countdown_json, task_options
from evolm_lib.tasks.countdown import (
    CountdownDataError,
    CountdownFileNotFoundError,
    answer_score,
    countdown_example,
    countdown_target_value,
    format_score,
    last_answer_block,
)

DATA = Path(__file__).parent / "data"
PAPER_FORMAT = DATA / "countdown_paper_format.json"
"""20 puzzles written by hand in the format of the paper's countdown/data/countdown.json."""
MALFORMED = DATA / "countdown_paper_malformed.json"
"""2 good entries and 13 malformed ones (one without an id)."""
REUSING_IDS = {11, 12, 13}
"""Fixture entries whose reference solution reuses a number (and leaves another out)."""
NULL_SOLUTION_IDS = {9, 10}


def answer(text: str) -> str:
    """A completion in the full format whose answer block holds `text`."""
    return f"reasoning</think>\n<answer>{text}</answer>"


# ------------------------------------------------------------------ the paper's file format


def test_paper_format_fixture_loads_with_targets_as_written():
    examples = load_countdown_json(PAPER_FORMAT)
    assert [e.data["id"] for e in examples] == list(range(20))
    by_id = {e.data["id"]: e for e in examples}
    assert by_id[6].target == "27.4" and by_id[6].data["numbers"] == [90, 47, 5]
    assert by_id[7].target == "-11" and by_id[16].target == "2.833333333333334"
    assert by_id[9].data["solution"] is None
    assert "create an equation that equals 27.4" in by_id[6].prompt
    assert by_id[6].data["context"].endswith("Let me solve this step by step.\n<think>")


def test_every_valid_reference_solution_scores_1_1_and_reusing_ones_score_the_format_only():
    # the paper's rule: sorted(numbers used) must equal sorted(numbers given), so a solution that
    # reuses a number gets no answer score, only 0.1 x format 1.0
    examples = load_countdown_json(PAPER_FORMAT)
    scored = {}
    for example in examples:
        if example.data["solution"] is None:
            continue
        result = countdown_reward(answer(example.data["solution"]), example.data["numbers"], example.target)
        scored[example.data["id"]] = result.value
    assert set(scored) == set(range(20)) - NULL_SOLUTION_IDS
    for puzzle_id, value in scored.items():
        expected = 0.1 if puzzle_id in REUSING_IDS else 1.1
        assert value == pytest.approx(expected), puzzle_id
    # the same in the lenient format
    for example in examples:
        if example.data["solution"] is not None and example.data["id"] not in REUSING_IDS:
            completion = answer(f"  {example.data['solution']}\n")
            assert countdown_reward(completion, example.data["numbers"], example.target, "lenient").value == 1.1


@pytest.mark.parametrize(
    "expression, numbers, target, expected",
    [
        ("(90 + 47) / 5", [90, 47, 5], "27.4", 1.1),  # 137 / 5 = 27.4
        ("90 / 5 + 47", [90, 47, 5], "27.4", 0.1),  # 65
        ("(2 - 47) / 8", [47, 2, 8], "-5.625", 1.1),
        ("7 * 2 / 3", [7, 3, 2], "4.666666666666667", 1.1),  # 14 / 3 = 4.6666666666666670
        ("7 * 2 / 3", [7, 3, 2], "4.66667", 1.1),  # |14/3 - 4.66667| = 3.3e-6 < 1e-5
        ("7 * 2 / 3", [7, 3, 2], "4.6667", 0.1),  # 3.3e-5
        ("(90 + 47) / 5", [90, 47, 5], "27.400009", 1.1),  # 9e-6
        ("(90 + 47) / 5", [90, 47, 5], "27.40001", 0.1),  # 1.0000000000332e-5: not below 1e-5
        ("(90 + 47) / 5", [90, 47, 5], 27.4, 1.1),  # a float target through the API
        ("4 - 20 + 5", [4, 20, 5], "-11", 1.1),
        ("4 - 20 + 5", [4, 20, 5], -11, 1.1),
    ],
)
def test_non_integer_targets_are_compared_as_floats_within_1e_5(expression, numbers, target, expected):
    assert countdown_reward(answer(expression), numbers, target).value == pytest.approx(expected)


def test_malformed_entries_are_all_reported_by_id():
    with pytest.raises(CountdownDataError) as caught:
        load_countdown_json(MALFORMED)
    labels = [label for label, _ in caught.value.problems]
    # ids 101-112 (108: its second entry) and the entry without an id, in file order
    assert labels == [f"id {n}" for n in range(101, 113)] + ["entry 14"]
    message = str(caught.value)
    assert "13 of 15 entries are malformed" in message and "skip_malformed" in message
    for label in labels:
        assert f"  {label}: " in message
    reasons = dict(caught.value.problems)
    assert reasons["id 101"] == "'target' must be a finite decimal number, got '27,4'"
    assert "got 'nan'" in reasons["id 102"] and "got 'inf'" in reasons["id 103"] and "got nan" in reasons["id 112"]
    assert "'numbers'" in reasons["id 104"] and "'numbers'" in reasons["id 106"] and "'numbers'" in reasons["id 110"]
    assert reasons["id 105"] == "needs 'numbers' and 'target'"
    assert reasons["id 107"].startswith("'solution' must be text or null")
    assert reasons["id 108"] == "duplicate id (entries 8 and 9)"
    assert "got True" in reasons["id 111"] and "got 'three'" in reasons["entry 14"]


def test_skip_malformed_warns_and_keeps_the_good_entries():
    with pytest.warns(UserWarning, match=r"13 of 15 entries are malformed(.|\n)*id 112"):
        examples = load_countdown_json(MALFORMED, skip_malformed=True)
    assert [(e.data["id"], e.target) for e in examples] == [(100, "27"), (108, "42")]
    with pytest.warns(UserWarning, match="malformed"):
        task = get_task("countdown", path=MALFORMED, num_train=1, num_eval=1, skip_malformed=True)
    assert task.eval_examples()[0].data["numbers"] == [6, 7]


def test_a_long_list_of_malformed_entries_names_every_id(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"id": n, "numbers": [1], "target": "x"} for n in range(30)]))
    with pytest.raises(CountdownDataError) as caught:
        load_countdown_json(path)
    message = str(caught.value)
    assert len(caught.value.problems) == 30
    assert all(re.search(rf"\bid {n}\b", message) for n in range(30))


def test_a_file_of_only_malformed_entries_fails_even_when_skipping(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"id": 1, "numbers": [1], "target": "NaN"}]))
    with pytest.raises(CountdownDataError, match="id 1"):
        load_countdown_json(path, skip_malformed=True)


# ------------------------------------------------------------------ non-finite targets


@pytest.mark.parametrize("target", [math.nan, math.inf, -math.inf, "nan", "NaN", "inf", "-Infinity", "1e999", 10**400])
def test_non_finite_targets_are_refused_through_the_api(target):
    with pytest.raises(ValueError, match="must be a finite decimal number"):
        countdown_target_value(target)
    with pytest.raises(ValueError, match="must be a finite decimal number"):
        countdown_reward(answer("1 + 2"), [1, 2], target)
    with pytest.raises(ValueError, match="must be a finite decimal number"):
        countdown_example([1, 2], target)


@pytest.mark.parametrize("target", ["three", "", "1_000", "٣", None, True, [3]])
def test_targets_that_are_no_number_are_refused(target):
    with pytest.raises(ValueError, match="must be a finite decimal number"):
        countdown_reward(answer("1 + 2"), [1, 2], target)


def test_a_nan_target_no_longer_accepts_any_answer():
    # before: abs(value - nan) >= 1e-5 is False, so every valid answer scored 1.1
    with pytest.raises(ValueError):
        answer_score(answer("1 + 2"), [1, 2], float("nan"))


# ------------------------------------------------------------------ strict (paper) and lenient formats


@pytest.mark.parametrize(
    "completion, strict, lenient",
    [
        ("x</think>\n<answer>1 + 2</answer>", 1.1, 1.1),
        ("x</think>\n<answer>1 + 2</answer>\n", 1.1, 1.1),  # the paper's `$` allows one final newline
        ("x</think>\n<answer>1 + 2</answer>\n\n", 1.06, 1.1),  # two: not the full format in the paper
        ("x</think>\n<answer>1 + 2</answer> ", 1.06, 1.1),
        ("x</think>\n<answer>1 + 2\n</answer>", 1.1, 1.1),  # `$` again, inside the answer
        ("x</think>\n<answer>\n1 + 2\n</answer>", 0.1, 1.1),  # a leading newline: paper says no answer
        ("x</think>\n<answer>1\t+ 2</answer>", 0.1, 1.1),  # tabs: only spaces in the paper
        ("x</think>\n<answer>  1 + 2  </answer>", 1.1, 1.1),
        ("x</think>\n<answer></answer>", 0.1, 0.1),
        ("x</think>\n<answer>   </answer>", 0.1, 0.1),
        ("x</think>\n<answer>2 ** 1 + 1</answer>", 0.1, 0.1),  # deliberate: eval would give 3 (numbers differ)
        ("x</think>\n<answer>(1 + 2) // 1</answer>", 0.1, 0.1),
        ("x</think>\n<answer>1+2=3</answer>", 0.1, 0.1),
        ("x</think>\n<answer>03</answer>", 0.1, 0.1),  # leading zero: a SyntaxError for eval too
    ],
)
def test_strict_format_is_the_papers_and_lenient_the_old_one(completion, strict, lenient):
    assert countdown_reward(completion, [1, 2], "3").value == pytest.approx(strict)
    assert countdown_reward(completion, [1, 2], "3", answer_format="lenient").value == pytest.approx(lenient)


def test_deliberate_difference_power_and_floor_division_score_no_answer():
    # the paper's eval computes 2 ** 3 = 8 and 9 // 2 = 4; safe_arith refuses both
    assert countdown_reward(answer("2 ** 3"), [2, 3], "8").value == pytest.approx(0.1)
    assert countdown_reward(answer("9 // 2"), [9, 2], "4").value == pytest.approx(0.1)


def test_reason_names_the_allowed_characters_of_the_format():
    _, _, strict_reason = answer_score(answer("1\t+ 2"), [1, 2], "3")
    assert strict_reason == "answer has characters other than digits, + - * /, parentheses and spaces"
    _, expression, lenient_reason = answer_score(answer("1 + 2 = 3"), [1, 2], "3", "lenient")
    assert expression == "1 + 2 = 3" and "whitespace" in lenient_reason


def test_answer_format_option_is_checked():
    with pytest.raises(ValueError, match="answer_format must be one of strict, lenient"):
        get_task("countdown", num_train=1, num_eval=1, answer_format="loose")
    with pytest.raises(ValueError, match="answer_format"):
        countdown_reward("x", [1], "1", answer_format="loose")
    lenient = get_task("countdown", path=PAPER_FORMAT, num_train=2, num_eval=1, answer_format="lenient")
    example = lenient.train_examples()[0]
    completion = f"x</think>\n<answer>\n{example.data['solution']}\n</answer>\n\n"
    assert lenient.reward(completion, example).value == pytest.approx(1.1)
    strict = get_task("countdown", path=PAPER_FORMAT, num_train=2, num_eval=1)
    assert strict.reward(completion, example).value == pytest.approx(0.06)


# ------------------------------------------------------------------ the regex-free scan matches the regexes

# the paper's regexes (countdown/countdown_task.py), as oracles on short texts
PAPER_FULL_FORMAT = re.compile(r"^<think>.*?<\/think>\n<answer>.*?<\/answer>$", re.DOTALL)
PAPER_THINK = re.compile(r"<think>.*?<\/think>", re.DOTALL)
PAPER_ANSWER = re.compile(r"<answer>(.*?)<\/answer>", re.DOTALL)

FRAGMENTS = ["<think>", "</think>", "<answer>", "</answer>", "</think>\n<answer>", "\n", " ", "1 + 2", "x", "<", "/",
             "answer>", "think>", "</", "<answer", "</answer"]


def paper_format_score(text: str) -> float:
    if PAPER_FULL_FORMAT.match(text):
        return 1.0
    return 0.1 * bool(PAPER_THINK.search(text)) + 0.5 * bool(PAPER_ANSWER.search(text))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=14))
def test_tag_scan_agrees_with_the_papers_regexes(parts):
    completion = "".join(parts)
    assert format_score(completion) == paper_format_score("<think>" + completion)
    assert format_score(completion, "lenient") == paper_format_score(("<think>" + completion).strip())
    blocks = PAPER_ANSWER.findall(completion)
    assert last_answer_block(completion) == (blocks[-1] if blocks else None)


# ------------------------------------------------------------------ linear time


def adversarial_completions(size: int = 1_000_000) -> dict[str, str]:
    """Completions of about `size` characters that made the old regexes quadratic, or stress the parser."""

    def repeat(unit: str, prefix: str = "", suffix: str = "") -> str:
        return prefix + unit * ((size - len(prefix) - len(suffix)) // len(unit)) + suffix

    half = size // 2
    return {
        "unclosed_answer": repeat("<answer>"),
        "unclosed_answer_with_digits": repeat("<answer>1 + 2"),
        "think_repeated": repeat("<think>"),
        "between_blocks_repeated": repeat("</think>\n<answer>"),
        "think_answer_mix": repeat("<think><answer></think>"),
        "many_answer_blocks": repeat("<answer>1 + 2</answer>"),
        "closing_tags_only": repeat("</answer>"),
        "digit_run": repeat("1", "x</think>\n<answer>", "</answer>"),
        "digit_run_unclosed": repeat("1", "x</think>\n<answer>"),
        "nested_parentheses": "x</think>\n<answer>" + "(" * half + "1 + 2" + ")" * half + "</answer>",
        "spaces": repeat(" ", "x</think>\n<answer>1 +", "2</answer>"),
        "plus_chain": repeat("1 + ", "x</think>\n<answer>", "2</answer>"),
    }


@pytest.mark.parametrize("answer_format", ["strict", "lenient"])
@pytest.mark.parametrize("shape", list(adversarial_completions(100)))
def test_a_1_mb_completion_scores_in_milliseconds(shape, answer_format):
    completion = adversarial_completions()[shape]
    assert len(completion) >= 999_000
    timings = []
    for _ in range(3):
        start = time.perf_counter()
        result = countdown_reward(completion, [1, 2], "3", answer_format)
        timings.append(time.perf_counter() - start)
    # measured 1-15 ms on a shared 2-core machine (the old regexes: 20-55 s already at 128 KB)
    assert min(timings) < 0.050, f"{shape}: best of 3 took {min(timings) * 1000:.1f} ms"
    # only the many blocks end in a right answer; everything else is too long or malformed
    assert result.details["answer_score"] == (1.0 if shape == "many_answer_blocks" else 0.0)


# ------------------------------------------------------------------ the `path` option and configs


def test_task_option_path_reads_the_papers_format():
    task = get_task("countdown", path=str(PAPER_FORMAT), num_train=15, num_eval=5)
    assert [e.data["id"] for e in task.train_examples()] == list(range(15))
    assert [e.data["id"] for e in task.eval_examples()] == list(range(15, 20))


def test_a_missing_file_is_a_clear_error_naming_it(tmp_path):
    missing = tmp_path / "countdown.json"
    with pytest.raises(CountdownFileNotFoundError, match=re.escape(str(missing))) as caught:
        get_task("countdown", path=missing)
    assert isinstance(caught.value, FileNotFoundError) and isinstance(caught.value, ValueError)
    assert "es-fine-tuning-paper" in str(caught.value)
    with pytest.raises(CountdownFileNotFoundError, match="relative to"):
        load_countdown_json("no/such/countdown.json")


def test_config_task_options_take_the_path_and_report_a_missing_file(tmp_path):
    config = ESConfig.from_dict({"task": "countdown", "task_options": {"path": str(PAPER_FORMAT), "num_train": 10,
                                                                       "num_eval": 10}})
    assert config.task_options["path"] == str(PAPER_FORMAT)
    missing = tmp_path / "countdown.json"
    with pytest.raises(ConfigError, match=f"countdown data file not found: {re.escape(str(missing))}"):
        ESConfig.from_dict({"task": "countdown", "task_options": {"path": str(missing)}})
    with pytest.raises(ConfigError, match="id 101"):
        ESConfig.from_dict({"task": "countdown", "task_options": {"path": str(MALFORMED), "num_train": 1}})


# ------------------------------------------------------------------ difficulty of generated puzzles


def solve(numbers: list[int], target: int) -> str | None:
    """An expression using every number once that reaches `target` with + - * / (exact fractions), or None: every
    way of combining two of the numbers is tried, then the result with the rest, so None means no solution."""

    def search(parts: list[tuple[Fraction, str]]) -> str | None:
        if len(parts) == 1:
            return parts[0][1] if parts[0][0] == target else None
        for i, j in itertools.combinations(range(len(parts)), 2):
            (x, x_text), (y, y_text) = parts[i], parts[j]
            rest = [part for k, part in enumerate(parts) if k not in (i, j)]
            combined = [(x + y, f"({x_text} + {y_text})"), (x - y, f"({x_text} - {y_text})"),
                        (y - x, f"({y_text} - {x_text})"), (x * y, f"({x_text} * {y_text})")]
            combined += [(x / y, f"({x_text} / {y_text})")] if y else []
            combined += [(y / x, f"({y_text} / {x_text})")] if x else []
            for value, text in combined:
                found = search(rest + [(value, text)])
                if found is not None:
                    return found
        return None

    return search([(Fraction(n), str(n)) for n in numbers])


def test_the_solver_finds_solutions_and_only_solutions():
    assert solve([1, 1], 3) is None  # 1 + 1, 1 - 1, 1 * 1, 1 / 1: no 3
    assert solve([2, 3, 7], 100) is None
    assert evaluate_expression(solve([2, 3], 6)) == 6
    assert evaluate_expression(solve([4, 6, 3], 8)) == 8  # e.g. 4 * 6 / 3
    assert solve([90, 47, 5], Fraction(137, 5)) is not None


@pytest.mark.parametrize(
    "options",
    [
        {"num_numbers": 2, "max_number": 9, "max_target": 20},  # the easiest: what a 135M model might start on
        {"num_numbers": [2, 3], "max_number": 10, "max_target": 30},
        {"num_numbers": 3, "max_number": 20, "max_target": 100},
        {"num_numbers": (3, 4), "max_number": 100, "max_target": 1000},  # the defaults
        {"num_numbers": 4, "max_number": 25, "max_target": 50},
    ],
)
def test_generated_puzzles_are_in_range_and_solvable(options):
    task = get_task("countdown", num_train=40, num_eval=20, seed=11, **options)
    counts = {options["num_numbers"]} if isinstance(options["num_numbers"], int) else set(options["num_numbers"])
    puzzles = task.train_examples() + task.eval_examples()
    assert len(puzzles) == 60
    assert len({(tuple(sorted(p.data["numbers"])), p.target) for p in puzzles}) == 60  # no puzzle twice
    for puzzle in puzzles:
        numbers, target = puzzle.data["numbers"], int(puzzle.target)
        assert len(numbers) in counts and all(1 <= n <= options["max_number"] for n in numbers), puzzle
        assert 1 <= target <= options["max_target"] and puzzle.target == str(target), puzzle
        # solvable whatever the generator's own solution says: found by search and scored by the reward
        expression = solve(numbers, target)
        assert expression is not None, puzzle
        completion = f"reasoning</think>\n<answer>{expression}</answer>"
        assert task.reward(completion, puzzle).value == pytest.approx(1.1), (puzzle, expression)
    assert {len(p.data["numbers"]) for p in puzzles} == counts  # 60 puzzles reach every count


def test_the_difficulty_defaults_keep_the_generated_puzzles():
    # the puzzles of seed 0 before the difficulty options existed (copied from the earlier generator)
    task = get_task("countdown", num_train=5, num_eval=2, seed=0)
    assert [(e.data["numbers"], e.target) for e in task.train_examples() + task.eval_examples()] == [
        ([93, 52, 91], "50"), ([73, 29, 31], "133"), ([71, 38, 91, 16], "42"), ([19, 90, 29], "138"),
        ([12, 48, 15, 5], "825"), ([34, 9, 29], "335"), ([6, 77, 13, 90], "604"),
    ]
    assert task_options("countdown")["num_numbers"] == (3, 4)
    assert (task_options("countdown")["max_number"], task_options("countdown")["max_target"]) == (100, 1000)


def test_difficulty_options_are_for_generated_puzzles_only():
    with pytest.raises(ValueError, match="max_number, max_target only apply to generated puzzles"):
        get_task("countdown", path=PAPER_FORMAT, num_train=2, num_eval=1, max_number=9, max_target=20)
    # the paper's file path works as before, also with the defaults written out ([3, 4] as YAML gives it)
    task = get_task("countdown", path=PAPER_FORMAT, num_train=15, num_eval=5, num_numbers=[3, 4], max_target=1000)
    assert [e.data["id"] for e in task.eval_examples()] == list(range(15, 20))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_numbers": 1}, "num_numbers must be at least 2"),
        ({"max_number": 0}, "need 1 <= min_number <= max_number"),
        ({"max_target": 0}, "max_target must be >= 1"),
        ({"num_numbers": 2, "max_number": 2, "max_target": 4, "num_train": 20}, "could only make .* max_target"),
    ],
)
def test_bad_difficulty_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        get_task("countdown", **{"num_train": 4, "num_eval": 2, **options})


def test_a_config_takes_the_difficulty_options():
    options = {"num_train": 16, "num_eval": 16, "num_numbers": 2, "max_number": 9, "max_target": 20}
    config = ESConfig.from_dict({"task": "countdown", "task_options": options})
    assert config.task_options == options
    with pytest.raises(ConfigError, match="max_target must be >= 1"):
        ESConfig.from_dict({"task": "countdown", "task_options": {"max_target": 0}})
