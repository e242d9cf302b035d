"""`evolm sweep [SPEC]`: ES vs GRPO at equal sample budgets, then notebook 04 on the result."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .. import sweep
from ..env import apply_engine_defaults
from ..paths import resolve_in_project


def main(argv: list[str] | None = None) -> int:
    """Command line: plan, estimate, run, measure; then draw the comparison with notebook 04 (exit 2 on a
    bad spec or option)."""
    parser = argparse.ArgumentParser(prog="evolm sweep", description=sweep.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", nargs="?", default=sweep.DEFAULT_SPEC, help="sweep spec (YAML)")
    parser.add_argument("--generations", type=int, help="ES generations (GRPO steps follow from the equal budget)")
    parser.add_argument("--seeds", help="comma-separated seeds, e.g. 0,1,2")
    parser.add_argument("--methods", help="comma-separated methods to run, e.g. es_full,grpo (default: all of the spec's)")
    parser.add_argument("--out", help="folder for the run folders (default: the spec's sweep.out)")
    parser.add_argument("--model", help="override the model (e.g. tiny-random for a quick check)")
    parser.add_argument("--max-new-tokens", type=int, help="override max_new_tokens")
    parser.add_argument("--no-kl", action="store_true", help="skip the KL-to-base measurement")
    parser.add_argument("--no-notebook", action="store_true", help="do not run notebook 04 at the end")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the estimate only")
    args = parser.parse_args(argv)

    apply_engine_defaults()
    overrides = {k: v for k, v in {"model": args.model, "max_new_tokens": args.max_new_tokens}.items() if v is not None}
    try:
        spec_path = resolve_in_project(args.spec)
        batch_part, spec = sweep.load_sweep_spec(spec_path)
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
        rates = sweep.grpo_learning_rates(spec)
        lr_runs = sweep.plan_learning_rate_sweep(spec, args.generations, seeds, overrides) if len(rates) > 1 else []
        methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
        plan = sweep.select_methods(sweep.plan_sweep(spec, args.generations, seeds, overrides,
                                                     grpo_learning_rate=rates[0]), methods)
        if methods and not any(run.kind == "grpo" for run in plan):
            lr_runs = []  # no GRPO run asked for: no learning-rate sweep either
    except (ValueError, FileNotFoundError) as err:  # a bad spec or option: one line naming it
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out or spec.get("out", "runs/es_vs_grpo"))
    kl_settings = None if args.no_kl else dict(spec.get("kl") or {})
    estimate, how = sweep.timing_estimate(lr_runs + plan, spec, overrides)
    if lr_runs:
        print(f"GRPO learning-rate sweep first ({', '.join(f'{r:g}' for r in rates)}, seed {lr_runs[0].config.seed}); "
              "the best rate then trains every seed")
    estimated = f"estimated wall time {estimate / 60:.1f} min ({how})" if estimate is not None else how
    print(f"{len(lr_runs) + len(plan)} runs into {out}, {plan[0].budget} training completions each; {estimated}")
    for run in lr_runs + plan:
        print(f"  {run.name}: {run.kind} {run.length} {'generations' if run.kind == 'es' else 'steps'}")
    if args.dry_run:
        return 0
    started = time.perf_counter()
    evaluator = sweep.make_shared_evaluator(lr_runs + plan)
    try:
        seconds = sweep.run_sweep(lr_runs, out, evaluator, kl_settings=kl_settings) if lr_runs else {}
        if lr_runs:
            best, scores = sweep.best_learning_rate(out, lr_runs)
            print(f"GRPO learning rates by score: {scores}; best {best:g}", flush=True)
            plan = sweep.select_methods(sweep.plan_sweep(spec, args.generations, seeds, overrides,
                                                         grpo_learning_rate=best), methods)
            sweep.adopt_learning_rate_run(out, lr_runs, plan, best)
        seconds.update(sweep.run_sweep(plan, out, evaluator, kl_settings=kl_settings))
    finally:
        evaluator.close()
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
