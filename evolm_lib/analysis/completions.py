"""Held-out answers and completions, read from run folders: whether an answer was empty or held
its target (`ANSWER_FLAGS`), the share of such answers per run, and the final greedy completions of
every run side by side."""
from __future__ import annotations

import re
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from ..metrics import completions_table
from .load import Groups, RunRecord, heldout_rows


def empty_answer(row: Mapping[str, Any]) -> bool | None:
    """Whether a held-out row's answer was empty or nothing but whitespace (where the reward is minus
    the length gap, as on conciseness, an empty one scores minus the target's length): its
    ``completion``, or the ``empty`` flag a compacted run keeps instead; None where the row has neither."""
    if "empty" in row:
        return bool(row["empty"])
    return not row["completion"].strip() if isinstance(row.get("completion"), str) else None


def target_in_answer(row: Mapping[str, Any]) -> bool | None:
    """Whether a held-out row's answer holds its target as a word of its own, in any case ("Paris" in
    "The capital is Paris."; "10" not in "100"): whether it is right, where the reward does not check
    (conciseness scores the length only). Its ``completion`` and ``target``, or the ``has_target``
    flag a compacted run keeps instead; None where the row has neither."""
    if "has_target" in row:
        return bool(row["has_target"])
    completion, target = row.get("completion"), row.get("target")
    if not isinstance(completion, str) or not isinstance(target, str) or not target.strip():
        return None
    return re.search(rf"(?<!\w){re.escape(target.strip())}(?!\w)", completion, re.IGNORECASE) is not None


ANSWER_FLAGS = {"empty": empty_answer, "has_target": target_in_answer}
"""What each held-out answer is judged by, under the name of the flag ``compact`` keeps in its place."""

ANSWER_SHARES = {"empty_answers": "empty", "target_answers": "has_target"}
"""The held-out table's columns of answer shares, and the flag each counts."""


def answer_share(record: RunRecord, flag: str) -> float | None:
    """The share of a run's held-out answers ``ANSWER_FLAGS[flag]`` says yes to; None where its rows
    do not say (a compacted run from before ``compact`` kept the flag, or lines without the answers)."""
    flags = [ANSWER_FLAGS[flag](row) for row in heldout_rows(record) or []]
    return None if not flags or None in flags else statistics.fmean(flags)


def heldout_summary(lines: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """problems, the reward and success means of held-out lines, and the share of each of
    ``ANSWER_FLAGS`` (a flag its judge cannot give for every line, a target that is no text, left out)."""
    judged = {flag: [judge(line) for line in lines] for flag, judge in ANSWER_FLAGS.items()}
    return {"problems": len(lines), "reward": statistics.fmean(float(line["reward"]) for line in lines),
            "success": statistics.fmean(float(line["success"]) for line in lines),
            **{flag: statistics.fmean(map(float, flags)) for flag, flags in judged.items() if None not in flags}}


def side_by_side_completions(groups: Groups, example_index: int | Sequence[int] | None = None,
                             split: str = "eval", max_chars: int | None = 200):
    """Final greedy completions of every run for the same prompts of `split` ("eval" or "train"):
    one row per prompt, one column per (method, seed) (a DataFrame)."""
    from ..tasks import get_task

    if split not in ("eval", "train"):
        raise ValueError(f"split must be 'eval' or 'train', got {split!r}")
    key = f"policy/{split}_completions"
    columns: dict[str, list[str]] = {}
    first = None
    for label, runs in groups.items():
        for r in runs:
            completions = next((row[key] for row in reversed(r.rows) if row.get(key)), None)
            if completions is None:
                raise ValueError(f"{r.path} logged no {key!r}")
            columns[f"{label} seed {r.seed}"] = completions
            first = first or r
    if first is None:
        raise ValueError("no runs to show")
    task = get_task(first.config.get("task", "conciseness"), **(first.config.get("task_options") or {}))
    examples = task.eval_examples() if split == "eval" else task.train_examples()
    count = min([len(examples), *(len(c) for c in columns.values())])
    if example_index is None:
        indices = list(range(count))
    else:
        indices = [example_index] if isinstance(example_index, int) else list(example_index)
    bad = [i for i in indices if not -count <= i < count]
    if bad:
        raise IndexError(f"example index {bad} out of range: the runs logged {count} {split} completions")
    return completions_table(
        ({"prompt": examples[i].prompt, "target": examples[i].target, **{name: c[i] for name, c in columns.items()}}
         for i in indices),
        max_chars=max_chars,
    )
