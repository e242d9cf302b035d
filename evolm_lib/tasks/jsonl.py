"""User tasks from a JSONL file, scored by a named reward.

One JSON object per line::

    {"prompt": "Capital of France?", "target": "Paris", "split": "eval"}

- ``prompt`` (string, required): the user turn the model answers;
- ``target`` (required): the reference answer, a string or a number (numbers become text; null, true,
  a list or an object are refused);
- ``split`` (optional): "train" (the default: what the optimiser sees), "eval" (held out) or
  "validation" (for selecting settings, e.g. by `evolm tune`);
- any other key is kept in ``Example.data`` for rewards that need it.
Blank lines are skipped. Options (``task_options``): ``path`` (the file; relative paths are read from
the working directory: the project folder for `evolm batch`, notebooks/ in JupyterLab), ``reward``
("exact_match" 0/1 after stripping, "length" minus the character-length gap as in conciseness,
"regex" 0/1 when the stripped completion fully matches ``pattern``), ``system`` (a system message),
``case_sensitive`` (exact_match only), ``num_validation`` (the last this many "train" lines become
validation lines as well, carved from the training pool).

A missing file or a bad line is a JsonlTaskError (a ValueError, so a run's settings report it as a
configuration error before any engine starts) naming the file and the line.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from evolm_lib.tasks.base import Example, RewardResult, Task, register_task
from evolm_lib.tasks.conciseness import length_reward

REWARDS = ("exact_match", "length", "regex")
"""Names of the rewards a JSONL task can use."""
SPLITS = ("train", "eval", "validation")
REWARD_LABELS = {
    "exact_match": "exact match, 0 or 1",
    "length": "-|length difference|, chars",
    "regex": "regex match, 0 or 1",
}
"""Each reward in words with its unit, for axis labels."""


class JsonlTaskError(ValueError):
    """A JSONL task file is missing or holds a bad line; ``path`` and ``line`` (None for the file) say where."""

    def __init__(self, message: str, path: str | Path, line: int | None = None):
        super().__init__(message)
        self.path = Path(path)
        self.line = line


class JsonlFileNotFoundError(JsonlTaskError, FileNotFoundError):
    """The JSONL task file does not exist (also a FileNotFoundError)."""


def _line_error(path: Path, line_number: int, problem: str) -> JsonlTaskError:
    return JsonlTaskError(f"JSONL task file {path}, line {line_number}: {problem}", path, line_number)


def load_jsonl_examples(path: str | Path) -> dict[str, list[Example]]:
    """Examples of a JSONL file grouped by split; ValueError naming the line for a bad file."""
    path = Path(path).expanduser()
    if not path.is_file():
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
        kind = "is a folder, not a file" if path.is_dir() else "not found"
        raise JsonlFileNotFoundError(f"JSONL task file {path} {kind}{where}", path)
    examples: dict[str, list[Example]] = {split: [] for split in SPLITS}
    with open(path, "rb") as file:  # bytes: a line that is not UTF-8 is named by its number
        for line_number, raw in enumerate(file, start=1):
            fail = functools.partial(_line_error, path, line_number)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise fail(f"not UTF-8 text: byte 0x{raw[error.start]:02x} at column {error.start + 1} "
                           f"({error.reason}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise fail(f"bad JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise fail(f"expected a JSON object, got {type(record).__name__}")
            missing = [key for key in ("prompt", "target") if key not in record]
            if missing:
                raise fail(f"missing key {', '.join(map(repr, missing))}")
            if not isinstance(record["prompt"], str):
                raise fail("'prompt' must be a string")
            if not isinstance(record["target"], (str, int, float)) or isinstance(record["target"], bool):
                got = "null" if record["target"] is None else json.dumps(record["target"])
                raise fail(f"'target' must be a string or a number, got {got}")
            split = record.get("split", "train")
            if split not in SPLITS:
                raise fail(f"'split' must be one of {SPLITS}, got {split!r}")
            extras = {key: value for key, value in record.items() if key not in ("prompt", "target", "split")}
            examples[split].append(Example(record["prompt"], str(record["target"]), extras))
    if not any(examples.values()):
        raise JsonlTaskError(f"JSONL task file {path}: no examples (the file is empty)", path)
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
        num_validation: int = 0,
    ):
        """Read `path`; `pattern` is required for the regex reward, `system` is an optional system message;
        the last `num_validation` training lines become validation lines (beside the file's own)."""
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
        self.reward_label = REWARD_LABELS[reward]
        self.success_threshold = 0.0 if reward == "length" else 1.0  # exact length, or a match
        self.heldout_measure = "reward" if reward == "length" else "success"  # as conciseness, or a match
        self.case_sensitive = case_sensitive
        self.system_prompt = system
        self._examples = load_jsonl_examples(self.path)
        train = self._examples["train"]
        if num_validation < 0 or (num_validation and num_validation >= len(train)):  # training keeps one line
            raise ValueError(f"num_validation: between 0 and the {len(train)} training lines less one, "
                             f"got {num_validation}")
        if num_validation:
            self._examples["train"], carved = train[:-num_validation], train[-num_validation:]
            self._examples["validation"] = self._examples["validation"] + carved

    def train_examples(self) -> list[Example]:
        """Lines with split "train" (or no split)."""
        return list(self._examples["train"])

    def eval_examples(self) -> list[Example]:
        """Lines with split "eval"."""
        return list(self._examples["eval"])

    def validation_examples(self) -> list[Example]:
        """Lines with split "validation", then the training lines carved off by `num_validation`."""
        return list(self._examples["validation"])

    def reward(self, completion: str, example: Example) -> RewardResult:
        """The chosen reward of one completion."""
        if self.reward_name == "length":
            return length_reward(completion, example.target)
        if self.reward_name == "regex":
            return regex_reward(completion, self._pattern)
        return exact_match_reward(completion, example.target, self.case_sensitive)
