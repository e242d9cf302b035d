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
# # Tuning every method the same way
# Each method of a sweep spec gets the same number of Optuna trials over its own search space, at the
# same completion budget; a trial is scored by its final mean's greedy reward on the task's
# validation questions, never on the held-out ones. Each method's best setting is then rerun on
# fresh seeds and scored on the held-out problems, and the methods are compared across those seeds.
# `evolm tune SPEC` does the same from a shell, with several workers sharing the study.
#
# The defaults tune ES and GRPO on the tiny-random model with two trials each (its numbers mean
# nothing: a check that every step runs); give `spec` a real study's file for real results. The
# study continues when this notebook runs again on the same `out`.

# %% tags=["parameters"]
spec_path: str = "../papermill_runs/tune_tiny.yaml"  # sweep spec with a tune: section, relative to the kernel's working directory
out: str = "../runs/tune_notebook"  # folder of the studies (optuna.db), trials and reruns
trials: int = 2  # trials per method (0: the spec's tune.trials)
figures_dir: str = "../runs/tune_notebook/figures"  # where PNG/SVG figures go

# %%
import optuna
import pandas as pd

from evolm_lib import tune
from evolm_lib.viz.tuning import (export_tuning_figures, plot_best_so_far, plot_parameter_importances,
                                  plot_parameter_slices)

spec = tune.load_tune_spec(spec_path, out=out)
spec = tune.with_trials(spec, trials) if trials else spec
optuna.logging.set_verbosity(optuna.logging.WARNING)  # a line per study opened says nothing here
print("\n".join(tune.describe(spec)))

# %% [markdown]
# ## The trials: one engine for all of them

# %%
engine = tune.make_tuning_engine(spec)
ran = tune.tune(spec, engine)
ran

# %%
trials_by_method = {method: tune.study_trials(spec, method) for method in spec.methods}
pd.DataFrame([{k: t[k] for k in ("method", "number", "state", "value", "params", "seconds")}
              for rows in trials_by_method.values() for t in rows])

# %% [markdown]
# ## Best validation score so far, per method

# %%
plot_best_so_far(trials_by_method, spec.settings.select)

# %% [markdown]
# ## Each setting's effect: Optuna's slice and importance plots

# %%
studies = {method: tune.load_study(spec, method) for method in spec.methods}
for method, study in studies.items():
    plot_parameter_slices(study).update_layout(title=f"{method}: score against each setting").show()
    if len(trials_by_method[method]) >= 2:
        plot_parameter_importances(study).update_layout(title=f"{method}: importance of each setting").show()

# %% [markdown]
# ## The winners on the final seeds, scored on the held-out problems

# %%
tune.run_finals(spec, engine)
engine.close()
summary = tune.summarize(spec)
print("\n".join(tune.summary_lines(summary)))
pd.DataFrame(summary["final"])

# %%
pd.DataFrame(summary["comparisons"])

# %%
try:
    paths = export_tuning_figures(trials_by_method, studies, figures_dir, spec.settings.select)
    print(f"{len(paths)} figure files in {figures_dir}")
except RuntimeError as error:  # no chromium for static export
    print(error)
