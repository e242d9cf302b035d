"""`evolm tune SPEC`: an equal number of Optuna trials per method, selected on a validation split, then
each method's best setting rerun on fresh seeds and compared on the held-out problems; `evolm tune
report | export | import` read, export and import a study folder."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from .. import tune
from ..env import apply_engine_defaults
from ..paths import resolve_in_project
from .help import HelpFormatter
from .interrupt import ignore_stop_signals, report_interrupt

HELP = """Fair comparisons by search: every method of a sweep spec gets the same number of trials over its
own search space at the same completion budget, each scored on the task's validation questions;
each method's best setting is then rerun on fresh seeds and scored on the held-out problems.

    evolm tune papermill_runs/tune_tiny.yaml --dry-run        check every space against the settings; run nothing
    evolm tune papermill_runs/tune_tiny.yaml                  4 trials each of ES and GRPO on the tiny model, then the reruns
    evolm tune papermill_runs/tune_tiny.yaml --methods grpo   one worker per method: several processes share the study

A study folder's results: `evolm tune report STUDY` (re)writes its tables (summary.md, a CSV a table)
and figures; `evolm tune export STUDY DIR` writes the small files of a study to commit, from which
`evolm tune report DIR` gives the same tables; `evolm tune import DIR STUDY` writes a study folder
again from them, which `evolm tune SPEC --out STUDY` continues (each: evolm tune report --help).

The spec is a sweep spec (see evolm sweep --help) with a `tune:` section (trials, seeds, select, space,
and optionally sampler_seed, startup_trials, prune, heartbeat_s, max_retries, parallel, primary,
measure, long, control, out) and a `final_seeds:` list disjoint from tune.seeds; docs/tuning.md
describes each key. A study is a folder (OUT): the studies' storage OUT/optuna.db
(`optuna-dashboard sqlite:///OUT/optuna.db` shows it live), the trials' runs in OUT/trials/, the
reruns in OUT/final/ (continued to tune.long x the budget in OUT/long/, the shuffled-fitness control
of tune.control in OUT/control/), and at the end OUT/tune_summary.json, OUT/summary.md and
OUT/figures/. Running the same command again, here or on a machine the folder was copied to,
continues the study. A killed worker's trial is retried by the next worker from its run folders'
checkpoints; Ctrl-C or SIGTERM hands the cut trial on at once. Workers on several machines share a
database (--storage postgresql://...).

exit status: 0 done, 2 a bad spec, option or storage, 130 interrupted."""

SUBCOMMANDS = ("report", "export", "import")


def build_parser() -> argparse.ArgumentParser:
    """The command line of `evolm tune SPEC`."""
    parser = argparse.ArgumentParser(prog="evolm tune", description=HELP, formatter_class=HelpFormatter)
    parser.add_argument("spec", help="sweep spec with a tune: section (YAML); or report, export, import "
                                     "(evolm tune report --help)")
    parser.add_argument("--methods", help="comma-separated methods this worker tunes and reruns, e.g. es_lora,grpo "
                                          "(default: all of the spec's)")
    parser.add_argument("--trials", type=int, help="trials per method (default: the spec's tune.trials)")
    parser.add_argument("--out", help="the study folder (default: the spec's tune.out, else sweep.out)")
    parser.add_argument("--storage", help="the studies' storage: a database URL (postgresql://user@host/db, for "
                                          "workers on several machines), or journal:PATH (a file on a shared "
                                          "filesystem; no heartbeats there, so a killed worker's trial is not "
                                          "retried) (default: sqlite:///OUT/optuna.db)")
    parser.add_argument("--generations", type=int, help="ES generations; GRPO steps follow from the equal budget "
                                                         "(default: the spec's)")
    parser.add_argument("--model", help="override the model, e.g. tiny-random for a quick check (default: the spec's)")
    parser.add_argument("--no-finals", action="store_true", help="tune only; rerun no winner")
    parser.add_argument("--timeout", type=float, metavar="SECONDS",
                        help="start no new trial after SECONDS (Optuna's timeout, per method); the trials under "
                             "way finish, and the same command continues later (default: none)")
    parser.add_argument("--no-figures", action="store_true", help="write no figures")
    parser.add_argument("--dry-run", action="store_true", help="check the spec and print the plan only")
    return parser


def build_report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="evolm tune report", formatter_class=HelpFormatter,
                                     description="(Re)write a study's tables (summary.md and a CSV a table) and "
                                                 "figures, and print their paths. STUDY: a study folder or an export.")
    parser.add_argument("study", help="a study folder (OUT of evolm tune) or an export of one (evolm tune export)")
    parser.add_argument("--out", help="where to write them (default: STUDY itself; figures in STUDY/figures)")
    parser.add_argument("--measure", choices=("success", "reward"), help="held-out measure (default: the summary's)")
    parser.add_argument("--storage", help="the studies' storage where it is not STUDY/optuna.db")
    parser.add_argument("--no-figures", action="store_true", help="tables only (figures need chromium)")
    parser.add_argument("--untuned", metavar="PREFIX",
                        help="STUDY is a plain sweep's folder (the untuned five-seed study): write PREFIX_study.csv, "
                             "PREFIX_comparisons.csv, PREFIX_equal_budget.csv and PREFIX_equal_budget_tests.csv "
                             "(--measure required)")
    return parser


def build_export_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="evolm tune export", formatter_class=HelpFormatter,
                                     description="Write the small, committable summary of a study (runs.jsonl.gz, "
                                                 "trials.jsonl.gz, tune_summary.json, manifest.json) into DIR: "
                                                 "every run's scalar rows and held-out scores, every trial; no "
                                                 "weights. evolm tune report DIR rebuilds the same tables.")
    parser.add_argument("study", help="the study folder")
    parser.add_argument("dir", help="the folder to write the export into")
    parser.add_argument("--storage", help="the studies' storage where it is not STUDY/optuna.db")
    return parser


def build_import_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="evolm tune import", formatter_class=HelpFormatter,
                                     description="Write a study folder back from an export (its Optuna storage with "
                                                 "every trial, the finished runs' rows), so that evolm tune SPEC "
                                                 "--out STUDY continues it. STUDY must not exist or be empty.")
    parser.add_argument("dir", help="the export (evolm tune export)")
    parser.add_argument("study", help="the study folder to write")
    parser.add_argument("--spec", help="the study's spec (default: the one its tune_summary.json names)")
    parser.add_argument("--methods", help="comma-separated methods to load the spec with, as evolm tune --methods")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command line: check, tune, rerun the winners, summarise, report (exit 2 on a bad spec or storage,
    130 on Ctrl-C or SIGTERM); or one of report, export, import."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in SUBCOMMANDS:
        return {"report": report_main, "export": export_main, "import": import_main}[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    apply_engine_defaults()
    overrides = {"model": args.model} if args.model else None
    try:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
        spec = tune.load_tune_spec(resolve_in_project(args.spec), generations=args.generations, overrides=overrides,
                                   methods=methods, out=args.out)
        if args.trials is not None:
            spec = tune.with_trials(spec, args.trials)
        spec = tune.with_storage(spec, args.storage)
        if args.timeout is not None and not (args.timeout > 0):
            raise ValueError(f"--timeout: a number of seconds above 0, not {args.timeout}")
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
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops as Ctrl-C does: the cut trial handed on
    try:
        return _run(spec, args)
    except tune.StudyStorageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        ignore_stop_signals()  # a second Ctrl-C must not cut the report short
        return report_interrupt(f"interrupted: finished trials and reruns are kept in {spec.out.resolve()}; the "
                                "trial cut short is queued again for the next worker; run the same command again "
                                "to continue")
    finally:
        if signal.getsignal(signal.SIGTERM) is _interrupt:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt()


TUNE_LIBRARIES = ("optuna", "scipy", "statsmodels")
"""What a tuning worker imports beyond a run's own needs: the search (Optuna) and the summary's statistics."""
FIGURE_LIBRARIES = ("plotly",)
"""What the figures at a tune's end import (chromium, which exports them, is checked when they are drawn)."""


def missing_libraries(names) -> list[str]:
    """The names of ``names`` that cannot be imported here (found without importing them)."""
    import importlib.util

    return [name for name in names if importlib.util.find_spec(name) is None]


def _quiet_optuna_logs() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # a line per study opened and trial told says nothing here


def _run(spec, args) -> int:
    """Tune, rerun the winners whose studies are finished, summarise, report."""
    _quiet_optuna_logs()
    started = time.perf_counter()
    left = tune.unfinished_parts(spec, finals=not args.no_finals)
    if left:
        engine = tune.make_tuning_engine(spec)
        try:
            # trials, then the reruns, their continuations (tune.long) and the control (tune.control);
            # waits while other workers hold what is left
            ran = tune.run_worker(spec, engine, finals=not args.no_finals, timeout=args.timeout)
            print(f"trials finished by this worker: {ran} ({(time.perf_counter() - started) / 60:.1f} min)", flush=True)
        finally:
            engine.close()
    else:
        print("nothing left to run for these methods: no engine started", flush=True)
    summary = tune.summarize(spec)
    print("\n".join(tune.summary_lines(summary)))
    print(f"summary: {spec.out / tune.SUMMARY} ({(time.perf_counter() - started) / 60:.1f} min in all)")
    paths = write_report(spec.out, spec.out, storage=spec.storage, figures=not args.no_figures, spec=spec,
                         summary=summary)
    for path in paths:
        print(path)
    return 0


def write_report(study: Path, out: Path, measure: str | None = None, storage: str | None = None,
                 figures: bool = True, spec=None, summary: dict | None = None) -> list[Path]:
    """The study's tables (summary.md and the CSVs) into ``out``, and with ``figures`` its figures (with a
    spec at hand, the trials' slice and importance plots too): into STUDY/figures where ``out`` is the
    study folder itself, else into ``out`` beside the tables. Returns the paths. Without chromium the
    figures are skipped with a line saying so."""
    from ..tune.digest import DIGEST, write_study_tables

    paths = write_study_tables(study, out, measure=measure, storage=storage)
    if summary is None and (Path(study) / tune.SUMMARY).is_file():
        summary = json.loads((Path(study) / tune.SUMMARY).read_text())
    digest = Path(out) / DIGEST
    if summary is not None and summary.get("plumbing_check") and digest.is_file():
        text = digest.read_text().split("\n", 2)
        note = (f"*A plumbing check: the model {summary['model']} has random weights, so these scores mean "
                "nothing; they show the study ran end to end.*")
        digest.write_text("\n".join([text[0], "", note, *text[1:]]))
    if not figures:
        return paths
    from ..viz.figures import chromium_available

    if not chromium_available():
        print("no figures: chromium is missing (apt-get install -y chromium), or pass --no-figures", file=sys.stderr)
        return paths
    from ..viz.study import export_study_figures

    drawn = Path(out) / "figures" if Path(out).resolve() == Path(study).resolve() else Path(out)
    paths += export_study_figures(study, drawn, storage=storage)
    if spec is not None and summary is not None:
        from ..viz.tuning import export_tuning_figures

        trials = {m: entry["trial_list"] for m, entry in summary["methods"].items()}
        studies = {m: tune.load_study(spec, m) for m, listed in trials.items() if listed}
        paths += export_tuning_figures(trials, studies, drawn, spec.settings.select)
    return paths


def report_main(argv: list[str]) -> int:
    """`evolm tune report STUDY`: the tables and figures of a study folder or an export."""
    args = build_report_parser().parse_args(argv)
    _quiet_optuna_logs()
    try:
        if args.untuned:
            if args.measure is None:
                raise ValueError("--untuned: give the held-out measure with --measure success|reward")
            paths = untuned_tables(args.study, args.measure, args.untuned)
        else:
            paths = write_report(Path(args.study), Path(args.out or args.study), args.measure, args.storage,
                                 figures=not args.no_figures)
    except (FileNotFoundError, ValueError, tune.StudyStorageError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def untuned_tables(folder: str, measure: str, prefix: str) -> list[Path]:
    """A plain sweep's tables: PREFIX_study.csv, PREFIX_comparisons.csv, PREFIX_equal_budget.csv and
    PREFIX_equal_budget_tests.csv (the ES forms of ``analysis.method_globs``: no grpo_* where absent)."""
    from ..analysis import (equal_budget_comparisons, equal_budget_table, load_runs, method_comparisons,
                            method_globs, study_table)

    groups = load_runs(list(method_globs(folder).values()))
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    tables = {"study": study_table(groups, measure=measure), "comparisons": method_comparisons(groups, measure=measure),
              "equal_budget": equal_budget_table(groups), "equal_budget_tests": equal_budget_comparisons(groups)}
    paths = []
    for name, table in tables.items():
        paths.append(Path(f"{prefix}_{name}.csv"))
        table.to_csv(paths[-1], float_format="%.6g")
    return paths


def export_main(argv: list[str]) -> int:
    """`evolm tune export STUDY DIR`."""
    from ..tune.export import export_study

    args = build_export_parser().parse_args(argv)
    _quiet_optuna_logs()
    try:
        manifest = export_study(args.study, args.dir, storage=args.storage)
    except (FileNotFoundError, ValueError, tune.StudyStorageError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    size = sum(manifest["bytes"].values())
    print(f"exported {sum(manifest['runs'].values())} runs ({', '.join(f'{k} {v}' for k, v in manifest['runs'].items())}; "
          f"{manifest['with_heldout']} with held-out scores) and {manifest['trials']} trials into {args.dir} "
          f"({size / 2**20:.2f} MiB)")
    return 0


def import_main(argv: list[str]) -> int:
    """`evolm tune import DIR STUDY`."""
    from ..tune.importer import import_from

    args = build_import_parser().parse_args(argv)
    _quiet_optuna_logs()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    try:
        import_from(args.dir, args.study, spec=args.spec and resolve_in_project(args.spec), methods=methods)
    except (FileExistsError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"continue it with: evolm tune SPEC --out {args.study}")
    return 0
