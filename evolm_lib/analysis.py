"""ES vs GRPO from run folders: load runs grouped by method, final points, seed spread, side-by-side
completions, the reward at an equal sample budget (the fair comparison), and the study's held-out
tables: accuracy per method with bootstrap intervals and whether two methods differ by more than seed
noise (`study_table`, `method_comparisons`; the maths in `evolm_lib.stats`). Reads files, starts no engine.

A run folder is what `ESRun` and `GRPORun` write (see `evolm_lib.runs`): config.yaml (with `kind`,
and `es_mode` for ES runs: lora, full or eggroll; older folders have none: lora) and metrics.jsonl.
Rows of both methods share the keys used here: `generation`/`step`, `seed`, `policy/train_reward`,
`eval/reward`, `samples/completions`, `samples/tokens`, `time/wall_s`, `time/generation_s`,
`policy/train_completions`, `policy/eval_completions`; `policy/kl` where a script recorded it
(`evolm_lib.runs.record_final_metrics`). `evolm sweep` adds kl.jsonl (the KL of each checkpoint) and
heldout.jsonl (the final mean adapter or policy scored greedily on the held-out problems, one line
per problem: `index`, `prompt`, `target`, `completion`, `reward`, `success`). This module only reads:
it writes no file; the summaries that hold its results are written by `evolm_lib.batch.summary`.
"""
from __future__ import annotations

import dataclasses
import glob
import itertools
import json
import math
import os
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .metrics import RESULT_COLUMNS, by_mean, completions_table, final_value, finite, interp, run_summary, series
from .stats import MAX_EXACT_SPLITS, bootstrap_interval, compare_seeds, holm, interquartile_mean, seed_interval, t_interval
from .types import NotARunFolder

# Settings that must agree across the compared runs, or the comparison is unfair.
COMPARED_FIELDS = ("model", "task", "task_options", "target_modules", "lora_rank", "lora_alpha",
                   "layers_to_transform", "max_new_tokens", "prompts_per_step")
# A method is its full set of settings: runs of one label that differ in any setting but these are
# split into methods of their own, each named by the settings it differs in. The seed is what varies
# within a method; `label` and `kind` name it already; budget, cadence and where the engines run do
# not change the science (`evolm_lib.runs.EXTENDABLE`: a run extended to more generations is the same method).
NOT_METHOD_SETTINGS = frozenset({"seed", "kind", "label"})
# Short names of settings in labels ("grpo G=8", "es N=16 lr=0.2"); every other setting by its own name.
SETTING_NAMES = {"population_size": "N", "group_size": "G", "learning_rate": "lr"}
# What a held-out score of a run is, per `measure`: the heldout.jsonl field averaged over problems,
# and the key its axes and tables are labelled by (evolm_lib.viz.labels).
HELDOUT_MEASURES = {"success": ("success", "heldout/accuracy"), "reward": ("reward", "heldout/reward")}
HELDOUT_FIELDS = ("index", "reward", "success")
"""The fields every line of heldout.jsonl must hold (``prompt``, ``target``, ``completion`` are shown, not scored)."""


class MixedRuns(ValueError):
    """The runs differ in settings that make the comparison unfair (model, task, LoRA layout, ...)."""


class RepeatedSeeds(ValueError):
    """Two runs of one method share a seed: pooled, they would pass for two seeds of one method."""


@dataclass(frozen=True)
class RunRecord:
    """One run folder, read: its label, seed, raw settings and metrics rows."""

    path: Path
    method: str
    seed: int | None
    config: dict = field(repr=False)
    rows: list[dict] = field(repr=False)
    heldout: list[dict] | None = field(default=None, repr=False)
    "its heldout.jsonl lines when read from elsewhere (a compacted study); None: read from the folder"

    @property
    def kind(self) -> str:
        """'es' or 'grpo', from config.yaml."""
        return str(self.config.get("kind", "es"))

    @property
    def name(self) -> str:
        """The folder's name."""
        return self.path.name

    @property
    def es_mode(self) -> str | None:
        """What an ES run moved (lora, full or eggroll; lora for folders older than the setting); None for GRPO."""
        return str(self.config.get("es_mode") or "lora") if self.kind == "es" else None


Groups = Mapping[str, Sequence[RunRecord]]


# --------------------------------------------------------------------------- loading


def read_run(path: str | os.PathLike, label: str | None = None) -> RunRecord:
    """Read one run folder; fail with NotARunFolder when config.yaml or metrics.jsonl is missing or empty."""
    import yaml

    from .runs import read_metrics

    path = Path(path)
    missing = [name for name in ("config.yaml", "metrics.jsonl") if not (path / name).is_file()]
    if missing:
        raise NotARunFolder(f"{path} is not a run folder: no {' and no '.join(missing)}")
    config = yaml.safe_load((path / "config.yaml").read_text()) or {}
    if not isinstance(config, dict):
        raise NotARunFolder(f"{path}/config.yaml does not hold a mapping of settings")
    rows = read_metrics(path)
    if not rows:
        raise NotARunFolder(f"{path}/metrics.jsonl holds no rows (a run that never scored its first adapter)")
    method = label or str(config.get("label") or method_label(config))
    seed = config.get("seed", next((r["seed"] for r in rows if "seed" in r), None))
    return RunRecord(path, method, seed, config, rows)


def method_label(config: Mapping[str, Any]) -> str:
    """A run's default label from its settings: its kind ("es", "grpo"), and for runs that moved the
    model's own weights the mode too ("es full", "es eggroll", "grpo full"; LoRA runs stay "es", "grpo")."""
    kind = str(config.get("kind", "es"))
    mode = str(config.get("es_mode" if kind == "es" else "policy_weights") or "lora")
    return f"{kind} {mode}" if mode != "lora" else kind


def read_heldout(run_dir: str | os.PathLike) -> list[dict] | None:
    """The rows of a run's heldout.jsonl (its final mean adapter or policy scored greedily on the
    held-out problems, one row per problem), in file order; None when the run has no such file.
    A line torn by a kill is skipped; a row without `index`, `reward` or `success` fails, naming it."""
    from .runs import read_jsonl

    path = Path(run_dir) / "heldout.jsonl"
    if not path.is_file():
        return None
    rows = read_jsonl(path)
    for number, row in enumerate(rows, start=1):
        missing = [name for name in HELDOUT_FIELDS if name not in row]
        if missing:
            raise ValueError(f"{path}: row {number} has no {', '.join(missing)} "
                             f"(each line of heldout.jsonl holds {', '.join(HELDOUT_FIELDS)})")
    return rows


def _patterns(value: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """The globs given, without empty ones (an empty pattern means "none of this method")."""
    values = [value] if isinstance(value, (str, os.PathLike)) else list(value)
    return [os.fspath(v) for v in values if os.fspath(v).strip()]


def method_globs(folder: str | os.PathLike) -> dict[str, str]:
    """{"es": FOLDER/es_*, "grpo": FOLDER/grpo_*} for a sweep's folder, each "" when it matches no
    folder (a sweep of one kind of method): what ``load_runs`` and notebook 04 take."""
    folder = Path(folder)
    return {kind: str(folder / f"{kind}_*") if any(p.is_dir() for p in folder.glob(f"{kind}_*")) else ""
            for kind in ("es", "grpo")}


def _expand(pattern: str) -> list[Path]:
    """Run folders a glob matches (files it matches are ignored); fails on a pattern that matches none."""
    matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern)))
    folders = [p for p in matches if p.is_dir()]
    if not folders:
        where = "" if os.path.isabs(os.path.expanduser(pattern)) else f" (relative to {os.getcwd()})"
        raise FileNotFoundError(f"{pattern!r} matches no run folder{where}")
    return folders


def load_runs(patterns: str | os.PathLike | Sequence[str | os.PathLike] | Mapping[str, Any],
              allow_mixed: bool = False) -> dict[str, list[RunRecord]]:
    """Run folders from globs, grouped by method label: {label: [RunRecord, ...] sorted by seed}.

    The label is the mapping's key when ``patterns`` is a mapping {label: glob(s)}, else the
    config.yaml's `label` key if it has one, else its `kind` ("es" or "grpo") and, for ES runs that
    moved the model's own weights, its `es_mode` ("es full", "es eggroll": `method_label`). A method is
    its full set of settings: runs of one label that differ in any setting but the seed (and budget,
    cadence and engine placement: `NOT_METHOD_SETTINGS`, `evolm_lib.runs.EXTENDABLE`) are split, each
    label naming every setting in which they differ ("grpo G=8", "es sigma=0.1 lr=0.4": `method_labels`).
    A method with two runs of one seed fails with RepeatedSeeds: they are never pooled as seeds.
    Without a mapping, ES labels are ordered lora, eggroll, full where ES first appears. Empty
    patterns are skipped (only ES runs: ``[es_glob, ""]``); every other pattern must match a folder,
    every folder must be a run folder, and the runs must share COMPARED_FIELDS unless ``allow_mixed``.
    """
    if isinstance(patterns, Mapping):
        sources = [(str(label), p) for label, value in patterns.items() for p in _patterns(value)]
    else:
        sources = [(None, p) for p in _patterns(patterns)]
    if not sources:
        raise ValueError("no run folder patterns given")
    records, seen = [], set()
    for label, pattern in sources:
        for folder in _expand(pattern):
            if folder.resolve() not in seen:
                seen.add(folder.resolve())
                records.append(read_run(folder, label))
    if not allow_mixed:
        check_comparable(records)
    groups: dict[str, list[RunRecord]] = {}
    for record, label in zip(records, method_labels([r.config for r in records], [r.method for r in records])):
        groups.setdefault(label, []).append(record if record.method == label else
                                            RunRecord(record.path, label, record.seed, record.config, record.rows))
    for runs in groups.values():
        runs.sort(key=lambda r: (r.seed is None, r.seed if r.seed is not None else 0, str(r.path)))
    check_distinct_seeds(groups)
    if not isinstance(patterns, Mapping):
        groups = _ordered_by_mode(groups)
    return groups


def method_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """A run's settings that make it the method it is: its config.yaml resolved through its config
    class (settings added since filled with their defaults; the raw file where it no longer loads),
    without the seed, its names and the settings that do not change the science (`NOT_METHOD_SETTINGS`,
    `evolm_lib.runs.EXTENDABLE`)."""
    from .config import config_class
    from .runs import EXTENDABLE

    data = {k: v for k, v in config.items() if k not in ("kind", "label")}
    if config.get("kind", "es") == "es" and "noise_scheme" not in data:
        data["noise_scheme"] = "per_tensor"  # as `runs.load_run_config` reads a folder older than the setting
    try:
        resolved = config_class(str(config.get("kind", "es"))).from_dict(data).to_dict()
    except Exception:  # noqa: BLE001 - settings this version no longer has: compare the file as written
        resolved = data
    return {k: v for k, v in resolved.items() if k not in NOT_METHOD_SETTINGS and k not in EXTENDABLE}


def folder_settings(run_dir: str | os.PathLike | None) -> dict[str, Any]:
    """`method_settings` of the run in ``run_dir`` from its config.yaml ({} when it has none)."""
    import yaml

    path = Path(run_dir) / "config.yaml" if run_dir else None
    if path is None or not path.is_file():
        return {}
    config = yaml.safe_load(path.read_text()) or {}
    return method_settings(config) if isinstance(config, dict) else {}


def varying_settings(settings: Sequence[Mapping[str, Any]]) -> list[str]:
    """The names of the settings whose values differ across ``settings`` (a setting one of them lacks
    differs), in the order they first appear."""
    names = list(dict.fromkeys(name for values in settings for name in values))
    return [name for name in names if len({_text(values.get(name)) for values in settings}) > 1]


def _text(value: Any) -> str:
    """A setting's value as label text: floats in %g, mappings and lists as compact JSON."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, separators=(",", ":"), sort_keys=True, default=str)
    return str(value)


def method_labels(configs: Sequence[Mapping[str, Any]], labels: Sequence[str | None] | None = None) -> list[str]:
    """Each run's method label: its given label (else `method_label` of its config), followed by every
    setting in which it differs from runs of the same label (`method_settings`), e.g. four ES variants
    that differ in sigma and learning rate: "es sigma=0.1 lr=0.4", ...; runs of one label and the same
    settings share it."""
    bases = [label or str(config.get("label") or method_label(config))
             for config, label in zip(configs, labels or [None] * len(configs))]
    settings = [method_settings(config) for config in configs]
    varying = {base: varying_settings([s for b, s in zip(bases, settings) if b == base]) for base in set(bases)}
    return [" ".join([base, *(f"{SETTING_NAMES.get(name, name)}={_text(values.get(name))}" for name in varying[base])])
            for base, values in zip(bases, settings)]


def check_distinct_seeds(groups: Groups) -> None:
    """Raise RepeatedSeeds naming every method that holds two runs of one seed, and their folders."""
    repeated = []
    for label, runs in groups.items():
        by_seed: dict[Any, list[str]] = {}
        for record in runs:
            by_seed.setdefault(record.seed, []).append(str(record.path))
        repeated += [f"{label!r} seed {seed}: {', '.join(paths)}" for seed, paths in by_seed.items() if len(paths) > 1]
    if repeated:
        raise RepeatedSeeds("runs of one method share a seed, and pooling them would count one seed twice — "
                            + " | ".join(repeated) + " (a run made twice with the same settings: remove one of them "
                            "or give each its own label, {label: glob})")


ES_MODE_ORDER = ("lora", "eggroll", "full")
"""The order of ES labels of one kind in tables and figures (folder names sort eggroll, full, lora)."""


def _ordered_by_mode(groups: dict[str, list[RunRecord]]) -> dict[str, list[RunRecord]]:
    """The labels with each kind where it first appears, and within ES the modes in ES_MODE_ORDER."""
    labels = list(groups)
    first_of_kind: dict[str, int] = {}
    for index, label in enumerate(labels):
        first_of_kind.setdefault(groups[label][0].kind, index)

    def position(label: str) -> tuple[int, int, int]:
        record = groups[label][0]
        mode = ES_MODE_ORDER.index(record.es_mode) if record.es_mode in ES_MODE_ORDER else len(ES_MODE_ORDER)
        return first_of_kind[record.kind], mode, labels.index(label)

    return {label: groups[label] for label in sorted(labels, key=position)}


def check_comparable(records: Sequence[RunRecord], fields: Sequence[str] = COMPARED_FIELDS) -> None:
    """Raise MixedRuns listing every field in which the runs differ, and which runs hold which value."""
    differences = []
    for name in fields:
        values: dict[str, list[str]] = {}
        for record in records:
            values.setdefault(repr(record.config.get(name)), []).append(record.name)
        if len(values) > 1:
            listing = "; ".join(f"{value} ({', '.join(names)})" for value, names in values.items())
            differences.append(f"{name}: {listing}")
    if differences:
        raise MixedRuns("the runs differ in settings that make the comparison unfair — "
                        + " | ".join(differences) + " (pass allow_mixed=True to compare anyway)")


def runs_for_plots(groups: Groups) -> dict[str, list[list[dict]]]:
    """{label: [rows of seed 0, rows of seed 1, ...]}: the input of the plots' ES-vs-GRPO figures."""
    return {label: [record.rows for record in runs] for label, runs in groups.items()}


def describe_runs(groups: Groups):
    """One line per run: label, seed, folder, steps, samples, wall time and final rewards (a DataFrame)."""
    import pandas as pd

    lines = []
    for label, runs in groups.items():
        for r in runs:
            last = r.rows[-1]
            lines.append({
                "method": label, "seed": r.seed, "run": r.name, "kind": r.kind,
                "steps": last.get("generation", last.get("step")),
                "samples/completions": final_value(r.rows, "samples/completions"),
                "time/wall_s": final_value(r.rows, "time/wall_s"),
                "policy/train_reward": final_value(r.rows, "policy/train_reward"),
                "eval/reward": final_value(r.rows, "eval/reward"),
            })
    return pd.DataFrame(lines)


# --------------------------------------------------------------------------- final values


def final_points(groups: Groups, reward_key: str = "eval/reward", kl_key: str = "policy/kl") -> list[dict]:
    """One {method, seed, kl, reward} per run: the last logged reward, and KL from the last row that
    has it (None when no row does)."""
    return [{"method": label, "seed": r.seed, "kl": final_value(r.rows, kl_key), "reward": final_value(r.rows, reward_key)}
            for label, runs in groups.items() for r in runs]


def checkpoint_points(groups: Groups, reward_key: str = "eval/reward") -> list[dict]:
    """One {method, seed, generation, kl, reward} per measured checkpoint (kl.jsonl of ``evolm sweep``):
    each run's path through reward and KL, to compare the methods at equal reward. [] when none has any."""
    from .runs import read_checkpoint_kls

    points = []
    for label, runs in groups.items():
        for record in runs:
            by_generation = {row.get("generation", row.get("step")): row.get(reward_key) for row in by_mean(record.rows)}
            for entry in read_checkpoint_kls(record.path):
                reward = by_generation.get(entry["generation"])
                if reward is not None:
                    points.append({"method": label, "seed": record.seed, "generation": entry["generation"],
                                   "kl": entry["policy/kl"], "reward": reward})
    return points


def split_points_by_kl(points: Sequence[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], str]:
    """(points with a KL, a note naming the runs without one: they are left out of the scatter)."""
    kept = [p for p in points if p.get("kl") is not None and p.get("reward") is not None]
    left_out = [f"{p.get('method')} seed {p.get('seed')}" for p in points if p not in kept]
    note = ""
    if left_out:
        note = (f"{len(left_out)} run(s) without a KL or reward left out of the scatter: {', '.join(left_out)} "
                "(`evolm sweep` records policy/kl at the end of each run)")
    return kept, note


def _std(values: Sequence[float]) -> float:
    """Sample std (n - 1); NaN for fewer than two values."""
    if len(values) < 2:
        return math.nan
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def seed_spread_table(groups: Groups, key: str = "eval/reward"):
    """Per method: seeds, mean, std (n - 1), min, max of the final `key` across seeds, and, when ES
    runs are among them, `std(es)/std`: ES's std over this method's (1 on the ES row itself)."""
    import pandas as pd

    lines = []
    for label, runs in groups.items():
        finals = [v for v in (final_value(r.rows, key) for r in runs) if v is not None]
        lines.append({"method": label, "seeds": len(finals),
                      "mean": sum(finals) / len(finals) if finals else math.nan, "std": _std(finals),
                      "min": min(finals, default=math.nan), "max": max(finals, default=math.nan)})
    # the LoRA ES runs when there are several ES modes; else the first ES label
    es_labels = [label for label, runs in groups.items() if runs and runs[0].kind == "es"]
    es_label = next((label for label in es_labels if groups[label][0].es_mode == "lora"), next(iter(es_labels), None))
    if es_label is not None:
        es_std = next(line["std"] for line in lines if line["method"] == es_label)
        for line in lines:
            # a zero std has no ratio: NaN rather than inf
            line["std(es)/std"] = es_std / line["std"] if line["std"] else math.nan
    table = pd.DataFrame(lines).set_index("method")
    table.attrs["key"] = key
    return table


def reward_label(groups: Groups) -> str | None:
    """The compared runs' reward in words (their task's ``reward_label``), for axis titles."""
    from .tasks import get_task

    first = next((r for runs in groups.values() for r in runs), None)
    if first is None:
        return None
    try:
        return get_task(first.config.get("task", "conciseness"), **(first.config.get("task_options") or {})).reward_label
    except Exception:  # noqa: BLE001 - a task file moved since: the axes say "reward" without its definition
        return None


def run_length(config: Mapping[str, Any]) -> int | None:
    """A run's last generation (ES) or step (GRPO), from its settings (config.yaml's, with its kind)."""
    return config.get("num_steps" if config.get("kind") == "grpo" else "num_generations")


def run_results(run_dir: str | os.PathLike) -> dict[str, Any]:
    """A run folder's results, for batch summaries: kind, budget, `metrics.run_summary` and the
    final eval accuracy where the task has a success threshold. {} for a folder that holds no run."""
    try:
        record = read_run(run_dir)
    except (NotARunFolder, OSError):
        return {}
    return {"kind": record.kind, "budget": run_length({**record.config, "kind": record.kind}), **run_summary(record.rows),
            "eval_accuracy_final": final_accuracy(record)}


RUN_RESULT_COLUMNS = ("kind", "budget", *RESULT_COLUMNS, "eval_accuracy_final")
"""The columns of `run_results`, in order."""


def final_accuracy(record: RunRecord, split: str = "eval") -> float | None:
    """Share of the final greedy completions on `split` prompts at or above the task's success
    threshold (None when the task has none, or no completions were logged)."""
    from .tasks import get_task

    completions = next((row[f"policy/{split}_completions"] for row in reversed(record.rows)
                        if row.get(f"policy/{split}_completions")), None)
    if not completions:
        return None
    try:
        task = get_task(record.config.get("task", "conciseness"), **(record.config.get("task_options") or {}))
    except Exception:  # noqa: BLE001 - the task's data moved since: no accuracy rather than no summary
        return None
    if task.success_threshold is None:
        return None
    examples = task.eval_examples() if split == "eval" else task.train_examples()
    pairs = list(zip(completions, examples))
    rewards = task.reward_fn([c for c, _ in pairs], [e for _, e in pairs])
    return sum(r >= task.success_threshold for r in rewards) / len(rewards) if rewards else None


# --------------------------------------------------------------------------- the fair comparison


def _curve(record: RunRecord, budget_key: str, reward_key: str) -> tuple[list[float], list[float]]:
    """(budgets, rewards) of a run's rows that have both, in budget order."""
    pairs = sorted(zip(*series(record.rows, reward_key, x=budget_key)))
    if not pairs:
        raise ValueError(f"{record.path} has no row with both {budget_key!r} and {reward_key!r}")
    return [p[0] for p in pairs], [p[1] for p in pairs]


def equal_budget_table(groups: Groups, budget_key: str = "samples/completions", reward_key: str = "eval/reward"):
    """Reward of each method at the largest `budget_key` every run reached, interpolated linearly
    between the logged points of each run, then mean/std/min/max across seeds (a DataFrame; the
    common budget is also in `.attrs["budget"]`)."""
    import pandas as pd

    curves = {label: [_curve(r, budget_key, reward_key) for r in runs] for label, runs in groups.items()}
    if not curves:
        raise ValueError("no runs to compare")
    budget = min(xs[-1] for runs in curves.values() for xs, _ in runs)
    lines = []
    for label, runs in curves.items():
        values = [interp(budget, xs, ys) for xs, ys in runs]
        lines.append({"method": label, "seeds": len(values), budget_key: budget,
                      "reward_mean": sum(values) / len(values), "reward_std": _std(values),
                      "reward_min": min(values), "reward_max": max(values),
                      "final_budget_mean": sum(xs[-1] for xs, _ in runs) / len(runs),
                      "final_reward_mean": sum(ys[-1] for _, ys in runs) / len(runs)})
    table = pd.DataFrame(lines).set_index("method")
    table.attrs.update(budget=budget, budget_key=budget_key, reward_key=reward_key)
    return table


def equal_budget_comparisons(groups: Groups, budget_key: str = "samples/completions", reward_key: str = "eval/reward",
                             alpha: float = 0.05, level: float = 0.95, num_resamples: int = 10_000, seed: int = 0):
    """``method_comparisons`` at the common budget of ``equal_budget_table``: each run's `reward_key`
    interpolated at the largest `budget_key` every run reached, compared pair by pair across seeds
    (runs stopped before their budget included: the fair comparison when some did not finish).
    ``.attrs["budget"]`` holds that budget."""
    budget = equal_budget_table(groups, budget_key, reward_key).attrs["budget"]
    per_seed = {label: [interp(budget, *_curve(r, budget_key, reward_key)) for r in runs] for label, runs in groups.items()}
    table = _pairwise(per_seed, alpha=alpha, level=level, num_resamples=num_resamples, seed=seed)
    table.attrs.update(budget=budget, budget_key=budget_key, reward_key=reward_key, alpha=alpha, level=level)
    return table


# --------------------------------------------------------------------------- the study: held-out scores


def _measure(measure: str) -> tuple[str, str]:
    """(heldout.jsonl field, label key) of a measure; fails naming the setting."""
    if measure not in HELDOUT_MEASURES:
        raise ValueError(f"measure: one of {', '.join(map(repr, HELDOUT_MEASURES))} (share of problems solved, "
                         f"or the task's mean reward where accuracy does not apply), got {measure!r}")
    return HELDOUT_MEASURES[measure]


def default_measure(groups: Groups) -> str:
    """The held-out measure of the compared runs' task (its ``heldout_measure``: "reward" for
    conciseness, "success" for arithmetic and countdown); "success" when the task no longer loads."""
    from .tasks import get_task

    first = next((r for runs in groups.values() for r in runs), None)
    if first is None:
        return "success"
    try:
        task = get_task(first.config.get("task", "conciseness"), **(first.config.get("task_options") or {}))
    except Exception:  # noqa: BLE001 - a task file moved since: the share of problems solved
        return "success"
    return task.heldout_measure


def heldout_rows(record: RunRecord) -> list[dict] | None:
    """A run's held-out rows: those it carries (a compacted study's), else its heldout.jsonl's."""
    return record.heldout if record.heldout is not None else read_heldout(record.path)


def heldout_scores(record: RunRecord, measure: str = "success") -> list[float] | None:
    """One number per held-out problem of a run: 1.0 or 0.0 for ``measure="success"``, the task's
    reward for ``"reward"``; None when the run has no heldout.jsonl."""
    field_name, _ = _measure(measure)
    rows = heldout_rows(record)
    if rows is None:
        return None
    return [float(bool(row[field_name])) if field_name == "success" else float(row[field_name]) for row in rows]


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


def _runs_with_scores(groups: Groups, measure: str) -> tuple[dict[str, list[tuple[RunRecord, list[float]]]], list[str]]:
    """{label: [(run, its held-out scores), ...]} of the runs that have any, and the names of those left out.
    Each run comes back carrying its held-out rows, so what reads them next reads no file again."""
    kept: dict[str, list[tuple[RunRecord, list[float]]]] = {}
    left_out = []
    for label, runs in groups.items():
        for record in runs:
            record = dataclasses.replace(record, heldout=heldout_rows(record))
            scores = heldout_scores(record, measure)
            if scores:
                kept.setdefault(label, []).append((record, scores))
            else:
                left_out.append(f"{label} seed {record.seed} ({record.name})")
    return kept, left_out


def _left_out_note(left_out: Sequence[str]) -> str:
    return (f"{len(left_out)} run(s) without held-out scores left out: {', '.join(left_out)} "
            "(`evolm sweep` writes heldout.jsonl after each run)") if left_out else ""


def _seconds_per_step(rows: Sequence[Mapping[str, Any]]) -> list[float]:
    return [float(row["time/generation_s"]) for row in rows if finite(row.get("time/generation_s"))]


def heldout_table(groups: Groups, measure: str = "success", level: float = 0.95, num_resamples: int = 10_000,
                  seed: int = 0):
    """One row per run: its held-out score (mean over problems of ``measure``) with a percentile
    bootstrap interval over problems (`stats.bootstrap_interval`, ``seed``), the problem count, and the
    final KL to the base model (a DataFrame: method, seed, run, problems, value, ci_low, ci_high, kl).
    Runs without heldout.jsonl get 0 problems and NaN scores."""
    import pandas as pd

    _measure(measure)
    lines = []
    for label, runs in groups.items():
        for record in runs:
            scores = heldout_scores(record, measure)
            value, low, high = (bootstrap_interval(scores, level=level, num_resamples=num_resamples, seed=seed)
                                if scores else (math.nan, math.nan, math.nan))
            kl = final_value(record.rows, "policy/kl")
            lines.append({"method": label, "seed": record.seed, "run": record.name, "problems": len(scores or ()),
                          "value": value, "ci_low": low, "ci_high": high, "kl": math.nan if kl is None else kl})
    table = pd.DataFrame(lines, columns=["method", "seed", "run", "problems", "value", "ci_low", "ci_high", "kl"])
    table.attrs.update(measure=measure, key=HELDOUT_MEASURES[measure][1], level=level)
    return table


def study_table(groups: Groups, measure: str = "success", level: float = 0.95, num_resamples: int = 10_000,
                seed: int = 0):
    """One row per method, from each run's heldout.jsonl (a DataFrame indexed by method).

    Columns: ``seeds`` (runs with held-out scores), ``problems`` (the fewest any of them scored);
    ``mean``, ``ci_low``, ``ci_high``: the mean across seeds of each run's held-out score (share of
    problems solved for ``measure="success"``, mean task reward for ``"reward"``, e.g. minus the
    length gap for conciseness) with a BCa bootstrap interval across seeds at ``level``
    (`stats.seed_interval`; NaN where BCa is undefined; Student's t below ``stats.MIN_BOOTSTRAP_VALUES``
    seeds), ``interval`` naming which; ``t_low``, ``t_high``: Student's t
    interval across seeds (`stats.t_interval`); for ``measure="success"`` both are cut to [0, 1]; ``iqm``: the interquartile mean across seeds;
    ``seed_std`` (n - 1), ``min``, ``max``; ``per_seed``: each seed's score and its bootstrap interval
    over problems, as text; ``kl_mean``, ``kl_std``: final KL to the base model across seeds;
    ``seconds_per_step``: median `time/generation_s` over every generation or step of every seed;
    ``training_completions``: mean final `samples/completions`; ``empty_answers`` and
    ``target_answers``: the mean across seeds of the share of held-out answers that were empty and that
    held their target (``answer_share``), each a column only where some run's rows say. Runs without
    heldout.jsonl are left out, named in ``.attrs["note"]``; ``.attrs`` also holds measure, key (the
    axis label key) and level.
    """
    import pandas as pd

    _measure(measure)
    kept, left_out = _runs_with_scores(groups, measure)
    lines = []
    for label, pairs in kept.items():
        values, texts = [], []
        for record, scores in pairs:
            value, low, high = bootstrap_interval(scores, level=level, num_resamples=num_resamples, seed=seed)
            values.append(value)
            texts.append(f"{record.seed}: {value:.3g} [{low:.3g}, {high:.3g}]")
        mean, low, high, interval = seed_interval(values, level=level, num_resamples=num_resamples, seed=seed)
        _, t_low, t_high = t_interval(values, level=level)
        if measure == "success":  # a share lies in [0, 1]: an interval cut to it covers the true share as often
            low, high, t_low, t_high = (min(max(bound, 0.0), 1.0) for bound in (low, high, t_low, t_high))
        kls = [kl for kl in (final_value(record.rows, "policy/kl") for record, _ in pairs) if kl is not None]
        seconds = [s for record, _ in pairs for s in _seconds_per_step(record.rows)]
        completions = [c for c in (final_value(record.rows, "samples/completions") for record, _ in pairs) if c is not None]
        shares = {column: [share for share in (answer_share(record, flag) for record, _ in pairs) if share is not None]
                  for column, flag in ANSWER_SHARES.items()}
        lines.append({
            "method": label, "seeds": len(values), "problems": min(len(scores) for _, scores in pairs),
            "mean": mean, "ci_low": low, "ci_high": high, "interval": interval, "t_low": t_low, "t_high": t_high,
            "iqm": interquartile_mean(values), "seed_std": _std(values),
            "min": min(values), "max": max(values), "per_seed": "; ".join(texts),
            "kl_mean": sum(kls) / len(kls) if kls else math.nan, "kl_std": _std(kls),
            "seconds_per_step": statistics.median(seconds) if seconds else math.nan,
            "training_completions": sum(completions) / len(completions) if completions else math.nan,
            **{column: statistics.fmean(found) if found else math.nan for column, found in shares.items()},
        })
    columns = ["method", "seeds", "problems", "mean", "ci_low", "ci_high", "interval", "t_low", "t_high", "iqm", "seed_std",
               "min", "max", "per_seed",
               "kl_mean", "kl_std", "seconds_per_step", "training_completions"]
    # runs that kept no answers, or no flags for them: no such column
    columns += [column for column in ANSWER_SHARES if any(not math.isnan(line[column]) for line in lines)]
    table = pd.DataFrame(lines, columns=columns).set_index("method")
    table.attrs.update(measure=measure, key=HELDOUT_MEASURES[measure][1], level=level, note=_left_out_note(left_out))
    return table


def _pairwise(per_seed: Mapping[str, Sequence[float]], primary: Sequence[tuple[str, str]] = (), **settings):
    """The comparisons table of ``method_comparisons`` from {method: per-seed values}: the pairs named
    in ``primary`` form the family Holm's correction covers, every other pair is exploratory."""
    import pandas as pd

    declared = {frozenset(pair) for pair in primary}
    unknown = [pair for pair in primary if not set(pair) <= set(per_seed)]
    if unknown:
        raise ValueError(f"primary: {unknown} name methods without held-out scores; methods: {list(per_seed)}")
    lines = []
    for first, second in itertools.combinations(per_seed, 2):
        result = compare_seeds(per_seed[first], per_seed[second], **settings)
        family = "primary" if frozenset((first, second)) in declared else "exploratory"
        lines.append({"family": family, 
            "method_a": first, "method_b": second, "seeds_a": len(per_seed[first]), "seeds_b": len(per_seed[second]),
            "difference": result.difference, "ci_low": result.low, "ci_high": result.high, "interval": result.interval,
            "permutation_p": result.permutation.p, "exact": result.permutation.exact,
            "smallest_p": result.permutation.smallest_p, "welch_t": result.welch.t, "welch_dof": result.welch.dof,
            "welch_p": result.welch.p, "larger_than_seed_noise": "yes" if result.larger_than_seed_noise else "no",
        })
    family = [i for i, line in enumerate(lines) if line["family"] == "primary"]
    alpha = settings.get("alpha", 0.05)
    _, adjusted = holm([lines[i]["permutation_p"] for i in family], alpha=alpha)
    for line in lines:
        line["holm_p"] = math.nan
    for i, p in zip(family, adjusted):
        lines[i]["holm_p"] = p
        lines[i]["larger_than_seed_noise"] = "yes" if p < alpha else "no"
    columns = ["family", "method_a", "method_b", "seeds_a", "seeds_b", "difference", "ci_low", "ci_high", "interval",
               "permutation_p", "holm_p", "exact", "smallest_p", "welch_t", "welch_dof", "welch_p",
               "larger_than_seed_noise"]
    return pd.DataFrame(lines, columns=columns)


def method_comparisons(groups: Groups, measure: str = "success", alpha: float = 0.05, level: float = 0.95,
                       num_resamples: int = 10_000, seed: int = 0, max_exact: int = MAX_EXACT_SPLITS,
                       num_permutations: int = 100_000, primary: Sequence[tuple[str, str]] = ()):
    """Every pair of methods (in label order): is their difference in held-out score larger than seed
    noise? One row per pair (a DataFrame): ``method_a``, ``method_b``, ``seeds_a``, ``seeds_b``,
    ``difference`` (mean of a's per-seed scores minus b's), ``ci_low``, ``ci_high`` (its bootstrap
    interval at ``level``; Welch's t where a side has fewer than ``stats.MIN_BOOTSTRAP_VALUES`` seeds),
    ``interval`` naming which, ``permutation_p`` (two-sided, over seed labels; ``exact``: every split
    enumerated, else a Monte Carlo estimate whose floor is ``smallest_p``), ``smallest_p`` (the least p the seed counts allow: 1/3 for 2 vs 2, 2/252 for 5 vs 5),
    ``welch_t``, ``welch_dof``, ``welch_p`` (for reference), and ``larger_than_seed_noise``: "yes"
    when permutation_p < alpha, else "no" (`stats.compare_seeds`). ``primary``: the pairs of method
    labels declared before the study; they form the family (``family`` "primary") whose p-values
    Holm's correction adjusts (``holm_p``, which then decides ``larger_than_seed_noise``); every
    other pair is "exploratory", uncorrected. Runs without heldout.jsonl are left out (``.attrs["note"]``)."""
    _measure(measure)
    kept, left_out = _runs_with_scores(groups, measure)
    per_seed = {label: [sum(scores) / len(scores) for _, scores in pairs] for label, pairs in kept.items()}
    table = _pairwise(per_seed, primary, alpha=alpha, level=level, num_resamples=num_resamples, seed=seed,
                      max_exact=max_exact, num_permutations=num_permutations)
    table.attrs.update(measure=measure, alpha=alpha, level=level, note=_left_out_note(left_out))
    return table


# --------------------------------------------------------------------------- completions


def side_by_side_completions(groups: Groups, example_index: int | Sequence[int] | None = None,
                             split: str = "eval", max_chars: int | None = 200):
    """Final greedy completions of every run for the same prompts of `split` ("eval" or "train"):
    one row per prompt, one column per (method, seed) (a DataFrame)."""
    from .tasks import get_task

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
