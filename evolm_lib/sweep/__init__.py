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

Before any engine starts, every run's folder is compared with its planned settings (the planner that
batch, sweep and tune share, ``evolm_lib.grid.run_folder_state``): a folder holding a run made with
other settings is a conflict, listed old -> new, and the sweep refuses to start until ``--out`` names
another folder or ``--overwrite METHOD[/SEED]`` replaces those runs. A replaced run waits beside its folder
(OUT/.<run>.kept-<time>) until its new attempt finishes; an attempt that fails is moved to
OUT/<run>.failed-<time> and the finished run put back.

Usage::

    evolm sweep [SPEC] [--generations G] [--seeds 0,1,2] [--methods es_lora,grpo] [--out DIR]
                [--model NAME] [--max-new-tokens N] [--overwrite METHOD[/SEED]] [--no-kl] [--no-notebook] [--dry-run]

The pieces: ``plan`` (the spec read and checked, the runs planned, what each folder will see, the
time estimate: everything before an engine starts); this module runs the plan (one run after another
through ``evolm_lib.grid.execute``), scores and summarizes.
"""
from __future__ import annotations

import json
import time
from collections.abc import Collection
from pathlib import Path

from ..analysis import method_globs
from ..batch import execute_notebook, read_yaml_file, spec_from_dict, write_summary_files
from ..engines import EngineSizing, make_engine
from ..env import record_placement
from ..grid import BUSY, OK, Outcome, Replacement, execute
from ..train.es import ESRun
from ..scoring import evaluate_adapter, mean_kl_to_base, success
from ..train.grpo import GRPORun
from ..train.model_weights import ModelWeights
from ..runs import (RunFolderBusy, list_checkpoints, load_checkpoint, read_checkpoint_kls, read_jsonl,
                   record_final_metrics, write_jsonl)
from .plan import (
    DEFAULT_SPEC,
    HELDOUT,
    LEARNING_RATE_LIST,
    PlannedRun,
    RunAction,
    SECTIONS,
    SWEEP_KEYS,
    check_equal_budgets,
    check_not_empty,
    check_out_folder,
    check_plan_sizes,
    check_sections,
    estimate_seconds,
    load_sweep_spec,
    overwritten_runs,
    plan_actions,
    plan_sweep,
    run_budget,
    select_methods,
    timing_estimate,
)


# --------------------------------------------------------------------------- running


def make_shared_engine(plan: list[PlannedRun]):
    """One engine for every run: sized for the largest population and LoRA rank (a plan of GRPO runs
    alone, ``--methods grpo``, included)."""
    first = next((run.config for run in plan if run.kind == "es"), plan[0].config)
    sizing = EngineSizing.from_config(first).covering(run.config for run in plan)
    if any(getattr(run.config, "policy_weights", "lora") == "full" for run in plan):
        sizing = sizing.replace(adapter_transfer="in_place")  # GRPO on the model weights writes them in place
    return make_engine(first, sizing=sizing)


def model_weights_of(run) -> ModelWeights | GRPORun | None:
    """What a run moves when it is the model's own weights, with ``serving_base`` and ``replay``: an ES
    run's ``ModelWeights`` (es_mode full/eggroll), a GRPO run itself (policy_weights full); else None."""
    if isinstance(run, GRPORun):
        return run if run.engine_weights is not None else None
    parameters = getattr(run, "parameters", None)
    return parameters if isinstance(parameters, ModelWeights) else None


def _kl_of(engine, run, adapter, kl_settings: dict) -> float:
    """KL(policy || base) on the run's eval prompts: ``adapter``, or with None the engine's own weights
    (es_mode full/eggroll), the base then served from the model folder's weights while it scores."""
    weights = model_weights_of(run)
    return mean_kl_to_base(engine, run.task, adapter, run.eval_examples,
                           num_samples=int(kl_settings.get("num_samples", 4)),
                           temperature=float(kl_settings.get("temperature", 1.0)),
                           max_new_tokens=run.config.max_new_tokens, seed=run.config.seed,
                           serving_base=weights.serving_base if adapter is None and weights is not None else None)


def measure_kl(engine, run, kl_settings: dict) -> float | None:
    """Mean per-token KL of the run's final adapter (or mean weights) to the base model on the eval
    prompts (None: the engine cannot score tokens)."""
    try:
        return _kl_of(engine, run, run.adapter, kl_settings)
    except TypeError as error:  # an engine without token log-probs (HF, synthetic)
        print(f"  no KL: {error}", flush=True)
        return None


def checkpoint_kls(engine, run, kl_settings: dict) -> list[dict]:
    """KL(adapter || base) of every kept checkpoint of a run not yet measured, appended to run_dir/kl.jsonl.
    For es_mode full/eggroll the checkpoints are the weight snapshots' generations (every
    ``checkpoint_every`` and the last), whose means the seed log replays on the engine."""
    path = Path(run.run_dir) / "kl.jsonl"
    done = {json.loads(line)["generation"] for line in path.read_text().splitlines()} if path.exists() else set()
    rows = []

    def record(generation: int, adapter) -> None:
        started = time.perf_counter()
        kl = _kl_of(engine, run, adapter, kl_settings)
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


def score_held_out(engine, run) -> list[dict]:
    """The run's final adapter (or mean weights) scored greedily on every held-out problem, one JSON
    line per problem in run_dir/heldout.jsonl (index, prompt, target, completion, reward, success, and
    the generation or step scored); written atomically, kept when it holds the run's current generation
    (a run extended since is scored again). Returns the lines."""
    path = Path(run.run_dir) / HELDOUT
    if path.exists():
        kept = read_jsonl(path)
        if all(line.get("generation") == run.generation for line in kept):
            return kept
    result = evaluate_adapter(engine, run.task, run.adapter, run.eval_examples,
                              max_new_tokens=run.config.max_new_tokens)
    lines = evaluation_lines(run.eval_examples, result, run.generation)
    write_jsonl(path, lines)
    return lines


def run_one(planned: PlannedRun, out: Path, engine, kl_engine=None, kl_settings: dict | None = None):
    """Run (or resume) one planned run to its end, save its final adapter, record its KL, release its folder."""
    cls = ESRun if planned.kind == "es" else GRPORun
    run = cls.open(planned.config, out / planned.name, engine=engine)
    try:
        if run.generation < planned.length:  # the times in its rows, read with where it ran (an attempt
            record_placement(run.run_dir, planned.config, run.placement())  # that finds the run done writes none)
        run.run(callback=lambda row: print(
            f"  {planned.name} {row['generation']:>4}/{planned.length}  train {row['train/reward_mean']:9.3f}  "
            f"greedy {row.get('policy/train_reward', float('nan')):9.3f}  samples {row['samples/completions']:>6}  "
            f"{row['time/generation_s']:6.1f} s", flush=True))
        run.save_final()
        lines = score_held_out(engine, run)
        share = sum(line["success"] for line in lines) / max(len(lines), 1)
        reward = sum(line["reward"] for line in lines) / max(len(lines), 1)
        print(f"  {planned.name} held-out on {len(lines)} problems: success {share:.3f}, mean reward {reward:.4g}",
              flush=True)
        if kl_settings is not None and kl_settings.get("every_checkpoint"):
            for row in checkpoint_kls(kl_engine or engine, run, kl_settings):
                print(f"  {planned.name} checkpoint {row['generation']}: KL to base {row['policy/kl']:.4g}", flush=True)
        if kl_settings is not None and run.history[-1].get("policy/kl") is None:
            kl = measure_kl(kl_engine or engine, run, kl_settings)
            if kl is not None:
                run.history[-1] = record_final_metrics(run.run_dir, {"policy/kl": kl})
                print(f"  {planned.name} KL to base {kl:.4g}", flush=True)
    finally:
        run.close()  # frees the run folder (a failed run too); the shared engine was passed in and stays open
    return run


class SweepRunFailed(RuntimeError):
    """A run of the sweep raised: one message naming the run, what went wrong and what was kept."""


def run_sweep(plan: list[PlannedRun], out: str | Path, engine=None, kl_engine=None,
              kl_settings: dict | None = None, overwrite: Collection[str] = ()) -> dict[str, float]:
    """Run every planned run into OUT/<name>, one after another (`grid.execute`); returns {name: wall
    seconds}. One engine shared by all. A run whose folder another process writes is left as it is and
    recorded busy (no seconds). ``overwrite``: folder names of runs to replace; each waits in
    OUT/.<name>.kept-<time> until its new attempt finishes, and comes back if the attempt fails
    (`grid.Replacement`). A run that raises stops the sweep with SweepRunFailed (the runs before it kept)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    own = engine is None
    engine = engine or make_shared_engine(plan)

    def attempt(planned: PlannedRun) -> None:
        print(f"{planned.name}: {planned.kind}, {planned.length} {'generations' if planned.kind == 'es' else 'steps'}, "
              f"{planned.budget} training completions", flush=True)
        _attempt(planned, out, planned.name in overwrite, engine, kl_engine, kl_settings)

    def after(planned: PlannedRun, outcome: Outcome) -> None:
        entry = {"run": planned.name, "label": planned.label}
        if outcome.status == BUSY:
            print(f"  {planned.name}: busy, left as it is ({outcome.error})", flush=True)
            entry.update(status="busy", holder=outcome.holder)
        else:
            entry.update(seconds=outcome.seconds, budget=planned.budget)
        with open(out / "sweep_summary.jsonl", "a") as handle:
            handle.write(json.dumps(entry) + "\n")

    try:
        outcomes = execute(plan, attempt, after, keep_going=False)
    finally:
        if own:
            engine.close()
    return {outcome.name: outcome.seconds for outcome in outcomes if outcome.status == OK}


def _attempt(planned: PlannedRun, out: Path, replacing: bool, engine, kl_engine, kl_settings) -> None:
    """One run of the sweep (``replacing``: its folder's run is moved aside first, and back on failure);
    an exception other than RunFolderBusy becomes SweepRunFailed, naming what was kept."""
    replaced = Replacement.begin(out / planned.name, replacing)
    try:
        run_one(planned, out, engine, kl_engine, kl_settings)
    except RunFolderBusy:
        if replaced is not None:
            replaced.abandoned()
        raise
    except Exception as error:  # noqa: BLE001 - reported as one message; the run folders say the rest
        kept = ""
        if replaced is not None:
            failed = replaced.failed()
            kept = f"; the run it was to replace is kept in {replaced.folder}, this attempt moved to {failed.name}"
        raise SweepRunFailed(f"{planned.name}: {type(error).__name__}: {error}{kept}") from error
    if replaced is not None:
        replaced.succeeded()


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
    from ..analysis import folder_settings, method_labels, run_results
    from ..runs import load_run_config

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
