"""Reading run folders for comparison: one run (`read_run`), many grouped by method
(`load_runs`), each method labelled by the settings it differs in, the checks that make a
comparison fair (`check_comparable`, `check_distinct_seeds`), and a run's results for batch
summaries (`run_results`). Reads files, writes none."""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..metrics import RESULT_COLUMNS, run_summary
from ..types import NotARunFolder

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

    from ..runs import read_metrics

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
    from ..runs import read_jsonl

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
    from ..config import config_class
    from ..runs import EXTENDABLE

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
    from ..tasks import get_task

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


def heldout_rows(record: RunRecord) -> list[dict] | None:
    """A run's held-out rows: those it carries (a compacted study's), else its heldout.jsonl's."""
    return record.heldout if record.heldout is not None else read_heldout(record.path)
