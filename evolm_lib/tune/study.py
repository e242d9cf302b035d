"""The search: one Optuna study per method in OUT/optuna.db (SQLite), shared by every worker process.

A worker keeps one engine for all its trials (a trial resets what it moves: a new run starts from the
spec's initial adapter, or ``ESRun.close`` gives a shared engine the model folder's weights back).
A trial runs its method once per tuning seed into OUT/trials/<method>/trial_NNNN/seedS and is scored
by the mean of the final ``select`` values. Trials follow each other without gaps or overshoot: a
worker counts the study's trials and asks for a new one under an exclusive lock on OUT/study.lock,
so each method gets exactly ``trials`` trials, and Optuna's storage gives a trial to one worker only.
A running trial writes a heartbeat every ``heartbeat_s``; a trial silent for three of them (its
worker was killed) is marked failed by the next worker and retried with the same setting, resuming
its run folders from their checkpoints (``RetryHeartbeatStaleTrialCallback``). Running again continues.
"""
from __future__ import annotations

import contextlib
import fcntl
import math
import os
import socket
import statistics
import threading
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ..env import record_placement
from ..metrics import final_value
from ..runs import RunFolderBusy, read_metrics, row_generation
from ..seeds import derive_seed
from ..sweep import PlannedRun, make_shared_evaluator
from ..train.es import ESRun
from ..train.grpo import GRPORun
from .space import SPLIT
from .spec import STEP_SIZE, TuneSpec, check_space, trial_config

STORAGE = "optuna.db"
LOCK = "study.lock"


def storage_url(out: str | Path) -> str:
    """The SQLite URL of a tuning folder's studies (what ``optuna-dashboard`` opens)."""
    return f"sqlite:///{Path(out).resolve() / STORAGE}"


def open_storage(spec: TuneSpec):
    """The studies' storage in the tuning folder, with heartbeats and retries of stale trials; opened
    under the folder's lock (two processes creating the database's tables at once collide)."""
    import optuna

    spec.out.mkdir(parents=True, exist_ok=True)
    beat = max(1, math.ceil(spec.settings.heartbeat_s))
    with study_lock(spec.out), _quiet_optuna():
        retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=spec.settings.max_retries)
        return optuna.storages.RDBStorage(storage_url(spec.out), engine_kwargs={"connect_args": {"timeout": 120}},
                                          heartbeat_interval=beat, grace_period=3 * beat,
                                          heartbeat_stale_trial_callback=retry)


@contextlib.contextmanager
def _quiet_optuna() -> Iterator[None]:
    """Optuna's heartbeat API is marked experimental, and it warns that heartbeats belong to
    Study.optimize: this worker asks for trials itself and beats their heartbeats (see ``heartbeat``)."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
        yield


def load_study(spec: TuneSpec, method: str, storage=None):
    """The method's study (created on first use); its TPE sampler seeded from ``sampler_seed``, the
    method and the number of trials the study holds, so a worker that stops and starts again draws
    the settings an uninterrupted one would."""
    import optuna

    settings = spec.settings
    pruner = (optuna.pruners.MedianPruner(n_startup_trials=1) if settings.prune == "median"
              else optuna.pruners.NopPruner())
    study = optuna.create_study(storage=storage or open_storage(spec), study_name=method, direction="maximize",
                                pruner=pruner, load_if_exists=True)
    number = len(study.get_trials(deepcopy=False))
    study.sampler = optuna.samplers.TPESampler(seed=derive_seed(settings.sampler_seed, method, number),
                                               n_startup_trials=settings.startup_trials)
    return study


@contextlib.contextmanager
def study_lock(out: Path) -> Iterator[None]:
    """The tuning folder's exclusive lock (OUT/study.lock): one worker at a time counts and asks for
    trials, creates the storage's tables, or copies a rerun to continue it."""
    with open(out / LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def counted(trial) -> bool:
    """Whether a trial is one of the method's ``trials``: finished, running, waiting, or failed for a
    reason of its own (a setting the config refuses); a trial failed because its worker died is not
    (its retry is)."""
    from optuna.trial import TrialState

    if trial.state == TrialState.FAIL:
        return "error" in trial.user_attrs
    return True


def trials_left(study, trials: int) -> int:
    """Trials the method still needs started (retries waiting included)."""
    from optuna.trial import TrialState

    all_trials = study.get_trials(deepcopy=False)
    waiting = sum(t.state == TrialState.WAITING for t in all_trials)
    return max(trials - sum(counted(t) for t in all_trials), 0) + waiting


def ended(trial) -> bool:
    """Whether a trial has ended: neither running nor waiting (a retry queued)."""
    from optuna.trial import TrialState

    return trial.state not in (TrialState.RUNNING, TrialState.WAITING)


def trials_done(trials) -> int:
    """How many of a method's trials count against its ``trials`` and have ended."""
    return sum(counted(t) and ended(t) for t in trials)


def all_trials_done(trials, wanted: int) -> bool:
    """Whether these trials (a method's study's) hold ``wanted`` done ones, none running or waiting."""
    return trials_done(trials) >= wanted and all(ended(t) for t in trials)


def finished(spec: TuneSpec, method: str, storage=None) -> bool:
    """Whether a method's study holds all its trials, none running or waiting."""
    return all_trials_done(load_study(spec, method, storage).get_trials(deepcopy=False), spec.settings.trials)


def always(seconds: float | Callable[[], float] = 0.0) -> bool:
    """The default ``may_claim``: a worker claims work for as long as there is some, whatever its
    expected length (``seconds``; ``pace.Deadline`` is the rule that weighs it)."""
    return True


def _next_trial(spec: TuneSpec, method: str, storage, may_claim: Callable[..., bool] = always):
    """(study, trial) for this worker's next trial of ``method``, or (study, None) when none is left,
    ``tune.parallel`` trials already run (a retry, whose setting is fixed, runs regardless) or the
    worker may claim no more (``may_claim``); stale trials (a killed worker's) are failed first, which
    queues their retries."""
    import optuna
    from optuna.trial import TrialState

    with study_lock(spec.out), _quiet_optuna():
        study = load_study(spec, method, storage)
        optuna.storages.fail_stale_trials(study)
        if trials_left(study, spec.settings.trials) == 0 or not may_claim(lambda: trial_seconds(spec, method, study)):
            return study, None
        states = [t.state for t in study.get_trials(deepcopy=False)]
        limit = spec.settings.parallel
        if limit and TrialState.WAITING not in states and states.count(TrialState.RUNNING) >= limit:
            return study, None  # the worker waits (tune.work) until one of them ends
        return study, study.ask()


@contextlib.contextmanager
def heartbeat(storage, trial_id: int, seconds: float) -> Iterator[None]:
    """A thread that records the trial's heartbeat every ``seconds`` while the block runs."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            storage.record_heartbeat(trial_id)
            stop.wait(seconds)

    thread = threading.Thread(target=beat, name=f"heartbeat-{trial_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def trial_folder(spec: TuneSpec, method: str, study, trial) -> Path:
    """OUT/trials/<method>/trial_NNNN, numbered by the first attempt of the trial (a retry resumes it)."""
    import optuna

    frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
    with _quiet_optuna():
        first = optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number(frozen)
    return spec.out / "trials" / method / f"trial_{trial.number if first is None else first:04d}"


def rows_wall(rows: Sequence[dict]) -> tuple[float, int] | None:
    """A run's wall-clock seconds at its last timed row and the generation or step its rows reach, or
    None where it has no timed row past generation 0."""
    wall = final_value(rows, "time/wall_s")
    generation = max((row_generation(row) for row in rows), default=-1)
    return (wall, generation) if wall is not None and generation > 0 else None


def run_wall(folder: Path) -> tuple[float, int] | None:
    """``rows_wall`` of a run folder's metrics (None where it has none)."""
    return rows_wall(read_metrics(folder) if (folder / "metrics.jsonl").exists() else [])


def median_pace(walls: Sequence[tuple[float, int]]) -> float | None:
    """The median over runs' ``rows_wall`` of their seconds a generation or step; None for no runs."""
    return statistics.median(seconds / reached for seconds, reached in walls) if walls else None


def study_trial_folder(method: str, run_dir: str) -> str:
    """A trial's folder as its study names it, ``trials/<method>/trial_NNNN``, from ``run_dir``: where
    the trial ran, in whatever folder the study lay then, or that folder's name alone."""
    return f"trials/{method}/{Path(run_dir).name}"


def trial_walls(spec: TuneSpec, method: str, study, trial) -> list[tuple[float, int]]:
    """(wall-clock seconds, generations or steps) of each of a trial's runs that has timed rows."""
    folder = trial_folder(spec, method, study, trial)
    walls = [run_wall(seed) for seed in sorted(folder.glob("seed*"))] if folder.exists() else []
    return [wall for wall in walls if wall is not None]


def trial_seconds(spec: TuneSpec, method: str, study=None) -> float:
    """What a new trial of ``method`` should take: the median of its complete trials' seconds (their
    runs' wall clocks together; a trial's ``seconds`` attribute where its folders hold none). 0.0
    while it has no complete trial. ``study``: the method's, where the caller holds the study's lock
    (opening the storage takes it)."""
    from optuna.trial import TrialState

    study = study or load_study(spec, method)
    seconds = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        walls = trial_walls(spec, method, study, trial)
        took = sum(wall for wall, _ in walls) if walls else trial.user_attrs.get("seconds")
        if took:
            seconds.append(float(took))
    return statistics.median(seconds) if seconds else 0.0


def trial_settings(planned: PlannedRun, params: dict[str, Any], config) -> dict[str, Any]:
    """What a trial's runs were given: its searched values, and what they set (the generations or steps
    at the budget; a split's size and prompts per member)."""
    size = STEP_SIZE[planned.kind]
    derived = {size: getattr(config, size), "prompts_per_step": config.prompts_per_step} if SPLIT in params else {}
    length = "num_generations" if planned.kind == "es" else "num_steps"
    return {**params, **derived, length: getattr(config, length)}


class _Pruned(Exception):
    """The pruner stopped the trial at a scoring row."""


def _run_trial(spec: TuneSpec, method: str, trial, folder: Path, evaluator, log: Callable[[str], None]) -> float:
    """The trial's runs, one per tuning seed; returns the mean of their final ``select`` values.
    Raises _Pruned when the pruner stops it (its runs closed, their folders kept)."""
    params = {parameter.name: parameter.suggest(trial) for parameter in spec.settings.space[method]}
    key, values, step = spec.settings.select, [], 0
    for planned in spec.tuning_runs[method]:
        config = trial_config(spec, planned, params)
        if planned is spec.tuning_runs[method][0]:
            trial.set_user_attr("config", trial_settings(planned, params, config))
        cls = ESRun if planned.kind == "es" else GRPORun
        run = cls.open(config, folder / f"seed{config.seed}", evaluator=evaluator)
        stop = False

        def report(row: dict) -> None:
            nonlocal step, stop
            value = row.get(key)
            if value is not None and math.isfinite(value):
                step += 1
                trial.report(float(value), step)
                stop = stop or (spec.settings.prune != "none" and trial.should_prune())

        try:
            record_placement(run.run_dir, config, run.placement())  # the times in its rows, read with where it ran
            run.run(callback=report, should_stop=lambda: stop)
            if stop:
                raise _Pruned()
            value = final_value(run.history, key)
        finally:
            run.close()  # frees the folder; a shared engine gets the model folder's weights back
        if value is None:
            raise ValueError(f"{folder}: the run wrote no {key!r} (tune.select)")
        values.append(value)
        log(f"  {method} trial {trial.number} seed {config.seed}: {key} {value:.4g}")
    return sum(values) / len(values)


def tune_method(spec: TuneSpec, method: str, evaluator, log: Callable[[str], None] = print, storage=None,
                may_claim: Callable[..., bool] = always) -> int:
    """Run trials of ``method`` until its study holds ``trials`` of them, or until ``may_claim`` says
    this worker starts no more; returns how many this worker ran."""
    from optuna.trial import TrialState

    storage = storage or open_storage(spec)
    ran = 0
    while True:
        study, trial = _next_trial(spec, method, storage, may_claim)
        if trial is None:
            return ran
        folder = trial_folder(spec, method, study, trial)
        started = time.perf_counter()
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        # Optuna's heartbeat API takes the storage's trial id (its optimize loop passes the same)
        with heartbeat(storage, trial._trial_id, spec.settings.heartbeat_s):
            try:
                value = _run_trial(spec, method, trial, folder, evaluator, log)
            except _Pruned:
                trial.set_user_attr("seconds", time.perf_counter() - started)
                study.tell(trial, state=TrialState.PRUNED)
                log(f"{method} trial {trial.number}: pruned")
                ran += 1
                continue
            except (ValueError, RunFolderBusy) as error:  # a setting the config refuses: a trial of its own
                trial.set_user_attr("error", str(error))
                study.tell(trial, state=TrialState.FAIL)
                log(f"{method} trial {trial.number}: failed: {error}")
                ran += 1
                continue
        trial.set_user_attr("seconds", time.perf_counter() - started)
        trial.set_user_attr("run_dir", str(folder))
        study.tell(trial, value)
        ran += 1
        log(f"{method} trial {trial.number}: {spec.settings.select} {value:.4g} {trial.params}")


def make_tuning_evaluator(spec: TuneSpec):
    """One engine for every trial and rerun of the spec: sized for the largest population and LoRA
    rank any searched setting asks for."""
    runs = [run for runs in spec.tuning_runs.values() for run in runs]
    probes = [PlannedRun("probe", "probe", "es" if hasattr(config, "population_size") else "grpo", config, runs[0].budget)
              for config in check_space(spec)]
    return make_shared_evaluator(runs + probes)


def tune(spec: TuneSpec, evaluator=None, log: Callable[[str], None] = print,
         may_claim: Callable[..., bool] = always) -> dict[str, int]:
    """Every method's trials (this worker's share of them, those it claims while ``may_claim``), on one
    engine; returns {method: trials run here}."""
    own = evaluator is None
    evaluator = evaluator or make_tuning_evaluator(spec)
    try:
        storage = open_storage(spec)
        return {method: tune_method(spec, method, evaluator, log, storage, may_claim) for method in spec.methods}
    finally:
        if own:
            evaluator.close()


def trial_rows(study, method: str) -> list[dict[str, Any]]:
    """Every trial of an Optuna study as plain data: number, state, value, params, config, seconds,
    error, worker, run folder, the trial it retries, and the values it reported by step (what a
    pruner compares; ``tune.restore`` puts them back)."""
    import optuna

    rows = []
    retried = optuna.storages.RetryHeartbeatStaleTrialCallback.retried_trial_number
    for t in study.get_trials(deepcopy=False):
        with _quiet_optuna():
            retry_of = retried(t)
        rows.append({"method": method, "number": t.number, "state": t.state.name.lower(), "value": t.value,
                     "params": dict(t.params), "config": t.user_attrs.get("config"),
                     "seconds": t.user_attrs.get("seconds"), "error": t.user_attrs.get("error"),
                     "worker": t.user_attrs.get("worker"), "run_dir": t.user_attrs.get("run_dir"),
                     "retries": retry_of, "intermediate_values": dict(t.intermediate_values)})
    return rows


def study_trials(spec: TuneSpec, method: str) -> list[dict[str, Any]]:
    """Every trial of a method's study as plain data (``trial_rows``)."""
    return trial_rows(load_study(spec, method), method)


def best_trial(spec: TuneSpec, method: str):
    """The method's best complete trial (FrozenTrial); ValueError when it has none."""
    study = load_study(spec, method)
    try:
        return study.best_trial
    except ValueError:
        raise ValueError(f"{method}: no complete trial in {spec.out / STORAGE} yet (run `evolm tune` first)") from None


def with_methods(spec: TuneSpec, methods: list[str]) -> TuneSpec:
    """The spec narrowed to some of its methods."""
    return replace(spec, tuning_runs={m: spec.tuning_runs[m] for m in methods},
                   final_runs={m: spec.final_runs[m] for m in methods})
