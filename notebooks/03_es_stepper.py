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
# # ES stepper
# Fine-tune a LoRA adapter with Evolution Strategies, one generation at a time: step it with the
# buttons in JupyterLab, or let the loop below run `num_generations` (as papermill does). Every
# `ESConfig` setting can be set: the common ones below by name, any other through `settings`.

# %% tags=["parameters", "settings:es"]
model: str = "smollm2-135m-instruct"  # model name (smollm2-135m-instruct, tiny-random) or a local folder
task: str = "conciseness"  # task from the registry (conciseness, arithmetic, countdown, jsonl)
task_options: str = "{}"  # task options as YAML or JSON, e.g. {operations: "+", digits: 2} for arithmetic, {num_train: 8} for countdown, {path: my_task.jsonl} for jsonl
population_size: int = 4  # members per generation (even: antithetic pairs)
num_generations: int = 2  # generations to run in total
sigma: float = 0.05  # noise std on LoRA weights
learning_rate: float = 0.2  # ES step size
fitness_shaping: str = "centered_ranks"  # centered_ranks, z_score, per_prompt or raw
noise_mode: str = "uniform"  # uniform sigma, or per_layer (sigma x mean |W| of each layer)
lora_rank: int = 1  # LoRA rank
init_scheme: str = "peft_default"  # peft_default (B starts at 0) or random_ab
max_new_tokens: int = 16  # tokens generated per completion
temperature: float = 0.0  # sampling temperature for the population (0: greedy)
prompts_per_step: int = 0  # train prompts per generation, drawn by seed (0: all)
eval_every: int = 1  # score the mean adapter on train and eval prompts every k generations
seed: int = 0  # master seed (noise, prompt order, sampling)
max_model_len: int = 512  # longest prompt + completion the engine serves
kv_cache_gb: float = 0.5  # vLLM KV cache size in GiB (None: from gpu_memory_utilization)
gpu_memory_utilization: float = None  # vLLM share of GPU memory when kv_cache_gb is None (None: the engine default, 0.6 on a GPU)
engine: str = "vllm"  # rollout engine: vllm (one call per population) or hf (transformers + peft)
adapter_transfer: str = "in_place"  # vllm: members written into resident LoRA slots (in_place) or as adapter files
estimator: str = ""  # empty: ES with fitness_shaping; or a zeroth-order estimator over the seeds (e.g. zoar)
engine_host: str = "local"  # local (one engine in this kernel) or ray (num_engines Ray actors)
num_engines: int = 1  # engine_host ray: engines the population is sharded over (one GPU each)
ray_address: str = ""  # engine_host ray: the address `ray start --head` printed (empty: a local cluster)
init_adapter_dir: str = ""  # start from this saved adapter from 02_lora_initialization (empty: fresh init)
run_dir: str = ""  # run folder (empty: runs/notebooks/03_es_stepper-<hash of the settings>: changed settings start a new run, the same ones resume)
resume: bool = True  # continue the run in run_dir if it has the same settings
overwrite: bool = False  # replace a run in run_dir instead of refusing
figures_dir: str = "../figures"  # where PNG/PDF/SVG figures go
verbose: bool = False  # show every engine message (as the environment variable EVOLM_VERBOSE does)
settings: dict = {}  # any ESConfig setting by name, over the parameters above, e.g. {optimizer: adam, dtype: bfloat16, noise_device: cuda}

# %%
from evolm_lib.config import ESConfig
from evolm_lib.lora import load_adapter
from evolm_lib.metrics import completions_table
from evolm_lib.parameters import notebook_config, open_notebook_run
from evolm_lib.quiet import set_verbose
from evolm_lib.train.es import ESRun
from evolm_lib.viz.labels import model_title
from evolm_lib.viz.plots import plot_fitness, plot_time_breakdown
from evolm_lib.viz.stepper import ESStepper

set_verbose(verbose)
config = notebook_config(ESConfig, globals())  # the parameters above by name, then `settings` over them
print(config.to_yaml())

# %% [markdown]
# Open the run: resume it when `run_dir` holds one with the same settings, else create it (this
# starts the engine and scores the initial adapter as generation 0). Run All again in this kernel
# closes the run opened before and resumes it; the default folder is named by the settings, so
# changed settings start a new run beside it.

# %%
run = open_notebook_run(ESRun, config, "03_es_stepper", run_dir, resume=resume, overwrite=overwrite,
                        initial_adapter=load_adapter(init_adapter_dir) if init_adapter_dir else None)
print(f"{run.run_dir}: generation {run.generation}")

# %% [markdown]
# The controls: **Step** runs one generation, **Run N** runs N more in the background (**Pause**
# stops after the current one), **Save checkpoint** writes one now. The plot and the table of
# best and worst completions update as generations finish; after every Step or Run N the fitness
# figure in `figures_dir` is written again, so the files follow the run.

# %%
stepper = ESStepper(run, figures_dir=figures_dir)
stepper

# %% [markdown]
# The loop: one generation is ask for members (seeds), evaluate them in one engine call (where the
# engine batches, the same call scores the mean that produced the generation when due), tell the
# update (the generation's metrics row), score the new mean when it needs a call of its own (the
# last generation, or engines that serve one grid per call), and commit (checkpoint, then the
# metrics line). A committed row is final. `run.step()` and `run.run()` do exactly this; headless
# (papermill) this cell runs up to `config.num_generations` (nothing when the run is already there,
# or past it after more Steps).

# %%
for generation in range(run.generation, config.num_generations):
    members = run.ask()  # integer seeds and signs
    result = run.evaluate(members)  # ONE engine call: the members written from their seeds
    row = run.tell(members, result)  # the update; the generation's metrics row
    row.update(run.score())  # the new mean's scores, when due in a call of its own
    run.commit(row)  # checkpoint, then the metrics line
    stepper.show(row)  # redraw the plot and the table, print one line

# %%
final_adapter = run.save_final()
final_adapter

# %%
fitness = plot_fitness(run.history, title=model_title(f"ES on {config.task}", config.model), reward_label=run.task.reward_label)
fitness

# %%
figure_paths = stepper.export_figure()  # es_stepper_fitness.{png,pdf,svg}; the stepper rewrites them after each Step
figure_paths

# %%
plot_time_breakdown(run.history)

# %%
completions_table(
    {"prompt": example.prompt, "target": example.target, "mean adapter (greedy)": completion}
    for example, completion in zip(run.train_examples, run.history[-1]["policy/train_completions"])
)
