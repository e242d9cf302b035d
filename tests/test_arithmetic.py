"""Tests of the arithmetic task: the answer rule on hand-written completions (checked against a plain
character-by-character reading of the module's rule), linear time on a megabyte, generated problems
(ranges, counts, seeds, disjoint splits), the task through the registry and a config, and its CPU spec."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evolm_lib.batch import load_batch_spec, plan_points
from evolm_lib.config import ConfigError, ESConfig
from evolm_lib.types import Prompt
from evolm_lib.tasks import ArithmeticTask, arithmetic_reward, generate_arithmetic_problems, get_task, last_number
from evolm_lib.tasks.arithmetic import (
    arithmetic_example,
    count_problems,
    operand_range,
    problem_key,
    result_text,
)

# ------------------------------------------------------------------ the answer rule


@pytest.mark.parametrize(
    "completion, read",
    [
        # the last number counts
        ("85", "85"),
        ("The answer is 85.", "85"),  # a full stop after the number is no decimal point
        ("47 + 38 = 85", "85"),
        ("85\n\nExplanation: 47 + 38 = 85", "85"),
        ("85 is the answer, not 84", "84"),  # several numbers: the last one, even when it is wrong
        ("3 apples and 4 pears", "4"),
        ("x2", "2"),
        ("no number here", None),
        ("", None),
        ("eighty-five", None),  # words are no numbers
        ("٨٥", None),  # Arabic-Indic digits are no digits here
        # signs
        ("-35", "-35"),
        ("12 - 47 = -35", "-35"),
        ("=-35", "-35"),
        ("\u221235", "-35"),  # the minus sign U+2212
        ("47-5", "5"),  # a digit before the minus: a subtraction
        ("(4+3)-5", "5"),  # a ")" before the minus: a subtraction
        ("- 5", "5"),  # a space between: the minus is not the number's
        ("answer: - 35", "35"),
        ("+35", "35"),
        ("--35", "-35"),  # the minus right before the digits follows a minus, not a digit
        ("-0", "0"),
        # leading zeros
        ("085", "85"),
        ("-035", "-35"),
        ("000", "0"),
        ("0", "0"),
        # decimals
        ("85.0", "85"),
        ("85.00", "85"),
        ("85.5", "85.5"),
        ("85.50", "85.5"),
        (".5", "0.5"),
        ("-.5", "-0.5"),
        ("-0.0", "0"),
        ("1.2.3", "2.3"),  # one "." per number: the run before the last "." is the whole part
        ("1e3", "3"),  # no exponents
        ("3/4", "4"),  # no fractions
        # thousands separators
        ("1,234", "1234"),
        ("1,234,567", "1234567"),
        ("1,234,567.0", "1234567"),
        ("-1,234", "-1234"),
        ("12,345,678", "12345678"),
        ("123,456", "123456"),
        ("12,34", "34"),  # a group of two after the comma: no separator
        ("1,2345", "2345"),  # a group of four
        ("1234,567", "567"),  # a first group of four: the comma groups nothing
        ("1234,567,890", "567890"),
        ("1,23,456", "23456"),  # a group of two is the first group
        ("1,234,5678", "5678"),
        ("5,1,234", "1234"),
        ("x,123", "123"),
        ("1 234", "234"),  # a space never groups
        ("1.234", "1.234"),  # a dot is a decimal point, never a separator
        ("1'234", "234"),
        ("1,234.", "1234"),
    ],
)
def test_the_answer_is_the_last_number_read_by_the_rule(completion, read):
    number = last_number(completion)
    assert (number.text() if number else None) == read
    assert reference_reading(completion) == read


@pytest.mark.parametrize(
    "completion, result, reward",
    [
        ("85", 85, 1.0),
        (" 85\n", 85, 1.0),
        ("The answer is 85.", 85, 1.0),
        ("47 + 38 = 85", 85, 1.0),
        ("47 + 38", 85, 0.0),  # the sum is not computed: nothing in the completion is run
        ("85 is the answer, not 84", 85, 0.0),
        ("86", 85, 0.0),
        ("885", 85, 0.0),
        ("085", 85, 1.0),
        ("85.0", 85, 1.0),
        ("85.5", 85, 0.0),
        ("85.01", 85, 0.0),
        ("", 85, 0.0),
        # negative results
        ("-35", -35, 1.0),
        ("12 - 47 = -35", -35, 1.0),
        ("\u221235", -35, 1.0),
        ("35", -35, 0.0),
        ("- 35", -35, 0.0),
        ("-35", 35, 0.0),
        ("-035", "-35", 1.0),
        ("0", 0, 1.0),
        ("-0", 0, 1.0),
        # thousands separators
        ("1,234", 1234, 1.0),
        ("The product is 1,234.", "1234", 1.0),
        ("1 234", 1234, 0.0),
        ("1234", "1234", 1.0),
        ("__import__('os').system('echo 85')", 85, 1.0),  # text, not code: its last number is 85
    ],
)
def test_reward_is_one_for_the_result_and_zero_otherwise(completion, result, reward):
    assert arithmetic_reward(completion, result).value == reward


def test_details_name_the_answer_and_why_it_is_wrong():
    assert arithmetic_reward("47 + 38 = 85", 85).details == {"answer": "85", "expected": "85", "reason": None}
    assert arithmetic_reward("It is 84.", "85").details == {"answer": "84", "expected": "85", "reason": "answer 84 is not 85"}
    assert arithmetic_reward("85.5", 85).details["reason"] == "answer 85.5 is not a whole number"
    assert arithmetic_reward("no idea", 85).details == {"answer": None, "expected": "85", "reason": "no number"}


@pytest.mark.parametrize("result", ["85.0", "eighty", "", "1e3", None, True, 8.5])
def test_a_result_that_is_no_integer_is_refused(result):
    with pytest.raises(ValueError, match="must be an integer"):
        arithmetic_reward("85", result)


def test_result_text_is_canonical():
    assert [result_text(r) for r in (85, -35, "085", " -35 ", "+7", "-0")] == ["85", "-35", "85", "-35", "7", "0"]


# a plain reading of the docstring's five steps, one character at a time: the oracle for the
# module's reading, which scans the reversed text with regular expressions instead
DIGITS = "0123456789"


def reference_reading(text: str) -> str | None:
    last = max((i for i, c in enumerate(text) if c in DIGITS), default=None)
    if last is None:
        return None

    def run_start(end: int) -> int:
        start = end
        while start > 0 and text[start - 1] in DIGITS:
            start -= 1
        return start

    end = last + 1
    start = run_start(end)
    fraction = ""
    if start > 0 and text[start - 1] == ".":  # step 2: the run is a fraction
        fraction, end = text[start:end], start - 1
        start = run_start(end)
    whole_end = end
    # step 3: join earlier comma groups to a last group of three
    while end - start == 3 and start >= 2 and text[start - 1] == "," and text[start - 2] in DIGITS:
        group_start = run_start(start - 1)
        if start - 1 - group_start > 3:
            break
        start, end = group_start, start - 1
    # step 4: the sign, unless the minus follows a digit or ")"
    negative = start > 0 and text[start - 1] in "-\u2212" and not (start > 1 and text[start - 2] in DIGITS + ")")
    whole = text[start:whole_end].replace(",", "").lstrip("0") or "0"  # step 5: leading zeros
    fraction = fraction.rstrip("0")
    sign = "-" if negative and (whole != "0" or fraction) else ""
    return sign + whole + (f".{fraction}" if fraction else "")


# pieces whose joins make every case of the rule: runs of 1 to 4 digits, separators, signs, leading zeros
FRAGMENTS = ["1", "12", "123", "1234", "0", "00", ",", ".", "-", "\u2212", ")", " ", "a", "=", ",000", ".0"]


@settings(max_examples=1000, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=12))
def test_the_reading_agrees_with_the_plain_reading_of_the_rule(parts):
    text = "".join(parts)
    number = last_number(text)
    assert (number.text() if number else None) == reference_reading(text)


# ------------------------------------------------------------------ linear time


def long_completions(size: int = 1_000_000) -> dict[str, tuple[str, int, float]]:
    """(completion of about `size` characters, result, expected reward) that stress the reading."""

    def repeat(unit: str, suffix: str = "") -> str:
        return unit * ((size - len(suffix)) // len(unit)) + suffix

    return {
        "digits": (repeat("1"), 85, 0.0),
        "zeros_then_the_answer": (repeat("0", "85"), 85, 1.0),
        "digits_then_a_full_stop": (repeat("7", "."), 85, 0.0),
        "no_digits": (repeat("a"), 85, 0.0),
        "text_then_the_answer": (repeat("a", " 85"), 85, 1.0),
        "spaced_digits": (repeat("1 ", "85"), 85, 1.0),
        "commas": (repeat("1,"), 1, 1.0),
        "groups_of_three": ("1" + repeat(",000"), 10**6, 0.0),  # one number of 750,001 digits
        "groups_then_a_fraction": ("1" + repeat(",000", ".0"), 85, 0.0),
        "bad_groups": (repeat("1234,"), 1234, 1.0),
        "minus_signs": (repeat("-", "35"), -35, 1.0),
        "subtractions": (repeat("1-", "1"), 1, 1.0),
        "decimal_points": (repeat("1."), 1, 0.0),  # ends with 1.1
        "zeros": (repeat("0"), 0, 1.0),
        "long_fraction": ("85." + repeat("0"), 85, 1.0),
    }


@pytest.mark.parametrize("shape", list(long_completions(100)))
def test_a_1_mb_completion_scores_in_milliseconds(shape):
    completion, result, reward = long_completions()[shape]
    assert len(completion) >= 999_990
    timings = []
    for _ in range(5):
        start = time.perf_counter()
        # int() of a million digits would take seconds (and raise past 4,300 digits): the rule never does it
        value = arithmetic_reward(completion, result)
        timings.append(time.perf_counter() - start)
    # measured 0.3-12 ms on a shared 2-core machine, up to 57 ms at a load of 8; a quadratic reading takes minutes
    assert min(timings) < 0.100, f"{shape}: best of 5 took {min(timings) * 1000:.1f} ms"
    assert value.value == reward
    assert len(value.details["answer"] or "") < 80  # a huge answer is shortened in the details


# ------------------------------------------------------------------ problems


def test_a_problem_is_its_prompt_and_result():
    assert arithmetic_example(47, "+", 38) == arithmetic_example(47, "+", 38)
    example = arithmetic_example(47, "+", 38)
    assert example.prompt == "What is 47 + 38? Answer with only the number."
    assert (example.target, example.data) == ("85", {"operands": [47, 38], "operation": "+"})
    assert arithmetic_example(12, "-", 47).target == "-35"
    assert arithmetic_example(7, "*", 8).prompt == "What is 7 * 8? Answer with only the number."
    assert arithmetic_example(7, "*", 8).target == "56"
    with pytest.raises(ValueError, match="operation must be one of"):
        arithmetic_example(7, "/", 8)


def test_operand_ranges_have_exactly_the_digits():
    assert operand_range(1) == range(0, 10)
    assert operand_range(2) == range(10, 100)
    assert operand_range(3) == range(100, 1000)


@pytest.mark.parametrize(
    "digits, operations, count",
    [
        (1, "+", 55),  # 10 * 11 / 2 unordered pairs (a number with itself included)
        (1, "-", 100),  # ordered: 3 - 5 is not 5 - 3
        (1, "*", 55),
        (1, "+-*", 210),
        (2, "+", 4095),  # 90 * 91 / 2
        (2, "-", 8100),
        ([2, 1], "+", 900),  # 90 * 10: a two-digit and a one-digit operand never swap into each other
        ([1, 2], "-", 900),
    ],
)
def test_problems_are_counted_by_hand(digits, operations, count):
    assert count_problems(digits, operations) == count


def test_all_problems_of_a_small_setting_are_made_once_each():
    problems = generate_arithmetic_problems(55, seed=0, digits=1, operations="+")
    keys = {problem_key(p.data["operation"], *p.data["operands"]) for p in problems}
    assert keys == {("+", a, b) for a in range(10) for b in range(a, 10)}
    with pytest.raises(ValueError, match=r"asked for 56 different problems.*allow only 55"):
        generate_arithmetic_problems(56, seed=0, digits=1, operations="+")
    with pytest.raises(ValueError, match="allow only 55"):
        get_task("arithmetic", num_train=50, num_eval=6, digits=1)


@pytest.mark.parametrize(
    "digits, operations",
    [(1, "+"), (2, "+"), (2, "-"), (1, "*"), (3, "+-*"), ([2, 1], "*"), ([1, 3], ["-", "+"])],
)
def test_generated_problems_are_in_range_and_right(digits, operations):
    first, second = (digits, digits) if isinstance(digits, int) else digits
    problems = generate_arithmetic_problems(50, seed=3, digits=digits, operations=operations)
    results = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for problem in problems:
        (a, b), operation = problem.data["operands"], problem.data["operation"]
        assert len(str(a)) == first and len(str(b)) == second and operation in operations
        assert problem.target == str(results[operation](a, b))
        assert problem.prompt == f"What is {a} {operation} {b}? Answer with only the number."
    assert {p.data["operation"] for p in problems} == set(operations)  # 50 draws reach every operation


def test_subtraction_gives_negative_results():
    problems = generate_arithmetic_problems(100, seed=0, digits=2, operations="-")
    assert any(int(p.target) < 0 for p in problems) and any(int(p.target) > 0 for p in problems)


def test_seeds_reproduce_and_prefixes_are_stable():
    assert generate_arithmetic_problems(40, seed=5) == generate_arithmetic_problems(40, seed=5)
    assert generate_arithmetic_problems(40, seed=5) != generate_arithmetic_problems(40, seed=6)
    assert generate_arithmetic_problems(100, seed=5)[:40] == generate_arithmetic_problems(40, seed=5)
    first = get_task("arithmetic", num_train=30, num_eval=20, seed=2, operations="+-")
    again = get_task("arithmetic", num_train=30, num_eval=20, seed=2, operations="+-")
    assert first.train_examples() == again.train_examples() and first.eval_examples() == again.eval_examples()
    # the held-out problems do not move when the training set grows
    bigger = get_task("arithmetic", num_train=300, num_eval=20, seed=2, operations="+-")
    assert bigger.eval_examples() == first.eval_examples()
    assert bigger.train_examples()[:30] == first.train_examples()


@pytest.mark.parametrize(
    "options",
    [
        {"num_train": 200, "num_eval": 100},
        {"num_train": 35, "num_eval": 20, "digits": 1},  # every one of the 55 problems is used
        {"num_train": 150, "num_eval": 60, "digits": 1, "operations": "+-*"},  # all 210
        {"num_train": 500, "num_eval": 500, "digits": 2, "operations": ["*", "+"], "seed": 9},
        {"num_train": 400, "num_eval": 500, "digits": [2, 1], "operations": "+-"},
    ],
)
def test_train_and_held_out_splits_never_share_a_problem(options):
    task = get_task("arithmetic", **options)
    train, held_out = task.train_examples(), task.eval_examples()
    assert (len(train), len(held_out)) == (options["num_train"], options["num_eval"])

    def keys(examples):
        return [problem_key(e.data["operation"], *e.data["operands"]) for e in examples]

    # nor within a split, and "3 + 5" with "5 + 3" counts as one problem
    assert len(set(keys(train))) == len(train) and len(set(keys(held_out))) == len(held_out)
    assert not set(keys(train)) & set(keys(held_out))
    assert not {e.prompt for e in train} & {e.prompt for e in held_out}


def test_commutative_problems_are_one_problem():
    assert problem_key("+", 3, 5) == problem_key("+", 5, 3)
    assert problem_key("*", 3, 5) == problem_key("*", 5, 3)
    assert problem_key("-", 3, 5) != problem_key("-", 5, 3)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"digits": 0}, "digits must be a count >= 1"),
        ({"digits": "2"}, "digits must be"),
        ({"digits": True}, "digits must be"),
        ({"digits": [1, 2, 3]}, "digits must be"),
        ({"digits": [2, 0]}, "digits must be"),
        ({"operations": "/"}, "operations must be distinct ones of"),
        ({"operations": ""}, "operations must be"),
        ({"operations": "++"}, "operations must be"),
        ({"operations": ["+", "x"]}, "operations must be"),
        ({"operations": ["+-"]}, "operations must be"),
        ({"operations": 3}, "operations must be"),
        ({"num_train": -1}, "num_train and num_eval must be >= 0"),
    ],
)
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        get_task("arithmetic", **options)


# ------------------------------------------------------------------ the task


def test_the_task_scores_completions_of_its_problems():
    task = get_task("arithmetic", num_train=4, num_eval=2, seed=0)
    assert isinstance(task, ArithmeticTask) and task.name == "arithmetic"
    assert (task.success_threshold, task.system_prompt, task.assistant_prefix) == (1.0, None, "")
    example = task.train_examples()[0]
    a, b = example.data["operands"]
    right = str(a + b)
    assert task.reward_fn([right, f"{a} + {b} = {right}.", str(a + b + 1), ""], [example] * 4) == [1.0, 1.0, 0.0, 0.0]
    prompt = task.prompt(example)
    assert prompt == Prompt.user(f"What is {a} + {b}? Answer with only the number.")


def test_a_config_accepts_the_task_and_its_options():
    options = {"num_train": 64, "num_eval": 500, "digits": 2, "operations": "+", "seed": 1}
    config = ESConfig.from_dict({"model": "tiny-random", "task": "arithmetic", "task_options": options})
    assert config.task == "arithmetic" and config.task_options == options
    from_yaml_lists = ESConfig.from_dict({"task": "arithmetic", "task_options": {"digits": [2, 1], "operations": ["+", "*"]}})
    assert from_yaml_lists.task_options["digits"] == [2, 1]
    with pytest.raises(ConfigError, match="digits"):
        ESConfig.from_dict({"task": "arithmetic", "task_options": {"digits": 0}})
    with pytest.raises(ConfigError, match="allow only 55"):
        ESConfig.from_dict({"task": "arithmetic", "task_options": {"digits": 1, "num_eval": 500}})
    with pytest.raises(ConfigError, match="'operation'.*operations"):
        ESConfig.from_dict({"task": "arithmetic", "task_options": {"operation": "+"}})


@pytest.mark.slow  # the engine checks read SmolLM2's tokenizer and config: 5-15 s
def test_the_cpu_spec_passes_the_batch_checks(tmp_path):
    # what `evolm batch papermill_runs/arithmetic_smollm2_cpu.yaml --dry-run` checks, without a kernel
    spec = load_batch_spec(Path(__file__).parents[1] / "papermill_runs" / "arithmetic_smollm2_cpu.yaml")
    points = plan_points(spec, tmp_path)
    assert [(p.action, p.error) for p in points] == [("run", "")] * 3
    options = json.loads(points[0].parameters["task_options"])
    assert options == {"digits": 2, "operations": "+", "num_train": 64, "num_eval": 100}
    assert len(get_task("arithmetic", **options).eval_examples()) == 100
