"""Tests of the task registry, the conciseness, countdown and JSONL tasks, with hand-computed rewards."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from evolm_lib.tasks import (
    Example,
    RewardResult,
    Task,
    countdown_reward,
    generate_countdown_puzzles,
    get_task,
    list_tasks,
    load_countdown_json,
    register_task,
)
from evolm_lib.tasks.countdown import ASSISTANT_PREFIX, answer_score, format_score
from evolm_lib.tasks.jsonl import load_jsonl_examples
from evolm_lib.types import Prompt

DATA = Path(__file__).parent / "data"
COUNTDOWN_JSON = DATA / "countdown_sample.json"
USER_JSONL = DATA / "user_task.jsonl"

# small options per task so every registered task is built and checked for free
SMALL_OPTIONS = {
    "arithmetic": {"num_train": 4, "num_eval": 2, "seed": 0},
    "countdown": {"num_train": 4, "num_eval": 2, "seed": 0},
    "jsonl": {"path": USER_JSONL},
}


# ------------------------------------------------------------------ registry


@pytest.mark.parametrize("name", list_tasks())
def test_every_registered_task_builds_prompts_and_rewards(name):
    task = get_task(name, **SMALL_OPTIONS.get(name, {}))
    assert isinstance(task, Task) and task.name == name
    train, evaluation = task.train_examples(), task.eval_examples()
    assert train and evaluation
    for example in train + evaluation:
        assert isinstance(example, Example)
        prompt = task.prompt(example)
        assert isinstance(prompt, Prompt)
        assert prompt.messages[-1] == {"role": "user", "content": example.prompt}
    rewards = task.reward_fn(["42", ""], train[:1] * 2)
    assert len(rewards) == 2 and all(isinstance(r, float) for r in rewards)
    assert isinstance(task.reward("42", train[0]), RewardResult)


@pytest.mark.parametrize("name", list_tasks())
def test_every_registered_task_says_what_its_reward_is(name):
    label = get_task(name, **SMALL_OPTIONS.get(name, {})).reward_label
    assert label and label != Task.reward_label and "/" not in label  # words for an axis, not a key


def test_reward_labels_name_the_definition():
    assert get_task("conciseness").reward_label == "-|length difference|, chars"
    assert get_task("jsonl", path=USER_JSONL, reward="length").reward_label == "-|length difference|, chars"
    assert get_task("jsonl", path=USER_JSONL).reward_label == "exact match, 0 or 1"


def test_registry_lists_the_builtin_tasks():
    assert {"conciseness", "countdown", "jsonl"} <= set(list_tasks())


def test_registry_lists_the_arithmetic_task():
    assert "arithmetic" in list_tasks()


def test_unknown_task_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown task 'nope'.*conciseness.*countdown"):
        get_task("nope")


def test_unknown_option_is_named():
    with pytest.raises(TypeError, match="'num_trian'.*num_train"):
        get_task("countdown", num_trian=3)
    with pytest.raises(TypeError, match="'seed'"):
        get_task("conciseness", seed=1)


def test_registering_a_name_twice_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_task("conciseness")(lambda: None)


def test_reward_fn_checks_lengths_and_reads_conversational_completions():
    task = get_task("conciseness")
    example = task.eval_examples()[0]  # "Paris"
    assert task.reward_fn([[{"role": "assistant", "content": "Paris"}]], [example]) == [0.0]
    assert task.reward_fn(["Paris"], [example], prompts=["ignored"]) == [0.0]
    with pytest.raises(ValueError, match="2 completions for 1 examples"):
        task.reward_fn(["a", "b"], [example])


def test_example_data_is_a_private_copy():
    numbers = {"numbers": [1, 2]}
    example = Example("p", "t", numbers)
    numbers["numbers"] = [9]
    assert example.data["numbers"] == [1, 2]
    assert Example("p", "t").data == {}


# --------------------------------------------------------------- conciseness


def test_conciseness_examples_are_the_papers():
    task = get_task("conciseness")
    assert [(e.prompt, e.target) for e in task.train_examples()] == [
        ("Solve: 3 + 5 =", "8"),
        ("If all birds can fly and penguins are birds, can penguins fly?", "No"),
    ]
    assert len(task.eval_examples()) == 8
    assert task.eval_examples()[1].target == "84"
    assert task.prompt(task.train_examples()[0]) == Prompt.user("Solve: 3 + 5 =")


@pytest.mark.parametrize(
    "completion, target, expected",
    [
        ("8", "8", 0.0),
        ("", "8", -1.0),
        ("The answer is 8.", "8", -15.0),  # 16 characters vs 1
        ("No", "No", 0.0),
        (" No\n", "No", -2.0),  # raw length, as in the paper: whitespace counts
        ("Paris", "Paris", 0.0),
        ("P", "Paris", -4.0),
    ],
)
def test_conciseness_reward_is_minus_the_length_gap(completion, target, expected):
    result = get_task("conciseness").reward(completion, Example("q", target))
    assert result.value == expected
    assert result.details == {"completion_length": len(completion), "target_length": len(target)}


# ------------------------------------------------------------------ countdown

NUMBERS = [19, 36, 55, 7]
TARGET = "65"


def countdown_value(completion, numbers=NUMBERS, target=TARGET):
    return countdown_reward(completion, numbers, target).value


def test_countdown_perfect_format_and_answer_is_1_1():
    completion = "55 + 36 = 91, 91 - 19 = 72, 72 - 7 = 65</think>\n<answer>55 + 36 - 7 - 19</answer>"
    result = countdown_reward(completion, NUMBERS, TARGET)
    assert result.value == pytest.approx(1.1)
    assert result.details == {
        "format_score": 1.0,
        "answer_score": 1.0,
        "expression": "55 + 36 - 7 - 19",
        "reason": None,
    }


def test_countdown_trailing_whitespace_and_eos_newline_keep_full_format():
    assert countdown_value("x</think>\n<answer> (55 + 36) - (7 + 19) </answer>\n") == pytest.approx(1.1)


def test_countdown_right_answer_wrong_format():
    # a space instead of the newline between the blocks: think 0.1 + answer 0.5
    assert countdown_value("x</think> <answer>55 + 36 - 7 - 19</answer>") == pytest.approx(0.06 + 1.0)
    # no closing think tag: only the answer block counts
    assert countdown_value("x <answer>55 + 36 - 7 - 19</answer>") == pytest.approx(0.05 + 1.0)
    # text after the answer block breaks the full format
    assert countdown_value("x</think>\n<answer>55 + 36 - 7 - 19</answer> done") == pytest.approx(0.06 + 1.0)


def test_countdown_format_scores():
    assert format_score("x</think>\n<answer>1</answer>") == 1.0
    assert format_score("x</think>") == pytest.approx(0.1)
    assert format_score("x <answer>1</answer>") == pytest.approx(0.5)
    assert format_score("no tags at all") == 0.0
    assert format_score("") == 0.0


def test_countdown_wrong_numbers():
    result = countdown_reward("x</think>\n<answer>55 + 10</answer>", NUMBERS, TARGET)
    assert result.value == pytest.approx(0.1)
    assert result.details["answer_score"] == 0.0
    assert "uses numbers [10, 55]" in result.details["reason"]


def test_countdown_reused_or_missing_number_scores_no_answer():
    # 65 = 55 + 7 + 7 - 19 + 19 reuses 7 and 19 and leaves out 36
    assert countdown_value("x</think>\n<answer>55 + 7 + 7 - 19 + 19</answer>") == pytest.approx(0.1)
    # every number once except 19, which is used twice
    assert countdown_value("x</think>\n<answer>55 + 36 - 7 - 19 + 19 - 19</answer>") == pytest.approx(0.1)
    # duplicate numbers in the puzzle must each be used
    assert countdown_value("x</think>\n<answer>5 * 5</answer>", [5, 5], "25") == pytest.approx(1.1)
    assert countdown_value("x</think>\n<answer>5 * 5</answer>", [5, 5, 1], "25") == pytest.approx(0.1)


def test_countdown_wrong_value():
    result = countdown_reward("x</think>\n<answer>55 + 36 + 7 + 19</answer>", NUMBERS, TARGET)
    assert result.value == pytest.approx(0.1)
    assert "not the target" in result.details["reason"]


def test_countdown_division_by_zero_scores_no_answer():
    result = countdown_reward("x</think>\n<answer>3 / (2 - 2)</answer>", [3, 2, 2], "1")
    assert result.value == pytest.approx(0.1)
    assert result.details["reason"] == "division by zero"


def test_countdown_fractional_intermediate_values_are_fine():
    # 6 / (1 - 3 / 4) = 24 goes through 0.25
    assert countdown_value("x</think>\n<answer>6 / (1 - 3 / 4)</answer>", [6, 1, 3, 4], "24") == pytest.approx(1.1)


def test_countdown_last_answer_block_counts():
    wrong_then_right = "x</think>\n<answer>1 + 1</answer> no wait <answer>55 + 36 - 7 - 19</answer>"
    result = countdown_reward(wrong_then_right, NUMBERS, TARGET)
    assert result.details["answer_score"] == 1.0
    assert result.details["expression"] == "55 + 36 - 7 - 19"
    right_then_wrong = "x</think>\n<answer>55 + 36 - 7 - 19</answer> or <answer>1 + 1</answer>"
    assert countdown_reward(right_then_wrong, NUMBERS, TARGET).details["answer_score"] == 0.0


@pytest.mark.parametrize(
    "answer",
    [
        "",
        "sixty-five",
        "55 + 36 - 7 - 19 = 65",  # '=' is not allowed
        "55 ** 1 + 36 - 7 - 19",  # '**' gets past the character filter, not the parser
        "55 + 36 - 7 - 19.0",  # '.' would admit floats
        "__import__('os').system('true')",
        "(55 + 36 - 7 - 19",  # unbalanced
    ],
)
def test_countdown_malformed_or_hostile_answers_score_no_answer(answer):
    result = countdown_reward(f"x</think>\n<answer>{answer}</answer>", NUMBERS, TARGET)
    assert result.details["answer_score"] == 0.0
    assert result.value == pytest.approx(0.1)
    assert result.details["reason"]


def test_countdown_no_answer_block():
    result = countdown_reward("I give up</think>", NUMBERS, TARGET)
    assert result.value == pytest.approx(0.01)
    assert result.details["expression"] is None and result.details["reason"] == "no <answer> block"


def test_answer_score_returns_expression_and_reason():
    assert answer_score("<answer> 2 * 3 * 4 </answer>", [2, 3, 4], 24) == (1.0, "2 * 3 * 4", None)


def test_countdown_prompt_matches_the_paper():
    task = get_task("countdown", num_train=1, num_eval=1)
    example = task.train_examples()[0]
    prompt = task.prompt(example)
    system, user = prompt.messages
    assert system["role"] == "system" and "helpful assistant" in system["content"]
    assert user["content"].startswith(f"Using the numbers {example.data['numbers']}, create an equation that equals")
    assert "<answer> (1 + 2) / 3 </answer>" in user["content"]
    assert prompt.assistant_prefix == ASSISTANT_PREFIX == "Let me solve this step by step.\n<think>"


def test_generated_puzzles_are_solved_by_their_reference_solution():
    puzzles = generate_countdown_puzzles(300, seed=7)
    assert len({(tuple(sorted(p.data["numbers"])), p.target) for p in puzzles}) == 300
    for puzzle in puzzles:
        numbers = puzzle.data["numbers"]
        assert len(numbers) in (3, 4) and all(1 <= n <= 100 for n in numbers)
        assert 1 <= int(puzzle.target) <= 1000
        completion = f"reasoning</think>\n<answer>{puzzle.data['solution']}</answer>"
        assert countdown_reward(completion, numbers, puzzle.target).value == pytest.approx(1.1), puzzle


def test_generator_is_seeded_and_validates():
    assert generate_countdown_puzzles(20, seed=3) == generate_countdown_puzzles(20, seed=3)
    assert generate_countdown_puzzles(20, seed=3) != generate_countdown_puzzles(20, seed=4)
    assert {len(p.data["numbers"]) for p in generate_countdown_puzzles(20, seed=0, num_numbers=5)} == {5}
    assert generate_countdown_puzzles(0, seed=0) == []
    with pytest.raises(ValueError, match="num_numbers"):
        generate_countdown_puzzles(3, seed=0, num_numbers=1)
    with pytest.raises(ValueError, match="distinct puzzles"):
        generate_countdown_puzzles(50, seed=0, num_numbers=2, min_number=1, max_number=2)


def test_generated_task_splits_are_disjoint():
    task = get_task("countdown", num_train=30, num_eval=10, seed=1)
    train, evaluation = task.train_examples(), task.eval_examples()
    assert (len(train), len(evaluation)) == (30, 10)
    assert not {e.prompt for e in train} & {e.prompt for e in evaluation}


def test_load_countdown_json_fixture():
    examples = load_countdown_json(COUNTDOWN_JSON)
    assert len(examples) == 4
    first = examples[0]
    assert first.data["numbers"] == [19, 36, 55, 7] and first.target == "65"
    assert first.data["solution"] == "55 + 36 - 7 - 19"
    assert "<|im_start|>" in first.data["context"]
    for example in examples:
        completion = f"x</think>\n<answer>{example.data['solution']}</answer>"
        assert countdown_reward(completion, example.data["numbers"], example.target).value == pytest.approx(1.1)


def test_countdown_task_from_path():
    task = get_task("countdown", path=COUNTDOWN_JSON, num_train=3, num_eval=1)
    assert [e.target for e in task.train_examples()] == ["65", "98", "24"]
    assert [e.target for e in task.eval_examples()] == ["70"]
    with pytest.raises(ValueError, match="fewer than num_train"):
        get_task("countdown", path=COUNTDOWN_JSON, num_train=4, num_eval=1)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{}", "non-empty JSON list"),
        ("[]", "non-empty JSON list"),
        ("[{", "not valid JSON"),
        ('[{"numbers": [1, 2]}]', "entry 0: needs 'numbers' and 'target'"),
        ('[{"numbers": [1, 2], "target": "3"}, {"numbers": "1 2", "target": "3"}]', "entry 1: 'numbers'"),
        ('[{"numbers": [1, 2], "target": "three"}]', "entry 0: 'target'"),
    ],
)
def test_load_countdown_json_errors(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_countdown_json(path)


# ---------------------------------------------------------------------- jsonl


def test_jsonl_loads_splits_and_extras():
    task = get_task("jsonl", path=USER_JSONL, system="Answer in one word.")
    assert [e.target for e in task.train_examples()] == ["4", "Rome"]
    [evaluation] = task.eval_examples()
    assert (evaluation.prompt, evaluation.target, evaluation.data) == ("Colour of the sky?", "Blue", {"source": "fixture"})
    assert task.prompt(evaluation) == Prompt.user("Colour of the sky?", system="Answer in one word.")


def test_jsonl_exact_match_reward():
    task = get_task("jsonl", path=USER_JSONL)
    rome = Example("Capital of Italy?", "Rome")
    assert task.reward_fn([" Rome\n", "rome", "Rome."], [rome] * 3) == [1.0, 0.0, 0.0]
    relaxed = get_task("jsonl", path=USER_JSONL, case_sensitive=False)
    assert relaxed.reward_fn(["ROME", "Roma"], [rome] * 2) == [1.0, 0.0]


def test_jsonl_length_reward_is_conciseness():
    task = get_task("jsonl", path=USER_JSONL, reward="length")
    assert task.reward_fn(["Rome", "Rome!!", ""], [Example("q", "Rome")] * 3) == [0.0, -2.0, -4.0]


def test_jsonl_regex_reward():
    task = get_task("jsonl", path=USER_JSONL, reward="regex", pattern=r"[0-9]+")
    example = Example("q", "ignored")
    assert task.reward_fn([" 42 ", "42 apples", "", "7"], [example] * 4) == [1.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"reward": "bleu"}, "unknown reward 'bleu'"),
        ({"reward": "regex"}, "needs the 'pattern' option"),
        ({"reward": "regex", "pattern": "("}, "bad regex pattern"),
        ({"pattern": "x"}, "only used by the regex reward"),
    ],
)
def test_jsonl_option_errors(options, message):
    with pytest.raises(ValueError, match=message):
        get_task("jsonl", path=USER_JSONL, **options)


@pytest.mark.parametrize(
    "lines, message",
    [
        ([], "no examples"),
        (["", "  "], "no examples"),
        (['{"prompt": "a", "target": "b"}', "{not json"], "line 2: bad JSON"),
        (['{"prompt": "a"}'], "line 1: missing key 'target'"),
        (['{"prompt": "a", "target": "b"}', "", '{"target": "b"}'], "line 3: missing key 'prompt'"),
        (["[1, 2]"], "line 1: expected a JSON object"),
        (['{"prompt": "a", "target": "b", "split": "test"}'], "line 1: 'split' must be one of"),
    ],
)
def test_jsonl_bad_files_name_the_line(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines))
    with pytest.raises(ValueError, match=message):
        load_jsonl_examples(path)


def test_jsonl_numeric_targets_become_text(tmp_path):
    path = tmp_path / "numbers.jsonl"
    path.write_text(json.dumps({"prompt": "2 + 2?", "target": 4}) + "\n")
    assert load_jsonl_examples(path)["train"] == [Example("2 + 2?", "4")]


def test_jsonl_missing_file_is_a_configuration_error_naming_it(tmp_path):
    from evolm_lib.config import ConfigError, ESConfig
    from evolm_lib.tasks.jsonl import JsonlFileNotFoundError, JsonlTaskError

    missing = tmp_path / "nope.jsonl"
    with pytest.raises(JsonlFileNotFoundError, match=f"JSONL task file {missing} not found") as caught:
        load_jsonl_examples(missing)
    assert isinstance(caught.value, FileNotFoundError) and caught.value.path == missing
    with pytest.raises(JsonlTaskError, match=r"not found \(relative to "):
        load_jsonl_examples("no_such_dir/nope.jsonl")
    with pytest.raises(ConfigError, match=f"JSONL task file {missing} not found"):
        ESConfig(model="tiny-random", task="jsonl", task_options={"path": str(missing)})


def test_jsonl_bad_line_is_a_configuration_error_with_file_and_line(tmp_path):
    from evolm_lib.config import ConfigError, ESConfig
    from evolm_lib.tasks.jsonl import JsonlTaskError

    path = tmp_path / "task.jsonl"
    path.write_text('{"prompt": "a", "target": "b"}\n\n{"prompt": 3, "target": "b"}\n')
    with pytest.raises(JsonlTaskError) as caught:
        load_jsonl_examples(path)
    assert (caught.value.path, caught.value.line) == (path, 3)
    with pytest.raises(ConfigError, match=f"JSONL task file {path}, line 3: 'prompt' must be a string"):
        ESConfig(model="tiny-random", task="jsonl", task_options={"path": str(path)})


def test_a_jsonl_file_with_a_byte_that_is_not_utf8_is_named_with_its_line(tmp_path):
    """A Latin-1 'é' (0xe9) on line 2: the error names the file, the line, the column and the byte, not
    "'utf-8' codec can't decode byte 0xe9 in position 99"."""
    from evolm_lib.config import ConfigError, ESConfig
    from evolm_lib.tasks.jsonl import JsonlTaskError

    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a", "target": "b"}\n{"prompt": "caf\xe9?", "target": "x"}\n')
    with pytest.raises(JsonlTaskError, match=rf"^JSONL task file {path}, line 2: not UTF-8 text: byte 0xe9 at "
                                             r"column 16 \(invalid continuation byte\); save the file as UTF-8$") as caught:
        load_jsonl_examples(path)
    assert (caught.value.path, caught.value.line) == (path, 2)
    with pytest.raises(ConfigError, match=f"JSONL task file {path}, line 2: not UTF-8 text"):
        ESConfig(model="tiny-random", task="jsonl", task_options={"path": str(path)})


@pytest.mark.parametrize("target, shown", [(None, "null"), (True, "true"), ([1], "[1]"), ({"a": 1}, '{"a": 1}')])
def test_a_jsonl_target_that_is_not_text_or_a_number_is_refused_not_turned_into_text(tmp_path, target, shown):
    """`"target": null` became the string "None" (and true "True"): refused, naming the file and the line."""
    path = tmp_path / "null.jsonl"
    path.write_text(json.dumps({"prompt": "a", "target": "b"}) + "\n" + json.dumps({"prompt": "c", "target": target}) + "\n")
    with pytest.raises(ValueError, match=rf"^JSONL task file {path}, line 2: 'target' must be a string or a number, "
                                         rf"got {re.escape(shown)}$"):
        load_jsonl_examples(path)


def test_a_countdown_file_with_a_byte_that_is_not_utf8_is_named_with_its_line(tmp_path):
    from evolm_lib.tasks.countdown import load_countdown_json

    path = tmp_path / "countdown.json"
    line = b'  {"numbers": [1, 2], "target": 3, "note": "\xe9"}'
    path.write_bytes(b"[\n" + line + b"\n]\n")
    column = line.index(b"\xe9") + 1
    with pytest.raises(ValueError, match=rf"^{path}, line 2, column {column}: not UTF-8 text \(byte 0xe9"):
        load_countdown_json(path)
