"""GRPO runs on the same LoRA adapters, engine, tasks and run folders as ES; resumable to the bit.

A step: the policy adapter -> G seeded samples per prompt from the engine (vLLM) -> rewards ->
group-normalised advantages -> log-probs and gradients with transformers + peft on exactly the
tokens the engine produced -> AdamW on the LoRA tensors -> metrics row and checkpoint.

References:
- GRPO (DeepSeekMath): https://arxiv.org/abs/2402.03300
- Stanford CS336 assignment 5, whose primitives `grpo_primitives` implements:
  https://github.com/stanford-cs336/assignment5-alignment
- Dr. GRPO, constant length normaliser: https://arxiv.org/abs/2503.20783
"""
from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Literal, Optional, Sequence

import torch
from pydantic import Field, ValidationInfo, field_validator

from .config import CommonConfig
from .evaluators import Evaluator, SamplingSettings, make_evaluator
from .grpo_primitives import compute_group_normalized_rewards, grpo_microbatch_train_step
from .lora import AdapterWeights, save_adapter
from .models import resolve_model
from .runner import RunLoop, _derive, _percentile
from .runs import timed, write_checkpoint
from .tasks import Example, Task, get_task
from .types import Completion


class GRPOConfig(CommonConfig):
    """A GRPO run: G samples per prompt, group-relative advantages, AdamW on the LoRA tensors."""

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
    "rollouts per forward/backward pass, gradients accumulated over the batch (None: one group)"
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
    num_steps: int = Field(10, ge=1)
    "steps run() does by default"

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


# ---------------------------------------------------------------------------- batches and AdamW state


def rollout_batch(
    prompt_token_ids: Sequence[Sequence[int]], completion_token_ids: Sequence[Sequence[int]], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """Token ids (not text) -> right-padded input_ids, labels and response_mask, as `tokenize_prompt_and_output`.

    Working on ids keeps the trainer on exactly the tokens the engine sampled (re-tokenising the
    decoded text can split it differently).
    """
    if len(prompt_token_ids) != len(completion_token_ids) or not prompt_token_ids:
        raise ValueError(f"got {len(prompt_token_ids)} prompts and {len(completion_token_ids)} completions")
    sequences = [list(p) + list(c) for p, c in zip(prompt_token_ids, completion_token_ids)]
    width = max(len(s) for s in sequences)
    full = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)  # (batch, width)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)  # (batch, width)
    for row, (seq, prompt) in enumerate(zip(sequences, prompt_token_ids)):
        full[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, len(prompt) : len(seq)] = True
    return {"input_ids": full[:, :-1], "labels": full[:, 1:], "response_mask": mask[:, 1:]}


def optimizer_state_to_tensors(optimizer: torch.optim.Optimizer, names: dict[torch.nn.Parameter, str]) -> dict[str, torch.Tensor]:
    """AdamW's per-parameter state as flat named tensors ('<param name>/exp_avg', ...) for safetensors."""
    tensors = {}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            tensors[f"{names[param]}/{key}"] = value.detach().clone() if torch.is_tensor(value) else torch.tensor(value)
    return tensors


def optimizer_state_from_tensors(optimizer: torch.optim.Optimizer, names: dict[torch.nn.Parameter, str],
                                 tensors: dict[str, torch.Tensor]) -> None:
    """Load state written by :func:`optimizer_state_to_tensors` into a freshly built optimizer."""
    state_dict = optimizer.state_dict()
    order = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, param in enumerate(order):
        prefix = names[param] + "/"
        entries = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if entries:
            state[index] = entries
    known = {names[p] for p in order}
    stray = sorted({k.rsplit("/", 1)[0] for k in tensors} - known)
    if stray:
        raise ValueError(f"optimizer state for unknown parameters: {stray[:3]}")
    state_dict["state"] = state
    optimizer.load_state_dict(state_dict)


# ---------------------------------------------------------------------------- the trainer


class PolicyTrainer:
    """The policy as transformers + peft (float32): log-probs, gradients and AdamW on the LoRA tensors only."""

    def __init__(self, model_dir: Path, adapter: AdapterWeights, config: GRPOConfig):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = config
        self.spec = adapter.spec
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else self.tokenizer.eos_token_id
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.vocab_size = base.get_output_embeddings().weight.shape[0]
        lora = LoraConfig(
            r=adapter.spec.rank,
            lora_alpha=adapter.spec.alpha,
            target_modules=list(adapter.spec.target_modules),
            layers_to_transform=list(adapter.spec.layers_to_transform) if adapter.spec.layers_to_transform is not None else None,
            lora_dropout=0.0,
        )
        self.model = get_peft_model(base, lora)
        self.model.eval()  # no dropout anywhere: gradients still flow, and results are deterministic
        self.set_adapter(adapter)
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.names = {p: n for n, p in self.model.named_parameters() if p.requires_grad}
        self.optimizer = torch.optim.AdamW(
            self.parameters, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
            weight_decay=config.weight_decay,
        )

    def set_adapter(self, adapter: AdapterWeights) -> None:
        """Copy an adapter's tensors into the peft model."""
        from peft import set_peft_model_state_dict

        with torch.no_grad():
            result = set_peft_model_state_dict(self.model, {k: v.float() for k, v in adapter.tensors.items()})
        missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
        if result.unexpected_keys or missing:
            raise ValueError(f"adapter does not fit the model: unexpected {result.unexpected_keys[:3]}, missing {missing[:3]}")

    def adapter(self) -> AdapterWeights:
        """The current LoRA tensors, PEFT-named, as the engine loads them."""
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.model)
        return AdapterWeights(self.spec, {k: v.detach().clone().float() for k, v in state.items()})

    def encode(self, prompt) -> list[int]:
        """Prompt token ids, for evaluators that do not tokenise (the synthetic one)."""
        from .evaluators import _PromptEncoder

        return _PromptEncoder(self.tokenizer).encode(prompt)

    def _log_probs(self, batch: dict, rows: slice, *, grad: bool, base: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, mask) of one micro-batch over the columns from its first to its last response token.

        As `get_response_log_probs` with logits / temperature (the policy that sampled), but the
        vocabulary projection runs on response positions only: prompt logits are never needed.
        """
        mask = batch["response_mask"][rows]
        columns = mask.any(dim=0).nonzero().flatten()
        if columns.numel() == 0:
            raise ValueError("a micro-batch has no response tokens")
        first, width = int(columns[0]), int(columns[-1]) + 1
        input_ids, labels, mask = batch["input_ids"][rows, :width], batch["labels"][rows, first:width], mask[:, first:width]
        with torch.set_grad_enabled(grad), (self.model.disable_adapter() if base else contextlib.nullcontext()):
            logits = self.model(input_ids=input_ids, logits_to_keep=width - first).logits  # (micro, kept, vocab)
            if self.config.temperature != 1.0:
                logits = logits / self.config.temperature
            label_logits = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (micro, kept)
            log_probs = label_logits - torch.logsumexp(logits, dim=-1)
        return log_probs, mask  # (micro, kept) each

    def train(self, batch: dict, raw_rewards: torch.Tensor, advantages: torch.Tensor) -> dict:
        """Epochs of micro-batched, gradient-accumulated updates on one rollout batch; returns stats."""
        config = self.config
        n = batch["input_ids"].shape[0]
        micro = config.micro_batch_size or config.group_size
        if n % micro:
            raise ValueError(f"micro_batch_size {micro} does not divide the rollout batch of {n}")
        slices = [slice(s, s + micro) for s in range(0, n, micro)]
        accumulation = len(slices)
        # the batch's policy before any update: pi_old of the ratio, and the reference for KL
        old = [self._log_probs(batch, s, grad=False)[0] for s in slices] if config.loss_type == "grpo_clip" and config.epochs_per_batch > 1 else None
        ref = [self._log_probs(batch, s, grad=False, base=True)[0] for s in slices] if config.beta > 0 else None
        first_pass: list[tuple[torch.Tensor, torch.Tensor]] = []
        losses, clip_fractions, kls, grad_norms = [], [], [], []
        for epoch in range(config.epochs_per_batch):
            self.optimizer.zero_grad(set_to_none=True)
            epoch_loss = 0.0
            for i, rows in enumerate(slices):
                log_probs, mask = self._log_probs(batch, rows, grad=True)
                if epoch == 0:
                    first_pass.append((log_probs.detach(), mask))
                old_log_probs = None
                if config.loss_type == "grpo_clip":
                    # one epoch is on-policy: pi_old is this very forward pass, detached (ratio 1)
                    old_log_probs = old[i] if old is not None else log_probs.detach()
                loss, meta = grpo_microbatch_train_step(
                    log_probs, mask, accumulation, config.loss_type,
                    raw_rewards=raw_rewards[rows], advantages=advantages[rows], old_log_probs=old_log_probs,
                    cliprange=config.cliprange if config.loss_type == "grpo_clip" else None,
                    length_normalization=config.length_normalization,
                    normalize_constant=float(config.max_new_tokens) if config.length_normalization == "constant" else None,
                    beta=config.beta, ref_log_probs=ref[i] if ref is not None else None,
                )
                epoch_loss += float(loss)
                if "clip_fraction" in meta:
                    clip_fractions.append(float(meta["clip_fraction"]))
                if "kl" in meta:
                    kls.append(float(meta["kl"]))
            norm = torch.nn.utils.clip_grad_norm_(self.parameters, config.max_grad_norm or math.inf)
            grad_norms.append(float(norm))
            self.optimizer.step()
            losses.append(epoch_loss)
        stats = {
            "grpo/loss": sum(losses) / len(losses),
            "grpo/grad_norm": sum(grad_norms) / len(grad_norms),
            "grpo/clip_fraction": sum(clip_fractions) / len(clip_fractions) if clip_fractions else 0.0,
        }
        if kls:
            stats["grpo/kl"] = sum(kls) / len(kls)
        stats["_first_pass"] = first_pass
        return stats

    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        """AdamW state as named tensors."""
        return optimizer_state_to_tensors(self.optimizer, self.names)

    def load_optimizer_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore AdamW state saved by :meth:`optimizer_tensors`."""
        optimizer_state_from_tensors(self.optimizer, self.names, tensors)


# ---------------------------------------------------------------------------- the run


class GRPORun(RunLoop):
    """One GRPO run bound to a run folder, with ESRun's API; ``generation`` counts steps done."""

    kind = "grpo"
    config_class = GRPOConfig

    def __init__(self, config: GRPOConfig, run_dir: Path, evaluator: Evaluator, task: Task, trainer: PolicyTrainer,
                 generation: int, counters: dict, history: list[dict], model_dir: Path):
        self.config = config
        self.run_dir = Path(run_dir)
        self.evaluator = evaluator
        self.task = task
        self.trainer = trainer
        self.generation = generation
        self.counters = counters
        self.history = history
        self.model_dir = model_dir
        self.policy = trainer.adapter()
        self.train_examples = task.train_examples()
        self.eval_examples = task.eval_examples()
        self._started = time.perf_counter()
        self._wall_at_start = counters.get("wall_s", 0.0)

    # --- construction ----------------------------------------------------------------------------
    @classmethod
    def create(cls, config: GRPOConfig, run_dir: str | Path, *, evaluator: Evaluator | None = None,
               overwrite: bool = False, initial_adapter: AdapterWeights | None = None) -> "GRPORun":
        """Start a new run in an empty folder (an existing run is refused unless ``overwrite``)."""
        task, model_dir, run_dir, initial_adapter = cls._start_folder(config, run_dir, overwrite, initial_adapter)
        evaluator = evaluator or make_evaluator(config, max_loras=1)  # one policy adapter per call
        trainer = PolicyTrainer(model_dir, initial_adapter, config)
        run = cls(config, run_dir, evaluator, task, trainer, 0, {}, [], model_dir)
        row = {"step": 0, "generation": 0, "method": "grpo", "seed": config.seed, **run._score_current(),
               **run._sample_counters()}
        row["time/wall_s"] = run._wall()
        run._commit(row)
        return run

    @classmethod
    def resume(cls, run_dir: str | Path, *, evaluator: Evaluator | None = None) -> "GRPORun":
        """Continue a run from its latest checkpoint; it ends as if never interrupted."""
        config, adapter, optimizer_tensors, step, counters, rows = cls._load_latest(Path(run_dir))
        model_dir = resolve_model(config.model)
        task = get_task(config.task, **config.task_options)
        trainer = PolicyTrainer(model_dir, adapter, config)
        trainer.load_optimizer_tensors(optimizer_tensors)
        evaluator = evaluator or make_evaluator(config, max_loras=1)  # one policy adapter per call
        return cls(config, Path(run_dir), evaluator, task, trainer, step, counters, rows, model_dir)

    # --- the loop ------------------------------------------------------------------------------
    def rollouts(self, examples: Sequence[Example], step: int) -> list[Completion]:
        """G seeded samples per example from the current policy, group by group, in ONE engine call."""
        config = self.config
        prompts = [self.task.prompt(e) for e in examples for _ in range(config.group_size)]
        sampling = SamplingSettings(
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            seed=_derive(config.seed, "sampling", step),  # each of the G copies has its own prompt index, so its own seed
            logprobs=True,
        )
        # A fresh AdapterWeights each step: the evaluator gives every call new LoRA names and ids.
        return self.evaluator.generate(prompts, [self.policy], sampling)[0]

    def step(self) -> dict:
        """One GRPO step: rollouts, rewards, advantages, update; logs, checkpoints, returns the metrics row."""
        config = self.config
        step = self.generation + 1
        timing: dict[str, float] = {}
        examples = self.batch_examples(step)
        repeated = [e for e in examples for _ in range(config.group_size)]
        with timed(timing, "rollout_s"):
            completions = self.rollouts(examples, step)
        with timed(timing, "reward_s"):
            rewards = self.task.reward_fn([c.text for c in completions], repeated)
        advantages, raw_rewards, meta = compute_group_normalized_rewards(
            lambda _response, index: rewards[int(index)],  # rewards come from the batched task.reward_fn above
            [c.text for c in completions], [str(i) for i in range(len(completions))],
            config.group_size, config.advantage_eps, config.normalize_by_std,
        )
        with timed(timing, "update_s"):
            encode = getattr(self.evaluator, "encode", None) or self.trainer.encode
            prompt_ids = [encode(self.task.prompt(e)) for e in examples]
            completion_ids = [list(c.token_ids) for c in completions]
            too_large = max((t for ids in completion_ids for t in ids), default=0)
            if too_large >= self.trainer.vocab_size:
                raise ValueError(f"the engine returned token id {too_large} beyond the model's vocabulary ({self.trainer.vocab_size})")
            batch = rollout_batch([p for p in prompt_ids for _ in range(config.group_size)], completion_ids,
                                  self.trainer.pad_token_id)
            stats = self.trainer.train(batch, raw_rewards, advantages)
            first_pass = stats.pop("_first_pass")
            self.policy = self.trainer.adapter()
        self.generation = step
        self.counters["completions"] = self.counters.get("completions", 0) + len(completions)
        self.counters["tokens"] = self.counters.get("tokens", 0) + sum(c.num_tokens for c in completions)

        grouped = raw_rewards.view(len(examples), config.group_size)  # (prompts, group_size)
        best, worst = grouped.argmax(dim=1).tolist(), grouped.argmin(dim=1).tolist()
        row = {
            "step": step,
            "generation": step,
            "method": "grpo",
            "seed": config.seed,
            "train/reward_mean": float(raw_rewards.mean()),
            "train/reward_std": float(raw_rewards.std(unbiased=False)),
            "train/reward_best": float(raw_rewards.max()),
            "train/reward_worst": float(raw_rewards.min()),
            "train/reward_p20": _percentile(raw_rewards, 0.2),
            "train/reward_p80": _percentile(raw_rewards, 0.8),
            "grpo/rewards": raw_rewards.tolist(),
            "grpo/zero_std_group_fraction": meta["zero_std_group_fraction"],
            "grpo/response_tokens_mean": sum(c.num_tokens for c in completions) / len(completions),
            **stats,
            "grpo/adapter_norm": float(sum((v.float() ** 2).sum() for v in self.policy.tensors.values()) ** 0.5),
            "best_completions": [completions[p * config.group_size + b].text for p, b in enumerate(best)],
            "worst_completions": [completions[p * config.group_size + w].text for p, w in enumerate(worst)],
            "prompts": [e.prompt for e in examples],
        }
        gap = _engine_logprob_gap(completions, first_pass, config)
        if gap is not None:
            row["grpo/engine_logprob_gap"] = gap
        return self._finish_row(row, timing)

    # --- helpers --------------------------------------------------------------------------------
    def _budget(self) -> int:
        return self.config.num_steps

    @property
    def adapter(self) -> AdapterWeights:
        """The adapter the run moves (the GRPO policy)."""
        return self.policy

    def save_checkpoint(self, row: dict | None = None) -> Path:
        """Write a checkpoint of the current step now: adapter, AdamW state, counters."""
        row = row if row is not None else (self.history[-1] if self.history else {})
        state = {"generation": self.generation, "step": self.generation, "counters": self.counters, "row": row}
        return write_checkpoint(self.run_dir, self.generation, self.policy, self.trainer.optimizer_tensors(),
                                state, str(self.model_dir), keep=self.config.keep_checkpoints)

    def save_final(self) -> Path:
        """The policy adapter in PEFT format under run_dir/final_adapter (loadable by vLLM and peft)."""
        return save_adapter(self.policy, self.run_dir / "final_adapter", base_model=str(self.model_dir))

    def close(self) -> None:
        """Release the engine and the trainer's model."""
        if self.evaluator is not None:
            self.evaluator.close()
        self.trainer = None


def _engine_logprob_gap(completions: Sequence[Completion], first_pass: list[tuple[torch.Tensor, torch.Tensor]],
                        config: GRPOConfig) -> float | None:
    """Mean |trainer - engine| log-prob of the sampled tokens before the update (comparable at T = 1 only:
    the engine reports untempered log-probs)."""
    if config.temperature != 1.0 or any(c.logprobs is None for c in completions):
        return None
    total, count, row = 0.0, 0, 0
    for log_probs, mask in first_pass:  # (micro, kept) each
        for r in range(log_probs.shape[0]):
            trainer = log_probs[r][mask[r]]
            engine = torch.tensor(completions[row].logprobs, dtype=trainer.dtype)
            if engine.shape != trainer.shape:
                return None
            total += float((trainer - engine).abs().sum())
            count += engine.numel()
            row += 1
    return total / count if count else None
