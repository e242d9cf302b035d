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
# # GRPO stepper
# Fine-tune a LoRA adapter with GRPO, one step at a time: G sampled completions per prompt from the
# engine, group-relative advantages, an AdamW update of the LoRA tensors. The loop below runs
# `num_steps` (as papermill does) and draws the reward of every step as it lands. Every `GRPOConfig`
# setting can be set: the common ones below by name, any other through `settings`.

# %% tags=["parameters", "settings:grpo"]
model: str = "smollm2-135m-instruct"  # model name (smollm2-135m-instruct, tiny-random) or a local folder
task: str = "conciseness"  # task from the registry (conciseness, arithmetic, countdown, jsonl)
task_options: str = "{}"  # task options as YAML or JSON, e.g. {operations: "+", digits: 2} for arithmetic, {num_train: 8} for countdown, {path: my_task.jsonl} for jsonl
group_size: int = 4  # sampled completions per prompt (G); advantages compare a completion with its group
num_steps: int = 2  # steps to run in total
learning_rate: float = 0.001  # AdamW step size on the LoRA tensors
loss_type: str = "grpo_clip"  # grpo_clip (clipped ratio), reinforce_with_baseline or no_baseline
normalize_by_std: bool = True  # divide advantages by the group's std (GRPO); False: mean-centred only (Dr. GRPO)
beta: float = 0.0  # weight of the KL penalty to the base model (0: none, and no reference pass)
lora_rank: int = 1  # LoRA rank
init_scheme: str = "peft_default"  # peft_default (B starts at 0) or random_ab
max_new_tokens: int = 16  # tokens generated per completion
temperature: float = 1.0  # sampling temperature of the rollouts (> 0: a greedy group has no spread)
prompts_per_step: int = 2  # train prompts per step, drawn by seed (0: all)
micro_batch_size: int = 0  # rollouts per forward/backward pass (0: one group)
eval_every: int = 1  # score the adapter greedily on train and eval prompts every k steps
seed: int = 0  # master seed (prompt order, sampling)
max_model_len: int = 512  # longest prompt + completion the engine serves
kv_cache_gb: float = 0.5  # vLLM KV cache size in GiB (None: from gpu_memory_utilization)
gpu_memory_utilization: float = None  # vLLM share of GPU memory when kv_cache_gb is None (None: room for the policy beside the engine)
engine: str = "vllm"  # rollout engine: vllm or hf (transformers + peft)
init_adapter_dir: str = ""  # start from this saved adapter from 02_lora_initialization (empty: fresh init)
run_dir: str = ""  # run folder (empty: runs/notebooks/06_grpo_stepper-<hash of the settings>: changed settings start a new run, the same ones resume)
resume: bool = True  # continue the run in run_dir if it has the same settings
overwrite: bool = False  # replace a run in run_dir instead of refusing
figures_dir: str = "../figures"  # where PNG/PDF/SVG figures go
verbose: bool = False  # show every engine message (as the environment variable EVOLM_VERBOSE does)
settings: dict = {}  # any GRPOConfig setting by name, over the parameters above, e.g. {max_grad_norm: 0.5, epochs_per_batch: 2, dtype: bfloat16}

# %%
from evolm_lib.config import GRPOConfig
from evolm_lib.lora import load_adapter
from evolm_lib.metrics import completions_table
from evolm_lib.parameters import notebook_config, open_notebook_run
from evolm_lib.quiet import set_verbose
from evolm_lib.train.grpo import GRPORun
from evolm_lib.viz.figures import export_figure
from evolm_lib.viz.labels import model_title
from evolm_lib.viz.live import live_fitness_plot
from evolm_lib.viz.plots import plot_fitness, plot_time_breakdown

set_verbose(verbose)
config = notebook_config(GRPOConfig, globals())  # the parameters above by name, then `settings` over them
print(config.to_yaml())

# %% [markdown]
# Open the run: resume it when `run_dir` holds one with the same settings, else create it (this
# starts the engine, loads the policy model for the updates and scores the initial adapter as step 0).
# Run All again in this kernel closes the run opened before and resumes it; the default folder is
# named by the settings, so changed settings start a new run beside it.

# %%
run = open_notebook_run(GRPORun, config, "06_grpo_stepper", run_dir, resume=resume, overwrite=overwrite,
                        initial_adapter=load_adapter(init_adapter_dir) if init_adapter_dir else None)
print(f"{run.run_dir}: step {run.generation}, {run.adapter.num_parameters():,} LoRA parameters")

# %% [markdown]
# The live plot: the rollouts' mean reward per step with its 20-80 percentile band and best, and the
# greedy reward of the adapter on the train (line) and eval prompts (diamonds) when scored.

# %%
reward_plot = live_fitness_plot(title=model_title(f"GRPO on {config.task}", config.model), reward_label=run.task.reward_label)
reward_plot.update(run.history)
reward_plot

# %% [markdown]
# One step is `run.step()`: rollouts (G samples per prompt in one engine call), rewards, advantages,
# the AdamW update, the greedy scoring when due, then checkpoint and metrics line. Rerun this cell to
# continue after raising `num_steps` (or interrupting it): the loop starts at the run's current step.

# %%
for step in range(run.generation, config.num_steps):
    row = run.step()
    reward_plot.update(run.history)
    print(f"step {row['generation']:>3}/{config.num_steps}  rollout reward {row['train/reward_mean']:8.3f}"
          + (f"  greedy train {row['policy/train_reward']:8.3f}  eval {row['eval/reward']:8.3f}" if "eval/reward" in row else "")
          + f"  {row['time/generation_s']:6.1f} s", flush=True)

# %%
final_adapter = run.save_final()
final_adapter

# %%
reward = plot_fitness(run.history, title=model_title(f"GRPO on {config.task}", config.model), reward_label=run.task.reward_label)
figure_paths = export_figure(reward, "grpo_stepper_reward", figures_dir)  # grpo_stepper_reward.{png,pdf,svg}
reward

# %%
plot_time_breakdown(run.history, title="Time per step")

# %%
completions_table(
    {"prompt": example.prompt, "target": example.target, "adapter (greedy)": completion}
    for example, completion in zip(run.train_examples, run.history[-1]["policy/train_completions"])
)
