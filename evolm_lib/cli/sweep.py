"""`evolm sweep [SPEC]`: ES vs GRPO at equal sample budgets, then notebook 04 on the result."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .. import sweep
from ..env import apply_engine_defaults
from ..grid import format_plan
from ..paths import resolve_in_project
from .help import HelpFormatter
from .interrupt import ignore_stop_signals, kernels_stopped_first, report_interrupt, stop_children

HELP = f"""ES against GRPO at equal sample budgets: one ES and one GRPO run per seed with the same model,
task, LoRA layout and prompts, then notebook 04 draws the comparison from the run folders.

    evolm sweep --dry-run                      the plan and wall-time estimate of the default spec; run nothing
    evolm sweep --model tiny-random --generations 1 --seeds 0 --max-new-tokens 8 --no-kl --out runs/sweep_check
                                               a quick check of the whole pipeline on the tiny test model
    evolm sweep {sweep.DEFAULT_SPEC}
                                               the study on SmolLM2 on this machine's CPU

The budget is counted in training completions: an ES generation costs population_size x prompts, a
GRPO step group_size x prompts, so GRPO runs generations x population_size / group_size steps. Runs
go to OUT/es_seedN and OUT/grpo_seedN (more names where the spec lists several variants) and resume
when they already hold the same settings. Every method trains every seed: several GRPO learning
rates are several variants under sweep.grpo_modes (tuning each method with equal effort is `evolm
tune`). After each run the KL of its final adapter to the base model is measured and its held-out
problems scored. OUT/summary.csv holds one row per run, with a column for every setting that varies.

Before any engine starts, each run folder already in OUT is compared with its planned settings: one
that holds a run made with other settings is listed (old -> new) and the sweep refuses to start;
--overwrite METHOD[/SEED] replaces those runs (the old run is kept until the new one finishes), or
--out runs the new settings in another folder. --dry-run lists the same. Ctrl-C stops the sweep;
finished runs are kept and the same command continues.

The spec is a batch file for notebook 04 plus a `sweep` section (common, es, grpo settings;
generations, seeds, out, kl): see the shipped specs in papermill_runs/es_vs_grpo_*.yaml and
docs/batch-runs.md.

exit status: 0 done, 1 a run failed or a run folder holds other settings, 2 a bad spec or option,
130 interrupted."""


def build_parser() -> argparse.ArgumentParser:
    """The command line of `evolm sweep`."""
    parser = argparse.ArgumentParser(prog="evolm sweep", description=HELP, formatter_class=HelpFormatter)
    parser.add_argument("spec", nargs="?", default=sweep.DEFAULT_SPEC, help="sweep spec (YAML)")
    parser.add_argument("--generations", type=int, help="ES generations; GRPO steps follow from the equal budget "
                                                         "(default: the spec's)")
    parser.add_argument("--seeds", help="comma-separated seeds, e.g. 0,1,2 (default: the spec's)")
    parser.add_argument("--methods", help="comma-separated methods to run, e.g. es_full,grpo (default: all of the spec's)")
    parser.add_argument("--out", help="folder for the run folders (default: the spec's sweep.out)")
    parser.add_argument("--model", help="override the model, e.g. tiny-random for a quick check (default: the spec's)")
    parser.add_argument("--max-new-tokens", type=int, help="override max_new_tokens (default: the spec's)")
    parser.add_argument("--overwrite", action="append", metavar="METHOD[/SEED]",
                        help="replace the runs of METHOD (every seed, or SEED alone) whose folders hold other "
                             "settings, e.g. es_lora/1; repeat for several (default: replace none)")
    parser.add_argument("--no-kl", action="store_true", help="skip the KL-to-base measurement")
    parser.add_argument("--no-notebook", action="store_true", help="do not run notebook 04 at the end")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the estimate only")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command line: plan, estimate, run, measure; then draw the comparison with notebook 04 (exit 2 on a
    bad spec or option, 130 on Ctrl-C)."""
    args = build_parser().parse_args(argv)

    apply_engine_defaults()
    overrides = {k: v for k, v in {"model": args.model, "max_new_tokens": args.max_new_tokens}.items() if v is not None}
    try:
        spec_path = resolve_in_project(args.spec)
        batch_part, spec = sweep.load_sweep_spec(spec_path)
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
        methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
        plan = sweep.select_methods(sweep.plan_sweep(spec, args.generations, seeds, overrides), methods)
        out = Path(args.out or spec.get("out", "runs/es_vs_grpo"))
        actions = sweep.plan_actions(plan, out, args.overwrite or ())
    except (ValueError, FileNotFoundError) as err:  # a bad spec or option: one line naming it
        print(f"error: {err}", file=sys.stderr)
        return 2
    kl_settings = None if args.no_kl else dict(spec.get("kl") or {})
    estimate, how = sweep.timing_estimate(plan, spec, overrides)
    estimated = f"estimated wall time {estimate / 60:.1f} min ({how})" if estimate is not None else how
    budgets = {kind: run.budget for run in plan for kind in [run.kind]}
    each = (f"{plan[0].budget} training completions each" if len(set(budgets.values())) == 1 else
            "training completions: " + ", ".join(f"{kind} {budget}" for kind, budget in budgets.items())
            + " (sweep.grpo_completions: not an equal-budget comparison)")
    print(f"{len(plan)} runs into {out}, {each}; {estimated}")
    print(format_plan(actions))
    damaged = [action for action in actions if action.action == "damaged"]
    if damaged:
        print(f"{'error: ' if not args.dry_run else ''}{len(damaged)} run folder(s) in {out.resolve()} lost their "
              "config.yaml (listed above, with the command that restores each); nothing was run", file=sys.stderr)
        return 1
    conflicts = [action for action in actions if action.action == "conflict"]
    if conflicts:
        print(f"{'error: ' if not args.dry_run else ''}{len(conflicts)} run folder(s) in {out.resolve()} hold runs "
              "made with other settings (listed above): --overwrite METHOD/SEED replaces them, --out runs the new "
              "settings in another folder", file=sys.stderr)
        return 1
    if args.dry_run:
        return 0
    replaced = {action.name for action in actions if action.action == "overwrite"}
    try:
        with kernels_stopped_first():
            return _run(args, spec_path, batch_part, [a.run for a in actions if a.action != "skip"], replaced, out,
                        kl_settings, estimate)
    except KeyboardInterrupt:
        return _interrupted(plan, out)
    except sweep.SweepRunFailed as failed:
        print(f"error: {failed}; finished runs are kept in {out.resolve()}, and the same command continues",
              file=sys.stderr)
        return 1


def _interrupted(runs: list, out: Path) -> int:
    """After Ctrl-C: stop any notebook kernel, then one line saying which runs are kept and how to go on."""
    from ..analysis import run_results

    ignore_stop_signals()  # a second Ctrl-C or SIGTERM must not cut the cleanup short
    stop_children()
    finished = 0
    for run in runs:
        results = run_results(out / run.name)
        finished += bool(results) and results.get("generation", -1) >= (results.get("budget") or 0)
    return report_interrupt(f"interrupted: {finished} of {len(runs)} run(s) finished and kept in {out.resolve()}; "
                            "run the same command again to continue")


def _run(args, spec_path, batch_part, plan, replaced, out, kl_settings, estimate) -> int:
    """Train the planned runs, summarise them and run notebook 04 on them."""
    started = time.perf_counter()
    seconds = sweep.run_sweep(plan, out, kl_settings=kl_settings, overwrite=replaced) if plan else {}
    measured = time.perf_counter() - started
    per_run = ", ".join(f"{name} {s:.0f} s" for name, s in seconds.items())
    versus = f" (estimated {estimate / 60:.1f} min)" if estimate is not None else ""
    print(f"measured wall time {measured / 60:.1f} min{versus}: {per_run}")
    sweep.summarize(out)
    print(f"summary: {out / 'summary.csv'}")
    if not args.no_notebook:
        executed = sweep.run_notebook(batch_part, out, spec_path)
        print(f"comparison: {executed}, figures in {out / 'figures'}")
    return 0
