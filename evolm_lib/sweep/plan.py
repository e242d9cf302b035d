"""The sweep's spec and plan, before any engine starts: the spec read and checked (`load_sweep_spec`),
the runs planned at equal budgets (`plan_sweep`), what each run's folder holds and what the sweep
will do with it (`plan_actions`), and the wall-time estimate. See `evolm_lib.sweep` for the spec."""
from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..batch import read_yaml_file
from ..config import ConfigError, ESConfig, GRPOConfig, did_you_mean
from ..config_checks import RENAMED_SETTINGS
from ..grid import Step, decide, out_contents, run_folder_state
from ..tasks import get_task

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
    """The settings a section may name (older names of renamed settings too: older specs still read)."""
    fields = ([f for f in ESConfig.model_fields if f in GRPOConfig.model_fields] if section == "common"
              else list((ESConfig if section == "es" else GRPOConfig).model_fields))
    return fields + list(RENAMED_SETTINGS)


def _unknown_keys(path: str, values: dict, fields, what: str) -> list[str]:
    """A problem line for each key of ``values`` that is not one of ``fields``, with the nearest one."""
    return [f"{path}.{key}: not one of {what}{did_you_mean(key, fields)}" for key in values if key not in fields]


def check_sections(sweep: dict, source: str | Path = "the spec") -> None:
    """Every key of sweep.common, sweep.es and sweep.grpo is a setting of its class(es); a ValueError
    names each other one by its path, with the nearest setting."""
    problems = []
    for section, what in SECTIONS.items():
        values = sweep.get(section) or {}
        if not isinstance(values, dict):
            problems.append(f"sweep.{section}: expected a mapping of {what}, got {values!r}")
            continue
        problems += _unknown_keys(f"sweep.{section}", values, _section_fields(section), f"the {what}")
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
            problems += _unknown_keys(f"sweep.{modes}.{name}", values, _section_fields(section), f"the {what} settings")
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
    from ..models import cached_model_dir
    from ..preflight import check_run_sizes

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


RunAction = Step
"""What a sweep does with one planned run's folder, decided before any engine starts (`grid.Step`): its
state is new, finished, unfinished (resumed), changed (its folder holds a run with other settings),
damaged or busy; its action run, finish (a finished run: its held-out scores and KL completed where
missing), resume, overwrite, conflict (left as it is, and the sweep refuses to start), damaged (its
config.yaml is missing: the sweep refuses to start and gives the command that restores it) or skip (busy)."""


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
    folders, summary = out_contents(out)
    points, notebook = [folder.name for folder in folders], summary.get("notebook")
    if points or notebook:
        held = f"points of {Path(notebook).name}" if notebook else "points of a batch"
        listed = f" ({', '.join(points)})" if points else ""
        raise ValueError(f"this folder, {Path(out).resolve()}, holds an `evolm batch`'s {held}{listed}; a sweep would write "
                         "its runs and its summary.csv beside them. The folder is left as it is: give --out another folder")


def plan_actions(plan: list[PlannedRun], out: str | Path, overwrite: Collection[str] = ()) -> list[RunAction]:
    """Each planned run with its folder's state and what the sweep does with it (`grid.run_folder_state`
    and `grid.decide`: a change of budget or cadence extends a run, any other change is a conflict).
    ``overwrite``: METHOD or METHOD/SEED names of the runs to replace (`overwritten_runs`)."""
    check_out_folder(out)
    replace = overwritten_runs(plan, overwrite)
    actions = []
    for run in plan:
        folder = Path(out) / run.name
        what = f"{run.kind}, {run.length} {'generations' if run.kind == 'es' else 'steps'}"
        found = run_folder_state(folder, run.config, run.length)
        action = decide(found.state, run.name in replace, finished="finish")
        again = f"`--overwrite {run.method}/{run.config.seed}`"
        reason = found.reason
        if action == "overwrite":
            listed = ", ".join(map(str, found.changes))
            reason = (f"replaces the run there ({found.reason})" if found.state == "damaged" else
                      f"replaces the run there (was {found.state}{': ' + listed if found.changes else ''})")
        elif found.state == "damaged":
            reason += f"; or {again} starts it again"
        elif found.state == "changed":
            reason += (f"; kept as it is: {again} replaces this run alone, or `--out` another folder runs the new "
                       "settings there")
        elif found.state == "finished":
            reason = "finished (held-out scores and KL completed if missing)"
        actions.append(RunAction(run, folder, found.state, action, "; ".join(filter(None, [what, reason]))))
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
