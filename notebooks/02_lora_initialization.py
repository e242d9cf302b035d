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
# # LoRA initialization
# Choose where the adapters go (target modules, rank) and how they start (init scheme), see the
# per-layer scales, and how diverse a first population is under each init scheme.

# %% tags=["parameters"]
model: str = "smollm2-135m-instruct"  # model name (smollm2-135m-instruct, tiny-random) or a local folder
task: str = "conciseness"  # task whose train prompts the population answers
task_options: str = "{}"  # task options as YAML or JSON, e.g. {num_train: 8} for countdown, {path: my_task.jsonl} for jsonl
target_modules: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # comma-separated modules with adapters
lora_rank: int = 1  # LoRA rank
init_scheme: str = "peft_default"  # scheme of the adapter saved for the stepper: peft_default or random_ab
init_scale: float = 0.1  # random_ab: std of A and B as a multiple of the layer's mean |W|
sigma: float = 0.05  # noise std on LoRA weights
noise_mode: str = "uniform"  # uniform sigma, or per_layer (sigma x mean |W| of each layer)
population_size: int = 4  # members of the sample population per scheme
max_new_tokens: int = 32  # tokens generated per completion
seed: int = 0  # seed of the adapter init and the noise
max_model_len: int = 512  # longest prompt + completion the engine serves
kv_cache_gb: float = 0.5  # vLLM KV cache size in GiB
engine: str = "vllm"  # rollout engine: vllm (one call per population) or hf (transformers + peft)
init_adapter_dir: str = "../runs/notebooks/init_adapter"  # where the chosen initial adapter is saved
verbose: bool = False  # show every engine message (as the environment variable EVOLM_VERBOSE does)
figures_dir: str = "../figures"  # where PNG/PDF/SVG figures go

# %%
import pandas as pd
import yaml

from evolm_lib import es
from evolm_lib.config import ESConfig
from evolm_lib.engines import make_engine
from evolm_lib.scoring import preview_population
from evolm_lib.lora import (
    adapter_shapes, base_weight_magnitudes, init_adapter, layer_of, module_of,
    noise_scales, save_adapter,
)
from evolm_lib.models import resolve_model
from evolm_lib.metrics import completions_table, wrap_table
from evolm_lib.preflight import check_engine_settings
from evolm_lib.quiet import set_verbose
from evolm_lib.viz.figures import export_figure
from evolm_lib.viz.labels import model_note
from evolm_lib.viz.plots import plot_layer_scales
from evolm_lib.tasks import get_task

set_verbose(verbose)
config = ESConfig.from_dict(dict(
    model=model, task=task, task_options=yaml.safe_load(task_options) or {}, target_modules=tuple(target_modules.split(",")),
    lora_rank=lora_rank, init_scheme=init_scheme, init_scale=init_scale, sigma=sigma, noise_mode=noise_mode,
    population_size=population_size, max_new_tokens=max_new_tokens, seed=seed, max_model_len=max_model_len,
    kv_cache_gb=kv_cache_gb, engine=engine,
))
print(yaml.safe_dump({key: config.to_dict()[key] for key in (
    "model", "task", "task_options", "target_modules", "lora_rank", "lora_alpha", "init_scheme", "init_scale",
    "sigma", "noise_mode", "population_size", "max_new_tokens", "seed", "engine")}, sort_keys=False))

# %% [markdown]
# The adapter tensors this layout creates on the model (unknown modules or layers fail here).

# %%
model_dir = resolve_model(config.model)
spec = config.lora_spec()
shapes = adapter_shapes(model_dir, spec)
print(f"{len(shapes)} tensors, {sum(a * b for a, b in shapes.values()):,} LoRA parameters")
pd.DataFrame([{"tensor": name, "shape": shape} for name, shape in list(shapes.items())[:8]])

# %% [markdown]
# Mean |W| of the base weights the adapters attach to, per layer (the scale `random_ab` and
# `per_layer` noise follow).

# %%
magnitudes = pd.Series(base_weight_magnitudes(model_dir, spec))
per_layer_magnitude = magnitudes.groupby(layer_of).mean()
plot_layer_scales([str(i) for i in per_layer_magnitude.index], per_layer_magnitude.tolist(),
                  title="Mean |W| of the adapted base weights, per layer", y_title="mean |W|")

# %%
magnitudes.groupby(module_of).mean().rename("mean |W|").to_frame()

# %% [markdown]
# Noise std per layer under the chosen `noise_mode`.

# %%
sigmas = noise_scales(shapes, config.sigma, config.noise_mode, magnitudes.to_dict())
per_layer_sigma = pd.Series(sigmas).groupby(layer_of).mean()
layer_sigmas = plot_layer_scales([str(i) for i in per_layer_sigma.index], per_layer_sigma.tolist(),
                                 title=f"Noise std per layer ({config.noise_mode})", y_title="sigma")
figure_paths = export_figure(layer_sigmas, "lora_initialization_sigma_per_layer", figures_dir)
layer_sigmas

# %% [markdown]
# The initial adapter under each scheme, and a first population around it (mean + sigma * noise,
# the members of generation 1): one engine call per scheme, greedy decoding.

# %%
initial = {
    scheme: init_adapter(spec, shapes, scheme, config.seed, magnitudes.to_dict(), config.init_scale)
    for scheme in ("peft_default", "random_ab")
}
members = es.population(config.seed, 1, config.population_size, config.antithetic)
task_instance = get_task(config.task, **config.task_options)
examples = task_instance.train_examples()
check_engine_settings(config, model_dir, task_instance)  # context, KV cache and memory before the engine starts
inference_engine = make_engine(config, max_loras=config.population_size)

# %%
previews = {scheme: preview_population(inference_engine, task_instance, adapter, members, sigmas, examples, config.max_new_tokens)
            for scheme, adapter in initial.items()}
inference_engine.close()

# %% [markdown]
# Diversity: distinct completions per prompt and the spread of member rewards; then every member's
# whole completion (wrapped), prompt by prompt.

# %%
diversity = pd.DataFrame([{"scheme": scheme, **preview.statistics()} for scheme, preview in previews.items()])
print(model_note(config.model) or f"model: {config.model}")
diversity

# %%
wrap_table(completions_table([{"scheme": scheme, **row} for scheme, preview in previews.items() for row in preview.rows()],
                             max_chars=None))

# %% [markdown]
# Save the adapter of the chosen `init_scheme`; `03_es_stepper` starts from it with
# `init_adapter_dir` set to this folder.

# %%
saved = save_adapter(initial[config.init_scheme], init_adapter_dir, base_model=str(model_dir))
saved

