"""The search: one Optuna study per method, in the storage every worker shares (OUT/optuna.db by
default, a database URL, or ``journal:PATH``), run by Optuna's own loop (``Study.optimize``).

A worker keeps one engine for all its trials (a new run starts from the spec's initial adapter, or
``ESRun.close`` gives a shared engine the model folder's weights back). A trial runs its method once
per tuning seed into OUT/trials/<method>/trial_NNNN/seedS, scored by the mean of the final ``select``
values. Each method gets exactly ``trials`` finished trials (complete or pruned): ``MaxTrialsCallback``
ends a worker's loop once they are there, and a trial asked while the others fill the count (two
workers asking at once) is given back at its start, before any run, marked ``surplus`` (never counted).

An SQL storage (``RDBStorage``) records each running trial's heartbeat every ``heartbeat_s``; a trial
silent for three (its worker killed) is failed by the next worker and queued again with its setting
(``RetryHeartbeatStaleTrialCallback``, ``max_retries`` times at most), resuming its run folders. A
retry that finds a run folder still held by a live process (a worker paused past its heartbeats)
waits until that process gives it up; the paused worker, going on, sees at its next row (or when
Optuna refuses its report) that its trial was taken over and gives it up. Ctrl-C or SIGTERM fails the
cut trial and queues its retry (landing inside a storage call, it acts once the call has returned:
``stop_signals.stop_signals_held``). A journal storage (a shared filesystem) has no heartbeats: a killed
worker's trial stays running, unretried.
"""
from __future__ import annotations

import math
import os
import socket
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from ..env import record_placement
from ..metrics import final_value
from ..runs import RunFolderBusy
from ..runs.lock import describe_holder
from ..seeds import derive_seed
from ..sweep import PlannedRun, make_shared_engine
from ..train.es import ESRun
from ..train.grpo import GRPORun
from .space import SPLIT
from .spec import STEP_SIZE, TuneSpec, check_space, trial_config
from .storage import StudyStorageError, open_storage, retry_callback, storage_url

POLL_S = 5.0
"""How often a worker looks again at trials or run folders other workers hold (at most heartbeat_s)."""


def load_study(spec: TuneSpec, method: str, storage=None):
    """The method's study (created on first use); its TPE sampler seeded from ``sampler_seed``, the method
    and the number of trials held (a study continued after a stop draws from a seed of its own)."""
    import optuna

    settings = spec.settings
    pruner = optuna.pruners.MedianPruner(n_startup_trials=1) if settings.prune == "median" else optuna.pruners.NopPruner()
    storage = storage or open_storage(spec)
    try:  # read first: creating writes, and a writer stopped mid-commit (SIGSTOP) holds SQLite's lock
        study = optuna.load_study(storage=storage, study_name=method, pruner=pruner)
    except KeyError:
        study = optuna.create_study(storage=storage, study_name=method, direction="maximize", pruner=pruner, load_if_exists=True)
    number = len(study.get_trials(deepcopy=False))
    study.sampler = optuna.samplers.TPESampler(seed=derive_seed(settings.sampler_seed, method, number),
                                               n_startup_trials=settings.startup_trials)
    return study


def retried_number(trial) -> int | None:
    """The number of the trial that ``trial`` retries (Optuna's ``failed_trial``), None for a first attempt."""
    return trial.system_attrs.get("failed_trial")


FINISHED = ("COMPLETE", "PRUNED")  # the states of a method's trials that count against its ``trials``


def _counts(trial) -> bool:
    """Whether a trial fills one of the method's ``trials``: finished, running, or a queued retry."""
    return trial.state.name in FINISHED + ("RUNNING", "WAITING")


def finished_trials(trials) -> int:
    """How many of a method's trials are finished (complete or pruned)."""
    return sum(t.state.name in FINISHED for t in trials)


def all_trials_done(trials, wanted: int) -> bool:
    """Whether these trials (a method's) hold ``wanted`` finished ones, none running or waiting."""
    return finished_trials(trials) >= wanted and not any(t.state.name in ("RUNNING", "WAITING") for t in trials)


def finished(spec: TuneSpec, method: str, storage=None) -> bool:
    """Whether a method's study holds all its trials, none running or waiting."""
    return all_trials_done(load_study(spec, method, storage).get_trials(deepcopy=False), spec.settings.trials)


def trial_name(method: str, trial) -> str:
    """A trial as the log, the figures and its folder name it: by its first attempt's number, a retry
    with its own number beside it ("es trial 3 (attempt 5)")."""
    first = retried_number(trial)
    return f"{method} trial {trial.number}" if first is None else f"{method} trial {first} (attempt {trial.number})"


def trial_folder(spec: TuneSpec, method: str, trial) -> Path:
    """OUT/trials/<method>/trial_NNNN, numbered by the first attempt of the trial (a retry resumes it)."""
    first = trial.system_attrs.get("failed_trial") if hasattr(trial, "system_attrs") else None
    return spec.out / "trials" / method / f"trial_{trial.number if first is None else first:04d}"


def check_folders_belong(spec: TuneSpec, method: str, study) -> None:
    """StudyStorageError where OUT/trials/<method> holds trial folders but the storage no trial of the
    method: an emptied or another study's storage, whose trials would run into the old folders."""
    folders = sorted((spec.out / "trials" / method).glob("trial_*"))
    if folders and not study.get_trials(deepcopy=False):
        raise StudyStorageError(
            f"{spec.out / 'trials' / method} holds {len(folders)} trial folders, but the storage "
            f"{spec.storage or storage_url(spec.out)} holds no trial of {method}: it is not this study's storage. "
            f"Put the study's own storage back (or import its export: evolm tune import EXPORT {spec.out}), "
            "or tune into a new --out")


def study_trial_folder(method: str, run_dir: str) -> str:
    """A trial's folder as its study names it, ``trials/<method>/trial_NNNN``, from ``run_dir``: where
    the trial ran, in whatever folder the study lay then, or that folder's name alone."""
    return f"trials/{method}/{Path(run_dir).name}"


def trial_settings(planned: PlannedRun, params: dict[str, Any], config) -> dict[str, Any]:
    """What a trial's runs were given: its searched values, and what they set (the generations or steps
    at the budget; a split's size and prompts per member)."""
    size = STEP_SIZE[planned.kind]
    derived = {size: getattr(config, size), "prompts_per_step": config.prompts_per_step} if SPLIT in params else {}
    length = "num_generations" if planned.kind == "es" else "num_steps"
    return {**params, **derived, length: getattr(config, length)}


class _Pruned(Exception):
    """The pruner stopped the trial at a scoring row."""


class _GivenUp(BaseException):
    """This worker's trial ended without it (another worker took it over, or it was surplus): out of
    Optuna's loop without a tell, which the trial's storage state no longer takes. A BaseException, so
    that Optuna's loop does not record it as the trial's failure."""


class _Interrupted(BaseException):
    """Ctrl-C or SIGTERM, once the cut trial is failed and its retry queued (``tune_method``)."""


def open_when_free(cls, config, folder: Path, engine, log: Callable[[str], None]):
    """``cls.open`` on a run folder, waiting while another live process holds it (a worker paused past
    its heartbeats, whose trial this worker retries): the operating system frees the folder when that
    process ends, and a paused worker that goes on gives it up at its next row."""
    said = False
    while True:
        try:
            return cls.open(config, folder, engine=engine)
        except RunFolderBusy as busy:
            if busy.holder.get("pid") == os.getpid():
                raise
            if not said:
                log(f"  {folder.name} of {folder.parent.name}: held by {describe_holder(busy.holder)}; "
                    "waiting until it gives the folder up")
                said = True
            time.sleep(POLL_S)


def _run_trial(spec: TuneSpec, method: str, trial, folder: Path, engine, log: Callable[[str], None],
               still_mine: Callable[[], bool] = lambda: True, name: str | None = None) -> float:
    """The trial's runs, one per tuning seed; returns the mean of their final ``select`` values.
    Raises _Pruned when the pruner stops it, _GivenUp when ``still_mine`` says at a row that the trial
    is no longer this worker's (each run closed, its folder kept). ``name``: the trial in the log."""
    from optuna.exceptions import UpdateFinishedTrialError

    name = name or f"{method} trial {trial.number}"
    params = {parameter.name: parameter.suggest(trial) for parameter in spec.settings.space[method]}
    key, values, step = spec.settings.select, [], 0
    for planned in spec.tuning_runs[method]:
        config = trial_config(spec, planned, params)
        if planned is spec.tuning_runs[method][0]:
            trial.set_user_attr("config", trial_settings(planned, params, config))
        cls = ESRun if planned.kind == "es" else GRPORun
        run = open_when_free(cls, config, folder / f"seed{config.seed}", engine, log)
        stop, taken = False, False

        def report(row: dict) -> None:
            nonlocal step, stop, taken
            taken = taken or not still_mine()
            value = row.get(key)
            if not taken and value is not None and math.isfinite(value):
                step += 1
                try:
                    trial.report(float(value), step)
                except UpdateFinishedTrialError:  # a heartbeat failed it after still_mine() said yes
                    taken = True
                    return
                stop = stop or (spec.settings.prune != "none" and trial.should_prune())

        try:
            record_placement(run.run_dir, config, run.placement())  # the times in its rows, read with where it ran
            run.run(callback=report, should_stop=lambda: stop or taken)
            if taken:
                raise _GivenUp(f"{name} was taken over by another worker")
            if stop:
                raise _Pruned()
            value = final_value(run.history, key)
        finally:
            run.close()  # frees the folder; a shared engine gets the model folder's weights back
        if value is None:
            raise ValueError(f"{folder}: the run wrote no {key!r} (tune.select)")
        values.append(value)
        log(f"  {name} seed {config.seed}: {key} {value:.4g}")
    return sum(values) / len(values)


def _surplus(study, trial, wanted: int) -> bool:
    """Whether a first attempt asked while the trials before it already fill the method's count."""
    if retried_number(trial) is not None:
        return False  # a retry takes the place of the trial it retries
    return sum(_counts(t) for t in study.get_trials(deepcopy=False) if t.number < trial.number) >= wanted


def _objective(spec: TuneSpec, method: str, study, storage, engine, log: Callable[[str], None], current: dict):
    """Optuna's objective for ``method``: a trial's runs (``_run_trial``) and what they leave in its
    user attributes (worker, seconds, run folder, error)."""
    import optuna
    from optuna.trial import TrialState

    def objective(trial) -> float:
        frozen = storage.get_trial(trial._trial_id)
        current["trial"] = frozen
        if _surplus(study, frozen, spec.settings.trials):
            trial.set_user_attr("surplus", True)
            study.tell(trial, state=TrialState.FAIL)
            raise _GivenUp(f"{method} trial {trial.number}: surplus")
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        folder, name = trial_folder(spec, method, frozen), trial_name(method, frozen)
        started = time.perf_counter()

        def still_mine() -> bool:
            return storage.get_trial(trial._trial_id).state == TrialState.RUNNING

        try:
            value = _run_trial(spec, method, trial, folder, engine, log, still_mine, name)
        except _Pruned:
            trial.set_user_attr("seconds", time.perf_counter() - started)
            log(f"{name}: pruned")
            raise optuna.TrialPruned() from None
        except _GivenUp:
            log(f"{name}: taken over by another worker while this one was stopped; "
                "given up here (its retry goes on from the run folders' checkpoints)")
            raise
        except ValueError as error:  # a setting the config refuses: failed, with its reason kept
            trial.set_user_attr("error", str(error))
            study.tell(trial, state=TrialState.FAIL)
            log(f"{name}: failed: {error}")
            raise _GivenUp(str(error)) from None
        except KeyboardInterrupt:
            raise _Interrupted() from None
        trial.set_user_attr("seconds", time.perf_counter() - started)
        trial.set_user_attr("run_dir", str(folder))
        log(f"{name}: {spec.settings.select} {value:.4g} {trial.params}")
        return value

    return objective


def _stop_when_none_to_start(wanted: int, parallel: int):
    """An ``optimize`` callback that ends this worker's loop once every trial the method needs is
    finished, running or queued (``MaxTrialsCallback`` counts the finished ones only), or once
    ``parallel`` trials run; ``tune_method`` then waits for the trials other workers hold."""
    def callback(study, _trial) -> None:
        trials = study.get_trials(deepcopy=False)
        running = sum(t.state.name == "RUNNING" for t in trials)
        if sum(_counts(t) for t in trials) >= wanted or (parallel and running >= parallel):
            study.stop()

    return callback


def _fail_and_retry(spec: TuneSpec, study, storage, frozen) -> None:
    """The cut trial (Ctrl-C, SIGTERM) failed now and its retry queued, as a killed worker's would be
    after its heartbeats, so that the next worker takes it at once."""
    from optuna.trial import TrialState

    if frozen is None or storage.get_trial(frozen._trial_id).state != TrialState.RUNNING:
        return
    storage.set_trial_user_attr(frozen._trial_id, "interrupted", True)
    storage.set_trial_state_values(frozen._trial_id, state=TrialState.FAIL)
    retry_callback(spec)(study, storage.get_trial(frozen._trial_id))


def tune_method(spec: TuneSpec, method: str, engine, log: Callable[[str], None] = print, storage=None,
                timeout: float | None = None) -> int:
    """Run trials of ``method`` until its study holds ``trials`` finished ones, waiting while other
    workers hold the last of them (and taking a killed worker's trial once its heartbeats go stale);
    ``timeout``: seconds after which this worker starts no new trial (Optuna's ``timeout``). Returns
    how many trials this worker finished."""
    import optuna
    from optuna.trial import TrialState

    storage = storage or open_storage(spec)
    study = load_study(spec, method, storage)
    check_folders_belong(spec, method, study)
    before = {t.number for t in study.get_trials(deepcopy=False) if t.state.name in FINISHED}
    wanted, parallel = spec.settings.trials, spec.settings.parallel
    end = None if timeout is None else time.monotonic() + timeout
    said = False
    while True:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)  # a killed worker's trial: failed, its retry queued
        trials = study.get_trials(deepcopy=False)
        if all_trials_done(trials, wanted):
            return _finished_here(trials, before)
        errors = sum(t.state == TrialState.FAIL and "error" in t.user_attrs for t in trials)
        if errors >= wanted:
            log(f"{method}: {errors} trials failed on a setting the runs refuse; no more are started "
                "(see each trial's error in the summary)")
            return _finished_here(trials, before)
        left = None if end is None else end - time.monotonic()
        if left is not None and left <= 0:
            return _finished_here(trials, before)
        waiting = any(t.state == TrialState.WAITING for t in trials)
        running = sum(t.state == TrialState.RUNNING for t in trials)
        if not waiting and (sum(_counts(t) for t in trials) >= wanted or (parallel and running >= parallel)):
            if not said:
                log(f"{method}: waiting for the trials other workers run")
                said = True
            time.sleep(min(POLL_S, spec.settings.heartbeat_s))
            continue
        said = False
        study.sampler = load_study(spec, method, storage).sampler  # seeded by the trials held now
        current: dict[str, Any] = {}
        try:
            study.optimize(_objective(spec, method, study, storage, engine, log, current), timeout=left,
                           callbacks=[optuna.study.MaxTrialsCallback(wanted, states=(TrialState.COMPLETE,
                                                                                    TrialState.PRUNED)),
                                      _stop_when_none_to_start(wanted, parallel)])
        except _GivenUp:
            pass
        except (_Interrupted, KeyboardInterrupt):
            _fail_and_retry(spec, study, storage, current.get("trial"))
            raise KeyboardInterrupt() from None


def _finished_here(trials, before: set[int]) -> int:
    """How many of these trials this process finished, of those not finished ``before``."""
    worker = f"{socket.gethostname()}:{os.getpid()}"
    return sum(t.state.name in FINISHED and t.number not in before and t.user_attrs.get("worker") == worker
               for t in trials)


def make_tuning_engine(spec: TuneSpec):
    """One engine for every trial and rerun of the spec: sized for the largest population and LoRA
    rank any searched setting asks for."""
    runs = [run for runs in spec.tuning_runs.values() for run in runs]
    probes = [PlannedRun("probe", "probe", "es" if hasattr(config, "population_size") else "grpo", config, runs[0].budget)
              for config in check_space(spec)]
    return make_shared_engine(runs + probes)


def tune(spec: TuneSpec, engine=None, log: Callable[[str], None] = print,
         timeout: float | None = None) -> dict[str, int]:
    """Every method's trials (this worker's share of them), on one engine; ``timeout``: seconds per
    method after which no new trial starts. Returns {method: trials finished here}."""
    own = engine is None
    engine = engine or make_tuning_engine(spec)
    try:
        storage = open_storage(spec)
        return {method: tune_method(spec, method, engine, log, storage, timeout) for method in spec.methods}
    finally:
        if own:
            engine.close()


def trial_rows(study, method: str) -> list[dict[str, Any]]:
    """Every trial of an Optuna study as plain data: number, state, value, params, config, seconds,
    error, worker, run folder, the trial it retries, and the values it reported by step (what a
    pruner compares; ``evolm tune import`` puts them back). Surplus trials (given back unrun) are
    left out."""
    return [{"method": method, "number": t.number, "state": t.state.name.lower(), "value": t.value,
             "params": dict(t.params), "config": t.user_attrs.get("config"),
             "seconds": t.user_attrs.get("seconds"), "error": t.user_attrs.get("error"),
             "worker": t.user_attrs.get("worker"), "run_dir": t.user_attrs.get("run_dir"),
             "retries": retried_number(t), "intermediate_values": dict(t.intermediate_values)}
            for t in study.get_trials(deepcopy=False) if not t.user_attrs.get("surplus")]


def study_trials(spec: TuneSpec, method: str) -> list[dict[str, Any]]:
    """Every trial of a method's study as plain data (``trial_rows``)."""
    return trial_rows(load_study(spec, method), method)


def best_trial(spec: TuneSpec, method: str):
    """The method's best complete trial (FrozenTrial); ValueError when it has none."""
    study = load_study(spec, method)
    try:
        return study.best_trial
    except ValueError:
        raise ValueError(f"{method}: no complete trial in {spec.storage or storage_url(spec.out)} yet "
                         "(run `evolm tune` first)") from None


def with_methods(spec: TuneSpec, methods: list[str]) -> TuneSpec:
    """The spec narrowed to some of its methods."""
    return replace(spec, tuning_runs={m: spec.tuning_runs[m] for m in methods},
                   final_runs={m: spec.final_runs[m] for m in methods})


def with_storage(spec: TuneSpec, storage: str | None) -> TuneSpec:
    """The spec with its studies in ``storage`` (a database URL or journal:PATH; None for OUT/optuna.db)."""
    return replace(spec, storage=storage)
