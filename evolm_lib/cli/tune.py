"""`evolm tune SPEC`: an equal number of Optuna trials per method, selected on a validation split, then
each method's best setting rerun on fresh seeds and compared on the held-out problems."""
from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable

from .. import tune
from ..env import apply_engine_defaults
from ..paths import resolve_in_project
from ..tune.pace import FINISH_MARGIN, Deadline, starting_later
from .help import HelpFormatter
from .interrupt import report_interrupt

HELP = """Fair comparisons by search: every method of a sweep spec gets the same number of trials over its
own search space at the same completion budget, each scored on the task's validation questions;
each method's best setting is then rerun on fresh seeds and scored on the held-out problems.

    evolm tune papermill_runs/tune_tiny.yaml --dry-run        check every space against the settings; run nothing
    evolm tune papermill_runs/tune_tiny.yaml                  4 trials each of ES and GRPO on the tiny model, then the reruns
    evolm tune papermill_runs/tune_tiny.yaml --methods grpo   one worker per method: several processes share the study

The spec is a sweep spec (see evolm sweep --help) with a `tune:` section (trials, seeds, select, space,
and optionally sampler_seed, startup_trials, prune, heartbeat_s, max_retries, parallel, primary,
measure, long, control, out) and a
`final_seeds:` list disjoint from tune.seeds; docs/tuning.md describes each key. The studies live in
OUT/optuna.db (SQLite; `optuna-dashboard sqlite:///OUT/optuna.db` shows them live), the trials' runs
in OUT/trials/, the reruns in OUT/final/ (continued to tune.long x the budget in OUT/long/, the
shuffled-fitness control of tune.control in OUT/control/), the result in OUT/tune_summary.json and the figures in
OUT/figures/. A killed worker's trial is retried by the next worker, with the same setting; running
the same command again continues the study. A worker with nothing left to claim waits while other
workers still hold trials or reruns of its methods, then takes what their end makes ready, so every
worker ends with the whole summary. Ctrl-C stops; nothing finished is lost.

exit status: 0 done, 2 a bad spec or option, 130 interrupted."""


def build_parser() -> argparse.ArgumentParser:
    """The command line of `evolm tune`."""
    parser = argparse.ArgumentParser(prog="evolm tune", description=HELP, formatter_class=HelpFormatter)
    parser.add_argument("spec", help="sweep spec with a tune: section (YAML)")
    parser.add_argument("--methods", help="comma-separated methods this worker tunes and reruns, e.g. es_lora,grpo "
                                          "(default: all of the spec's)")
    parser.add_argument("--trials", type=int, help="trials per method (default: the spec's tune.trials)")
    parser.add_argument("--out", help="folder of the studies, trials and reruns (default: the spec's tune.out, "
                                      "else sweep.out)")
    parser.add_argument("--generations", type=int, help="ES generations; GRPO steps follow from the equal budget "
                                                         "(default: the spec's)")
    parser.add_argument("--model", help="override the model, e.g. tiny-random for a quick check (default: the spec's)")
    parser.add_argument("--no-finals", action="store_true", help="tune only; rerun no winner")
    deadline = parser.add_mutually_exclusive_group()
    deadline.add_argument("--claim-for", type=float, metavar="SECONDS",
                          help="start trials and runs only within SECONDS of this worker's start; it finishes what it "
                               "runs then, and ends leaving the rest (on a lent machine, for runs whose checkpoints "
                               "cannot travel to the next one; default: no limit)")
    deadline.add_argument("--claim-until", type=float, metavar="EPOCH_SECONDS",
                          help="the same, until a time on the clock (seconds since the epoch, as `date +%%s` prints "
                               "it): workers started one after another share one deadline, whatever their imports took")
    parser.add_argument("--finish-by", type=float, metavar="EPOCH_SECONDS",
                        help="start only trials and runs expected to end by this time on the clock (a lent "
                             "machine's end): each is paced by the study's own finished work, stretched by "
                             f"{FINISH_MARGIN:g}, and a worker that turns one down as too long ends, leaving its "
                             "card to other work (with --claim-for or --claim-until, both hold)")
    parser.add_argument("--engine-start-s", type=float, default=0.0, metavar="SECONDS",
                        help="with --finish-by or a claim deadline: how long this worker's engine takes to start; "
                             "before starting it, the worker weighs its work as of SECONDS from now and starts no "
                             "engine where none of it would fit by then (default: 0)")
    parser.add_argument("--no-figures", action="store_true", help="write no figures")
    parser.add_argument("--dry-run", action="store_true", help="check the spec and print the plan only")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command line: check, tune, rerun the winners, summarise (exit 2 on a bad spec, 130 on Ctrl-C)."""
    args = build_parser().parse_args(argv)
    apply_engine_defaults()
    overrides = {"model": args.model} if args.model else None
    try:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
        spec = tune.load_tune_spec(resolve_in_project(args.spec), generations=args.generations, overrides=overrides,
                                   methods=methods, out=args.out)
        if args.trials is not None:
            spec = tune.with_trials(spec, args.trials)
        if args.claim_for is not None and not (args.claim_for >= 0):
            raise ValueError(f"--claim-for: a number of seconds >= 0, not {args.claim_for}")
        if not (args.engine_start_s >= 0):
            raise ValueError(f"--engine-start-s: a number of seconds >= 0, not {args.engine_start_s}")
        for option, value in (("--claim-until", args.claim_until), ("--finish-by", args.finish_by)):
            if value is not None and not (value > 0):
                raise ValueError(f"{option}: seconds since the epoch (date +%s), not {value}")
    except (ValueError, FileNotFoundError) as error:  # a bad spec or option: one line naming it
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("\n".join(tune.describe(spec)), flush=True)
    missing = missing_libraries(TUNE_LIBRARIES)
    if missing:  # before any engine starts: a worker on a machine without them would die at its first trial
        print(f"error: evolm tune needs {', '.join(missing)}, not importable here (the project's requirements "
              "install them: requirements/common.txt)", file=sys.stderr)
        return 2
    missing = [] if args.no_figures else missing_libraries(FIGURE_LIBRARIES)
    if missing:  # the figures come after every trial and rerun: a worker would die there, its work done
        print(f"error: evolm tune's figures need {', '.join(missing)}, not importable here: install "
              "requirements/common.txt, or pass --no-figures and draw them later where it is", file=sys.stderr)
        return 2
    if args.dry_run:
        return 0
    try:
        return _run(spec, args)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return report_interrupt(f"interrupted: finished trials and reruns are kept in {spec.out.resolve()}; "
                                "run the same command again to continue (a trial cut short is retried)")


TUNE_LIBRARIES = ("optuna", "scipy", "statsmodels")
"""What a tuning worker imports beyond a run's own needs: the search (Optuna) and the summary's statistics."""
FIGURE_LIBRARIES = ("plotly",)
"""What the figures at a tune's end import (chromium, which exports them, is checked when they are drawn)."""


def missing_libraries(names) -> list[str]:
    """The names of ``names`` that cannot be imported here (found without importing them)."""
    import importlib.util

    return [name for name in names if importlib.util.find_spec(name) is None]


def claim_rule(claim_for: float | None = None, claim_until: float | None = None,
               finish_by: float | None = None) -> Callable[..., bool]:
    """Whether this worker may start another trial or run (``pace.Deadline``): always, or while within
    ``claim_for`` seconds of now, or before the clock's time ``claim_until``; and with ``finish_by``,
    only work expected to end by that time."""
    if claim_for is not None:
        claim_until = time.time() + claim_for
    if claim_until is None and finish_by is None:
        return tune.always
    return Deadline(claim_until=claim_until, finish_by=finish_by)


def _run(spec, args) -> int:
    """Tune, rerun the winners whose studies are finished, summarise, draw."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # a line per study opened says nothing here
    started = time.perf_counter()
    may_claim = claim_rule(args.claim_for, args.claim_until, args.finish_by)
    left = tune.outstanding(spec, finals=not args.no_finals)
    idle = tune.nothing_fits(spec, starting_later(may_claim, args.engine_start_s), left=left)
    if idle:  # a lent machine's end too near for any trial left: the slot goes to other work at once
        print(idle, flush=True)
    elif left:
        evaluator = tune.make_tuning_evaluator(spec)
        try:
            # trials, then the reruns, their continuations (tune.long) and the control (tune.control);
            # waits while other workers hold what is left
            ran = tune.work(spec, evaluator, finals=not args.no_finals, may_claim=may_claim)
            print(f"trials run by this worker: {ran} ({(time.perf_counter() - started) / 60:.1f} min)", flush=True)
        finally:
            evaluator.close()
    else:  # a worker started on a finished study (a new lease's, say) starts no engine
        print("nothing left to run for these methods: no engine started", flush=True)
    summary = tune.summarize(spec)
    print("\n".join(tune.summary_lines(summary)))
    print(f"summary: {spec.out / tune.SUMMARY} ({(time.perf_counter() - started) / 60:.1f} min in all)")
    if not args.no_figures:
        from ..viz.figures import chromium_available
        from ..viz.tuning import export_tuning_figures

        if chromium_available():
            trials = {m: entry["trial_list"] for m, entry in summary["methods"].items()}
            studies = {m: tune.load_study(spec, m) for m, listed in trials.items() if listed}
            paths = export_tuning_figures(trials, studies, spec.out / "figures", spec.settings.select)
            print(f"figures: {len(paths)} files in {spec.out / 'figures'}")
        else:
            print("no figures: chromium is missing (apt-get install -y chromium)")
    return 0
