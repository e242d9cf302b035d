"""A study's small, committable summary: ``evolm tune export STUDY DIR``; its tables and figures
rebuild from it on any machine (``evolm tune report DIR``), and ``evolm tune import DIR STUDY`` writes
a study folder back from it, which ``evolm tune`` continues.

Every run folder under STUDY (the tuning trials, the reruns, their continuations and controls, or the
runs of a plain sweep) becomes one line of DIR/runs.jsonl.gz: where it sits (stage, method, trial,
seed, path), its settings (config.yaml), its metrics rows with their scalar values only (completions,
prompts and per-member lists left out; floats to 6 significant digits, times of parts of a generation
to 3; stored by column; a continued run without the rows it shares with the rerun it was copied
from), its held-out scores (heldout.jsonl's index, reward and success per problem, and whether each
answer was empty and whether it held its target, ``analysis.ANSWER_FLAGS``: the answers themselves
are left out), where it ran (placement.jsonl) and the KL of its checkpoints where measured; a run
under way whose newest checkpoint holds no tensors (ES on the model's own weights, whose mean is its
seed log replayed) keeps what it goes on from (``resume_state``), so an imported study resumes it.
The Optuna trials of every study go to DIR/trials.jsonl.gz, tune_summary.json is copied, the base
model's held-out lines (``tune.base_answers``, STUDY/base/heldout.jsonl) become their summary in
DIR/base.json (``analysis.heldout_summary``), and manifest.json counts what went in. The gzip files
carry no timestamp, and a trial's folder is named within the study (``trials/<method>/trial_NNNN``):
the same study exports to the same bytes, wherever it lies. ``read_study`` reads an export, or a
live study folder the same way, and ``export_groups`` gives a stage's runs as ``analysis.RunRecord``
groups.
"""
from __future__ import annotations

import gzip
import json
import math
import shutil
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..env import PLACEMENT
from ..geometry import checkpoint_holds_weights
from ..runs import list_checkpoints, read_checkpoint_files, read_jsonl, read_metrics, row_generation
from ..sweep import HELDOUT
from .final import BASE_HELDOUT, CONTINUED_FROM, STAGES, SUMMARY
from .storage import STORAGE
from .study import study_trial_folder

RUNS = "runs.jsonl.gz"
TRIALS = "trials.jsonl.gz"
MANIFEST = "manifest.json"
BASE = "base.json"
"""The base model's held-out summary: the reference beside the methods' (``read_study``'s "base")."""
DIGITS = 6
"""Significant digits kept of a float in the rows (the figures and tables need far fewer)."""
TIME_DIGITS = 3
"""Significant digits kept of the seconds a part of a generation took (``time/...``; not the run's
cumulative ``time/wall_s``): milliseconds' noise is most of a study's bytes."""
MAX_TEXT = 64
"""Longest string value kept in a row (the method's name, not a completion)."""
TEXT_SUFFIXES = (".jsonl", ".json", ".yaml", ".yml", ".txt", ".log", ".csv")
"""A run folder's text files (its rows, seed log, settings and scores)."""
REBUILT = "rebuilt"
"""STUDY/rebuilt/<stage>/<method>/seedS: a rerun run again for the geometry (``tune.geometry``)."""
SKIPPED_FOLDERS = ("checkpoints", "snapshots", "final_model", "final_adapter", "adapter", "figures")


def _scalar(value: Any, digits: int = DIGITS) -> tuple[bool, Any]:
    """(keep, value): numbers (floats to ``digits`` significant digits, non-finite dropped), booleans
    and short strings."""
    if isinstance(value, bool) or value is None:
        return value is not None, value
    if isinstance(value, int):
        return True, value
    if isinstance(value, float):
        return math.isfinite(value), float(f"{value:.{digits}g}") if math.isfinite(value) else None
    if isinstance(value, str):
        return len(value) <= MAX_TEXT, value
    return False, None


def scalar_row(row: dict) -> dict:
    """A metrics row without its lists, mappings, long strings and non-finite values."""
    kept = {}
    for key, value in row.items():
        keep, value = _scalar(value, TIME_DIGITS if key.startswith("time/") and key != "time/wall_s" else DIGITS)
        if keep:
            kept[key] = value
    return kept


def columns(rows: Sequence[dict]) -> dict[str, list]:
    """Rows as {key: [value or None per row]} (keys sorted): what gzip packs best."""
    keys = sorted({key for row in rows for key in row})
    return {key: [row.get(key) for row in rows] for key in keys}


def from_columns(table: dict[str, list]) -> list[dict]:
    """The rows of ``columns`` back, each without the keys it did not have."""
    length = max((len(values) for values in table.values()), default=0)
    return [{key: values[i] for key, values in table.items() if values[i] is not None} for i in range(length)]


def run_folders(study: Path) -> Iterator[Path]:
    """Every run folder under ``study`` (config.yaml and metrics.jsonl), sorted; not a copy being made
    or set aside (a name starting with a dot), a failed attempt, nor anything inside weights."""
    for config in sorted(study.rglob("config.yaml")):
        folder = config.parent
        parts = folder.relative_to(study).parts
        if (folder / "metrics.jsonl").is_file() and not any(
                p.startswith(".") or ".failed-" in p or p in SKIPPED_FOLDERS for p in parts):
            yield folder


def locate(study: Path, folder: Path) -> dict[str, Any]:
    """(stage, method, trial) of a run folder from its place: trials/<method>/trial_NNNN/seedS,
    <stage>/<method>/seedS for the stages of ``final.STAGES``, rebuilt/<stage>/<method>/seedS (stage
    "rebuilt"), else a sweep's <method>_seedS."""
    parts = folder.relative_to(study).parts
    if parts[0] == "trials" and len(parts) == 4:
        return {"stage": "trial", "method": parts[1], "trial": int(parts[2].removeprefix("trial_"))}
    if parts[0] in STAGES and len(parts) == 3:
        return {"stage": parts[0], "method": parts[1], "trial": None}
    if parts[0] == REBUILT and len(parts) == 4:  # a rerun run again for the geometry: rebuilt/<stage>/<method>/seedS
        return {"stage": REBUILT, "method": parts[2], "trial": None}
    return {"stage": "sweep", "method": folder.name.rsplit("_seed", 1)[0], "trial": None}


KL = "kl.jsonl"
COMPACTED_FILES = ("config.yaml", "metrics.jsonl", HELDOUT, PLACEMENT, KL, CONTINUED_FROM)
"""A run folder's files a exported line holds in its own fields (``resume_state`` leaves them out)."""


def resume_state(folder: Path, config: dict, rows: Sequence[dict]) -> dict[str, Any] | None:
    """What a run under way goes on from on another machine, where its newest intact checkpoint is past
    its start and holds no tensors (ES on the model's own weights): {"checkpoint": its folder's name,
    "files": its files, "text": the run folder's other text files (the seed log), each as text}. None
    for a finished run (rows at its last generation), or one without such a checkpoint: a LoRA's or
    GRPO's checkpoint holds tensors, which a exported line does not carry."""
    from ..analysis import run_length

    length = run_length(config)
    if length is None or (rows and row_generation(rows[-1]) >= length) or checkpoint_holds_weights(folder):
        return None
    checkpoint = next(((path, found) for path in reversed(list_checkpoints(folder))
                       if (found := read_checkpoint_files(path)) is not None), None)  # the newest that reads whole
    if checkpoint is None or checkpoint_generation(checkpoint[0]) == 0:
        return None
    try:
        files = {name: data.decode() for name, data in checkpoint[1].items()}
        text = {p.name: p.read_bytes().decode() for p in sorted(folder.iterdir())
                if p.is_file() and p.suffix in TEXT_SUFFIXES and p.name not in COMPACTED_FILES}
    except UnicodeDecodeError:  # not text after all: the run starts again where imported
        return None
    return {"checkpoint": checkpoint[0].name, "files": files, "text": text}


def checkpoint_generation(checkpoint_folder: Path) -> int:
    """The generation (or step) a checkpoint was written at, from its folder's name."""
    return int(checkpoint_folder.name.split(".")[0])


def export_run(study: Path, folder: Path) -> dict[str, Any]:
    """One run folder as its line of runs.jsonl.gz (see the module docstring)."""
    import yaml

    from ..analysis import ANSWER_FLAGS

    config = yaml.safe_load((folder / "config.yaml").read_text()) or {}
    rows = [scalar_row(row) for row in read_metrics(folder)]
    heldout = read_jsonl(folder / HELDOUT)
    # what each answer was, kept without the answers themselves
    flags = {flag: [judge(line) for line in heldout] for flag, judge in ANSWER_FLAGS.items()}
    continued = folder / CONTINUED_FROM
    place = locate(study, folder)
    shared = 0  # a continued run's first rows are its rerun's: stored once, with the rerun
    source = study / "final" / place["method"] / folder.name
    if continued.is_file() and place["stage"] == "long" and (source / "metrics.jsonl").is_file():
        before = [scalar_row(row) for row in read_metrics(source)]
        if rows[:len(before)] == before:
            shared = len(before)
    return {
        **place, "seed": config.get("seed"), "path": str(folder.relative_to(study)),
        "config": config, "columns": columns(rows[shared:]),
        "rows_from": {"path": str(source.relative_to(study)), "rows": shared} if shared else None,
        "heldout": {"generation": heldout[0].get("generation"), "index": [line["index"] for line in heldout],
                    "reward": [_scalar(float(line["reward"]))[1] for line in heldout],
                    "success": [bool(line["success"]) for line in heldout],
                    **{flag: judged for flag, judged in flags.items() if None not in judged}}
        if heldout else None,
        "placement": read_jsonl(folder / PLACEMENT),
        "kl": [scalar_row(row) for row in read_jsonl(folder / KL)],
        "continued_from": json.loads(continued.read_text()) if continued.is_file() else None,
        "resume": resume_state(folder, config, rows),
    }


def study_trial_rows(study: Path, storage: str | None = None) -> list[dict[str, Any]]:
    """Every trial of every Optuna study in STUDY/optuna.db (or ``storage``, a URL; none without
    either), as ``study.study_trials`` lists them, read straight from the storage (no spec needed); a
    trial's folder (``run_dir``) as the study names it, ``trials/<method>/trial_NNNN``, not where the
    study lay when its trial ran, so the same study exports to the same file. A damaged SQLite file
    is named (``storage.check_sqlite``), never opened for writing."""
    if storage is None and not (study / STORAGE).is_file():
        return []
    import optuna

    from .storage import JOURNAL, check_sqlite
    from .study import trial_rows

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if storage is None:
        check_sqlite(study / STORAGE)
    url = storage or f"sqlite:///{(study / STORAGE).resolve()}"
    if url.startswith(JOURNAL):
        from optuna.storages.journal import JournalFileBackend

        url = optuna.storages.JournalStorage(JournalFileBackend(url.removeprefix(JOURNAL)))
    rows = [row for name in sorted(optuna.get_all_study_names(url))
            for row in trial_rows(optuna.load_study(study_name=name, storage=url), name)]
    return [{**row, "run_dir": row["run_dir"] and study_trial_folder(row["method"], row["run_dir"])} for row in rows]


def _write_gzip_lines(path: Path, lines: Sequence[dict]) -> None:
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as zipped:
        for line in lines:
            zipped.write((json.dumps(line, separators=(",", ":"), sort_keys=True) + "\n").encode())


def run_counts(runs: Sequence[dict]) -> dict[str, Any]:
    """The manifest's counts of exported runs: per stage, those with held-out scores, and those under
    way that carry what they go on from (``resume_state``)."""
    stages: dict[str, int] = {}
    for run in runs:
        stages[run["stage"]] = stages.get(run["stage"], 0) + 1
    return {"runs": stages, "with_heldout": sum(run["heldout"] is not None for run in runs),
            "resumable": sum(run.get("resume") is not None for run in runs)}


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """FOLDER/manifest.json (sorted keys: the same counts give the same bytes); returns the manifest."""
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def export_runs(study: Path) -> list[dict[str, Any]]:
    """Every run folder under ``study`` as its line of runs.jsonl.gz (``export_run``)."""
    return [export_run(study, folder) for folder in run_folders(study)]


def export_study(study: str | Path, out: str | Path, storage: str | None = None) -> dict[str, Any]:
    """Write STUDY's runs, trials and summary into OUT (see the module docstring); returns the
    manifest. ``storage``: the studies' storage where it is not STUDY/optuna.db."""
    from ..analysis import heldout_summary, read_heldout

    study, out = Path(study), Path(out)
    if not study.is_dir():
        raise FileNotFoundError(f"{study}: no such folder (a study's or sweep's `out`)")
    trials = study_trial_rows(study, storage)  # a damaged storage is named before anything is read
    runs = export_runs(study)
    if not runs:
        raise FileNotFoundError(f"{study}: no run folder (config.yaml and metrics.jsonl) under it")
    out.mkdir(parents=True, exist_ok=True)
    _write_gzip_lines(out / RUNS, runs)
    if trials:
        _write_gzip_lines(out / TRIALS, trials)
    if (study / SUMMARY).is_file():
        shutil.copyfile(study / SUMMARY, out / SUMMARY)
    base = read_heldout((study / BASE_HELDOUT).parent)
    if base:
        (out / BASE).write_text(json.dumps(heldout_summary(base), indent=1) + "\n")
    files = [p for p in (out / RUNS, out / TRIALS, out / SUMMARY, out / BASE) if p.is_file()]
    return _write_manifest(out, {"source": study.name, **run_counts(runs), "trials": len(trials),
                                 "bytes": {p.name: p.stat().st_size for p in files}})


def _read_gzip_lines(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def is_export(folder: str | Path) -> bool:
    """Whether ``folder`` holds an export (runs.jsonl.gz), not a live study."""
    return (Path(folder) / RUNS).is_file()


def read_study(folder: str | Path, storage: str | None = None) -> dict[str, Any]:
    """{"runs": [...], "trials": [...], "summary": {...} or None, "geometry": {...} or None, "base": {...}
    or None} of an export (``export_study``) or of a live study folder, read the same way (each run as
    its exported line, so both give the same tables); each run with its ``rows`` whole (a continued
    run's first rows taken from its rerun); geometry.json where ``tune.geometry`` wrote it beside the
    files, base.json (or the live folder's base/heldout.jsonl) for the base model's held-out summary."""
    from ..analysis import heldout_summary, read_heldout
    from .geometry import GEOMETRY

    folder = Path(folder)
    if is_export(folder):
        runs = _read_gzip_lines(folder / RUNS)
        trials = _read_gzip_lines(folder / TRIALS) if (folder / TRIALS).is_file() else []
        base = json.loads((folder / BASE).read_text()) if (folder / BASE).is_file() else None
    elif folder.is_dir():
        runs = json.loads(json.dumps(export_runs(folder), sort_keys=True))  # as an export's lines read back
        if not runs:
            raise FileNotFoundError(f"{folder}: neither an export ({RUNS}) nor a study folder with runs")
        trials = study_trial_rows(folder, storage)
        held = read_heldout((folder / BASE_HELDOUT).parent)
        base = heldout_summary(held) if held else None
    else:
        raise FileNotFoundError(f"{folder}: no such folder (a study folder, or an export of one)")
    for run in runs:
        run["rows"] = from_columns(run.pop("columns"))
    by_path = {run["path"]: run for run in runs}
    for run in runs:
        if run.get("rows_from"):
            run["rows"] = by_path[run["rows_from"]["path"]]["rows"][:run["rows_from"]["rows"]] + run["rows"]
    summary = folder / SUMMARY
    return {"runs": runs, "trials": trials,
            "summary": json.loads(summary.read_text()) if summary.is_file() else None,
            "geometry": json.loads((folder / GEOMETRY).read_text()) if (folder / GEOMETRY).is_file() else None,
            "base": base}


def heldout_lines(run: dict) -> list[dict] | None:
    """A exported run's held-out scores as heldout.jsonl's lines (index, reward, success, generation,
    and the answer's flags where they were kept: ``analysis.ANSWER_FLAGS``)."""
    from ..analysis import ANSWER_FLAGS

    held = run.get("heldout")
    if not held:
        return None
    lines = [{"index": i, "reward": r, "success": s, "generation": held.get("generation")}
             for i, r, s in zip(held["index"], held["reward"], held["success"])]
    for flag in ANSWER_FLAGS:
        for line, value in zip(lines, held.get(flag) or []):
            line[flag] = value
    return lines


def export_groups(runs: Sequence[dict], stage: str, label: str = "{method}") -> dict:
    """The runs of one stage grouped by method, as ``analysis.RunRecord`` lists sorted by seed (their
    held-out scores inside, so ``analysis.study_table`` and ``method_comparisons`` read them);
    ``label`` names a group from its method ("{method} shuffled")."""
    from ..analysis import RunRecord, check_distinct_seeds

    groups: dict[str, list] = {}
    for run in runs:
        if run["stage"] != stage:
            continue
        name = label.format(method=run["method"])
        groups.setdefault(name, []).append(RunRecord(Path(run["path"]), name, run["seed"], run["config"], run["rows"],
                                                     heldout=heldout_lines(run)))
    for records in groups.values():
        records.sort(key=lambda r: (r.seed is None, r.seed or 0))
    check_distinct_seeds(groups)
    return groups
