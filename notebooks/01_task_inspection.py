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
# # Task inspection
# Look at a task before training on it: its examples, the chat prompt the model sees, what the
# base model answers, and the rewards those answers get.

# %% tags=["parameters"]
model: str = "smollm2-135m-instruct"  # model name (smollm2-135m-instruct, tiny-random) or a local folder
task: str = "conciseness"  # task from the registry (conciseness, countdown, jsonl)
task_options: str = "{}"  # task options as YAML or JSON, e.g. {num_train: 8} for countdown, {path: my_task.jsonl} for jsonl
num_examples: int = 16  # examples per split (train, eval) to show and score
max_new_tokens: int = 64  # tokens generated per completion
temperature: float = 0.0  # sampling temperature (0: greedy)
seed: int = 0  # sampling seed
max_model_len: int = 512  # longest prompt + completion the engine serves
kv_cache_gb: float = 0.5  # vLLM KV cache size in GiB
engine: str = "vllm"  # rollout engine: vllm (one call per population) or hf (transformers + peft)
verbose: bool = False  # show every engine message (as the environment variable EVOLM_VERBOSE does)
figures_dir: str = "../figures"  # where PNG/PDF/SVG figures go

# %%
import yaml

from evolm_lib.config import ESConfig
from evolm_lib.engines import SamplingSettings, make_engine
from evolm_lib.metrics import completions_table, wrap_table
from evolm_lib.models import resolve_model
from evolm_lib.preflight import check_engine_settings
from evolm_lib.quiet import set_verbose
from evolm_lib.viz.figures import export_figure
from evolm_lib.viz.labels import model_title
from evolm_lib.viz.plots import plot_reward_distribution
from evolm_lib.tasks import get_task

set_verbose(verbose)
config = ESConfig.from_dict(dict(
    model=model, task=task, task_options=yaml.safe_load(task_options) or {}, max_new_tokens=max_new_tokens,
    temperature=temperature, seed=seed, max_model_len=max_model_len, kv_cache_gb=kv_cache_gb, engine=engine,
))
print(yaml.safe_dump({key: config.to_dict()[key] for key in (
    "model", "task", "task_options", "engine", "max_new_tokens", "temperature", "seed")}, sort_keys=False))

# %% [markdown]
# The examples: train (what the optimiser sees) and eval (held out).

# %%
task_instance = get_task(config.task, **config.task_options)
examples = [("train", e) for e in task_instance.train_examples()[:num_examples]]
examples += [("eval", e) for e in task_instance.eval_examples()[:num_examples]]
wrap_table(completions_table({"split": split, "prompt": e.prompt, "target": e.target, **e.data} for split, e in examples))

# %% [markdown]
# The engine's limits, checked against the model and this machine before it starts (context
# length, KV cache, memory), then the chat prompt exactly as the model sees it (chat template
# applied, special tokens included).

# %%
check_engine_settings(config, resolve_model(config.model), task_instance)

# %%
inference_engine = make_engine(config, max_loras=1)
rendered_prompt = inference_engine.encoder.render(task_instance.prompt(examples[0][1]))
print(rendered_prompt)

# %% [markdown]
# Base-model completions for every example, in one engine call (`None` = no adapter).

# %%
sampling = SamplingSettings(max_new_tokens=config.max_new_tokens, temperature=config.temperature, seed=config.seed)
completions = inference_engine.generate([task_instance.prompt(e) for _, e in examples], [None], sampling)[0]
inference_engine.close()
results = [task_instance.reward(c.text, e) for c, (_, e) in zip(completions, examples)]
wrap_table(completions_table(
    ({"split": split, "prompt": e.prompt, "target": e.target, "completion": c.text, "tokens": c.num_tokens,
      "finish": c.finish_reason, "reward": r.value, **r.details}
     for (split, e), c, r in zip(examples, completions, results)),
    max_chars=None,
))

# %% [markdown]
# How the base model's rewards are spread: the room ES has to improve.

# %%
rewards = [r.value for r in results]
distribution = plot_reward_distribution(rewards, title=model_title(f"Base-model rewards on {task}", model),
                                        reward_label=task_instance.reward_label)
figure_paths = export_figure(distribution, "task_inspection_rewards", figures_dir)
distribution
