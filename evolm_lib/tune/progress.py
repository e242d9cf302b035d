"""Where a tuned study stands, per method: trials finished of ``tune.trials`` and those under way,
reruns on the final seeds, continued reruns (``tune.long``), the best validation score so far and the
control (``tune.control``), each run under way with its generation or step. It starts no engine and
changes no trial (a method with no study yet gets an empty one, as a worker's first look would
make), so it runs wherever a pack was unpacked:

    python -m evolm_lib.tune.progress papermill_runs/tune_study_conciseness_gpu.yaml --out runs/tune_study_conciseness

prints the Markdown table that the docs' progress sections show. A trial "under way" is one the
storage holds as running: on a machine that unpacked a pack, a trial that was running when the last
machine went back is listed this way until a worker retries it. A "queued" one is waiting: the
retry of a killed or restored trial, with its setting, that no worker has taken yet.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Sequence

from ..runs import list_checkpoints, read_config_file, read_metrics, row_generation
from ..sweep import PlannedRun
from .final import control_plan, final_plan, finished_rerun, long_run, resolve_best
from .pace import resumes_at
from .spec import TuneSpec, load_tune_spec
from .study import STORAGE, all_trials_done, ended, load_study, trial_folder, trials_done


PACE_ROWS = 20
"""How many of a run's last rows its pace is the median of (``run_position``)."""


def run_position(folder: Path) -> str:
    """Where a run folder stands: ``at G/LENGTH`` (its last row's generation or step) and where it would
    resume (its newest checkpoint, or from its start), or ``from its start`` where it holds no config
    (a pack left it out); for a run short of its length whose rows time their generations or steps,
    how long the rest takes at its pace (the median of its last ``PACE_ROWS`` rows' ``time/generation_s``):
    what decides, within a lease, whether a run that cannot go on in a later one will end in this."""
    if not (folder / "config.yaml").exists():
        return "from its start"
    config = read_config_file(folder)
    steps = "num_steps" in config
    length = config.get("num_steps" if steps else "num_generations")
    rows = read_metrics(folder) if (folder / "metrics.jsonl").exists() else []
    resumes = f"checkpoint {resumes_at(folder)}" if list_checkpoints(folder) else "no checkpoint"
    at = max(row_generation(rows[-1]), 0) if rows else 0
    position = f"at {at}/{length} ({resumes})"
    paces = [row["time/generation_s"] for row in rows[-PACE_ROWS:]
             if row_generation(row) > 0 and isinstance(row.get("time/generation_s"), (int, float))]
    if length is not None and at < length and paces:
        pace = statistics.median(paces)
        left = (length - at) * pace
        position += (f", about {round(left)} s" if left < 120 else f", about {left / 60:.0f} min") + \
            f" left at {pace:.2g} s a {'step' if steps else 'generation'}"
    return position


def trials_cell(spec: TuneSpec, method: str, study, trials) -> str:
    """``k of N``, then each trial under way (running) and each queued (waiting: a retry of a killed
    or restored trial, which no worker has taken yet) with its runs' positions, from the method's
    ``study`` and its ``trials``."""
    from optuna.trial import TrialState

    cell = f"{trials_done(trials)} of {spec.settings.trials}"
    listed: dict[str, list[str]] = {"under way": [], "queued": []}
    for trial in (t for t in trials if not ended(t)):
        folder = trial_folder(spec, method, study, trial)
        positions = [run_position(folder / f"seed{planned.config.seed}") for planned in spec.tuning_runs[method]]
        listed["queued" if trial.state == TrialState.WAITING else "under way"].append(f"{folder.name} {', '.join(positions)}")
    return cell + "".join(f"; {label}: {'; '.join(entries)}" for label, entries in listed.items() if entries)


def best_cell(trials) -> str:
    """The best validation score among the completed trials (the study maximises it) and the trial
    that reached it first, with how many others reached the same; empty before any completed."""
    from optuna.trial import TrialState

    scored = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    if not scored:
        return ""
    best = max(t.value for t in scored)
    at_best = sorted(t.number for t in scored if t.value == best)
    others = f" and {len(at_best) - 1} other{'s' if len(at_best) > 2 else ''}" if len(at_best) > 1 else ""
    return f"{best:.3g} (trial {at_best[0]}{others})"


def runs_cell(out: Path, plans: Sequence[PlannedRun]) -> str:
    """``k of N`` finished runs of a stage, and those begun with their positions."""
    done, under_way = 0, []
    for planned in plans:
        folder = out / planned.name
        if finished_rerun(folder, planned.length):
            done += 1
        elif folder.exists():
            under_way.append(f"{folder.name} {run_position(folder)}")
    return f"{done} of {len(plans)}" + (f"; under way: {'; '.join(under_way)}" if under_way else "")


def progress_table(spec: TuneSpec) -> str:
    """The study's progress as Markdown: a row per method, then the control's line."""
    seeds = len(next(iter(spec.final_runs.values())))
    long = spec.settings.long
    lines = [f"| method | trials | reruns on the final seeds | continued to {long}x | best validation score |",
             "| --- | --- | --- | --- | --- |"]
    for method in spec.methods:
        study = load_study(spec, method)
        trials = study.get_trials(deepcopy=False)
        if all_trials_done(trials, spec.settings.trials):
            plans = final_plan(spec, method)
            reruns = runs_cell(spec.out / "final", plans)
            longer = (runs_cell(spec.out / "long", [long_run(spec, rerun) for rerun in plans]) if long > 1
                      else "none declared")
        else:
            reruns = longer = f"0 of {seeds}: waits for the trials"
        lines.append(f"| {method} | {trials_cell(spec, method, study, trials)} | {reruns} | {longer} | {best_cell(trials)} |")
    control = spec.settings.control
    if control != "none":
        method = resolve_best(spec, control)
        stands = ("undecided until every method of its kind has its trials" if method is None
                  else f"{method}, {runs_cell(spec.out / 'control', control_plan(spec, method))}")
        lines += ["", f"Control ({control}): {stands}"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evolm_lib.tune.progress", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", help="the study's spec (YAML with a tune: section)")
    parser.add_argument("--out", help="the study's folder (default: the spec's)")
    args = parser.parse_args(argv)
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        spec = load_tune_spec(args.spec, out=args.out)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not (spec.out / STORAGE).exists():
        print(f"error: {spec.out} holds no study (no {STORAGE}): nothing has run there, or --out names another "
              "folder", file=sys.stderr)
        return 2
    print(progress_table(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
