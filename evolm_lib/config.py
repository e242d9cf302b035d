"""Typed, validated run settings. Unknown keys, wrong types and out-of-range values fail at once, with a message naming
the field, before any model is converted or engine started (ConfigError and the shared checks: `evolm_lib.config_checks`)."""
from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from .config_checks import ConfigError, check_weight_selection, config_error, did_you_mean, renamed_settings
from .es import NOISE_DEVICE, NoiseDevice, check_population_size
from .lora import ALL_PROJECTIONS, LoraSpec
from .models import check_model_name
from .tasks import get_task, list_tasks, task_options as accepted_task_options

GPU_MEMORY_SHARE = 0.6
"""gpu_memory_utilization on a GPU when it is not set: leaves room on the card for a GRPO policy
(transformers + AdamW) beside the engine."""
CPU_KV_CACHE_GB = 1.0
"""kv_cache_gb on a CPU when neither it nor gpu_memory_utilization is set: vLLM would size the KV cache
as a share of RAM minus what the process already holds, which fails or wastes memory depending on
the process; a fixed size is predictable."""
AdapterTransfer, ReportTo = Literal["in_place", "files"], Literal["tensorboard"]
"""``ReportTo``: where ``report_to`` can stream metrics rows; each name has a backend in ``evolm_lib.reporting.BACKENDS``."""


class CommonConfig(BaseModel):
    """Settings shared by ES and GRPO runs, so both see the same model, adapters, task and engine."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    model: str = "smollm2-135m-instruct"
    "model name (smollm2-135m-instruct, tiny-random), local folder or hub name"
    engine: Literal["vllm", "hf"] = "vllm"
    "inference engine for rollouts: vLLM (multi-LoRA, one call per population) or HF transformers+peft"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    "engine dtype (float32 on CPU: bfloat16 is 2-4x slower there)"
    max_model_len: int = Field(1024, ge=64)
    "longest prompt + completion the engine serves"
    gpu_memory_utilization: Optional[float] = Field(None, gt=0, le=1)
    "vLLM memory share (on CPU: share of RAM); None: GPU_MEMORY_SHARE on a GPU (room for a GRPO policy beside the engine)"
    kv_cache_gb: Optional[float] = Field(None, gt=0)
    "vLLM KV cache size in GiB; None: from gpu_memory_utilization on a GPU, CPU_KV_CACHE_GB on a CPU"
    deterministic: bool = False
    "GPU engines: vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1), so a request's completion does not depend on what else is in the batch and a run repeats and resumes to the same rows; off by default: the batch-invariant kernels are slower (docs: Measurements). CPU engines repeat without it"
    engine_host: Literal["local", "ray"] = "local"
    "where engines run: one engine in this process, or num_engines Ray actors sharing each call (pip install -e '.[ray]')"
    num_engines: int = Field(1, ge=1)
    "engine_host ray: engines (Ray actors, one CPU or a share of a GPU each) a population is sharded over, all of them counted"
    engines_per_gpu: int = Field(1, ge=1)
    "engine_host ray: engines that share one GPU, each with its own copy of the weights, taking 1/engines_per_gpu of the card (num_engines <= GPUs x engines_per_gpu) and, unless gpu_memory_utilization is set, GPU_MEMORY_SHARE / engines_per_gpu of its memory; on a CPU cluster it is recorded and places nothing (each engine takes its CPU)"
    tensor_parallel_size: int = Field(1, ge=1)
    "vLLM engines: the cards (on a CPU: processes, each on its own cores) one engine's weights are split over (vLLM's tensor parallelism; docs: Engines, Running a large model); with engine_host ray each engine's actor takes that many cards of one node; the HF engine refuses more than 1"
    mps_thread_percentage: Optional[int] = Field(None, ge=1, le=100)
    "engine_host ray on a card shared through CUDA's MPS: each engine's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, the share of the card's SMs its kernels may take (for example 100 / engines_per_gpu); None: unset (each engine may take the whole card). Outside MPS it has no effect. Under it the engines see fewer SMs, and torch's CUDA random kernels size their grid from that count, so noise_device cuda draws other noise from the same seeds: the rows are those of runs at the same percentage on the same card, not those of engines with the whole card (refused with es_mode lora, whose update draws its noise in this process)"
    ray_address: Optional[str] = None
    "engine_host ray: a running cluster's address (host:port of `ray start --head`, ray://host:port, or auto); None: as ray.init(), the cluster `ray start` left on this machine, else a new local one"

    task: str = "conciseness"
    "task name from the registry"
    task_options: dict[str, Any] = Field(default_factory=dict)
    "keyword options of the task (e.g. num_train for countdown)"

    target_modules: tuple[str, ...] = ALL_PROJECTIONS
    "modules that carry a LoRA adapter"
    lora_rank: int = Field(1, ge=1, le=512)
    "LoRA rank"
    lora_alpha: float = Field(1.0, gt=0)
    "LoRA alpha (scaling = alpha / rank)"
    layers_to_transform: Optional[tuple[int, ...]] = None
    "layer indices that carry adapters (None: all)"
    init_scheme: Literal["peft_default", "random_ab"] = "peft_default"
    "adapter initialisation: PEFT default (B = 0) or random A and B scaled by each layer's mean |W|"
    init_scale: float = Field(0.1, gt=0)
    "random_ab only: std of A and B = init_scale * mean |W| of the layer"

    max_new_tokens: int = Field(64, ge=1)
    "tokens generated per completion"
    temperature: float = Field(0.0, ge=0)
    "sampling temperature for training rollouts (0: greedy)"
    top_p: float = Field(1.0, gt=0, le=1)
    "nucleus sampling for training rollouts"
    prompts_per_step: Optional[int] = Field(None, ge=1)
    "train prompts per generation/step, drawn by seed (None: all train prompts)"

    seed: int = 0
    "master seed: noise, prompt order and sampling derive from it"
    eval_every: int = Field(1, ge=0)
    "score the current adapter (greedy) on train and eval prompts every k generations/steps (0: only at the end)"
    checkpoint_every: int = Field(1, ge=1)
    "write a checkpoint every k generations/steps (and always at the end)"
    keep_checkpoints: int = Field(2, ge=1)
    "how many recent checkpoints to keep"
    report_to: tuple[ReportTo, ...] = ()
    "where each metrics row also goes, beside metrics.jsonl: tensorboard (its numbers as scalars in run_dir/tensorboard, offline; view with `tensorboard --logdir run_dir`; needs the tensorboard package); empty: metrics.jsonl only"

    def __init__(self, **data: Any):
        try:
            super().__init__(**renamed_settings(data))
        except ValidationError as error:
            raise config_error(type(self), error) from None

    @field_validator("model")
    @classmethod
    def _model_exists(cls, value: str) -> str:
        check_model_name(value)
        return value

    @field_validator("task")
    @classmethod
    def _task_exists(cls, value: str) -> str:
        if value not in list_tasks():
            raise ValueError(f"unknown task {value!r}; known tasks: {', '.join(list_tasks())}")
        return value

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_known(cls, value: Any) -> Any:
        # before pydantic's own check, so an unknown name gets the allowed ones, not "Input should be ..."
        names = (value,) if isinstance(value, str) else value
        if not isinstance(names, (list, tuple)):
            return value  # pydantic names the expected type
        allowed = list(typing.get_args(ReportTo))
        for name in names:
            if name not in allowed:
                raise ValueError(f"{name!r} is not supported; allowed: {allowed}")
        return tuple(dict.fromkeys(names))  # a name given twice streams once

    @field_validator("target_modules")
    @classmethod
    def _targets_nonempty(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("must name at least one module")
        return value

    @field_validator("ray_address")
    @classmethod
    def _ray_address_form(cls, value: str | None) -> str | None:
        if value is None or value == "auto":
            return value
        host, _, port = value.removeprefix("ray://").rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"expected host:port (the address `ray start --head` prints), ray://host:port or auto, got {value!r}")
        return value

    @model_validator(mode="after")
    def _ray_settings_consistent(self):
        # Reachability and the cluster's GPUs are checked as the Ray engines start, before any engine actor exists.
        if self.engine_host == "local" and self.num_engines > 1:
            raise ValueError(f"num_engines: {self.num_engines} engines need engine_host: ray (engine_host is 'local': one engine in this process)")
        if self.engine_host == "local" and self.engines_per_gpu > 1:
            raise ValueError(f"engines_per_gpu: {self.engines_per_gpu} engines on one GPU need engine_host: ray (engine_host is 'local': one engine in this process)")
        if self.engine_host == "local" and self.mps_thread_percentage is not None:
            raise ValueError(f"mps_thread_percentage: {self.mps_thread_percentage} applies to engines in Ray actors, each "
                             "starting CUDA in its own process; use engine_host: ray (engine_host is 'local': one engine in this process)")
        if self.engine_host == "local" and self.ray_address is not None:
            raise ValueError("ray_address: set, but engine_host is 'local'; use engine_host: ray to run engines on a Ray cluster")
        if self.engine_host == "ray" and self.engine != "vllm":
            raise ValueError(f"engine_host: 'ray' shards calls over vLLM engines; engine must be 'vllm', got {self.engine!r}")
        if self.tensor_parallel_size > 1 and self.engine != "vllm":
            raise ValueError(f"tensor_parallel_size: {self.tensor_parallel_size} splits a vLLM engine; engine must be 'vllm', "
                             f"got {self.engine!r}")
        return self

    @model_validator(mode="after")
    def _task_options_valid(self):
        try:
            get_task(self.task, **self.task_options)  # an unknown option fails here, naming it
        except (TypeError, ValueError) as error:  # pydantic wraps only ValueError: re-raised as one, with its field
            accepted = list(accepted_task_options(self.task))
            unknown = sorted(set(self.task_options) - set(accepted))
            if isinstance(error, TypeError) and len(unknown) == 1:
                raise ValueError(f"task_options.{unknown[0]}: task {self.task!r} has no option {unknown[0]!r}"
                                 f"{did_you_mean(unknown[0], accepted)}; accepted options: {', '.join(accepted)}") from None
            raise ValueError(f"task_options: {error}") from None
        return self

    def lora_spec(self) -> LoraSpec:
        """The adapter layout these settings describe."""
        return LoraSpec(self.target_modules, self.lora_rank, self.lora_alpha, self.layers_to_transform)

    # --- YAML ----------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        """Build and validate; raise ConfigError naming every bad field."""
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str | Path):
        """Read settings from a YAML file."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of settings at the top level")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, not tuples), for YAML and JSON."""
        return self.model_dump(mode="json")

    def to_yaml(self, path: str | Path | None = None) -> str:
        """The resolved settings as YAML (written to ``path`` when given)."""
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    def replace(self, **changes):
        """A validated copy with some fields changed."""
        return self.from_dict({**self.to_dict(), **changes})



def model_weight_targets(selection: str | None, spec: LoraSpec) -> tuple:
    """(target modules, or "all", and the layers) of the model weights a run moves: ``all`` for every
    parameter, None for those of the LoRA target_modules in layers_to_transform."""
    if selection == "all":
        return "all", None
    return spec.target_modules, spec.layers_to_transform




class ESConfig(CommonConfig):
    """An ES run: population of LoRA adapters = mean + sigma * seeded noise (Qiu et al. 2025)."""

    es_mode: Literal["lora", "full", "eggroll"] = "lora"
    "what ES moves: lora (a LoRA adapter; members in LoRA slots), full (the model's own weights in es_weights, one member at a time per engine, Qiu et al.) or eggroll (those weights, each member a rank-noise_rank perturbation served in a LoRA slot, full-rank update; Sarkar et al.)"
    es_weights: Optional[str] = None
    "full and eggroll: the weights ES moves; None: those of the LoRA target_modules (in layers_to_transform); all: every parameter (full only)"
    noise_rank: int = Field(1, ge=1)
    "eggroll: rank r of each member's noise A B^T / sqrt(r) per weight matrix"
    population_size: int = Field(16, ge=2)
    "members per generation"
    antithetic: bool = True
    "mirrored pairs (mean + eps, mean - eps); needs an even population"
    sigma: float = Field(0.05, gt=0)
    "noise std on LoRA weights (per_layer mode: a multiplier on each layer's mean |W|)"
    noise_mode: Literal["uniform", "per_layer"] = "uniform"
    "one sigma for every tensor, or sigma x mean |W| of each layer"
    adapter_transfer: AdapterTransfer = "in_place"
    "vLLM: write members into resident LoRA slots from their seeds (in_place; files where the engine cannot) or as adapter files"
    noise_device: NoiseDevice = NOISE_DEVICE
    "where noise is drawn: cpu (same bits on every machine) or cuda (faster for large adapters; GPU-only bits; cpu, with a warning, on a machine without a GPU)"
    noise_scheme: Literal["flat", "per_tensor", "tiled"] = "flat"
    "flat: one draw per member for all its tensors (fast); per_tensor: one per tensor (runs made before this setting); tiled: one per 2048 x 2048 tile of each tensor, so a card draws only its slice of a weight and a member is written weight by weight (es_mode full at tensor_parallel_size > 1 needs it; with es_mode full it also keeps no member's noise of every weight at once: docs: Engines, Running a large model)"
    score_in_population: bool = True
    "the mean adapter's greedy scoring rides in the next generation's population call (vLLM, Ray), not a call of its own"
    estimator: Optional[str] = None
    "None: the ES update with fitness_shaping (Qiu et al.); or a zeroth-order estimator of evolm_lib.zo over the members' seeds (e.g. zoar)"
    estimator_histories: int = Field(5, ge=0)
    "zoar and zohs: past generations whose queries are reused (H)"
    estimator_baseline: Literal["single", "average"] = "average"
    "zoo and reinforce: 'average' (mean of the generation's rewards); 'single' needs f at the mean and is refused here"
    fitness_shaping: Literal["centered_ranks", "z_score", "per_prompt", "raw"] = "centered_ranks"
    "reward shaping before the update"
    fitness_control: Literal["none", "shuffled"] = "none"
    "shuffled: a control run, the members' rewards permuted (seeded, per generation) before the update, so drift that is not learning shows"
    gradient_form: Literal["qiu", "textbook"] = "qiu"
    "qiu: theta += lr/N sum w_i eps_i (sigma folded into lr); textbook: divides by sigma"
    optimizer: Literal["sgd", "adam"] = "sgd"
    "update rule on the float32 master copy of the mean adapter"
    optimizer_step: Literal["torch", "formulas"] = "torch"
    "torch: torch.optim's kernels; formulas: the formulas term by term, as runs made before the torch step (their folders load with it, and resume to the same rows)"
    learning_rate: float = Field(0.2, gt=0)
    "step size (alpha)"
    momentum: float = Field(0.0, ge=0, lt=1)
    "SGD momentum"
    weight_decay: float = Field(0.0, ge=0)
    "decoupled weight decay"
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    "Adam beta1"
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    "Adam beta2"
    num_generations: int = Field(10, ge=1)
    "generations run() does by default"

    @model_validator(mode="after")
    def _antithetic_even(self):
        check_population_size(self.population_size, self.antithetic)  # the rule es.population applies
        return self

    @model_validator(mode="after")
    def _estimator_fits_seeds(self):
        if self.estimator is None:
            return self
        from .zo import ESTIMATORS, needs_center

        # seeded directions, and no query of f at the mean (a generation queries only its members)
        fitting = sorted(name for name, spec in ESTIMATORS.items() if spec.seed_population and spec.center != "always")
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator: unknown {self.estimator!r}; known: {', '.join(sorted(ESTIMATORS))} "
                             f"(for the LLM population: {', '.join(fitting)})")
        if not ESTIMATORS[self.estimator].seed_population:
            raise ValueError(f"estimator: {self.estimator!r} needs explicit positions or a d-sized state, not a "
                             f"population of seeds; use one of {', '.join(fitting)}")
        if self.estimator not in fitting:
            raise ValueError(f"estimator: {self.estimator!r} needs the reward of the mean adapter on the population's "
                             f"prompts, which a generation does not query; use one of {', '.join(fitting)}")
        if self.estimator == "twopoint" and not self.antithetic:
            raise ValueError("estimator: twopoint takes central differences over +/- pairs: set antithetic true")
        if self.noise_mode != "uniform":
            raise ValueError("estimator: the zeroth-order estimators take one perturbation scale (mu = sigma): "
                             "use noise_mode 'uniform'")
        if needs_center(self.estimator_config()):
            raise ValueError(f"estimator_baseline: {self.estimator!r} with baseline 'single' needs the reward of the "
                             "mean adapter on the population's prompts, which a generation does not query; use 'average'")
        return self

    def weight_targets(self) -> tuple:
        """(target modules, or "all", and the layers) of the weights es_mode full / eggroll moves."""
        return model_weight_targets(self.es_weights, self.lora_spec())

    def estimator_config(self):
        """The evolm_lib.zo settings of ``estimator`` (num_queries = population_size, mu = sigma)."""
        from .zo import EstimatorConfig

        try:
            return EstimatorConfig(self.estimator, num_queries=self.population_size, mu=self.sigma,
                                   num_histories=self.estimator_histories, baseline=self.estimator_baseline)
        except ValueError as error:
            raise ValueError(f"estimator: {error}") from None

    @model_validator(mode="after")
    def _mode_fits(self):
        if self.es_mode == "lora":
            return self
        mode = self.es_mode
        check_weight_selection("es_weights", self.es_weights)
        if self.es_weights == "all" and mode == "eggroll":
            raise ValueError("es_weights: eggroll perturbs weight matrices through LoRA slots; 'all' is for es_mode full")
        if self.adapter_transfer == "files":
            raise ValueError(f"adapter_transfer: es_mode {mode} writes the engine's weights in place; 'files' serves "
                             "adapters from files and cannot (use in_place)")
        if self.estimator is not None:
            raise ValueError(f"estimator: es_mode {mode} takes the ES update with fitness_shaping; estimators run in es_mode lora")
        if self.noise_mode != "uniform":
            raise ValueError(f"noise_mode: es_mode {mode} takes one sigma for every weight ('uniform')")
        if mode == "eggroll" and self.noise_rank > 512:
            raise ValueError(f"noise_rank: vLLM serves LoRA ranks up to 512, got {self.noise_rank}")
        return self

    @model_validator(mode="after")
    def _noise_drawn_where_it_is_used(self):
        # es_mode lora draws the update's noise in this process, the members' in the engines: an
        # engine limited to fewer SMs draws other noise from the same seeds (torch sizes its random
        # kernels' grid from the SM count), so the update would not be the one the members earned
        if self.mps_thread_percentage is not None and self.es_mode == "lora" and self.noise_device == "cuda":
            raise ValueError(f"mps_thread_percentage: {self.mps_thread_percentage} % of the SMs gives the engines other "
                             "noise than this process draws for the LoRA mean's update (es_mode lora); use it with "
                             "es_mode full or eggroll, whose engines draw both, or noise_device: cpu")
        # a card of a tensor-parallel engine holds a slice of each weight: only tiled noise draws a slice alone
        if self.tensor_parallel_size > 1 and self.es_mode == "full" and self.noise_scheme != "tiled":
            raise ValueError(f"noise_scheme: es_mode full at tensor_parallel_size={self.tensor_parallel_size} needs noise_scheme: "
                             f"tiled (each card draws only its slice of a weight's noise; {self.noise_scheme} draws all of it)")
        return self

    @model_validator(mode="after")
    def _population_covers_engines(self):
        if self.engine_host == "ray" and self.population_size < self.num_engines:
            raise ValueError(f"population_size: {self.population_size} members cannot keep num_engines={self.num_engines} "
                             "engines busy; use at most population_size engines")
        return self

    def optimizer_config(self):
        """The es-module optimizer settings."""
        from .es import AdamConfig, SGDConfig

        formulas = self.optimizer_step == "formulas"
        if self.optimizer == "adam":
            return AdamConfig(self.learning_rate, self.adam_beta1, self.adam_beta2, weight_decay=self.weight_decay, formulas=formulas)
        return SGDConfig(self.learning_rate, momentum=self.momentum, weight_decay=self.weight_decay, formulas=formulas)


class GRPOConfig(CommonConfig):
    """A GRPO run: G samples per prompt, group-relative advantages, AdamW on the LoRA tensors or on the
    model weights (``policy_weights``)."""

    policy_weights: Literal["lora", "full"] = "lora"
    "what GRPO trains: lora (AdamW on the LoRA tensors) or full (AdamW on the model weights in grpo_weights, float32 master in the trainer; after each step the engine's weights are written in place, no reload)"
    grpo_weights: Optional[str] = None
    "policy_weights full: the model weights GRPO trains; None: those of the LoRA target_modules (in layers_to_transform); all: every parameter"
    policy_process: Literal["auto", "same", "own"] = "auto"
    ("where the policy's update runs: same (this process, beside the engine) or own (a child process, the "
     "trained weights shared with it, not copied); auto: own when deterministic puts a local GPU vLLM engine "
     "in batch-invariant mode, which slows every update in its process, else same")
    deterministic_update: Optional[bool] = None
    ("the policy in its own process: torch.use_deterministic_algorithms there, so an update repeats on "
     "the GPU; None: as deterministic")
    policy_attention: Literal["auto", "sdpa", "eager"] = "auto"
    ("the trained policy's attention (transformers' attn_implementation): sdpa (torch's fused kernels) or "
     "eager (matmuls and a softmax); auto: eager where torch's deterministic algorithms are on for a GPU "
     "policy (deterministic_update), whose fused backward they force onto a slow path, else sdpa")

    temperature: float = Field(1.0, gt=0)
    "sampling temperature of the rollouts (> 0: a greedy group has no spread); log-probs use logits / temperature"
    loss_type: Literal["no_baseline", "reinforce_with_baseline", "grpo_clip"] = "grpo_clip"
    "policy-gradient loss: raw rewards, group-normalised advantages, or the clipped ratio surrogate"
    normalize_by_std: bool = True
    "divide advantages by the group's std (GRPO); False: mean-centred only (Dr. GRPO)"
    group_size: int = Field(8, ge=1)
    "samples per prompt (G)"
    learning_rate: float = Field(1e-4, gt=0)
    "AdamW step size"
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    "AdamW beta1"
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    "AdamW beta2"
    weight_decay: float = Field(0.0, ge=0)
    "AdamW decoupled weight decay on the LoRA tensors"
    max_grad_norm: Optional[float] = Field(1.0, gt=0)
    "clip the LoRA gradient to this global norm (None: no clipping)"
    micro_batch_size: Optional[int] = Field(None, ge=1)
    ("rollouts per forward/backward pass, gradients accumulated over the batch (None: one group); on a GPU "
     "larger is faster while memory lasts: SmolLM2 updated 64 short rollouts 6-8x faster in one pass than in 8")
    epochs_per_batch: int = Field(1, ge=1)
    "optimizer steps per rollout batch, each over all its rollouts (> 1 needs grpo_clip)"
    cliprange: float = Field(0.2, gt=0)
    "grpo_clip: the ratio is clipped to [1 - cliprange, 1 + cliprange]"
    advantage_eps: float = Field(1e-6, gt=0)
    "added to the group std before dividing"
    length_normalization: Literal["sequence_mean", "constant", "token_mean"] = "sequence_mean"
    "per-response mean (GRPO), sum / max_new_tokens (Dr. GRPO), or mean over the micro-batch's tokens (DAPO)"
    beta: float = Field(0.0, ge=0)
    "weight of the k3 KL penalty to the base model (0: none, and no reference pass)"
    kl_penalty: Literal["k3", "ratio_k3"] = "k3"
    ("the KL term's gradient: k3 as DeepSeekMath's GRPO adds it (TRL's loss_type 'grpo'), or ratio_k3, k3 times "
     "the importance ratio pi/pi_old (TRL's use_bias_correction_kl: an unbiased reverse-KL gradient); used when beta > 0")
    num_steps: int = Field(10, ge=1)
    "steps run() does by default"

    @model_validator(mode="after")
    def _update_setting_has_a_process(self):
        if self.deterministic_update is not None and self.policy_process == "same":
            raise ValueError(f"deterministic_update: {self.deterministic_update} sets torch in the policy's own "
                             "process, and policy_process is 'same' (torch's setting there would change the "
                             "engine's process too); use policy_process 'own' or 'auto', or leave it None")
        return self

    @model_validator(mode="after")
    def _weights_fit(self):
        check_weight_selection("grpo_weights", self.grpo_weights)
        if self.grpo_weights is not None and self.policy_weights == "lora":
            raise ValueError(f"grpo_weights: {self.grpo_weights!r} selects model weights, which only "
                             "policy_weights 'full' trains (policy_weights is 'lora')")
        return self

    def weight_targets(self) -> tuple:
        """(target modules, or "all", and the layers) of the model weights policy_weights full trains."""
        return model_weight_targets(self.grpo_weights, self.lora_spec())

    @field_validator("group_size")
    @classmethod
    def _group_has_spread(cls, value: int, info: ValidationInfo) -> int:
        loss_type, by_std = info.data.get("loss_type"), info.data.get("normalize_by_std")
        if value < 2 and (loss_type != "no_baseline" or by_std):
            raise ValueError(
                f"must be >= 2 with loss_type {loss_type!r} and normalize_by_std={by_std}: "
                "a group of one has no mean or std to compare against"
            )
        return value

    @field_validator("micro_batch_size")
    @classmethod
    def _micro_batch_divides(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None or "group_size" not in info.data or "task" not in info.data:
            return value
        try:
            num_train = len(get_task(info.data["task"], **info.data.get("task_options", {})).train_examples())
        except Exception:  # a bad task or option is reported by its own validator
            return value
        prompts = min(info.data.get("prompts_per_step") or num_train, num_train)
        batch = prompts * info.data["group_size"]
        if batch % value:
            raise ValueError(
                f"{value} does not divide the rollout batch of {batch} "
                f"({prompts} prompts x group_size {info.data['group_size']})"
            )
        return value

    @field_validator("epochs_per_batch")
    @classmethod
    def _off_policy_needs_ratio(cls, value: int, info: ValidationInfo) -> int:
        if value > 1 and info.data.get("loss_type") != "grpo_clip":
            raise ValueError(
                f"{value} > 1 needs loss_type 'grpo_clip': later epochs are off-policy and only "
                "the clipped importance ratio corrects for that"
            )
        return value


CONFIG_CLASSES = {"es": ESConfig, "grpo": GRPOConfig}


def config_class(kind: str) -> type[CommonConfig]:
    """The settings class of a run kind (es | grpo)."""
    if kind not in CONFIG_CLASSES:
        raise ConfigError(f"unknown run kind {kind!r}; known kinds: {', '.join(CONFIG_CLASSES)}")
    return CONFIG_CLASSES[kind]
