"""The winners: each method's best setting rerun on ``final_seeds`` (OUT/final/<method>/seedS), scored
on every held-out problem, then compared across seeds (``analysis.study_table``, ``method_comparisons``
with the spec's ``primary`` pairs Holm-corrected). The tuning seeds' runs never enter these tables.

Two further stages, declared in the spec: ``tune.long`` continues each rerun to that many times the
budget in a copy of its folder (OUT/long/<method>/seedS; the rerun's own folder is never written
again; the worker that finishes a rerun continues it next),
and ``tune.control`` reruns one ES method's winner with its members' rewards shuffled
(OUT/control/<method>/seedS), the control for drift that is not learning. ``best_es`` and
``best_grpo`` name the ES or GRPO method whose winner scored highest on the selection key, decided
once every method of that kind has its trials.

Each stage's runs are planned and run as a sweep's are (`evolm_lib.grid`: `plan_stage` finds a run
finished or held by another worker, `run_stage` runs the others one after another).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from ..grid import BUSY, NOT_RUN, OK, Outcome, Step, decide, execute, held_by
from ..runs import LOCK_FILE, list_checkpoints, lock_holder, read_jsonl
from ..sweep import HELDOUT, PlannedRun, run_one
from .spec import BEST, TuneSpec, trial_config
from .storage import held
from .study import POLL_S, best_trial, finished, tune

SUMMARY = "tune_summary.json"
STAGES = ("final", "long", "control")
"""The folders of the winners' runs under OUT: reruns, continued reruns, shuffled-fitness controls."""
CONTINUED_FROM = "continued_from.json"
"""In a continued rerun's folder: the rerun it was copied from, and at which generation or step."""
BASE_HELDOUT = Path("base") / HELDOUT
"""Under OUT: the base model's held-out lines (``tune.base_answers --out``), the reference an export summarises."""


def final_plan(spec: TuneSpec, method: str) -> list[PlannedRun]:
    """The method's reruns: its best trial's setting on every final seed (names method/seedS)."""
    params = best_trial(spec, method).params
    return [replace(planned, name=f"{method}/seed{planned.config.seed}", config=trial_config(spec, planned, params))
            for planned in spec.final_runs[method]]


def resolve_best(spec: TuneSpec, name: str) -> str | None:
    """The method ``name`` stands for: itself, or for best_es / best_grpo the method of that kind whose
    winner scored highest on the selection key (the first in the sweep's order on a tie); None while a
    method of that kind is still being tuned."""
    if name not in BEST:
        return name
    candidates = [method for method, kind in spec.kinds.items() if kind == BEST[name]]
    if not candidates or not all(finished(spec, method) for method in candidates):
        return None
    scores = {method: best_trial(spec, method).value for method in candidates}
    return max(candidates, key=lambda method: scores[method])


def resolved_primary(spec: TuneSpec) -> tuple[list[tuple[str, str]], dict[str, str | None], list[str]]:
    """(the declared family with best_es / best_grpo replaced by their methods, what each stood for,
    notes): a pair not yet decidable is left out, and a pair that repeats another (best_es vs best_grpo
    resolving to es_lora vs grpo_lora, declared already) is counted once in Holm's family."""
    names = {name: resolve_best(spec, name) for name in BEST
             if any(name in pair for pair in spec.settings.primary) or spec.settings.control == name}
    pairs, seen, notes = [], set(), []
    for a, b in spec.settings.primary:
        first, second = names.get(a, a), names.get(b, b)
        if first is None or second is None:
            notes.append(f"{a} vs {b}: undecided until every method of its kind has its trials")
        elif first == second or frozenset((first, second)) in seen:
            notes.append(f"{a} vs {b} is {first} vs {second}, already in the family: counted once")
        else:
            seen.add(frozenset((first, second)))
            pairs.append((first, second))
    return pairs, names, notes


def long_run(spec: TuneSpec, rerun: PlannedRun) -> PlannedRun:
    """A rerun at ``tune.long`` times its budget (the same settings, more generations or steps)."""
    factor = spec.settings.long
    length = "num_generations" if rerun.kind == "es" else "num_steps"
    config = rerun.config.replace(**{length: getattr(rerun.config, length) * factor})
    return replace(rerun, config=config, budget=rerun.budget * factor)


def long_plan(spec: TuneSpec, method: str) -> list[PlannedRun]:
    """The method's reruns at ``tune.long`` times the budget."""
    return [long_run(spec, rerun) for rerun in final_plan(spec, method)]


def control_plan(spec: TuneSpec, method: str) -> list[PlannedRun]:
    """The method's reruns with ``fitness_control: shuffled`` (an ES method's)."""
    return [replace(planned, config=planned.config.replace(fitness_control="shuffled"))
            for planned in final_plan(spec, method)]


def finished_rerun(folder, length: int | None = None) -> bool:
    """Whether a rerun's folder is done: scored on the held-out problems at its last generation or
    step (``length``; any, where None), and written by no one now. A rerun scores the held-out
    problems once, when it ends."""
    lines = read_jsonl(folder / HELDOUT)
    return (bool(lines) and (length is None or all(line.get("generation") == length for line in lines))
            and lock_holder(folder) is None)


def run_unfinished(planned: PlannedRun, out, engine) -> bool:
    """``run_one``, unless the run's folder holds a finished rerun already (held-out scores at its last
    generation or step: an imported study's finished reruns hold no weights, and nothing of them is
    left to run). Returns whether the run is finished."""
    if finished_rerun(out / planned.name, planned.length):
        return True
    run_one(planned, out, engine)
    return True


def continue_copy(source, folder) -> bool:
    """Copy a finished rerun's folder to ``folder`` to be continued there (not its held-out scores,
    which the continued run writes anew, nor its writer's lock); False, copying nothing, when the
    source holds no checkpoint (an imported rerun, which holds no weights: the continued run then
    starts from the beginning, which a deterministic run reproduces)."""
    if not list_checkpoints(source):
        return False
    partial = folder.with_name(f".{folder.name}.copying")
    if partial.exists():
        shutil.rmtree(partial)  # a copy cut short by a kill
    shutil.copytree(source, partial, ignore=shutil.ignore_patterns(LOCK_FILE, HELDOUT))
    rows = read_jsonl(partial / "metrics.jsonl")
    (partial / CONTINUED_FROM).write_text(json.dumps({"from": str(source), "generation": rows[-1].get("generation")
                                                      if rows else None}) + "\n")
    os.replace(partial, folder)
    return True


def continue_rerun(spec: TuneSpec, planned: PlannedRun, rerun: PlannedRun, engine,
                   log: Callable[[str], None] = print) -> bool:
    """The finished rerun ``rerun`` continued as ``planned`` (``tune.long`` x its budget) in a copy of
    its folder, OUT/long/<name>, from its last checkpoint (from the start where it holds none); one
    worker copies it, under a lock beside the copies. Returns whether the continuation is finished:
    False while its rerun is not (``RunFolderBusy`` where another worker writes it)."""
    source, folder = spec.out / "final" / planned.name, spec.out / "long" / planned.name
    folder.parent.mkdir(parents=True, exist_ok=True)
    with held(spec.out / "long" / ".copying.lock", "copies a rerun to continue it"):  # one worker copies a rerun; the others find the copy
        if not folder.exists():
            if not finished_rerun(source, rerun.length):
                log(f"  long/{planned.name}: waits for its rerun final/{planned.name} to finish")
                return False
            if not continue_copy(source, folder):
                log(f"  long/{planned.name}: final/{planned.name} has no checkpoint; run from the start")
    return run_unfinished(planned, spec.out / "long", engine)


def plan_stage(plans: list[PlannedRun], out: Path) -> list[Step]:
    """Each run of a stage (OUT/final, OUT/long or OUT/control) with its folder's state and what this
    worker does with it (`grid.decide`): finished (`finished_rerun`) or busy (another worker writes it),
    skipped; new or unfinished, run."""
    steps = []
    for planned in plans:
        folder = out / planned.name
        busy = held_by(folder)
        state = ("busy" if busy is not None else "finished" if finished_rerun(folder, planned.length)
                 else "unfinished" if folder.exists() else "new")
        steps.append(Step(planned, folder, state, decide(state), busy or ""))
    return steps


def run_stage(steps: list[Step], attempt: Callable[[Step], bool], label: str, log: Callable[[str], None],
              then: Callable[[Step], None] | None = None) -> list[Step]:
    """The steps of a stage run one after another (`grid.execute`; an error goes up, the runs before it
    kept), ``then(step)`` after each that this worker finishes; a run another worker writes is logged
    (``label`` before its name) and left to that writer. Returns the steps finished: found so, or run here."""
    def after(step: Step, outcome: Outcome) -> None:
        if outcome.status == BUSY:
            log(f"  {label}{step.name}: busy, left to its writer ({outcome.error})")
        elif outcome.value and then is not None:
            then(step)

    for step in steps:
        if step.state == "busy":
            log(f"  {label}{step.name}: busy, left to its writer ({step.reason})")
    outcomes = execute([step for step in steps if step.action not in NOT_RUN], attempt, after, keep_going=False)
    ran = {outcome.name for outcome in outcomes if outcome.status == OK and outcome.value}
    return [step for step in steps if step.state == "finished" or step.name in ran]


def run_extras(spec: TuneSpec, engine, log: Callable[[str], None] = print) -> dict[str, list[str]]:
    """The declared later stages for this worker's methods: each finished rerun continued to
    ``tune.long`` x the budget (OUT/long/, ``continue_rerun``), and the shuffled-fitness control of
    ``tune.control`` (OUT/control/) once its method is decided; returns {stage/method: folders written
    or found finished}."""
    done: dict[str, list[str]] = {}

    def record(key: str, steps: list[Step]) -> None:
        if steps:
            done[key] = [str(step.folder) for step in steps]

    if spec.settings.long > 1:
        for method in spec.methods:
            if not finished(spec, method):
                continue
            reruns = {rerun.name: rerun for rerun in final_plan(spec, method)}
            steps = plan_stage([long_run(spec, rerun) for rerun in reruns.values()], spec.out / "long")
            record(f"long/{method}", run_stage(
                steps, lambda step: continue_rerun(spec, step.run, reruns[step.name], engine, log), "long/", log))
    if spec.settings.control != "none":
        method = resolve_best(spec, spec.settings.control)
        if method is None:
            log(f"control ({spec.settings.control}): waits until every ES method has its trials")
        elif method in spec.methods:
            out = spec.out / "control"
            record(f"control/{method}", run_stage(plan_stage(control_plan(spec, method), out),
                                                  lambda step: run_unfinished(step.run, out, engine), "control/", log))
    return done


def run_finals(spec: TuneSpec, engine, log: Callable[[str], None] = print) -> dict[str, list[str]]:
    """Rerun every method whose study is finished on the final seeds (a method still being tuned by
    another worker is left for later, a rerun another worker writes is skipped); returns {method: rerun
    folders written or found finished}. With ``tune.long``, a rerun this worker finishes is continued
    at once (``continue_rerun``), before the next rerun; a rerun found finished is ``run_extras``'."""
    done: dict[str, list[str]] = {}
    out = spec.out / "final"

    def continued(step: Step) -> None:
        if spec.settings.long > 1:
            planned = long_run(spec, step.run)
            run_stage(plan_stage([planned], spec.out / "long"),
                      lambda long: continue_rerun(spec, long.run, step.run, engine, log), "long/", log)

    for method in spec.methods:
        if not finished(spec, method):
            log(f"{method}: tuning not finished; its reruns wait")
            continue
        steps = run_stage(plan_stage(final_plan(spec, method), out),
                          lambda step: run_unfinished(step.run, out, engine), "", log, then=continued)
        done[method] = [str(step.folder) for step in steps]
    return done


def _running_trials(spec: TuneSpec, method: str) -> int:
    from .study import load_study

    return sum(t.state.name in ("RUNNING", "WAITING") for t in load_study(spec, method).get_trials(deepcopy=False))


def unfinished_parts(spec: TuneSpec, finals: bool = True) -> list[str]:
    """The work of this worker's methods not finished yet: trials running or queued, and reruns,
    continued reruns and control runs another worker writes or that nobody has started. Empty when
    the worker's part of the study is done. A control undecided while another method's trials are
    unclaimed is left out (its own workers run them)."""
    left = []
    for method in spec.methods:
        if not finished(spec, method):
            left.append(f"trials of {method}")
            continue
        if not finals:
            continue
        stages = [("final", final_plan(spec, method))]
        if spec.settings.long > 1:
            stages.append(("long", long_plan(spec, method)))
        left += [f"{stage}/{planned.name}" for stage, plans in stages for planned in plans
                 if not finished_rerun(spec.out / stage / planned.name, planned.length)]
    control = spec.settings.control
    if finals and control != "none":
        method = resolve_best(spec, control)
        if method is None:
            candidates = [m for m, kind in spec.kinds.items() if kind == BEST[control]]
            if any(m in spec.methods for m in candidates) and any(_running_trials(spec, m) for m in candidates):
                left.append(f"control ({control}): the trials deciding it")
        elif method in spec.methods:
            left += [f"control/{planned.name}" for planned in control_plan(spec, method)
                     if not finished_rerun(spec.out / "control" / planned.name, planned.length)]
    return left


def run_worker(spec: TuneSpec, engine, finals: bool = True, log: Callable[[str], None] = print,
         timeout: float | None = None) -> dict[str, int]:
    """This worker's whole part of the study: trials, then (with ``finals``) the reruns, continued
    reruns and control, again and again until ``unfinished_parts`` is empty. A worker with nothing to
    start while others still hold trials or runs waits for them instead of ending, so it takes the
    reruns their trials make ready (and a killed worker's trial once its heartbeats go stale), and
    its summary holds every run. ``timeout``: seconds after which no new trial starts (the reruns of
    finished studies still run). Returns {method: trials finished here}."""
    ran = {method: 0 for method in spec.methods}
    said: set[str] = set()
    end = None if timeout is None else time.monotonic() + timeout

    def once(line: str) -> None:  # each pass repeats the lines of work still waiting: say each once
        if line not in said:
            said.add(line)
            log(line)

    while True:
        left_s = None if end is None else max(end - time.monotonic(), 0.0)
        for method, count in tune(spec, engine, log, left_s).items():
            ran[method] = max(ran[method], count)
        if finals:
            run_finals(spec, engine, once)
            run_extras(spec, engine, once)
        left = unfinished_parts(spec, finals)
        if not left or (end is not None and time.monotonic() >= end
                        and all(entry.startswith("trials of ") for entry in left)):
            return ran
        shown = ", ".join(left[:3]) + (", ..." if len(left) > 3 else "")
        once(f"waiting for other workers: {len(left)} unfinished ({shown})")
        time.sleep(min(POLL_S, spec.settings.heartbeat_s))
