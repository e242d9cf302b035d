"""The `tune:` section of a sweep spec, checked before any engine starts, and the configs of its trials.

    tune:
      trials: 24              # per method, the same for every method
      seeds: [100]            # tuning seeds, disjoint from final_seeds
      select: validation/reward
      space:
        es_lora: {sigma: {log: [0.005, 0.2]}, learning_rate: {log: [0.01, 2.0]}, optimizer: [sgd, adam]}
        grpo:    {learning_rate: {log: [1e-5, 3e-3]}, beta: [0.0, 0.01, 0.1]}
    final_seeds: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]

The methods are the sweep's (``evolm_lib.sweep.plan_sweep``: es_lora, es_full, grpo, ...); a trial is
one run per tuning seed of its method's spec settings with the trial's values put over them, at the
sweep's completion budget (a searched population_size or group_size changes the generations or
steps so the budget stays).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..config import ConfigError, ESConfig, GRPOConfig, did_you_mean
from ..sweep import PlannedRun, check_plan_sizes, load_sweep_spec, plan_sweep, select_methods
from ..tasks import get_task
from .space import SPLIT, Parameter, parse_space, parse_split

TUNE_KEYS = ("trials", "seeds", "select", "space", "sampler_seed", "startup_trials", "prune", "heartbeat_s",
             "max_retries", "primary", "measure", "out", "long", "control", "parallel")
MEASURES = ("reward", "success")
"""What the reruns are compared on: each run's mean held-out reward, or its share of problems solved."""
SELECTABLE = ("validation/reward", "policy/train_reward")
"""Keys a trial may be selected on: the final mean's greedy score on the validation or training prompts."""
PRUNERS = ("none", "median")
FIXED = {
    "seed": "set by tune.seeds (tuning) and final_seeds (the winners' reruns)",
    "num_generations": "the budget is the sweep's (sweep.generations)",
    "num_steps": "the budget is the sweep's (sweep.generations)",
    "prompts_per_step": "it changes the completion budget: search a split instead (split: [\"30x8\", \"8x30\"]: "
                        "population x prompts at the same budget), or set it in sweep.common",
    "model": "every method tunes on the same model: set it in sweep.common",
    "task": "every method tunes on the same task: set it in sweep.common",
    "task_options": "every method tunes on the same task: set it in sweep.common",
}
"""Settings a space may not search, and why."""
BEST = {"best_es": "es", "best_grpo": "grpo"}
"""Names that stand for a method decided by the tuning: the kind's method whose winner scored highest on
the selection key (``primary`` pairs and ``control`` may name them)."""
STEP_SIZE = {"es": "population_size", "grpo": "group_size"}
"""The setting that sets a method's completions per generation or step (with prompts_per_step)."""


@dataclass(frozen=True)
class TuneSettings:
    """The checked `tune:` section and `final_seeds`."""

    trials: int
    "trials per method, the same for every method"
    seeds: tuple[int, ...]
    "tuning seeds: each trial runs once on each, its score is their mean"
    final_seeds: tuple[int, ...]
    "the seeds each method's winning setting is rerun on, none of them a tuning seed"
    select: str = "validation/reward"
    "the key a trial is scored by: the final mean's greedy score (maximised)"
    space: dict[str, list[Parameter]] = field(default_factory=dict)
    "method -> its searched settings"
    sampler_seed: int = 0
    "the TPE sampler's seed (each trial's sampler is seeded from it and the trial's number)"
    startup_trials: int = 10
    "trials drawn at random before TPE models the results"
    prune: str = "none"
    "none, or median: a trial stops at a scoring row below the median of earlier trials at that row"
    heartbeat_s: float = 30.0
    "a running trial's heartbeat; a trial silent for 3 heartbeats is failed and retried (a killed worker)"
    parallel: int = 0
    ("at most this many trials of a method running at once, retries of killed ones aside (0: no limit): "
     "what TPE knows when it draws a trial depends on how many run beside it")
    max_retries: int = 3
    "times a failed (killed) trial is retried with the same setting"
    primary: tuple[tuple[str, str], ...] = ()
    "pairs of methods compared as the declared family (Holm-corrected); every other pair is exploratory"
    measure: str = "reward"
    "the reruns' held-out score: mean reward, or success (share of problems solved)"
    long: int = 1
    "the winners' reruns continued to this many times the budget, each in a copy (OUT/long/); 1: not continued"
    control: str = "none"
    "none, best_es or an ES method: its winning setting rerun on the final seeds with fitness_control shuffled"


def _whole(path: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{path}: a whole number >= {least}, got {value!r}")
    return value


def _seeds(path: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or any(isinstance(s, bool) or not isinstance(s, int) for s in value):
        raise ValueError(f"{path}: a non-empty list of whole-number seeds, got {value!r}")
    if len(set(value)) != len(value):
        raise ValueError(f"{path}: a seed listed twice in {value}")
    return tuple(value)


def parse_tune_section(tune: Any, final_seeds: Any) -> tuple[TuneSettings, str | None]:
    """(settings, out or None) from the spec's `tune:` mapping and `final_seeds` list; a ValueError
    names the first bad key by its path."""
    if not isinstance(tune, dict):
        raise ValueError("the spec has no `tune:` section (see `evolm tune --help`)")
    unknown = [key for key in tune if key not in TUNE_KEYS]
    if unknown:
        raise ValueError("; ".join(f"tune.{key}: unknown key{did_you_mean(key, TUNE_KEYS)}; allowed: {list(TUNE_KEYS)}"
                                   for key in unknown))
    for required in ("trials", "seeds", "space"):
        if required not in tune:
            raise ValueError(f"tune.{required}: missing (see `evolm tune --help`)")
    if final_seeds is None:
        raise ValueError("final_seeds: missing: the seeds the winners are rerun on, e.g. [0, 1, 2, 3, 4]")
    seeds, finals = _seeds("tune.seeds", tune["seeds"]), _seeds("final_seeds", final_seeds)
    shared = sorted(set(seeds) & set(finals))
    if shared:
        raise ValueError(f"final_seeds: {shared} also tuning seeds (tune.seeds): the winners' reruns need fresh seeds")
    select = tune.get("select", "validation/reward")
    if select == "eval/reward":
        raise ValueError("tune.select: eval/reward is the held-out score the winners are reported on; selecting on "
                         "it leaves no untouched score (select validation/reward)")
    if select not in SELECTABLE:
        raise ValueError(f"tune.select: no run writes {select!r}{did_you_mean(select, SELECTABLE)}; one of "
                         f"{', '.join(SELECTABLE)}")
    prune = tune.get("prune", "none")
    if prune not in PRUNERS:
        raise ValueError(f"tune.prune: one of {', '.join(PRUNERS)}, got {prune!r}{did_you_mean(str(prune), PRUNERS)}")
    heartbeat = tune.get("heartbeat_s", 30.0)
    if isinstance(heartbeat, bool) or not isinstance(heartbeat, (int, float)) or not heartbeat > 0:
        raise ValueError(f"tune.heartbeat_s: seconds above 0, got {heartbeat!r}")
    space = tune["space"]
    if not isinstance(space, dict) or not space:
        raise ValueError(f"tune.space: a mapping of method -> settings to search, got {space!r}")
    primary = tune.get("primary") or []
    if not isinstance(primary, list) or any(not isinstance(p, list) or len(p) != 2 for p in primary):
        raise ValueError(f"tune.primary: a list of [method, method] pairs, got {primary!r}")
    measure = tune.get("measure", "reward")
    if measure not in MEASURES:
        raise ValueError(f"tune.measure: one of {', '.join(MEASURES)}, got {measure!r}{did_you_mean(str(measure), MEASURES)}")
    out = tune.get("out")
    control = tune.get("control", "none")
    if not isinstance(control, str):
        raise ValueError(f"tune.control: none, best_es or an ES method's name, got {control!r}")
    settings = TuneSettings(
        trials=_whole("tune.trials", tune["trials"], 1), seeds=seeds, final_seeds=finals, select=select,
        space={str(method): parse_space(f"tune.space.{method}", values) for method, values in space.items()},
        sampler_seed=_whole("tune.sampler_seed", tune.get("sampler_seed", 0), 0),
        startup_trials=_whole("tune.startup_trials", tune.get("startup_trials", 10), 0), prune=prune,
        heartbeat_s=float(heartbeat), max_retries=_whole("tune.max_retries", tune.get("max_retries", 3), 0),
        primary=tuple((str(a), str(b)) for a, b in primary), measure=measure,
        long=_whole("tune.long", tune.get("long", 1), 1), control=control,
        parallel=_whole("tune.parallel", tune.get("parallel", 0), 0))
    return settings, None if out is None else str(out)


@dataclass(frozen=True)
class TuneSpec:
    """A sweep spec with a `tune:` section: its methods' spec settings at the tuning and final seeds."""

    path: Path
    batch: dict
    "the spec's batch part (notebook and parameters), for the comparison notebook"
    sweep: dict
    settings: TuneSettings
    out: Path
    tuning_runs: dict[str, list[PlannedRun]]
    "method -> its runs at the spec's settings, one per tuning seed"
    final_runs: dict[str, list[PlannedRun]]
    "method -> its runs at the spec's settings, one per final seed"
    kinds: dict[str, str] = field(default_factory=dict)
    "every tuned method of the spec (not only this worker's) -> es or grpo, to decide best_es and best_grpo"
    storage: str | None = None
    "the studies' storage (``storage.open_storage``): None for OUT/optuna.db, a database URL, or journal:PATH"

    @property
    def methods(self) -> list[str]:
        """This worker's tuned methods (``--methods``), in the sweep's order."""
        return list(self.tuning_runs)

    @property
    def study_methods(self) -> list[str]:
        """Every tuned method of the study, this worker's or not, in the sweep's order: what its one
        summary covers, whichever worker writes it."""
        return list(self.kinds) or self.methods

    @property
    def budget(self) -> int:
        """Training completions of every run, trial and rerun alike."""
        return next(iter(self.tuning_runs.values()))[0].budget


def _plan(sweep: dict, generations, seeds, overrides, methods) -> dict[str, list[PlannedRun]]:
    plan = select_methods(plan_sweep(sweep, generations, list(seeds), overrides), methods)
    grouped: dict[str, list[PlannedRun]] = {}
    for run in plan:
        grouped.setdefault(run.method, []).append(run)
    return grouped


def load_tune_spec(path: str | Path, *, generations: int | None = None, overrides: dict | None = None,
                   methods: list[str] | None = None, out: str | Path | None = None) -> TuneSpec:
    """The spec at ``path`` with its `tune:` section checked against the sweep's methods and the config
    classes (every searched setting exists, fits its method and is not one the tuning fixes); a
    ValueError names the first problem by its path in the spec. Starts no engine."""
    data, sweep = load_sweep_spec(path)
    if sweep.get("grpo_completions") is not None:
        raise ValueError("sweep.grpo_completions: gives GRPO a budget of its own; every tuned method trains on one "
                         "budget (leave it out of a tune spec)")
    tune, final_seeds = data.pop("tune", None), data.pop("final_seeds", None)
    settings, spec_out = parse_tune_section(tune, final_seeds)
    tuning = _plan(sweep, generations, settings.seeds, overrides, methods)
    every = _plan(sweep, generations, settings.seeds, overrides, None)
    known = list(every)
    for method in settings.space:
        if method not in known:
            raise ValueError(f"tune.space.{method}: not a method of this sweep{did_you_mean(method, known)}; "
                             f"its methods: {known}")
    missing = [m for m in tuning if m not in settings.space]
    if missing:
        raise ValueError(f"tune.space: no space for {missing}: every method gets the same trials over a space of "
                         f"its own (or leave it out with --methods {','.join(m for m in tuning if m in settings.space)})")
    for pair in settings.primary:
        bad = [m for m in pair if m not in known and m not in BEST]
        if bad:
            raise ValueError(f"tune.primary: {bad} not a method of this sweep{did_you_mean(bad[0], known + list(BEST))}")
        if len(set(pair)) == 1:
            raise ValueError(f"tune.primary: {list(pair)} compares a method with itself")
    kinds = {m: runs[0].kind for m, runs in every.items() if m in settings.space}
    for name, kind in BEST.items():
        if any(name in pair for pair in settings.primary) or settings.control == name:
            if kind not in kinds.values():
                raise ValueError(f"tune: {name} names the best {kind.upper()} method, but no {kind} method is tuned "
                                 f"here; tuned: {list(kinds)}")
    if settings.control not in ("none", "best_es") and kinds.get(settings.control) != "es":
        es = [m for m, kind in kinds.items() if kind == "es"]
        raise ValueError(f"tune.control: none, best_es or a tuned ES method{did_you_mean(settings.control, es)}; "
                         f"got {settings.control!r} (ES methods: {es}); the control shuffles ES fitness")
    finals = _plan(sweep, generations, settings.final_seeds, overrides, list(tuning))
    folder = Path(out or spec_out or sweep.get("out", "runs/es_vs_grpo"))  # trials/ and final/ beside a sweep's runs
    spec = TuneSpec(Path(path), data, sweep, settings, folder, tuning, finals, kinds)
    check_space(spec)
    return spec


def trial_config(spec: TuneSpec, planned: PlannedRun, params: dict[str, Any]):
    """``planned``'s settings with a trial's values over them, at the same completion budget; a
    ConfigError names the searched setting by its path (tune.space.es_lora.sigma). A searched
    ``split`` ("30x8") sets the population (or group) size and the prompts per member together."""
    method = planned.method
    size = STEP_SIZE[planned.kind]
    values = dict(params)
    where = {name: f"tune.space.{method}.{name}" for name in params}
    if SPLIT in values:
        split = values.pop(SPLIT)
        values[size], values["prompts_per_step"] = parse_split(where[SPLIT], split)
        where[size] = where["prompts_per_step"] = where[SPLIT]
    try:
        config = planned.config.replace(**values)
    except ConfigError as error:
        raise error.located(where) from None
    if size in values or "prompts_per_step" in values:
        shown = params.get(SPLIT, getattr(config, size))
        num_train = len(get_task(config.task, **config.task_options).train_examples())
        prompts = config.prompts_per_step or num_train
        if "prompts_per_step" in values and prompts > num_train:
            raise ValueError(f"{where[size]}: {shown} scores each member on {prompts} prompts, but the task has "
                             f"{num_train} training prompts")
        per_step = getattr(config, size) * min(prompts, num_train)
        length, rest = divmod(planned.budget, per_step)
        if rest or length < 1:
            raise ValueError(f"{where[size]}: {shown} makes {per_step} completions a "
                             f"{'generation' if planned.kind == 'es' else 'step'}, which does not divide the budget "
                             f"of {planned.budget}")
        config = config.replace(**{"num_generations" if planned.kind == "es" else "num_steps": length})
    return config


def check_space(spec: TuneSpec) -> list:
    """Every searched setting checked against its method's config class: a known setting (with the
    nearest name), not one the tuning fixes, and a config built at each end of its range and at each
    of its choices, each within what this machine can hold (``sweep.check_plan_sizes``); and the
    selected key written by every run. Returns those configs (the engine is sized for all of them)."""
    configs = []
    for method, runs in spec.tuning_runs.items():
        planned = runs[0]
        cls = ESConfig if planned.kind == "es" else GRPOConfig
        fields = list(cls.model_fields)
        for parameter in spec.settings.space[method]:
            path = f"tune.space.{method}.{parameter.name}"
            if parameter.name in FIXED:
                raise ValueError(f"{path}: not searched: {FIXED[parameter.name]}")
            if parameter.name not in fields and parameter.name != SPLIT:
                raise ValueError(f"{path}: not one of the {cls.__name__} settings{did_you_mean(parameter.name, fields)}")
            probes = [PlannedRun(f"{path}={value}", method, planned.kind, trial_config(spec, planned, {parameter.name: value}),
                                 planned.budget) for value in parameter.probes()]
            # a searched size this machine cannot hold is refused now, not when a trial draws it
            check_plan_sizes(probes)
            configs += [probe.config for probe in probes]
        configs.append(planned.config)
    if spec.settings.select == "validation/reward":
        for method, runs in spec.tuning_runs.items():
            config = runs[0].config
            if not get_task(config.task, **config.task_options).validation_examples():
                raise ValueError(f"tune.select: validation/reward, but {method}'s task {config.task!r} has no validation "
                                 "examples, so no run writes it: set sweep.common.task_options.num_validation (e.g. 50)")
    return configs


def describe(spec: TuneSpec) -> list[str]:
    """The plan in lines: methods, their spaces, trials, seeds, budget, where it goes."""
    s = spec.settings
    lines = [f"{len(spec.methods)} method(s) x {s.trials} trials x {len(s.seeds)} tuning seed(s) {list(s.seeds)}, "
             f"then the winners on final seeds {list(s.final_seeds)}; {spec.budget} training completions a run; "
             f"selected by {s.select}; into {spec.out}"]
    for method in spec.methods:
        space = ", ".join(f"{p.name} {p.kind} {list(p.choices) if p.kind == 'choice' else [p.low, p.high]}"
                          for p in s.space[method])
        lines.append(f"  {method}: {space}")
    if s.parallel:
        lines.append(f"  at most {s.parallel} trials of a method at once (tune.parallel)")
    if s.long > 1:
        lines.append(f"  then the winners' reruns continued to {s.long} x the budget ({s.long * spec.budget} training "
                     f"completions) in {spec.out / 'long'}")
    if s.control != "none":
        lines.append(f"  control: {s.control}'s winner on the final seeds with fitness_control shuffled, in "
                     f"{spec.out / 'control'}")
    if s.primary:
        lines.append(f"  primary family (Holm): {', '.join(' vs '.join(pair) for pair in s.primary)}"
                     + ("; best_es / best_grpo: the ES / GRPO method whose winner scored highest on "
                        f"{s.select}" if any(m in BEST for pair in s.primary for m in pair) else ""))
    return lines


def with_trials(spec: TuneSpec, trials: int) -> TuneSpec:
    """The spec with another number of trials per method (``--trials``)."""
    return replace(spec, settings=replace(spec.settings, trials=_whole("--trials", trials, 1)))
