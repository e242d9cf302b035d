# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     notebook_metadata_filter: kernelspec,jupytext
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # ES vs GRPO
# Compare finished ES and GRPO run folders: held-out accuracy per method with 95 % bootstrap intervals
# and whether two methods differ by more than seed noise, reward per sample and per second, reward
# against KL to the base model, spread across seeds, completions side by side, and the reward at an
# equal budget. ES runs are labelled by what they moved: `es` (a LoRA adapter), `es eggroll`, `es full`.
#
# The defaults show the tiny fixture runs in `tests/data/es_vs_grpo/` (tiny-random with a synthetic
# engine, and hand-made held-out scores: their numbers mean nothing); point `es_runs` and `grpo_runs`
# at your own, e.g. the folders `evolm sweep` writes to `runs/es_vs_grpo/`. Either may be empty: the
# notebook then shows the other method alone. The last section compares two runs' solutions: how far
# each moved the weights, in which direction, the straight path between them and the drift off the task
# (`geometry_runs`).

# %% tags=["parameters"]
es_runs: str = "../tests/data/es_vs_grpo/es_*"  # glob of ES run folders, relative to the kernel's working directory (empty: none)
grpo_runs: str = "../tests/data/es_vs_grpo/grpo_*"  # glob of GRPO run folders (empty: none)
reward_key: str = "policy/train_reward"  # reward drawn against samples and time (greedy, current adapter)
eval_key: str = "eval/reward"  # final reward of the KL scatter, the seed spread and the equal-budget table
budget_key: str = "samples/completions"  # sample count: samples/completions or samples/tokens
kl_key: str = "policy/kl"  # KL of the final adapter to the base model, as recorded by the sweep script
band: str = "minmax"  # band across seeds: minmax or std
num_examples: int = 4  # held-out prompts shown side by side
measure: str = ""  # held-out score of a run: success (share of problems solved) or reward (mean task reward); empty: the task's own (reward for conciseness, success for arithmetic and countdown)
allow_mixed: bool = False  # compare runs with different models, tasks or LoRA layouts anyway
figures_dir: str = "../figures"  # where PNG/PDF/SVG figures go
geometry_runs: str = ""  # two run folders, A then B, comma-separated (e.g. es full and grpo full of one model) whose solutions are compared (empty: no geometry section)
geometry_points: int = 5  # points of the straight path from A to B, both ends included
kl_samples: int = 1  # samples per held-out prompt for KL to the base model along the path (0: no KL)
off_task: str = "conciseness"  # another task's name, or a JSONL file of prompts, for the drift off the task
geometry_dtype: str = "bfloat16"  # dtype in which "changed at all" is counted (the engine's on a GPU)

# %%
from evolm_lib.analysis import (
    checkpoint_points,
    default_measure,
    describe_runs,
    equal_budget_comparisons,
    equal_budget_table,
    final_points,
    heldout_table,
    load_runs,
    method_comparisons,
    reward_label,
    runs_for_plots,
    seed_spread_table,
    side_by_side_completions,
    split_points_by_kl,
    study_table,
)
from evolm_lib.metrics import wrap_table
from evolm_lib.viz.figures import export_figure
from evolm_lib.viz.labels import model_note, note_model
from evolm_lib.viz.plots import (
    plot_heldout,
    plot_reward_vs_kl,
    plot_reward_vs_samples,
    plot_reward_vs_time,
    plot_seed_spread,
)

groups = load_runs([es_runs, grpo_runs], allow_mixed=allow_mixed)
runs = runs_for_plots(groups)
reward_definition = reward_label(groups)  # the task's reward in words, for the axes
figure_paths = []
models = {run.config.get("model") for group in groups.values() for run in group}
print(model_note(models) or f"models: {', '.join(sorted(map(str, models)))}")
describe_runs(groups)

# %% [markdown]
# ## The study
# Each run's final mean adapter (ES) or policy (GRPO), scored greedily on the held-out problems
# (`heldout.jsonl`, written by `evolm sweep`). Per method: the mean across seeds of each run's score
# with a 95 % percentile bootstrap interval across seeds, the spread across seeds, each seed's score
# with its interval over problems, KL to the base model, seconds per generation or step, and the
# training completions (equal budgets). Runs without held-out scores are left out, and named.

# %%
measure = measure or default_measure(groups)
study = study_table(groups, measure=measure)
runs_heldout = heldout_table(groups, measure=measure)
print(study.attrs["note"] or f"{len(study)} methods with held-out scores ({measure})")
study

# %% [markdown]
# Is a difference larger than seed noise? For every pair of methods: the difference of the means,
# its bootstrap interval, and a two-sided permutation test over seed labels (every split of the
# seeds into the two methods; with 5 seeds each the smallest possible p is 2/252 = 0.008, with 2
# seeds each 1/3, so 2 seeds can never show it). "yes" where p < 0.05; Welch's t for reference.

# %%
comparisons = method_comparisons(groups, measure=measure)
comparisons

# %% [markdown]
# Held-out score per method: each seed's score with its 95 % interval over problems (thin bars), and
# the mean across seeds with its 95 % interval across seeds (diamond, thick bars).

# %%
if len(study):
    heldout_figure = note_model(plot_heldout(runs_heldout, study, y=study.attrs["key"], reward_label=reward_definition), models)
    figure_paths += export_figure(heldout_figure, "es_vs_grpo_heldout", figures_dir)
    display(heldout_figure)

# %% [markdown]
# Reward of the current adapter (greedy) against the training completions used so far: the mean
# across seeds, with the band across seeds.

# %%
reward_vs_samples = note_model(plot_reward_vs_samples(runs, x=budget_key, y=reward_key, band=band,
                                                     reward_label=reward_definition), models)
figure_paths += export_figure(reward_vs_samples, "es_vs_grpo_reward_vs_samples", figures_dir)
reward_vs_samples

# %% [markdown]
# The same reward against wall-clock seconds (engine start excluded).

# %%
reward_vs_time = note_model(plot_reward_vs_time(runs, y=reward_key, band=band, reward_label=reward_definition), models)
figure_paths += export_figure(reward_vs_time, "es_vs_grpo_reward_vs_time", figures_dir)
reward_vs_time

# %% [markdown]
# Final held-out reward against the KL of the final adapter to the base model, one marker per run;
# the dashed line is the Pareto front (more reward for less drift). Runs without a recorded KL are
# left out, with a note.

# %%
points, kl_note = split_points_by_kl(final_points(groups, reward_key=eval_key, kl_key=kl_key))
print(kl_note or f"{len(points)} runs with a KL")
reward_vs_kl = note_model(plot_reward_vs_kl(points, reward_key=eval_key, reward_label=reward_definition), models)
figure_paths += export_figure(reward_vs_kl, "es_vs_grpo_reward_vs_kl", figures_dir)
reward_vs_kl

# %% [markdown]
# The same, checkpoint by checkpoint, where `evolm sweep` measured every checkpoint's KL
# (`kl.jsonl`, written only when the sweep's spec sets `kl: {every_checkpoint: true}`): each run's
# path through reward and drift, to compare the methods at equal reward.

# %%
path_points = checkpoint_points(groups, reward_key=eval_key)
print(f"{len(path_points)} checkpoints with a KL" if path_points else "no checkpoint KLs in these runs (evolm sweep measures them with kl: {every_checkpoint: true} in its spec)")
if path_points:
    reward_vs_kl_paths = note_model(plot_reward_vs_kl(path_points, reward_key=eval_key, reward_label=reward_definition), models)
    figure_paths += export_figure(reward_vs_kl_paths, "es_vs_grpo_reward_vs_kl_checkpoints", figures_dir)
    display(reward_vs_kl_paths)

# %% [markdown]
# Spread across seeds of the final held-out reward: every seed and the mean (a box from 5 seeds up);
# with ES runs among them, the table gives the ratio of ES's std (LoRA ES's, where there are several
# ES modes) to each method's.

# %%
seed_spread = note_model(plot_seed_spread(runs, y=eval_key, reward_label=reward_definition), models)
figure_paths += export_figure(seed_spread, "es_vs_grpo_seed_spread", figures_dir)
seed_spread

# %%
spread = seed_spread_table(groups, key=eval_key)
spread

# %% [markdown]
# Final greedy completions of every run for the same held-out prompts: one row per prompt and run,
# so the table stays as wide as the screen however many runs there are.

# %%
completions = side_by_side_completions(groups, example_index=range(num_examples), max_chars=None)
completions = completions.melt(id_vars=["prompt", "target"], var_name="run", value_name="final greedy completion",
                               ignore_index=False).sort_index(kind="stable").reset_index(drop=True)
wrap_table(completions, max_width="32em")

# %% [markdown]
# The fair comparison: each method's held-out reward at the largest sample count every run
# reached, interpolated between logged points (a method that ran longer gets no credit for it).

# %%
equal_budget = equal_budget_table(groups, budget_key=budget_key, reward_key=eval_key)
equal_budget

# %% [markdown]
# At that budget, is a difference between methods larger than seed noise? The same test as above
# (permutation over seed labels), on each run's interpolated reward: it covers runs that stopped
# before their budget, which the held-out table leaves out.

# %%
equal_budget_tests = equal_budget_comparisons(groups, budget_key=budget_key, reward_key=eval_key)
equal_budget_tests

# %% [markdown]
# ## The geometry of two solutions
# What two runs changed in the model (`geometry_runs`: A then B), after Hoy, Wang & Pan 2026: each update as a
# full weight difference from the base model (a LoRA's merged `B A * scaling`, or the moved weights), its
# Frobenius norm per layer and the share of weights that changed at all in `geometry_dtype`; the cosine
# between the two updates; the held-out reward and KL to the base model along the straight path
# `(1 - t) theta_A + t theta_B`, served by one engine with the weights written in place, and its barrier
# (the largest drop below the line between the ends); and the drift: KL to the base model on another
# task's prompts (`off_task`), per checkpoint.

# %%
geometry_figures = []
if geometry_runs:
    import pandas as pd

    from evolm_lib.engines import EngineSizing, make_engine
    from evolm_lib.geometry import (interpolation_path, load_solution, off_task_drift, off_task_source, path_barrier,
                                    summarize, update_cosine, update_table)
    from evolm_lib.runs import load_run_config
    from evolm_lib.tasks import get_task
    from evolm_lib.viz.geometry import plot_drift, plot_path, plot_update_norms

    folders = [folder.strip() for folder in geometry_runs.split(",")]
    if len(folders) != 2:
        raise ValueError(f"geometry_runs: two run folders, A,B; got {folders}")
    drift_task = off_task_source(off_task)  # a missing file fails here, before any engine starts
    solutions = [load_solution(folder) for folder in folders]
    tables = {s.label: update_table(s.weights, s.base, geometry_dtype) for s in solutions}
    update_summary = pd.DataFrame([{"run": label, **summarize(rows)} for label, rows in tables.items()]).set_index("run")
    display(update_summary)

# %%
if geometry_runs:
    norms = plot_update_norms({label: summarize(rows, by="layer") for label, rows in tables.items()})
    geometry_figures += export_figure(norms, "geometry_update_norms", figures_dir)
    by_module = pd.concat({label: pd.DataFrame(summarize(rows, by="module")).set_index("module")
                           for label, rows in tables.items()}, names=["run"])
    display(norms, by_module)

# %%
if geometry_runs:
    cosine = update_cosine(solutions[0].delta, solutions[1].delta)
    cosines = pd.Series({"overall": cosine["overall"], **{f"layer {k}": v for k, v in cosine["per_layer"].items()}},
                        name=f"cosine({solutions[0].label}, {solutions[1].label})")
    display(cosines.to_frame().T)  # NaN: an update of no length (e.g. ES whose members all scored alike) has no direction

# %%
if geometry_runs:
    config_a = load_run_config(folders[0])
    # the weights are written in place: an engine with the worker extension (in_place), whatever A's method
    engine = make_engine(config_a, sizing=EngineSizing.from_config(config_a).replace(adapter_transfer="in_place"))
    path_rows = interpolation_path(engine, solutions[0], solutions[1], get_task(config_a.task, **config_a.task_options),
                              geometry_points, max_new_tokens=config_a.max_new_tokens, kl_samples=kl_samples)
    barrier = path_barrier([r["t"] for r in path_rows], [r["eval/reward"] for r in path_rows])
    path_figure = plot_path(path_rows, (solutions[0].label, solutions[1].label), barrier)
    geometry_figures += export_figure(path_figure, "geometry_path", figures_dir)
    display(path_figure, pd.DataFrame(path_rows).set_index("t"))

# %%
if geometry_runs:
    drift = {s.label: off_task_drift(engine, folder, drift_task, num_samples=max(kl_samples, 1))
             for s, folder in zip(solutions, folders)}
    engine.close()
    drift_figure = plot_drift(drift, drift_task.name)
    geometry_figures += export_figure(drift_figure, "geometry_drift", figures_dir)
    display(drift_figure)
