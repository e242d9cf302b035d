"""ES vs GRPO at equal sample budgets: one ES run and one GRPO run (per group size) per seed, with the
same model, task, LoRA layout and prompts per step, then notebooks/04_es_vs_grpo.py on the result.

The budget is counted in training completions: an ES generation costs population_size x prompts,
a GRPO step group_size x prompts, so GRPO runs generations x population_size / group_size steps.
Runs are normal run folders (resumed when they already hold the same settings):
OUT/es_seedN and OUT/grpo_seedN (OUT/grpo_G8_seedN, ... when the spec lists several group sizes).
After each run the KL of its final adapter to the base model is measured (vLLM engines only) and
stored as `policy/kl` in its last metrics row, for the reward-vs-KL figure.

The spec is a batch file for notebook 04 (`notebook`, `parameters`) plus a `sweep` section:

    sweep:
      common: {model: ..., task: ..., lora_rank: ...}   # ESConfig/GRPOConfig settings shared by both
      es: {population_size: 16, sigma: 0.05, ...}       # ES-only settings
      grpo: {group_size: [8, 16], learning_rate: ...}   # GRPO-only settings; group_size may be a list
      generations: 12                                   # ES generations (sets the budget)
      seeds: [0, 1, 2]
      out: runs/es_vs_grpo
      seconds_per_completion: {es: 1.1, grpo: 1.6}      # for the wall-time estimate
      kl: {num_samples: 4, temperature: 1.0}

Usage: python scripts/es_vs_grpo_sweep.py [SPEC] [--generations G] [--seeds 0,1,2] [--out DIR]
       [--model NAME] [--max-new-tokens N] [--no-kl] [--no-notebook] [--dry-run]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere without installing the package

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve a shared CPU

import yaml  # noqa: E402

DEFAULT_SPEC = REPO / "papermill_runs" / "es_vs_grpo_conciseness_cpu.yaml"
SWEEP_KEYS = ("common", "es", "grpo", "generations", "seeds", "out", "seconds_per_completion", "kl")


@dataclass(frozen=True)
class PlannedRun:
    """One run of the sweep: folder name, method label, kind and validated settings."""

    name: str
    label: str
    kind: str  # "es" | "grpo"
    config: Any  # ESConfig | GRPOConfig
    budget: int  # training completions it will use

    @property
    def length(self) -> int:
        """Generations (ES) or steps (GRPO)."""
        return self.config.num_generations if self.kind == "es" else self.config.num_steps


# --------------------------------------------------------------------------- spec and plan


def load_sweep_spec(path: str | Path) -> tuple[dict, dict]:
    """(batch part for notebook 04, sweep section) of a spec file; unknown sweep keys fail."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    sweep = data.pop("sweep", None)
    if not isinstance(sweep, dict):
        raise ValueError(f"{path} has no `sweep:` section (see {Path(__file__).name} --help)")
    unknown = sorted(set(sweep) - set(SWEEP_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in the sweep section of {path}; allowed: {list(SWEEP_KEYS)}")
    return data, sweep


def _prompts_per_step(config) -> int:
    from evolm_lib.tasks import get_task

    num_train = len(get_task(config.task, **config.task_options).train_examples())
    return min(config.prompts_per_step or num_train, num_train)


def plan_sweep(sweep: dict, generations: int | None = None, seeds: list[int] | None = None,
               overrides: dict | None = None) -> list[PlannedRun]:
    """Every run of the sweep, with GRPO's steps set for the same training completions as ES."""
    from evolm_lib.config import ESConfig
    from evolm_lib.grpo import GRPOConfig

    common = {**(sweep.get("common") or {}), **(overrides or {})}
    generations = int(generations if generations is not None else sweep.get("generations", 10))
    seeds = list(seeds if seeds is not None else sweep.get("seeds", [0]))
    grpo = dict(sweep.get("grpo") or {})
    group_sizes = grpo.pop("group_size", 8)
    group_sizes = group_sizes if isinstance(group_sizes, list) else [group_sizes]
    plan = []
    for seed in seeds:
        es = ESConfig.from_dict({**common, **(sweep.get("es") or {}), "seed": seed, "num_generations": generations})
        prompts = _prompts_per_step(es)
        budget = generations * es.population_size * prompts
        plan.append(PlannedRun(f"es_seed{seed}", "es", "es", es, budget))
        for group_size in group_sizes:
            steps, rest = divmod(generations * es.population_size, group_size)
            if rest or steps < 1:
                raise ValueError(f"unequal budgets: {generations} generations x population {es.population_size} "
                                 f"is not a whole number of steps of group_size {group_size}; change --generations")
            config = GRPOConfig.from_dict({**common, **grpo, "group_size": group_size, "seed": seed, "num_steps": steps})
            name = f"grpo_G{group_size}_seed{seed}" if len(group_sizes) > 1 else f"grpo_seed{seed}"
            label = f"grpo G={group_size}" if len(group_sizes) > 1 else "grpo"
            plan.append(PlannedRun(name, label, "grpo", config, steps * group_size * _prompts_per_step(config)))
    budgets = {run.budget for run in plan}
    if len(budgets) > 1:  # prompts_per_step differs between the methods' settings
        raise ValueError(f"unequal budgets across runs: {sorted(budgets)} training completions")
    return plan


def estimate_seconds(plan: list[PlannedRun], seconds_per_completion: dict) -> float:
    """Rough wall time: training plus greedy eval completions, times a per-completion cost of each method."""
    total = 0.0
    for run in plan:
        from evolm_lib.tasks import get_task

        task = get_task(run.config.task, **run.config.task_options)
        evals = (run.length // run.config.eval_every if run.config.eval_every else 1) + 1
        completions = run.budget + evals * (len(task.train_examples()) + len(task.eval_examples()))
        total += completions * float(seconds_per_completion.get(run.kind, 1.0))
    return total


# --------------------------------------------------------------------------- running


def make_shared_evaluator(plan: list[PlannedRun]):
    """One engine for every run: sized for the largest population and LoRA rank."""
    from evolm_lib.evaluators import make_evaluator

    first = next(run.config for run in plan if run.kind == "es")
    max_rank = max(run.config.lora_rank for run in plan)
    max_population = max(run.config.population_size for run in plan if run.kind == "es")
    return make_evaluator(first.replace(lora_rank=max_rank), max_loras=max_population + 1)


def measure_kl(evaluator, run, kl_settings: dict) -> float | None:
    """Mean per-token KL of the run's final adapter to the base model on the eval prompts (None: engine cannot)."""
    from evolm_lib.evaluation import mean_kl_to_base

    adapter = run.mean if run.kind == "es" else run.policy
    try:
        return mean_kl_to_base(evaluator, run.task, adapter, run.eval_examples,
                               num_samples=int(kl_settings.get("num_samples", 4)),
                               temperature=float(kl_settings.get("temperature", 1.0)),
                               max_new_tokens=run.config.max_new_tokens, seed=run.config.seed)
    except TypeError as error:  # an engine without token log-probs (HF, synthetic)
        print(f"  no KL: {error}", flush=True)
        return None


def run_one(planned: PlannedRun, out: Path, evaluator, kl_evaluator=None, kl_settings: dict | None = None):
    """Run (or resume) one planned run to its end, save its final adapter and record its KL."""
    from evolm_lib.analysis import record_final_metrics
    from evolm_lib.grpo import GRPORun
    from evolm_lib.runner import ESRun

    cls = ESRun if planned.kind == "es" else GRPORun
    run = cls.open(planned.config, out / planned.name, evaluator=evaluator)
    run.run(callback=lambda row: print(
        f"  {planned.name} {row['generation']:>4}/{planned.length}  train {row['train/reward_mean']:9.3f}  "
        f"greedy {row.get('policy/train_reward', float('nan')):9.3f}  samples {row['samples/completions']:>6}  "
        f"{row['time/generation_s']:6.1f} s", flush=True))
    run.save_final()
    if kl_settings is not None and run.history[-1].get("policy/kl") is None:
        kl = measure_kl(kl_evaluator or evaluator, run, kl_settings)
        if kl is not None:
            run.history[-1] = record_final_metrics(run.run_dir, {"policy/kl": kl})
            print(f"  {planned.name} KL to base {kl:.4g}", flush=True)
    return run


def run_sweep(plan: list[PlannedRun], out: str | Path, evaluator=None, kl_evaluator=None,
              kl_settings: dict | None = None) -> dict[str, float]:
    """Run every planned run into OUT/<name>; returns {name: wall seconds}. One engine shared by all."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    own = evaluator is None
    evaluator = evaluator or make_shared_evaluator(plan)
    seconds = {}
    try:
        for planned in plan:
            started = time.perf_counter()
            print(f"{planned.name}: {planned.kind}, {planned.length} {'generations' if planned.kind == 'es' else 'steps'}, "
                  f"{planned.budget} training completions", flush=True)
            run_one(planned, out, evaluator, kl_evaluator, kl_settings)
            seconds[planned.name] = time.perf_counter() - started
            with open(out / "sweep_summary.jsonl", "a") as handle:
                handle.write(json.dumps({"run": planned.name, "label": planned.label, "seconds": seconds[planned.name],
                                         "budget": planned.budget}) + "\n")
    finally:
        if own:
            evaluator.close()
    return seconds


def run_notebook(batch_part: dict, out: Path, spec_path: Path) -> Path:
    """notebooks/04_es_vs_grpo.py on the sweep's folders; executed notebook and figures under OUT."""
    from evolm_lib.batch import execute_notebook, spec_from_dict

    spec = spec_from_dict(batch_part, source=spec_path.resolve())
    parameters = {**spec.parameters, "es_runs": str(out.resolve() / "es_*"),
                  "grpo_runs": str(out.resolve() / "grpo_*"), "figures_dir": str(out.resolve() / "figures")}
    return execute_notebook(spec.notebook, out / "04_es_vs_grpo.ipynb", parameters, kernel_name=spec.kernel)


def main(argv: list[str] | None = None) -> int:
    """Command line: plan, estimate, run, measure; then draw the comparison with notebook 04."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", nargs="?", default=str(DEFAULT_SPEC), help="sweep spec (YAML)")
    parser.add_argument("--generations", type=int, help="ES generations (GRPO steps follow from the equal budget)")
    parser.add_argument("--seeds", help="comma-separated seeds, e.g. 0,1,2")
    parser.add_argument("--out", help="folder for the run folders (default: the spec's sweep.out)")
    parser.add_argument("--model", help="override the model (e.g. tiny-random for a quick check)")
    parser.add_argument("--max-new-tokens", type=int, help="override max_new_tokens")
    parser.add_argument("--no-kl", action="store_true", help="skip the KL-to-base measurement")
    parser.add_argument("--no-notebook", action="store_true", help="do not run notebook 04 at the end")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the estimate only")
    args = parser.parse_args(argv)

    spec_path = Path(args.spec)
    batch_part, sweep = load_sweep_spec(spec_path)
    overrides = {k: v for k, v in {"model": args.model, "max_new_tokens": args.max_new_tokens}.items() if v is not None}
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    plan = plan_sweep(sweep, args.generations, seeds, overrides)
    out = Path(args.out or sweep.get("out", "runs/es_vs_grpo"))
    estimate = estimate_seconds(plan, sweep.get("seconds_per_completion") or {})
    print(f"{len(plan)} runs into {out}, {plan[0].budget} training completions each; "
          f"estimated wall time {estimate / 60:.1f} min (seconds_per_completion "
          f"{sweep.get('seconds_per_completion')}, engine start and KL not included)")
    for run in plan:
        print(f"  {run.name}: {run.kind} {run.length} {'generations' if run.kind == 'es' else 'steps'}")
    if args.dry_run:
        return 0
    started = time.perf_counter()
    kl_settings = None if args.no_kl else dict(sweep.get("kl") or {})
    seconds = run_sweep(plan, out, kl_settings=kl_settings)
    measured = time.perf_counter() - started
    per_run = ", ".join(f"{name} {s:.0f} s" for name, s in seconds.items())
    print(f"measured wall time {measured / 60:.1f} min (estimated {estimate / 60:.1f} min): {per_run}")
    if not args.no_notebook:
        executed = run_notebook(batch_part, out, spec_path)
        print(f"comparison: {executed}, figures in {out / 'figures'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
