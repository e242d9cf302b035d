"""User tasks from a JSONL file, scored by a named reward.

One JSON object per line: {"prompt": ..., "target": ..., "split": "train" | "eval"}
("split" is optional and defaults to "train"). Blank lines are skipped.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from evolm_lib.tasks.base import Example, RewardResult, Task, register_task
from evolm_lib.tasks.conciseness import length_reward

REWARDS = ("exact_match", "length", "regex")
"""Names of the rewards a JSONL task can use."""
SPLITS = ("train", "eval")


def load_jsonl_examples(path: str | Path) -> dict[str, list[Example]]:
    """Examples of a JSONL file grouped by split; ValueError naming the line for a bad file."""
    examples: dict[str, list[Example]] = {split: [] for split in SPLITS}
    with open(path, encoding="utf-8") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: bad JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            missing = [key for key in ("prompt", "target") if key not in record]
            if missing:
                raise ValueError(f"{where}: missing key {', '.join(map(repr, missing))}")
            if not isinstance(record["prompt"], str):
                raise ValueError(f"{where}: 'prompt' must be a string")
            split = record.get("split", "train")
            if split not in SPLITS:
                raise ValueError(f"{where}: 'split' must be one of {SPLITS}, got {split!r}")
            extras = {key: value for key, value in record.items() if key not in ("prompt", "target", "split")}
            examples[split].append(Example(record["prompt"], str(record["target"]), extras))
    if not any(examples.values()):
        raise ValueError(f"{path}: no examples (the file is empty)")
    return examples


def exact_match_reward(completion: str, target: str, case_sensitive: bool = True) -> RewardResult:
    """1.0 when the stripped completion equals the stripped target, else 0.0."""
    answer, expected = completion.strip(), target.strip()
    if not case_sensitive:
        answer, expected = answer.casefold(), expected.casefold()
    return RewardResult(float(answer == expected), {"answer": completion.strip()})


def regex_reward(completion: str, pattern: str | re.Pattern) -> RewardResult:
    """1.0 when the whole stripped completion matches the pattern, else 0.0."""
    matched = re.fullmatch(pattern, completion.strip()) is not None
    return RewardResult(float(matched), {"pattern": getattr(pattern, "pattern", pattern)})


@register_task("jsonl")
class JsonlTask(Task):
    """Prompts and targets from a JSONL file with an exact-match, length or regex reward."""

    name = "jsonl"

    def __init__(
        self,
        path: str | Path,
        reward: str = "exact_match",
        pattern: str | None = None,
        system: str | None = None,
        case_sensitive: bool = True,
    ):
        """Read `path`; `pattern` is required for the regex reward, `system` is an optional system message."""
        if reward not in REWARDS:
            raise ValueError(f"unknown reward {reward!r}; choose one of {', '.join(REWARDS)}")
        if reward == "regex":
            if pattern is None:
                raise ValueError("the regex reward needs the 'pattern' option")
            try:
                self._pattern = re.compile(pattern)
            except re.error as error:
                raise ValueError(f"bad regex pattern {pattern!r}: {error}") from None
        elif pattern is not None:
            raise ValueError(f"'pattern' is only used by the regex reward, not {reward!r}")
        self.path = Path(path)
        self.reward_name = reward
        self.success_threshold = 0.0 if reward == "length" else 1.0  # exact length, or a match
        self.case_sensitive = case_sensitive
        self.system_prompt = system
        self._examples = load_jsonl_examples(self.path)

    def train_examples(self) -> list[Example]:
        """Lines with split "train" (or no split)."""
        return list(self._examples["train"])

    def eval_examples(self) -> list[Example]:
        """Lines with split "eval"."""
        return list(self._examples["eval"])

    def reward(self, completion: str, example: Example) -> RewardResult:
        """The chosen reward of one completion."""
        if self.reward_name == "length":
            return length_reward(completion, example.target)
        if self.reward_name == "regex":
            return regex_reward(completion, self._pattern)
        return exact_match_reward(completion, example.target, self.case_sensitive)
