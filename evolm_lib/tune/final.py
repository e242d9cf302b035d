"""The winners: each method's best setting rerun on ``final_seeds`` (OUT/final/<method>/seedS), scored
on every held-out problem, then compared across seeds (``analysis.study_table``, ``method_comparisons``
with the spec's ``primary`` pairs Holm-corrected). The tuning seeds' runs never enter these tables.

Two further stages, declared in the spec: ``tune.long`` continues each rerun to that many times the
budget in a copy of its folder (OUT/long/<method>/seedS; the rerun's own folder is never written
again; the worker that finishes a rerun continues it next, while its checkpoint is on its machine),
and ``tune.control`` reruns one ES method's winner with its members' rewards shuffled
(OUT/control/<method>/seedS), the control for drift that is not learning. ``best_es`` and
``best_grpo`` name the ES or GRPO method whose winner scored highest on the selection key, decided
once every method of that kind has its trials.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from ..runs import LOCK_FILE, RunFolderBusy, list_checkpoints, lock_holder, read_jsonl
from ..sweep import HELDOUT, PlannedRun, run_one
from .pace import run_seconds, step_seconds
from .spec import BEST, TuneSpec, trial_config
from .study import (always, best_trial, ended, finished, load_study, run_wall, study_lock, study_trials,
                    trial_seconds, trials_left, tune)

POLL_S = 5.0
"""How often a worker with nothing to claim looks again at what other workers hold (at most the
spec's heartbeat_s)."""

SUMMARY = "tune_summary.json"
STAGES = ("final", "long", "control")
"""The folders of the winners' runs under OUT: reruns, continued reruns, shuffled-fitness controls."""
CONTINUED_FROM = "continued_from.json"
"""In a continued rerun's folder: the rerun it was copied from, and at which generation or step."""
BASE_HELDOUT = Path("base") / HELDOUT
"""Under OUT: the base model's held-out lines (``tune.base --out``), the reference ``pack`` carries
and ``compact`` summarises."""


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


def run_unfinished(planned: PlannedRun, out, evaluator, may_claim: Callable[..., bool] = always,
                   seconds: float | Callable[[], float] = 0.0) -> bool:
    """``run_one``, unless the run's folder holds a finished rerun already (held-out scores at its last
    generation or step): such a folder may hold no weights (unpacked on another machine from a pack,
    which leaves weights out), and nothing of it is left to run. An unfinished run is left alone
    when ``may_claim`` says the worker starts nothing more, or nothing as long as ``seconds`` (the
    run's expected length, ``pace.run_seconds``). Returns whether the run is finished."""
    if finished_rerun(out / planned.name, planned.length):
        return True
    if not may_claim(seconds):
        return False
    run_one(planned, out, evaluator)
    return True


def continue_copy(source, folder) -> bool:
    """Copy a finished rerun's folder to ``folder`` to be continued there (not its held-out scores,
    which the continued run writes anew, nor its writer's lock); False, copying nothing, when the
    source holds no checkpoint (a folder unpacked without weights: the continued run then starts
    from the beginning, which a deterministic run reproduces)."""
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


def continue_rerun(spec: TuneSpec, planned: PlannedRun, rerun: PlannedRun, evaluator,
                   log: Callable[[str], None] = print, may_claim: Callable[..., bool] = always) -> bool:
    """The finished rerun ``rerun`` continued as ``planned`` (``tune.long`` x its budget) in a copy of
    its folder, OUT/long/<name>, from its last checkpoint (from the start where this machine holds
    none); one worker copies it, under the study's lock. Returns whether the continuation is
    finished: False while its rerun is not, or once ``may_claim`` says no (``RunFolderBusy`` where
    another worker writes it)."""
    source, folder = spec.out / "final" / planned.name, spec.out / "long" / planned.name
    # asked outside the study's lock, which pacing takes to open the study's storage
    if (not folder.exists() and finished_rerun(source, rerun.length)
            and not may_claim(lambda: continuation_seconds(spec, planned, rerun))):
        return False
    with study_lock(spec.out):  # one worker copies a rerun; the others find the copy
        if not folder.exists():
            if not finished_rerun(source, rerun.length):
                log(f"  long/{planned.name}: waits for its rerun final/{planned.name} to finish")
                return False
            folder.parent.mkdir(parents=True, exist_ok=True)
            if not continue_copy(source, folder):
                log(f"  long/{planned.name}: final/{planned.name} has no checkpoint here; run from the start")
    return run_unfinished(planned, spec.out / "long", evaluator, may_claim, lambda: continuation_seconds(spec, planned, rerun))


def continuation_seconds(spec: TuneSpec, planned: PlannedRun, rerun: PlannedRun, step: float | None = None) -> float:
    """What the continuation ``planned`` of the finished ``rerun`` should take (``pace.run_seconds``):
    from its own folder's newest checkpoint once copied, before that from the rerun's last checkpoint,
    or from the start where this machine holds none. Paced by its own timed rows (the copy's once
    made, else the rerun's: the same setting and seed, timed at the load it ran under, nearer than
    the winner trial's pace), by ``step`` (or its method's, ``pace.step_seconds``) only where there are none."""
    source, folder = spec.out / "final" / planned.name, spec.out / "long" / planned.name
    copied = folder.exists()
    start = None if copied else rerun.length if list_checkpoints(source) else 0
    timed = run_wall(folder if copied else source)
    return run_seconds(spec, planned, folder, start=start, step=timed[0] / timed[1] if timed else step)


def _finished_unless_busy(run: Callable[[], bool], label: str, log: Callable[[str], None]) -> bool:
    """``run()`` (whether the run it starts or finds is finished), False where another worker writes
    its folder, which is left to that writer and logged under ``label``."""
    try:
        return run()
    except RunFolderBusy as busy:
        log(f"  {label}: busy, left to its writer ({busy})")
        return False


def run_extras(spec: TuneSpec, evaluator, log: Callable[[str], None] = print,
               may_claim: Callable[..., bool] = always) -> dict[str, list[str]]:
    """The declared later stages for this worker's methods: each finished rerun continued to
    ``tune.long`` x the budget (OUT/long/, ``continue_rerun``), and the shuffled-fitness control of
    ``tune.control`` (OUT/control/) once its method is decided, each started while ``may_claim``;
    returns {stage/method: folders written or found finished}."""
    done: dict[str, list[str]] = {}

    def run(planned: PlannedRun, stage: str, start: Callable[[], bool]) -> None:
        if _finished_unless_busy(start, f"{stage}/{planned.name}", log):
            done.setdefault(f"{stage}/{planned.method.split('/')[0]}", []).append(str(spec.out / stage / planned.name))

    if spec.settings.long > 1:
        for method in spec.methods:
            if not finished(spec, method):
                continue
            for rerun in final_plan(spec, method):
                planned = long_run(spec, rerun)
                run(planned, "long", lambda: continue_rerun(spec, planned, rerun, evaluator, log, may_claim))
    if spec.settings.control != "none":
        method = resolve_best(spec, spec.settings.control)
        if method is None:
            log(f"control ({spec.settings.control}): waits until every ES method has its trials")
        elif method in spec.methods:
            for planned in control_plan(spec, method):
                folder = spec.out / "control" / planned.name
                run(planned, "control", lambda: run_unfinished(planned, spec.out / "control", evaluator, may_claim,
                                                               lambda: run_seconds(spec, planned, folder)))
    return done


def run_finals(spec: TuneSpec, evaluator, log: Callable[[str], None] = print,
               may_claim: Callable[..., bool] = always) -> dict[str, list[str]]:
    """Rerun every method whose study is finished on the final seeds (a method still being tuned by
    another worker is left for later, a rerun another worker writes is skipped, and none is started
    once ``may_claim`` says no); returns {method: rerun folders written or found finished}. With
    ``tune.long``, a rerun this worker finishes is continued at once (``continue_rerun``), before the
    next rerun: its checkpoint is on this machine now, where a later machine may not get it (a
    full-weight GRPO checkpoint never travels, and its continuation would start from the first step).
    For the same reason the continuations of reruns finished earlier whose checkpoints are here (a
    kept pack's) go before the reruns not yet started, which can run on any machine."""
    done: dict[str, list[str]] = {}
    for method in spec.methods:
        if not finished(spec, method):
            log(f"{method}: tuning not finished; its reruns wait")
            continue
        done[method] = []
        plan = final_plan(spec, method)

        def continued(planned: PlannedRun) -> None:
            if spec.settings.long > 1:
                _finished_unless_busy(lambda: continue_rerun(spec, long_run(spec, planned), planned, evaluator, log,
                                                             may_claim), f"long/{planned.name}", log)

        for planned in plan:
            folder = spec.out / "final" / planned.name
            if finished_rerun(folder, planned.length) and list_checkpoints(folder):
                continued(planned)
        for planned in plan:
            folder = spec.out / "final" / planned.name
            if finished_rerun(folder, planned.length):  # here already: its continuation is run_extras'
                done[method].append(str(folder))
                continue
            if not _finished_unless_busy(lambda: run_unfinished(planned, spec.out / "final", evaluator, may_claim,
                                                                lambda: run_seconds(spec, planned, folder)),
                                         planned.name, log):
                continue
            done[method].append(str(folder))
            continued(planned)
    return done


def _running_trials(spec: TuneSpec, method: str) -> int:
    return sum(not ended(t) for t in load_study(spec, method).get_trials(deepcopy=False))


TRIALS_OF = "trials of "
"""How ``outstanding`` names a method's unfinished trials (``nothing_fits`` reads the method back)."""


def outstanding(spec: TuneSpec, finals: bool = True) -> list[str]:
    """The work of this worker's methods not finished yet that a worker can still finish: trials
    running or queued, and reruns, continued reruns and control runs another worker writes or that
    nobody has started. Empty when the worker's part of the study is done. Work nobody can start
    here is left out: a control undecided while another method's trials are unclaimed (its own
    workers run them)."""
    left = []
    for method in spec.methods:
        if not finished(spec, method):
            left.append(TRIALS_OF + method)
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


def nothing_fits(spec: TuneSpec, may_claim: Callable[..., bool], finals: bool = True,
                 left: list[str] | None = None) -> str | None:
    """Where this worker could start none of its outstanding work and ``may_claim`` turned some of it
    down (too long for a ``pace.Deadline``'s end, or its claim window shut): the line saying so. The
    rest is work other workers hold, so ``work`` would claim nothing and end after its first pass;
    the worker then starts no engine. None where some work may be claimed now, or where all of it is
    held by other workers (a trial or run they write, a continuation whose rerun they write, a
    control their trials decide), which the worker waits for. ``left``: ``outstanding``'s list,
    where the caller has it already."""
    left = outstanding(spec, finals) if left is None else left
    refused = getattr(may_claim, "refused", 0)
    # each method's plan and pace read once (each opens its study), not once for every seed
    plans = functools.cache(lambda method: final_plan(spec, method))
    paces = functools.cache(lambda method: step_seconds(spec, method))
    turned_down = False
    for entry in left:
        answer = _may_start(spec, entry, may_claim, plans, paces)
        if answer is None:
            continue
        if answer:
            return None
        turned_down = True
    if not turned_down:
        return None
    why = "would not end by the deadline" if getattr(may_claim, "refused", 0) > refused else "may not be started now"
    shown = ", ".join(left[:3]) + (f", ... ({len(left)} in all)" if len(left) > 3 else "")
    return f"claiming no more: what is left {why} ({shown}): no engine started"


def _may_start(spec: TuneSpec, entry: str, may_claim: Callable[..., bool],
               plans: Callable[[str], list[PlannedRun]], paces: Callable[[str], float]) -> bool | None:
    """Whether this worker may start ``outstanding``'s ``entry`` now, asking ``may_claim`` with the
    length the worker would ask it with (``plans``: ``final_plan``, ``paces``: ``pace.step_seconds``,
    by method); None where other workers hold it (or, for the control, their trials decide it)."""
    if entry.startswith(TRIALS_OF):
        method = entry.removeprefix(TRIALS_OF)
        study = load_study(spec, method)
        if trials_left(study, spec.settings.trials) == 0:
            return None  # every trial claimed, some still running elsewhere
        return may_claim(lambda: trial_seconds(spec, method, study))
    stage, _, name = entry.partition("/")
    if stage not in STAGES or lock_holder(spec.out / stage / name) is not None:
        return None
    method = name.split("/")[0]
    rerun = next(planned for planned in plans(method) if planned.name == name)
    if stage == "long":
        if not finished_rerun(spec.out / "final" / name, rerun.length):  # reached only through its rerun
            return _may_start(spec, f"final/{name}", may_claim, plans, paces)
        return may_claim(lambda: continuation_seconds(spec, long_run(spec, rerun), rerun, paces(method)))
    # a control run (control_plan) is its rerun with the rewards shuffled: the same length and pace
    return may_claim(lambda: run_seconds(spec, rerun, spec.out / stage / name, step=paces(method)))


def work(spec: TuneSpec, evaluator, finals: bool = True, log: Callable[[str], None] = print,
         may_claim: Callable[..., bool] = always) -> dict[str, int]:
    """This worker's whole part of the study: trials, then (with ``finals``) the reruns, continued
    reruns and control, again and again until ``outstanding`` is empty. A worker with nothing to
    claim while others still hold trials or runs waits for them instead of ending, so it takes the
    reruns their trials make ready (and a killed worker's trial once its heartbeat goes stale), and
    its summary holds every run. ``may_claim`` is asked before each trial or run is started: once it
    says no, the worker finishes what it runs and returns, leaving the rest to other workers or a
    later start (a run that cannot resume on another machine is not begun where it could not end);
    so it does after a pass in which a ``pace.Deadline`` turned work down as too long for the time left.
    Returns {method: trials run here}."""
    ran = {method: 0 for method in spec.methods}
    said: set[str] = set()

    def once(line: str) -> None:  # each pass repeats the lines of work still waiting: say each once
        if line not in said:
            said.add(line)
            log(line)

    while True:
        refused = getattr(may_claim, "refused", 0)  # a pace.Deadline counts the claims too long for it
        for method, count in tune(spec, evaluator, log, may_claim).items():
            ran[method] += count
        if finals:
            run_finals(spec, evaluator, once, may_claim)
            run_extras(spec, evaluator, once, may_claim)
        left = outstanding(spec, finals)
        if not left:
            return ran
        shown = ", ".join(left[:3]) + (", ..." if len(left) > 3 else "")
        if not may_claim():
            log(f"claiming no more: {len(left)} unfinished left to other workers or a later start ({shown})")
            return ran
        if getattr(may_claim, "refused", 0) > refused:  # the time left only shrinks: this worker's slot goes to other work
            log(f"claiming no more: what is left would not end by the deadline ({len(left)} unfinished left to "
                f"other workers or a later start: {shown})")
            return ran
        once(f"waiting for other workers: {len(left)} unfinished ({shown})")
        time.sleep(min(POLL_S, spec.settings.heartbeat_s))


def final_groups(spec: TuneSpec, methods: list[str] | None = None, stage: str = "final"):
    """A stage's finished runs (``STAGES``: final, long, control) grouped by method (``analysis.load_runs``),
    for the methods that have some. A run another worker is writing, or one a kill cut short, is
    left out until it finishes: its folder may hold no rows yet, and never a held-out score."""
    from ..analysis import load_runs

    folders = {m: found for m in (methods or spec.methods)
               if (found := [str(f) for f in sorted((spec.out / stage / m).glob("seed*")) if finished_rerun(f)])}
    return load_runs(folders, allow_mixed=True) if folders else {}


def _records(frame) -> list:
    return [] if frame is None else json.loads(frame.reset_index().to_json(orient="records"))


def _extras_summary(spec: TuneSpec, groups, measure: str) -> dict[str, Any]:
    """The long and control stages' tables: held-out per method at the longer budget (its pairs
    exploratory), and the control against its method's reruns."""
    from ..analysis import method_comparisons, study_table

    extras: dict[str, Any] = {}
    if spec.settings.long > 1:
        long_groups = final_groups(spec, spec.study_methods, stage="long")
        extras["long"] = {"factor": spec.settings.long, "budget": spec.budget * spec.settings.long,
                          "final": _records(study_table(long_groups, measure=measure)) if long_groups else [],
                          "comparisons": _records(method_comparisons(long_groups, measure=measure))
                          if len(long_groups) > 1 else []}
    if spec.settings.control != "none":
        method = resolve_best(spec, spec.settings.control)
        control = final_groups(spec, [method], stage="control") if method else {}
        entry: dict[str, Any] = {"declared": spec.settings.control, "method": method, "final": [], "comparison": []}
        if control:
            pair = {method: groups[method], f"{method} shuffled": control[method]} if method in groups else {
                f"{method} shuffled": control[method]}
            entry["final"] = _records(study_table({f"{method} shuffled": control[method]}, measure=measure))
            entry["comparison"] = _records(method_comparisons(pair, measure=measure)) if len(pair) > 1 else []
        extras["control"] = entry
    return extras


def summarize(spec: TuneSpec) -> dict[str, Any]:
    """OUT/tune_summary.json, the study's one summary (every tuned method, whichever worker writes
    it): per method its trials (complete, pruned, failed, retried), the winning setting and its
    selection score; the reruns' held-out table (t and BCa intervals across final seeds,
    interquartile mean) and the comparisons (primary ones Holm-corrected). Returns it."""
    from ..analysis import method_comparisons, study_table

    measure = spec.settings.measure
    methods = {}
    for method in spec.study_methods:
        trials = study_trials(spec, method)
        states = [t["state"] for t in trials]
        try:
            best = best_trial(spec, method)
            winner = {"trial": best.number, "value": best.value, "params": best.params,
                      "config": best.user_attrs.get("config")}
        except ValueError:
            winner = None
        methods[method] = {
            "trials": sum(s in ("complete", "pruned") for s in states) + sum(
                t["state"] == "fail" and t["error"] is not None for t in trials),
            "complete": states.count("complete"), "pruned": states.count("pruned"),
            "failed": sum(t["state"] == "fail" and t["error"] is not None for t in trials),
            "killed_and_retried": sum(t["retries"] is not None for t in trials),
            "winner": winner, "trial_list": trials,
        }
    groups = final_groups(spec, spec.study_methods)
    declared, resolved, notes = resolved_primary(spec)
    primary = [pair for pair in declared if all(m in groups for m in pair)]
    table = study_table(groups, measure=measure) if groups else None
    comparisons = method_comparisons(groups, measure=measure, primary=primary) if len(groups) > 1 else None
    summary = {
        "spec": str(spec.path), "select": spec.settings.select, "budget": spec.budget,
        "tuning_seeds": list(spec.settings.seeds), "final_seeds": list(spec.settings.final_seeds),
        "trials_per_method": spec.settings.trials, "methods": methods,
        "final": [] if table is None else json.loads(table.reset_index().to_json(orient="records")),
        "comparisons": [] if comparisons is None else json.loads(comparisons.to_json(orient="records")),
        "measure": measure,
        "primary": {"declared": [list(pair) for pair in spec.settings.primary], "resolved": resolved,
                    "family": [list(pair) for pair in primary], "notes": notes},
        **_extras_summary(spec, groups, measure),
    }
    spec.out.mkdir(parents=True, exist_ok=True)
    Path(spec.out / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary in a few printed lines: trials, winner and held-out result per method."""
    lines = []
    final = {row["method"]: row for row in summary["final"]}
    for method, entry in summary["methods"].items():
        winner = entry["winner"]
        won = (f"winner trial {winner['trial']} ({summary['select']} {winner['value']:.4g}): {winner['params']}"
               if winner else "no complete trial")
        lines.append(f"{method}: {entry['trials']} trials ({entry['complete']} complete, {entry['pruned']} pruned, "
                     f"{entry['failed']} failed, {entry['killed_and_retried']} retries of killed trials); {won}")
        if method in final:
            row = final[method]
            lines.append(f"  held-out {summary['measure']} on {row['seeds']} final seeds: {row['mean']:.4g} "
                         f"(BCa {row['ci_low']:.4g} to {row['ci_high']:.4g}; t {row['t_low']:.4g} to {row['t_high']:.4g})")
    resolved = {k: v for k, v in summary.get("primary", {}).get("resolved", {}).items() if v}
    if resolved:
        lines.append("decided by the tuning: " + ", ".join(f"{k} = {v}" for k, v in resolved.items()))
    for row in summary["comparisons"]:
        p = row["holm_p"] if row["family"] == "primary" else row["permutation_p"]
        lines.append(f"{row['method_a']} - {row['method_b']} ({row['family']}): {row['difference']:.4g}, "
                     f"p {p:.3g}{' (Holm)' if row['family'] == 'primary' else ''}")
    for stage in ("long", "control"):
        for row in summary.get(stage, {}).get("final", []):
            lines.append(f"{stage}: {row['method']} held-out {summary['measure']} on {row['seeds']} seeds: {row['mean']:.4g}")
    return lines
