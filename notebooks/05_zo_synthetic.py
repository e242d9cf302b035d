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
# # Zeroth-order estimators on synthetic functions
# The estimators that the LLM ES runner can use (`evolm_lib.zo`), compared where a run takes
# milliseconds and the true gradient is known: one test function and dimension, every estimator at
# the same number of function evaluations (queries), several seeds. `fo` (the exact gradient, charged
# `num_queries` queries a step) shows what the update rule does with a perfect estimate.
#
# Everything minimises f. `evolm batch papermill_runs/zo_synthetic.yaml` runs the
# standard grid: the five functions at d = 1,000, three seeds each.

# %% tags=["parameters"]
function: str = "rosenbrock"  # test function: ackley, levy, rosenbrock, quadratic or rastrigin
dimension: int = 1000  # number of variables (up to 10,000; xnes costs O(d^2) a step)
estimators: str = "fo,es,vanilla,rl,zoo,reinforce,twopoint,zoar,zoar_0,zohs,zohs_expavg,relizo,xnes,sepcmaes"  # comma-separated estimator names
num_seeds: int = 3  # runs per estimator, seeds 0, 1, ... (start point and perturbations)
query_budget: int = 5000  # function evaluations per run, the same for every estimator
num_queries: int = 10  # queries per generation (xnes and sepcmaes: the population size)
mu: float = 0.05  # perturbation scale (smoothing radius); xnes and sepcmaes start with this step size
num_histories: int = 5  # past generations reused by zoar and averaged by zohs
baseline: str = "single"  # zoo and reinforce baseline: single (f(x), one more query) or average (mean of the queries)
update_rule: str = "radazo"  # update rule of the gradient estimators: sgd, adam or radazo
learning_rate: float = 0.001  # step size of the update rule
bias_correction: bool = False  # Adam-style bias correction of m and v (the reference code has none)
band: str = "minmax"  # band over seeds: minmax or std (of log f)
figures_dir: str = "../figures"  # where PNG/PDF/SVG figures go

# %%
from evolm_lib.viz.figures import export_figure
from evolm_lib.zo.plots import plot_f_vs_queries, plot_final_values
from evolm_lib.zo.run import ComparisonConfig, final_table, run_comparison

config = ComparisonConfig.from_dict(dict(
    function=function, dimension=dimension, estimators=estimators, num_seeds=num_seeds, query_budget=query_budget,
    num_queries=num_queries, mu=mu, num_histories=num_histories, baseline=baseline, update_rule=update_rule,
    learning_rate=learning_rate, bias_correction=bias_correction,
))
figure_stem = f"zo_{function}_d{dimension}"
figure_paths = []
config

# %% [markdown]
# Every estimator on every seed, until the next step would exceed the budget. One line per run:
# f at the start and at the end, steps taken, seconds.

# %%
history = run_comparison(config)

# %% [markdown]
# Start and final f per estimator over the seeds, best first; `queries` is the most any run used.

# %%
summary = final_table(history)
summary

# %% [markdown]
# f at the current point against the queries used: the geometric mean over seeds, and the band over
# seeds. f at the current point is logged after every step and is not counted as a query.

# %%
f_vs_queries = plot_f_vs_queries(history, band=band)
figure_paths += export_figure(f_vs_queries, f"{figure_stem}_f_vs_queries", figures_dir)
f_vs_queries

# %% [markdown]
# The final f of every run at the equal budget, one marker per seed; the dotted line is the start.

# %%
final_values = plot_final_values(history)
figure_paths += export_figure(final_values, f"{figure_stem}_final_f", figures_dir)
final_values
