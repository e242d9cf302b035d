"""ES vs GRPO at equal sample budgets: one ES run and one GRPO run (per group size) per seed, with the
same model, task, LoRA layout and prompts per step, then notebooks/04_es_vs_grpo.py on the result.

The budget is counted in training completions: an ES generation costs population_size x prompts,
a GRPO step group_size x prompts, so GRPO runs generations x population_size / group_size steps.
Runs are normal run folders (resumed when they already hold the same settings):
OUT/es_seedN and OUT/grpo_seedN (OUT/grpo_G8_seedN, ... when the spec lists several group sizes).
After each run the KL of its final adapter to the base model is measured (vLLM engines only) and
stored as `policy/kl` in its last metrics row, for the reward-vs-KL figure; with `kl.every_checkpoint`
every kept checkpoint's KL goes to OUT/<run>/kl.jsonl. `summarize` writes OUT/summary.csv/json.

The spec is a batch file for notebook 04 (`notebook`, `parameters`) plus a `sweep` section:

    sweep:
      common: {model: ..., task: ..., lora_rank: ...}   # ESConfig/GRPOConfig settings shared by both
      es: {population_size: 16, sigma: 0.05, ...}       # ES-only settings
      es_modes:                                         # optional: several ES variants, each over `es`
        lora: {}                                        # -> OUT/es_lora_seedN
        full: {es_mode: full, sigma: 0.001, learning_rate: 0.0005}   # -> OUT/es_full_seedN
      grpo: {group_size: [8, 16], learning_rate: ...}   # GRPO-only settings; group_size may be a list
      grpo_modes:                                       # optional: several GRPO variants, each over `grpo`
        lr2e3: {learning_rate: 0.002}                   # -> OUT/grpo_lr2e3_seedN
        lr5e4: {learning_rate: 0.0005}                  # -> OUT/grpo_lr5e4_seedN
        full: {policy_weights: full, learning_rate: 1e-5}   # -> OUT/grpo_full_seedN: GRPO on the model weights
      generations: 12                                   # ES generations (sets the budget)
      seeds: [0, 1, 2]
      out: runs/es_vs_grpo
      seconds_per_completion: {es: 1.1, grpo: 1.6}      # for the wall-time estimate
      kl: {num_samples: 4, temperature: 1.0, every_checkpoint: true}
      grpo_completions: 39816                           # optional: a published protocol's own GRPO budget (below)

Every ES variant
Every ES variant of `es_modes` (all at the same budget: the same population x prompts) is one
more method, and so is every GRPO variant of `grpo_modes` (each trains every seed: several learning
rates are several variants; tuning a method fairly is `evolm tune`'s work, never a rate picked on one
seed whose run is then reported as that seed). `grpo_completions` gives GRPO a budget of its own in
training completions (steps = it / (group_size x prompts_per_step), which must divide it, and a
GRPO variant may then set its own prompts_per_step): a published protocol run as published (Hoy et
al.'s 79 GRPO steps against 100 ES generations), never the equal-budget comparison; the
budgets are still checked equal within ES and within GRPO. `--methods es_full,grpo` runs only those
methods' runs (several processes, each with its own engine, can share one OUT this way). After each run its final adapter (or, for `es_mode` full and
eggroll, the engine's mean) is scored greedily on every held-out problem, one line per problem in
OUT/<run>/heldout.jsonl: the input of the study's intervals (``evolm_lib.analysis``).

Before any engine starts, every run's folder is compared with its planned settings (the batch's one
comparison, ``evolm_lib.batch.settings_changes``): a folder holding a run made with other settings is
a conflict, listed old -> new, and the sweep refuses to start until ``--out`` names another folder or
``--overwrite METHOD[/SEED]`` replaces those runs. A replaced run waits beside its folder
(OUT/.<run>.kept-<time>) until its new attempt finishes; an attempt that fails is moved to
OUT/<run>.failed-<time> and the finished run put back.

Usage::

    evolm sweep [SPEC] [--generations G] [--seeds 0,1,2] [--methods es_lora,grpo] [--out DIR]
                [--model NAME] [--max-new-tokens N] [--overwrite METHOD[/SEED]] [--no-kl] [--no-notebook] [--dry-run]
"""
from __future__ import annotations

import json
import shutil
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .analysis import method_globs
from .batch import execute_notebook, read_yaml_file, settings_changes, spec_from_dict, write_summary_files
from .config import ConfigError, ESConfig, GRPOConfig, did_you_mean
from .engines import EngineSizing, make_evaluator
from .env import record_placement
from .train.es import ESRun
from .evaluation import evaluate_adapter, mean_kl_to_base, success
from .train.grpo import GRPORun
from .train.model_weights import ModelWeights
from .runs import (RunFolderBusy, describe_holder, list_checkpoints, load_checkpoint, lock_holder, missing_config,
                   read_checkpoint_kls, read_jsonl, read_metrics, record_final_metrics, write_jsonl)
from .tasks import get_task

DEFAULT_SPEC = "papermill_runs/es_vs_grpo_conciseness_cpu.yaml"  # relative to the project folder
SWEEP_KEYS = ("common", "es", "es_modes", "grpo", "grpo_modes", "generations", "seeds", "out", "seconds_per_completion", "kl",
              "grpo_completions")
HELDOUT = "heldout.jsonl"  # a finished run's greedy score on every held-out problem, one line each


@dataclass(frozen=True)
class PlannedRun:
    """One run of the sweep: folder name, method label, kind and validated settings."""

    name: str
    label: str
    kind: str  # "es" | "grpo"
    config: Any  # ESConfig | GRPOConfig
    budget: int  # training completions it will use

    @property
    def method(self) -> str:
        """The run's method as ``--methods`` names it: its folder name without the seed (es_full, grpo)."""
        return self.name.rsplit("_seed", 1)[0]

    @property
    def length(self) -> int:
        """Generations (ES) or steps (GRPO)."""
        return self.config.num_generations if self.kind == "es" else self.config.num_steps


# --------------------------------------------------------------------------- spec and plan


def load_sweep_spec(path: str | Path) -> tuple[dict, dict]:
    """(batch part for notebook 04, sweep section) of a spec file; unknown keys fail, each named by its
    path with the nearest valid name (sweep.es.sigmaa: ... did you mean sigma?)."""
    data = read_yaml_file(path) or {}
    sweep = data.pop("sweep", None)
    if not isinstance(sweep, dict):
        raise ValueError(f"{path} has no `sweep:` section (see `evolm sweep --help`)")
    unknown = sorted(set(sweep) - set(SWEEP_KEYS))
    if unknown:
        hints = "".join(did_you_mean(k, SWEEP_KEYS) for k in unknown)
        raise ValueError(f"unknown key(s) {unknown} in the sweep section of {path}{hints}; allowed: {list(SWEEP_KEYS)}")
    check_sections(sweep, path)
    return data, sweep


LEARNING_RATE_LIST = (
    "sweep.grpo.learning_rate: one rate, not a list (a list picked one rate on the first seed and reported "
    "that run as the seed, which favours GRPO); to compare several rates, give each a variant under "
    "sweep.grpo_modes, e.g. grpo_modes: {lr1e3: {learning_rate: 0.001}, lr3e3: {learning_rate: 0.003}} (each "
    "trains every seed); to tune GRPO and ES with equal effort, use `evolm tune`")
"""A GRPO learning-rate list in a spec: what it did, and what to use instead."""

SECTIONS = {"common": "settings of both ESConfig and GRPOConfig", "es": "ESConfig settings", "grpo": "GRPOConfig settings"}


def _section_fields(section: str) -> list[str]:
    if section == "common":
        return [f for f in ESConfig.model_fields if f in GRPOConfig.model_fields]
    return list((ESConfig if section == "es" else GRPOConfig).model_fields)


def check_sections(sweep: dict, source: str | Path = "the spec") -> None:
    """Every key of sweep.common, sweep.es and sweep.grpo is a setting of its class(es); a ValueError
    names each other one by its path, with the nearest setting."""
    problems = []
    for section, what in SECTIONS.items():
        values = sweep.get(section) or {}
        if not isinstance(values, dict):
            problems.append(f"sweep.{section}: expected a mapping of {what}, got {values!r}")
            continue
        fields = _section_fields(section)
        problems += [f"sweep.{section}.{key}: not one of the {what}{did_you_mean(key, fields)}"
                     for key in values if key not in fields]
    for modes, section, what in (("es_modes", "es", "ESConfig"), ("grpo_modes", "grpo", "GRPOConfig")):
        variants = sweep.get(modes) or {}
        if not isinstance(variants, dict):
            problems.append(f"sweep.{modes}: expected a mapping of name -> {what} settings, got {variants!r}")
            continue
        for name, values in variants.items():
            values = values or {}  # an empty variant: the section's settings as they are
            if not str(name).replace("_", "").isalnum():
                problems.append(f"sweep.{modes}.{name}: a name of letters, digits and _ (it names run folders)")
            if not isinstance(values, dict):
                problems.append(f"sweep.{modes}.{name}: expected a mapping of {what} settings, got {values!r}")
                continue
            fields = _section_fields(section)
            problems += [f"sweep.{modes}.{name}.{key}: not one of the {what} settings{did_you_mean(key, fields)}"
                         for key in values if key not in fields]
            if modes == "grpo_modes" and any(isinstance(values.get(k), list) for k in ("group_size", "learning_rate")):
                problems.append(f"sweep.grpo_modes.{name}: one group_size and one learning_rate per variant "
                                "(a variant is one method)")
    grpo = sweep.get("grpo") if isinstance(sweep.get("grpo"), dict) else {}
    if isinstance(grpo.get("learning_rate"), list):
        problems.append(LEARNING_RATE_LIST)
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))


def _config(cls, sections: list[tuple[str, dict]], fixed: dict):
    """``cls`` from the sweep's sections (later ones win) and the values the plan sets; a ConfigError
    names each bad field by the place it was written (sweep.es.sigma, --model)."""
    data, where = {}, {}
    for name, values in sections:
        data.update(values)
        where.update({key: name if name.startswith("--") else f"{name}.{key}" for key in values})
    try:
        return cls.from_dict({**data, **fixed})
    except ConfigError as error:
        raise error.located(where) from None


def _prompts_per_step(config) -> int:
    num_train = len(get_task(config.task, **config.task_options).train_examples())
    return min(config.prompts_per_step or num_train, num_train)


def run_budget(kind: str, config) -> int:
    """A run's training completions: its generations (ES) or steps (GRPO) x population or group size x
    prompts per step (all the task's training prompts where ``prompts_per_step`` is unset)."""
    length, size = ((config.num_generations, config.population_size) if kind == "es"
                    else (config.num_steps, config.group_size))
    return length * size * _prompts_per_step(config)


def plan_sweep(sweep: dict, generations: int | None = None, seeds: list[int] | None = None,
               overrides: dict | None = None) -> list[PlannedRun]:
    """Every run of the sweep, with GRPO's steps set for the same training completions as ES; every
    method (ES variant, GRPO variant, group size) trains every seed."""
    common = sweep.get("common") or {}
    given = [(f"--{key.replace('_', '-')}", {key: value}) for key, value in (overrides or {}).items()]
    generations = int(generations if generations is not None else sweep.get("generations", 10))
    check_not_empty(sweep, seeds)
    seeds = list(seeds if seeds is not None else sweep.get("seeds", [0]))
    grpo = dict(sweep.get("grpo") or {})
    if isinstance(grpo.get("learning_rate"), list):
        raise ConfigError(LEARNING_RATE_LIST)
    group_sizes = grpo.pop("group_size", 8)
    group_sizes = group_sizes if isinstance(group_sizes, list) else [group_sizes]
    own_budget = sweep.get("grpo_completions")
    if own_budget is not None and (isinstance(own_budget, bool) or not isinstance(own_budget, int) or own_budget < 1):
        raise ValueError(f"sweep.grpo_completions: a whole number of training completions >= 1, got {own_budget!r}")
    variants = sweep.get("es_modes") or {None: {}}
    grpo_variants = {name: dict(settings or {}) for name, settings in (sweep.get("grpo_modes") or {None: {}}).items()}
    plan = []
    for seed in seeds:
        for variant, settings in variants.items():
            sections = [("sweep.common", common), ("sweep.es", sweep.get("es") or {})]
            if variant is not None:
                sections.append((f"sweep.es_modes.{variant}", settings or {}))
            es = _config(ESConfig, [*sections, *given], {"seed": seed, "num_generations": generations})
            name, label = (f"es_{variant}", f"es {variant}") if variant is not None else ("es", "es")
            plan.append(PlannedRun(f"{name}_seed{seed}", label, "es", es, run_budget("es", es)))
        for variant, settings in grpo_variants.items():
            sizes = [settings["group_size"]] if "group_size" in settings else group_sizes
            for group_size in sizes:
                sections = [("sweep.common", common), ("sweep.grpo", grpo)]
                if variant is not None:
                    sections.append((f"sweep.grpo_modes.{variant}", {k: v for k, v in settings.items() if k != "group_size"}))
                if own_budget is None:
                    steps, rest = divmod(generations * es.population_size, group_size)
                    if rest or steps < 1:
                        raise ValueError(f"unequal budgets: {generations} generations x population {es.population_size} "
                                         f"is not a whole number of steps of group_size {group_size}; change --generations")
                else:
                    per_step = group_size * _prompts_per_step(_config(GRPOConfig, [*sections, *given],
                                                                      {"group_size": group_size, "seed": seed}))
                    steps, rest = divmod(own_budget, per_step)
                    if rest or steps < 1:
                        raise ValueError(f"sweep.grpo_completions: {own_budget} is not a whole number of steps of "
                                         f"{per_step} completions (group_size {group_size} x prompts_per_step)")
                config = _config(GRPOConfig, [*sections, *given], {"group_size": group_size, "seed": seed, "num_steps": steps})
                name, label = (f"grpo_{variant}", f"grpo {variant}") if variant is not None else ("grpo", "grpo")
                if len(sizes) > 1:
                    name, label = f"{name}_G{group_size}", f"{label} G={group_size}"
                plan.append(PlannedRun(f"{name}_seed{seed}", label, "grpo", config, run_budget("grpo", config)))
    if own_budget is None:
        check_equal_budgets(plan)
    else:  # a protocol's own GRPO budget: equal within each kind
        for kind in ("es", "grpo"):
            check_equal_budgets([run for run in plan if run.kind == kind])
    check_plan_sizes(plan)
    return plan


def check_not_empty(sweep: dict, seeds: list[int] | None = None) -> None:
    """Refuse a grid or method list given empty (``seeds: []``, ``grpo: {group_size: []}``, ``es_modes: {}``):
    written out, it would plan no run of that kind, or none at all, instead of what the spec names."""
    grpo = sweep.get("grpo") if isinstance(sweep.get("grpo"), dict) else {}
    empty = [(f"sweep.{key}", sweep.get(key)) for key in ("seeds", "es_modes", "grpo_modes")
             if key in sweep and sweep.get(key) is not None and len(sweep.get(key)) == 0]
    if "group_size" in grpo and isinstance(grpo["group_size"], list) and not grpo["group_size"]:
        empty.append(("sweep.grpo.group_size", grpo["group_size"]))
    if seeds is not None and not list(seeds):
        empty.append(("--seeds", seeds))
    if empty:
        raise ConfigError("; ".join(f"{field}: empty ({value!r}), so the sweep would leave out what it names; "
                                    "give at least one value, or leave the key out for its default"
                                    for field, value in empty))


def check_plan_sizes(plan: list[PlannedRun]) -> None:
    """Refuse a plan whose sizes no run on this machine can hold (``preflight.check_run_sizes``: population,
    group size, prompts, tokens and the rows a run writes, against the host's memory and the card's), before
    any folder or engine exists; the error names the run and the field with the largest value that fits."""
    from .models import cached_model_dir
    from .preflight import check_run_sizes

    checked = set()
    for run in plan:
        settings = {k: v for k, v in run.config.to_dict().items() if k != "seed"}
        key = json.dumps([run.kind, settings], sort_keys=True, default=str)
        if key in checked:  # the seeds of one method ask the same of the machine
            continue
        checked.add(key)
        try:
            # no tokenizer: planning stays quick, and the engine's own check measures the prompts before it starts
            check_run_sizes(run.config, cached_model_dir(run.config.model), tokenize=False)
        except ConfigError as error:
            raise ConfigError(f"{run.name}: {error}", error.errors, error.config_name) from None


def check_equal_budgets(plan: list[PlannedRun]) -> None:
    """Every run at one budget of training completions; else a ValueError naming the methods at each
    budget and how each budget is made (steps x population or group size x prompts per step)."""
    budgets: dict[int, dict[str, str]] = {}
    for run in plan:
        size = run.config.population_size if run.kind == "es" else run.config.group_size
        budgets.setdefault(run.budget, {})[run.method] = (
            f"{run.method} ({run.length} x {size} x {run.budget // (run.length * size)} prompts)")
    if len(budgets) > 1:  # prompts_per_step differs between the methods' settings
        listing = "; ".join(f"{budget}: {', '.join(methods.values())}" for budget, methods in sorted(budgets.items()))
        raise ValueError(f"unequal budgets across runs, in training completions — {listing}; give every method "
                         "the same prompts_per_step (sweep.common) so that they train on equal budgets")


def select_methods(plan: list[PlannedRun], methods: list[str] | None) -> list[PlannedRun]:
    """The planned runs of the named methods (``PlannedRun.method``: es_full, grpo, ...), all when None;
    a name no run has fails, listing the plan's methods."""
    if not methods:
        return plan
    known = list(dict.fromkeys(run.method for run in plan))
    unknown = [m for m in methods if m not in known]
    if unknown:
        hints = "".join(did_you_mean(m, known) for m in unknown)
        raise ValueError(f"--methods: {unknown} not in this sweep{hints}; its methods: {known}")
    return [run for run in plan if run.method in methods]


@dataclass(frozen=True)
class RunAction:
    """What a sweep does with one planned run's folder, decided before any engine starts."""

    run: PlannedRun
    state: str
    """new, finished, unfinished (resumed), changed (its folder holds a run with other settings) or busy."""
    action: str
    """run, finish (a finished run: its held-out scores and KL completed where missing), resume, overwrite,
    conflict (left as it is, and the sweep refuses to start), damaged (its config.yaml is missing: the sweep
    refuses to start and gives the command that restores it) or skip (busy)."""
    reason: str = ""
    error: str = ""

    @property
    def name(self) -> str:
        """The run's folder name under OUT."""
        return self.run.name


def overwritten_runs(plan: list[PlannedRun], names: Collection[str]) -> set[str]:
    """The folder names of the runs that ``--overwrite METHOD[/SEED]`` names (METHOD: every seed of it);
    a method or seed the plan lacks fails, listing what it has."""
    methods = list(dict.fromkeys(run.method for run in plan))
    chosen, problems = set(), []
    for name in names:
        method, _, seed = str(name).partition("/")
        runs = [run for run in plan if run.method == method and (not seed or str(run.config.seed) == seed.strip())]
        if method not in methods:
            problems.append(f"{name!r}: no method {method!r} in this sweep{did_you_mean(method, methods)}")
        elif not runs:
            seeds = sorted({run.config.seed for run in plan if run.method == method})
            problems.append(f"{name!r}: {method} has no seed {seed!r} here (seeds: {seeds})")
        chosen.update(run.name for run in runs)
    if problems:
        raise ValueError(f"--overwrite: {'; '.join(problems)}; METHOD or METHOD/SEED, methods: {', '.join(methods)}")
    return chosen


def check_out_folder(out: str | Path) -> None:
    """Refuse an output folder that holds a batch (point folders with status.json, or a summary.json of a
    notebook's points): the sweep's summary.csv would replace the batch's. A ValueError names what it holds."""
    out = Path(out)
    if not out.is_dir():
        return
    points = sorted(p.name for p in out.iterdir() if p.is_dir() and (p / "status.json").is_file())
    notebook = None
    try:
        notebook = json.loads((out / "summary.json").read_text(encoding="utf-8")).get("notebook")
    except (OSError, ValueError, AttributeError):
        pass
    if points or notebook:
        held = f"points of {Path(notebook).name}" if notebook else "points of a batch"
        listed = f" ({', '.join(points)})" if points else ""
        raise ValueError(f"this folder, {out.resolve()}, holds an `evolm batch`'s {held}{listed}; a sweep would write "
                         "its runs and its summary.csv beside them. The folder is left as it is: give --out another folder")


def plan_actions(plan: list[PlannedRun], out: str | Path, overwrite: Collection[str] = ()) -> list[RunAction]:
    """Each planned run with its folder's state and what the sweep does with it, by the batch's own
    comparison of a run folder with new settings (``batch.settings_changes``: a change of budget or
    cadence extends a run, any other change is a conflict). ``overwrite``: METHOD or METHOD/SEED names
    of the runs to replace (`overwritten_runs`)."""
    check_out_folder(out)
    replace = overwritten_runs(plan, overwrite)
    actions = []
    for run in plan:
        folder = Path(out) / run.name
        what = f"{run.kind}, {run.length} {'generations' if run.kind == 'es' else 'steps'}"
        holder = lock_holder(folder) if folder.is_dir() else None
        if holder is not None:
            actions.append(RunAction(run, "busy", "skip", f"{what}; held by {describe_holder(holder)}"))
            continue
        missing = missing_config(folder)
        if missing is not None:  # checkpoints without config.yaml: no plan can say where it resumes
            if run.name in replace:
                actions.append(RunAction(run, "damaged", "overwrite", f"{what}; replaces the run there ({missing})"))
            else:
                actions.append(RunAction(run, "damaged", "damaged", f"{what}; {missing}; or `--overwrite "
                                                                    f"{run.method}/{run.config.seed}` starts it again"))
            continue
        rows = read_metrics(folder) if (folder / "config.yaml").is_file() else []
        if not rows and not list_checkpoints(folder):
            actions.append(RunAction(run, "new", "run", what))
            continue
        changes, blocking, _ = settings_changes(folder, {"run_dir": folder}, run.config)
        listed = ", ".join(map(str, changes))
        done = rows[-1].get("generation", -1) if rows else -1
        if blocking:
            state, action = "changed", "conflict"
            reason = (f"{what}; its folder holds a run with other settings: {listed}; kept as it is: "
                      f"`--overwrite {run.method}/{run.config.seed}` replaces this run alone, or `--out` another "
                      "folder runs the new settings there")
        elif changes:
            state, action, reason = "unfinished", "resume", f"{what}; settings changed that its run can follow: {listed}"
        elif done >= run.length:
            state, action, reason = "finished", "finish", f"{what}; finished (held-out scores and KL completed if missing)"
        else:
            state, action, reason = "unfinished", "resume", f"{what}; resumes at generation {done} of {run.length}"
        if run.name in replace:
            action, reason = "overwrite", f"{what}; replaces the run there (was {state}{': ' + listed if changes else ''})"
        actions.append(RunAction(run, state, action, reason))
    return actions


def timing_estimate(plan: list[PlannedRun], sweep: dict, overrides: dict | None = None) -> tuple[float | None, str]:
    """(estimated seconds or None, how it was made): the spec's seconds_per_completion hold only for the
    spec's own model and completion length, so a --model or --max-new-tokens that changes them gives none."""
    timing = sweep.get("seconds_per_completion") or {}
    common = sweep.get("common") or {}
    changed = [f"--{key.replace('_', '-')} {value} (the spec's {key}: {common.get(key)})"
               for key, value in (overrides or {}).items() if common.get(key) != value]
    if changed:
        return None, (f"no estimate: the spec's seconds_per_completion {timing} were measured with its own "
                      f"settings, not with {', '.join(changed)}")
    if not timing:
        return None, "no estimate: the spec gives no seconds_per_completion"
    return estimate_seconds(plan, timing), f"seconds_per_completion {timing}, engine start and KL not included"


def estimate_seconds(plan: list[PlannedRun], seconds_per_completion: dict) -> float:
    """Rough wall time: training plus greedy eval completions, times a per-completion cost of each method."""
    total = 0.0
    for run in plan:
        task = get_task(run.config.task, **run.config.task_options)
        evals = (run.length // run.config.eval_every if run.config.eval_every else 1) + 1
        completions = run.budget + evals * (len(task.train_examples()) + len(task.eval_examples()))
        total += completions * float(seconds_per_completion.get(run.kind, 1.0))
    return total


# --------------------------------------------------------------------------- running


def make_shared_evaluator(plan: list[PlannedRun]):
    """One engine for every run: sized for the largest population and LoRA rank (a plan of GRPO runs
    alone, ``--methods grpo``, included)."""
    first = next((run.config for run in plan if run.kind == "es"), plan[0].config)
    sizing = EngineSizing.from_config(first).covering(run.config for run in plan)
    if any(getattr(run.config, "policy_weights", "lora") == "full" for run in plan):
        sizing = sizing.replace(adapter_transfer="in_place")  # GRPO on the model weights writes them in place
    return make_evaluator(first, sizing=sizing)


def model_weights_of(run) -> ModelWeights | GRPORun | None:
    """What a run moves when it is the model's own weights, with ``serving_base`` and ``replay``: an ES
    run's ``ModelWeights`` (es_mode full/eggroll), a GRPO run itself (policy_weights full); else None."""
    if isinstance(run, GRPORun):
        return run if run.engine_weights is not None else None
    parameters = getattr(run, "parameters", None)
    return parameters if isinstance(parameters, ModelWeights) else None


def _kl_of(evaluator, run, adapter, kl_settings: dict) -> float:
    """KL(policy || base) on the run's eval prompts: ``adapter``, or with None the engine's own weights
    (es_mode full/eggroll), the base then served from the model folder's weights while it scores."""
    weights = model_weights_of(run)
    return mean_kl_to_base(evaluator, run.task, adapter, run.eval_examples,
                           num_samples=int(kl_settings.get("num_samples", 4)),
                           temperature=float(kl_settings.get("temperature", 1.0)),
                           max_new_tokens=run.config.max_new_tokens, seed=run.config.seed,
                           serving_base=weights.serving_base if adapter is None and weights is not None else None)


def measure_kl(evaluator, run, kl_settings: dict) -> float | None:
    """Mean per-token KL of the run's final adapter (or mean weights) to the base model on the eval
    prompts (None: the engine cannot score tokens)."""
    try:
        return _kl_of(evaluator, run, run.adapter, kl_settings)
    except TypeError as error:  # an engine without token log-probs (HF, synthetic)
        print(f"  no KL: {error}", flush=True)
        return None


def checkpoint_kls(evaluator, run, kl_settings: dict) -> list[dict]:
    """KL(adapter || base) of every kept checkpoint of a run not yet measured, appended to run_dir/kl.jsonl.
    For es_mode full/eggroll the checkpoints are the weight snapshots' generations (every
    ``checkpoint_every`` and the last), whose means the seed log replays on the engine."""
    path = Path(run.run_dir) / "kl.jsonl"
    done = {json.loads(line)["generation"] for line in path.read_text().splitlines()} if path.exists() else set()
    rows = []

    def record(generation: int, adapter) -> None:
        started = time.perf_counter()
        kl = _kl_of(evaluator, run, adapter, kl_settings)
        row = {"generation": generation, "policy/kl": kl, "seconds": time.perf_counter() - started}
        with open(path, "a") as handle:
            handle.write(json.dumps(row) + "\n")
        rows.append(row)

    weights = model_weights_of(run)
    if weights is not None:
        every, last = run.config.checkpoint_every, run.generation
        wanted = [g for g in range(0, last + 1) if (g % every == 0 or g == last) and g not in done]
        for generation in weights.replay(wanted):
            record(generation, None)
        return rows
    for checkpoint in list_checkpoints(run.run_dir):
        generation = int(checkpoint.name.split(".")[0])
        if generation not in done:
            record(generation, load_checkpoint(checkpoint)[0])
    return rows


def evaluation_lines(examples, result: dict, generation: int) -> list[dict]:
    """heldout.jsonl's lines from ``evaluate_adapter``'s greedy result on ``examples``: index, prompt,
    target, the generation or step scored, completion, reward and success."""
    threshold = result["success_threshold"]
    return [{"index": i, "prompt": example.prompt, "target": example.target, "generation": generation,
             "completion": completion, "reward": reward, "success": success(reward, threshold)}
            for i, (example, completion, reward) in enumerate(zip(examples, result["completions"], result["rewards"]))]


def score_held_out(evaluator, run) -> list[dict]:
    """The run's final adapter (or mean weights) scored greedily on every held-out problem, one JSON
    line per problem in run_dir/heldout.jsonl (index, prompt, target, completion, reward, success, and
    the generation or step scored); written atomically, kept when it holds the run's current generation
    (a run extended since is scored again). Returns the lines."""
    path = Path(run.run_dir) / HELDOUT
    if path.exists():
        kept = read_jsonl(path)
        if all(line.get("generation") == run.generation for line in kept):
            return kept
    result = evaluate_adapter(evaluator, run.task, run.adapter, run.eval_examples,
                              max_new_tokens=run.config.max_new_tokens)
    lines = evaluation_lines(run.eval_examples, result, run.generation)
    write_jsonl(path, lines)
    return lines


def run_one(planned: PlannedRun, out: Path, evaluator, kl_evaluator=None, kl_settings: dict | None = None):
    """Run (or resume) one planned run to its end, save its final adapter, record its KL, release its folder."""
    cls = ESRun if planned.kind == "es" else GRPORun
    run = cls.open(planned.config, out / planned.name, evaluator=evaluator)
    try:
        if run.generation < planned.length:  # the times in its rows, read with where it ran (an attempt
            record_placement(run.run_dir, planned.config, run.placement())  # that finds the run done writes none)
        run.run(callback=lambda row: print(
            f"  {planned.name} {row['generation']:>4}/{planned.length}  train {row['train/reward_mean']:9.3f}  "
            f"greedy {row.get('policy/train_reward', float('nan')):9.3f}  samples {row['samples/completions']:>6}  "
            f"{row['time/generation_s']:6.1f} s", flush=True))
        run.save_final()
        lines = score_held_out(evaluator, run)
        share = sum(line["success"] for line in lines) / max(len(lines), 1)
        reward = sum(line["reward"] for line in lines) / max(len(lines), 1)
        print(f"  {planned.name} held-out on {len(lines)} problems: success {share:.3f}, mean reward {reward:.4g}",
              flush=True)
        if kl_settings is not None and kl_settings.get("every_checkpoint"):
            for row in checkpoint_kls(kl_evaluator or evaluator, run, kl_settings):
                print(f"  {planned.name} checkpoint {row['generation']}: KL to base {row['policy/kl']:.4g}", flush=True)
        if kl_settings is not None and run.history[-1].get("policy/kl") is None:
            kl = measure_kl(kl_evaluator or evaluator, run, kl_settings)
            if kl is not None:
                run.history[-1] = record_final_metrics(run.run_dir, {"policy/kl": kl})
                print(f"  {planned.name} KL to base {kl:.4g}", flush=True)
    finally:
        run.close()  # frees the run folder (a failed run too); the shared engine was passed in and stays open
    return run


class SweepRunFailed(RuntimeError):
    """A run of the sweep raised: one message naming the run, what went wrong and what was kept."""


def run_sweep(plan: list[PlannedRun], out: str | Path, evaluator=None, kl_evaluator=None,
              kl_settings: dict | None = None, overwrite: Collection[str] = ()) -> dict[str, float]:
    """Run every planned run into OUT/<name>; returns {name: wall seconds}. One engine shared by all.
    A run whose folder another process writes is left as it is and recorded busy (no seconds).
    ``overwrite``: folder names of runs to replace; each waits in OUT/.<name>.kept-<time> until its new
    attempt finishes, and comes back if the attempt fails. A run that raises stops the sweep with
    SweepRunFailed (the runs before it kept)."""
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
            try:
                _attempt(planned, out, planned.name in overwrite, evaluator, kl_evaluator, kl_settings)
            except RunFolderBusy as busy:
                print(f"  {planned.name}: busy, left as it is ({busy})", flush=True)
                with open(out / "sweep_summary.jsonl", "a") as handle:
                    handle.write(json.dumps({"run": planned.name, "label": planned.label, "status": "busy",
                                             "holder": busy.holder}) + "\n")
                continue
            seconds[planned.name] = time.perf_counter() - started
            with open(out / "sweep_summary.jsonl", "a") as handle:
                handle.write(json.dumps({"run": planned.name, "label": planned.label, "seconds": seconds[planned.name],
                                         "budget": planned.budget}) + "\n")
    finally:
        if own:
            evaluator.close()
    return seconds


def _attempt(planned: PlannedRun, out: Path, replacing: bool, evaluator, kl_evaluator, kl_settings) -> None:
    """One run of the sweep (``replacing``: its folder's run is moved aside first, and back on failure);
    an exception other than RunFolderBusy becomes SweepRunFailed, naming what was kept."""
    from .batch.state import stamp

    folder = out / planned.name
    aside = folder.with_name(f".{folder.name}.kept-{stamp()}") if replacing and folder.exists() else None
    if aside is not None:
        folder.rename(aside)
    try:
        run_one(planned, out, evaluator, kl_evaluator, kl_settings)
    except RunFolderBusy:
        if aside is not None:
            aside.rename(folder)
        raise
    except Exception as error:  # noqa: BLE001 - reported as one message; the run folders say the rest
        kept = ""
        if aside is not None:
            failed = folder.with_name(f"{folder.name}.failed-{stamp()}")
            if folder.exists():
                folder.rename(failed)
            aside.rename(folder)
            kept = f"; the run it was to replace is kept in {folder}, this attempt moved to {failed.name}"
        raise SweepRunFailed(f"{planned.name}: {type(error).__name__}: {error}{kept}") from error
    if aside is not None:
        shutil.rmtree(aside)


def run_notebook(batch_part: dict, out: Path, spec_path: Path) -> Path:
    """notebooks/04_es_vs_grpo.py on the sweep's folders; executed notebook and figures under OUT."""
    spec = spec_from_dict(batch_part, source=spec_path.resolve())
    runs = {f"{kind}_runs": pattern for kind, pattern in method_globs(out.resolve()).items()}  # "": none of this method
    parameters = {**spec.parameters, **runs, "figures_dir": str(out.resolve() / "figures")}
    return execute_notebook(spec.notebook, out / "04_es_vs_grpo.ipynb", parameters, kernel_name=spec.kernel)


def summarize(out: str | Path) -> list[dict]:
    """One row per run folder of a sweep: its method (the analysis's label: kind, ES mode and every
    setting in which runs of one label differ, `analysis.method_labels`), seed, a column per setting
    that varies across the runs, the run's results (``analysis.run_results``), the KL of every measured checkpoint, and its wall time.
    Written to OUT/summary.csv and OUT/summary.json by the batch's writer (``write_summary_files``)."""
    from .analysis import folder_settings, method_labels, run_results
    from .runs import load_run_config

    out = Path(out)
    seconds, status = {}, {}
    path = out / "sweep_summary.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            entry = json.loads(line)  # a run's last entry says how its latest attempt ended (ok or busy)
            status[entry["run"]] = entry.get("status", "ok")
            if "seconds" in entry:
                seconds[entry["run"]] = entry["seconds"]
    # the runs, not a replaced run waiting aside (.<run>.kept-<time>) or a failed attempt (<run>.failed-<time>)
    folders = sorted(p for p in out.iterdir() if (p / "config.yaml").exists()
                     and not p.name.startswith(".") and ".failed-" not in p.name)
    configs = [read_yaml_file(folder / "config.yaml") or {} for folder in folders]
    rows = []
    for folder, method in zip(folders, method_labels(configs)):
        kls = read_checkpoint_kls(folder)
        rows.append({
            "run": folder.name, "status": status.get(folder.name, "ok"), "method": method,
            "seed": load_run_config(folder).seed,
            **run_results(folder),
            "kl_by_checkpoint": {row["generation"]: row["policy/kl"] for row in kls},
            "seconds": seconds.get(folder.name),
        })
    columns = ["run", "status", "method", "seed"]
    return write_summary_files(out, rows, rows, columns=columns, settings=[folder_settings(folder) for folder in folders])
