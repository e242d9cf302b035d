"""A study folder written back from its export: ``evolm tune import DIR STUDY [--spec SPEC]``, so that
``evolm tune SPEC --out STUDY`` continues it on this machine.

- STUDY/optuna.db: each method's study with every trial of trials.jsonl.gz under its own number,
  state, value, settings (under the distributions of the spec's space), user attributes, the trial
  it retries and the values it reported. A trial that was running when the study was exported is
  written as a trial whose worker died: failed, marked ``under_way_when_exported``, and followed by
  its retry with the same setting, waiting, as Optuna's heartbeat callback queues it
  (``tune.max_retries`` retries at most); a retry that was waiting waits again.
- each finished run of runs.jsonl.gz as a run folder at its path: config.yaml, metrics.jsonl (the
  exported scalar rows), heldout.jsonl (the scores and answer flags, not the answers), placement.jsonl,
  kl.jsonl and continued_from.json where the run had them. A trial's runs are finished where their
  trial (or its retry) is complete, pruned or failed with an error; a rerun, continued rerun,
  control or sweep run where it holds held-out scores at its last generation or step. The others
  were under way: one whose line carries what it goes on from (``export.resume_state``: ES on the
  model's own weights, its newest checkpoint and seed log) is written with them, and its run (or its
  trial's retry) goes on from that checkpoint; the others begin again from their start (a LoRA's or
  GRPO's checkpoint holds tensors, which an export does not carry).
- tune_summary.json as exported; STUDY/imported.json records what was written and what was left out,
  and why. The base model's held-out lines are not in an export (only their summary, base.json):
  ``python -m evolm_lib.tune.base_answers SPEC`` writes them again.

Nothing is written where STUDY exists and is not empty, where DIR holds no runs.jsonl.gz, or where
its trials name a method or a setting the spec has not; the folder is built beside STUDY as
``.NAME.importing`` and renamed into place at the end, so a kill leaves no half-written study.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

from ..env import PLACEMENT
from ..runs import CHECKPOINTS, rewrite_metrics, write_config_data, write_jsonl
from ..sweep import HELDOUT
from ..analysis import run_length
from .export import KL, MANIFEST, TRIALS, checkpoint_generation, heldout_lines, read_study, run_counts
from .final import CONTINUED_FROM, SUMMARY
from .spec import TuneSpec, load_tune_spec
from .storage import open_storage
from .study import load_study

IMPORTED = "imported.json"
"""In a imported study: the exported folder it came from, its manifest, what was imported and what
was left out (and why)."""
UNDER_WAY = "under_way_when_exported"
"""The user attribute of a trial that was running when its study was exported (imported as failed,
not counted, and retried with its setting)."""
FINISHED_STATES = ("complete", "pruned")
UNDER_WAY_STATES = ("running", "waiting")
"""The states of a trial whose folder a worker writes into again (a waiting trial is a queued retry)."""


def check_trials(trials: Sequence[dict], spec: TuneSpec) -> None:
    """ValueError naming the first trial whose method the spec does not tune or whose setting its
    space does not search, or a method whose trial numbers are not 0, 1, 2, ... (a storage gives
    them in that order, and a imported trial keeps its number)."""
    space = spec.settings.space
    numbers: dict[str, list[int]] = {}
    for row in trials:
        method = row["method"]
        if method not in space:
            raise ValueError(f"{TRIALS}: trial {row['number']} is of method {method!r}, which the spec "
                             f"{spec.path} does not tune (tune.space has {list(space)})")
        searched = [parameter.name for parameter in space[method]]
        for name in row.get("params") or {}:
            if name not in searched:
                raise ValueError(f"{TRIALS}: {method} trial {row['number']} has parameter {name!r}, which the spec "
                                 f"does not search (tune.space.{method} has {searched})")
        numbers.setdefault(method, []).append(row["number"])
    for method, found in numbers.items():
        if sorted(found) != list(range(len(found))):
            raise ValueError(f"{TRIALS}: {method}'s trial numbers are not 0 to {len(found) - 1} each once: {sorted(found)}")


def retry_history(row: dict, rows: Sequence[dict]) -> list[int]:
    """The trials a retry follows, first to last (Optuna's ``retry_history``): the trial it retries and
    that trial's earlier retries, each of which names the same first trial."""
    first = row["retries"]
    return [first] + sorted(r["number"] for r in rows if r.get("retries") == first and r["number"] < row["number"])


def frozen_trial(row: dict, rows: Sequence[dict], spec: TuneSpec, study_dir: Path):
    """One row of trials.jsonl.gz as an Optuna trial to add to its method's study (``rows``: the
    method's; ``study_dir``: where the study is imported, which its trial folder's ``run_dir`` names);
    ValueError where a setting lies outside the spec's space."""
    import optuna
    from optuna.trial import TrialState

    distributions = {p.name: p.distribution() for p in spec.settings.space[row["method"]]}
    params = row.get("params") or {}
    attrs = {key: row[key] for key in ("config", "seconds", "error", "worker") if row.get(key) is not None}
    if row.get("run_dir"):
        attrs["run_dir"] = str(study_dir / "trials" / row["method"] / Path(row["run_dir"]).name)
    state = row["state"]
    if state == "running":
        attrs.pop("error", None)
        attrs[UNDER_WAY] = True
    system = ({"failed_trial": row["retries"], "retry_history": retry_history(row, rows)}
              if row.get("retries") is not None else {})
    try:
        return optuna.trial.create_trial(
            state=TrialState.FAIL if state == "running" else TrialState[state.upper()],
            value=None if state not in FINISHED_STATES else row.get("value"), params=params,
            distributions={name: distributions[name] for name in params}, user_attrs=attrs, system_attrs=system,
            intermediate_values={int(step): value for step, value in (row.get("intermediate_values") or {}).items()})
    except ValueError as error:
        raise ValueError(f"{TRIALS}: {row['method']} trial {row['number']}: {error} (tune.space.{row['method']})") from None


def trial_outcomes(trials: Sequence[dict]) -> dict[tuple[str, int], str]:
    """{(method, first attempt's number): what became of the trial} per trial folder. A retry resumes
    the folder of the trial it retries, so the folder is "finished" where any attempt finished
    (complete, pruned, or failed with an error), "under way" where one runs or waits, and "killed and
    not retried" where every attempt's worker died and no retry is left (``max_retries``)."""
    attempts: dict[tuple[str, int], list[dict]] = {}
    for row in trials:
        first = row["number"] if row.get("retries") is None else row["retries"]
        attempts.setdefault((row["method"], first), []).append(row)
    outcomes = {}
    for key, rows in attempts.items():
        if any(r["state"] in FINISHED_STATES or (r["state"] == "fail" and r.get("error") is not None) for r in rows):
            outcomes[key] = "finished"
        elif any(r["state"] in UNDER_WAY_STATES for r in rows):
            outcomes[key] = "under way"
        else:
            outcomes[key] = "killed and not retried"
    return outcomes


def left_out_reason(run: dict, outcomes: dict[tuple[str, int], str]) -> str | None:
    """Why a exported run is not written (it was under way, and carries nothing to go on from), or
    None for one that is: finished, or under way with its ``resume`` state."""
    resumable = run.get("resume") is not None
    if run["stage"] == "trial":
        outcome = outcomes.get((run["method"], run["trial"]))
        if outcome is None:
            return f"no trial {run['trial']} of {run['method']} in {TRIALS}"
        if outcome == "finished" or (outcome == "under way" and resumable):
            return None
        return f"its trial was {outcome} when exported"
    held = run.get("heldout")
    if not held:
        return None if resumable else "no held-out scores: under way when exported"
    length = run_length(run["config"])
    if length is not None and held.get("generation") != length:
        return f"held-out scores at {held.get('generation')}, not at its last generation or step {length}"
    return None


def write_run(folder: Path, run: dict) -> None:
    """A exported run's folder again: its settings, rows, held-out scores, placement, KL and the
    rerun it continued, where the exported line has them, and for a run under way what it goes on
    from (its checkpoint's files and seed log: ``export.resume_state``)."""
    folder.mkdir(parents=True)
    resume = run.get("resume")
    if resume is not None:  # the checkpoint first: a run folder whose rows pass it is resumed to it
        checkpoint = folder / CHECKPOINTS / resume["checkpoint"]
        checkpoint.mkdir(parents=True)
        for name, text in resume["files"].items():  # byte for byte: the checkpoint's manifest checks them
            (checkpoint / name).parent.mkdir(parents=True, exist_ok=True)
            (checkpoint / name).write_bytes(text.encode())
        for name, text in resume["text"].items():
            (folder / name).write_bytes(text.encode())
    write_config_data(folder, run["config"])
    rewrite_metrics(folder, run["rows"])
    held = heldout_lines(run)
    if held:
        write_jsonl(folder / HELDOUT, held)
    if run.get("placement"):
        write_jsonl(folder / PLACEMENT, run["placement"])
    if run.get("kl"):
        write_jsonl(folder / KL, run["kl"])
    if run.get("continued_from") is not None:
        (folder / CONTINUED_FROM).write_text(json.dumps(run["continued_from"]) + "\n")


def frozen_trials(trials: Sequence[dict], spec: TuneSpec, study_dir: Path) -> dict[str, list]:
    """{method: its trials as Optuna trials, in number order} (``frozen_trial``); ValueError, before
    anything is written, where a setting lies outside the spec's space."""
    frozen = {}
    for method in dict.fromkeys(row["method"] for row in trials):
        rows = sorted((r for r in trials if r["method"] == method), key=lambda r: r["number"])
        frozen[method] = [frozen_trial(row, rows, spec, study_dir) for row in rows]
    return frozen


def retry(study, trial, max_retries: int) -> None:
    """Queue the retry of ``trial`` (imported as failed: it was under way) with its setting, as Optuna's
    heartbeat callback does for a trial whose worker died, without the mark of its failed attempt."""
    import copy
    import warnings

    import optuna

    failed = copy.deepcopy(trial)
    failed.user_attrs = {key: value for key, value in trial.user_attrs.items() if key != UNDER_WAY}
    with warnings.catch_warnings():  # the callback is marked experimental; the workers use it too (storage.open_storage)
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=max_retries)(study, failed)


def import_trials(frozen: dict[str, list], spec: TuneSpec, folder: Path) -> dict[str, int]:
    """Each method's study in FOLDER/optuna.db (created as ``study.load_study`` creates it), its trials
    (``frozen_trials``) added in number order, so each keeps its number, then the retries of those that
    were under way (``retry``); returns {method: trials imported}."""
    import optuna

    if not frozen:
        return {}
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # a line per study created says nothing the summary does not
    writing = replace(spec, out=folder)
    storage = open_storage(writing)
    try:
        for method, method_trials in frozen.items():
            study = load_study(writing, method, storage)
            for trial in method_trials:
                study.add_trial(trial)
            for trial in study.get_trials(deepcopy=False):
                if trial.user_attrs.get(UNDER_WAY):
                    retry(study, trial, spec.settings.max_retries)
    finally:
        storage.remove_session()
        storage.engine.dispose()  # the database file is renamed with its folder next
    return {method: len(method_trials) for method, method_trials in frozen.items()}


def import_study(export_dir: str | Path, spec: TuneSpec, out: str | Path | None = None,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """Write the study of the exported folder ``export_dir`` into ``out`` (default ``spec.out``) so
    that it continues from there (see the module docstring); returns what STUDY/imported.json records.
    FileExistsError where ``out`` holds anything, FileNotFoundError where ``export_dir`` holds no
    exported runs, ValueError where its trials do not fit the spec: each before anything is written."""
    export_dir = Path(export_dir)
    study = Path(out) if out is not None else spec.out
    if study.exists() and (not study.is_dir() or any(study.iterdir())):
        raise FileExistsError(f"{study}: exists and is not empty; a study folder is never written over "
                              "(import into a new folder)")
    if not (export_dir / "runs.jsonl.gz").is_file():
        raise FileNotFoundError(f"{export_dir}: no runs.jsonl.gz here (an export: evolm tune export STUDY DIR)")
    exported = read_study(export_dir)
    trials = exported["trials"]
    check_trials(trials, spec)
    frozen = frozen_trials(trials, spec, study)
    outcomes = trial_outcomes(trials)
    runs, left_out = [], {}
    for run in exported["runs"]:
        reason = left_out_reason(run, outcomes)
        if reason is None:
            runs.append(run)
        else:
            left_out[run["path"]] = reason

    partial = study.with_name(f".{study.name}.importing")
    if partial.exists():
        shutil.rmtree(partial)  # a import cut short by a kill
    partial.mkdir(parents=True)
    imported_trials = import_trials(frozen, spec, partial)
    for run in runs:
        write_run(partial / run["path"], run)
    if (export_dir / SUMMARY).is_file():
        shutil.copyfile(export_dir / SUMMARY, partial / SUMMARY)
    stages = run_counts(runs)["runs"]
    resumed = {run["path"]: checkpoint_generation(Path(run["resume"]["checkpoint"])) for run in runs if run.get("resume")}
    manifest = export_dir / MANIFEST
    record = {
        "export": str(export_dir), "manifest": json.loads(manifest.read_text()) if manifest.is_file() else None,
        "trials": imported_trials,
        "under_way_trials": {m: [r["number"] for r in trials if r["method"] == m and r["state"] == "running"]
                             for m in imported_trials},
        "runs": stages, "resumed": resumed, "left_out": left_out,
        "base": "summary only: python -m evolm_lib.tune.base_answers SPEC writes the lines again" if exported["base"] else None,
    }
    (partial / IMPORTED).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    if study.exists():
        study.rmdir()  # empty (checked above): the imported folder takes its place
    partial.replace(study)
    for line in import_lines(record, study):
        log(line)
    return record


def import_lines(record: dict[str, Any], study: Path) -> list[str]:
    """What a import printed: one line per kind of thing imported or left out."""
    def counts(mapping: dict[str, int]) -> str:
        return ", ".join(f"{key} {value}" for key, value in mapping.items()) or "none"

    lines = [f"imported {sum(record['trials'].values())} trials ({counts(record['trials'])}) and "
             f"{sum(record['runs'].values())} runs ({counts(record['runs'])}) into {study}"]
    under_way = {m: numbers for m, numbers in record["under_way_trials"].items() if numbers}
    if under_way:
        lines.append("trials under way when exported, imported as failed and queued again with their settings: "
                     + "; ".join(f"{m} {', '.join(map(str, numbers))}" for m, numbers in under_way.items()))
    if record.get("resumed"):
        lines.append(f"{len(record['resumed'])} runs under way go on from their checkpoints: "
                     + "; ".join(f"{path} at {at}" for path, at in record["resumed"].items()))
    if record["left_out"]:
        lines.append(f"left out {len(record['left_out'])} unfinished runs, which begin again from their start: "
                     + "; ".join(f"{path} ({why})" for path, why in record["left_out"].items()))
    if record["base"]:
        lines.append("the base model's held-out lines are not in the exported files (only their summary, base.json): "
                     "python -m evolm_lib.tune.base_answers SPEC writes them again")
    return lines


def spec_of_export(folder: str | Path) -> Path:
    """The spec an export's tune_summary.json names (its ``spec``), found from the current folder or
    the project's; FileNotFoundError naming what to pass where there is none."""
    from ..paths import resolve_in_project

    summary = Path(folder) / SUMMARY
    named = json.loads(summary.read_text()).get("spec") if summary.is_file() else None
    if not named:
        raise FileNotFoundError(f"{folder}: its {SUMMARY} names no spec; pass the study's spec with --spec")
    path = resolve_in_project(named)
    if not Path(path).is_file():
        raise FileNotFoundError(f"{folder}: the spec it names, {named}, is not here; pass it with --spec")
    return Path(path)


def import_from(folder: str | Path, study: str | Path, spec: str | Path | None = None,
                methods: Sequence[str] | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """``import_study`` with the spec loaded (``spec``, else the one the export names)."""
    spec_path = Path(spec) if spec is not None else spec_of_export(folder)
    return import_study(folder, load_tune_spec(spec_path, methods=list(methods) if methods else None), study, log)
