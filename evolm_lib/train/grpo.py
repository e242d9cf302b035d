"""GRPO runs on the same LoRA adapters, engine, tasks and run folders as ES; resumable to the bit.

A step: the policy adapter -> G seeded samples per prompt from the engine (vLLM) -> rewards ->
group-normalised advantages -> log-probs and gradients with transformers + peft on exactly the
tokens the engine produced -> AdamW on the LoRA tensors -> metrics row and checkpoint.

With ``policy_weights: full`` the policy is the model weights themselves (those of ``grpo_weights``):
AdamW moves the trainer's float32 copy, and after each step the new weights are written into the
resident engine in place (``resident_weights(...).load``: the ``es_mode: full`` path, no reload, no
files; on every engine with ``engine_host: ray``); the engine then serves the policy as its base
model. A checkpoint holds the trained weights and AdamW's state in float32, so a resume continues
bit for bit; ``save_final`` writes ``final_model/``.

References:
- GRPO (DeepSeekMath): https://arxiv.org/abs/2402.03300
- Stanford CS336 assignment 5, whose primitives `evolm_lib.grpo.primitives` implements:
  https://github.com/stanford-cs336/assignment5-alignment
- Dr. GRPO, constant length normaliser: https://arxiv.org/abs/2503.20783
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from ..config import ConfigError, GRPOConfig
from ..engines import Engine, SamplingSettings, TokenScorer, WeightsEngine, make_engine
from ..lora import AdapterWeights
from ..clock import timed
from ..runs import RunState, list_checkpoints, load_checkpoint
from ..seeds import derive_seed
from ..tasks import Example, Task
from ..types import Completion
from ..grpo.primitives import compute_group_normalized_rewards
from .loop import RunLoop, percentile
from .policy import PolicyTrainer, engine_logprob_gap, rollout_batch
from .policy_process import PolicyProcess, make_policy


# ---------------------------------------------------------------------------- the run


class GRPORun(RunLoop):
    """One GRPO run bound to a run folder, with ESRun's API; ``generation`` counts steps done."""

    kind = "grpo"
    config_class = GRPOConfig

    def __init__(self, state: RunState, *, trainer: PolicyTrainer | PolicyProcess, run_dir: Path, engine: Engine, task: Task,
                 model_dir: Path):
        super().__init__(state, run_dir=run_dir, engine=engine, task=task, model_dir=model_dir)
        self.trainer = trainer
        self.engine_weights = None  # policy_weights full: the engine's resident copy of the trained weights
        if trainer.full:
            targets, layers = self.config.weight_targets()
            self.engine_weights = engine.resident_weights(targets, noise="full", layers_to_transform=layers)
            self.sync_engine()
        self.policy = None if trainer.full else trainer.adapter()

    @classmethod
    def _build(cls, state: RunState, *, run_dir: Path, engine: Engine | None, task: Task,
               model_dir: Path) -> "GRPORun":
        config = state.config
        full = config.policy_weights == "full"
        if full and engine is not None and not isinstance(engine, WeightsEngine):
            raise ConfigError(f"policy_weights: full writes the trained weights into the engine in place, which "
                              f"{type(engine).__name__} cannot (use vLLM, HF or Ray engines)")
        trainer = make_policy(model_dir, state.adapter, config)  # here, or in a process of its own
        try:
            tensors = dict(state.optimizer_tensors or {})
            weights = {k.removeprefix(WEIGHTS_PREFIX): tensors.pop(k) for k in list(tensors) if k.startswith(WEIGHTS_PREFIX)}
            if weights:
                trainer.set_weights(weights)
            if tensors:
                trainer.load_optimizer_tensors(tensors)
            engine = engine or make_engine(config)  # sized for one policy adapter per call
            return cls(state, trainer=trainer, run_dir=run_dir, engine=engine, task=task, model_dir=model_dir)
        except BaseException:
            trainer.close()  # a policy process ends with the failed start
            raise

    @staticmethod
    def _moves_adapter(config: GRPOConfig) -> bool:
        return config.policy_weights == "lora"  # full: the policy is the model weights, no adapter is built

    def placement(self) -> dict:
        """Where the policy updates and the attention it resolved (``policy_attention: auto``)."""
        return {**super().placement(), "policy_process": "own" if isinstance(self.trainer, PolicyProcess) else "same",
                "policy_attention": self.trainer.attention}

    def sync_engine(self) -> float:
        """policy_weights full: write the trainer's weights into the engine (cast to its dtype, in place);
        returns the seconds it took."""
        started = time.perf_counter()
        flat = self.trainer.flat_weights()
        # an engine in this process takes the vector where it is (one device-to-device copy); Ray
        # engines get it through the object store, from the host
        self.engine_weights.load({"master": flat.cpu() if self.config.engine_host == "ray" else flat})
        if flat.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    def row_header(self) -> dict:
        """GRPO rows also carry ``step`` (= generation)."""
        return {"step": self.generation, **super().row_header()}

    # --- the loop ------------------------------------------------------------------------------
    def rollouts(self, examples: Sequence[Example], step: int) -> list[Completion]:
        """G seeded samples per example from the current policy, group by group, in ONE engine call."""
        config = self.config
        prompts = [self.task.prompt(e) for e in examples for _ in range(config.group_size)]
        sampling = SamplingSettings(
            max_new_tokens=config.max_new_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            seed=derive_seed(config.seed, "sampling", step),  # each of the G copies has its own prompt index, so its own seed
            logprobs=True,
        )
        # A fresh AdapterWeights each step: the engine gives every call new LoRA names and ids.
        return self.engine.generate(prompts, [self.policy], sampling)[0]

    def train_step(self) -> dict:
        """One GRPO step's update: rollouts, rewards, advantages, AdamW; returns its metrics row."""
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
        self._begin_update()
        with timed(timing, "update_s"):
            encode = self.engine.encode if isinstance(self.engine, TokenScorer) else self.trainer.encode
            prompt_ids = [encode(self.task.prompt(e)) for e in examples]
            completion_ids = [list(c.token_ids) for c in completions]
            too_large = max((t for ids in completion_ids for t in ids), default=0)
            if too_large >= self.trainer.vocab_size:
                raise ValueError(f"the engine returned token id {too_large} beyond the model's vocabulary ({self.trainer.vocab_size})")
            batch = rollout_batch([p for p in prompt_ids for _ in range(config.group_size)], completion_ids,
                                  self.trainer.pad_token_id)
            stats = self.trainer.train(batch, raw_rewards, advantages)
            first_pass = stats.pop("_first_pass")
            if not self.trainer.full:
                self.policy = self.trainer.adapter()
        if self.trainer.full:
            timing["sync_s"] = self.sync_engine()
        self.generation = step
        self.counters["completions"] = self.counters.get("completions", 0) + len(completions)
        self.counters["tokens"] = self.counters.get("tokens", 0) + sum(c.num_tokens for c in completions)

        grouped = raw_rewards.view(len(examples), config.group_size)  # (prompts, group_size)
        best, worst = grouped.argmax(dim=1).tolist(), grouped.argmin(dim=1).tolist()
        row = {
            "generation": step,
            **self.row_header(),
            "train/reward_mean": float(raw_rewards.mean()),
            "train/reward_std": float(raw_rewards.std(unbiased=False)),
            "train/reward_best": float(raw_rewards.max()),
            "train/reward_worst": float(raw_rewards.min()),
            "train/reward_p20": percentile(raw_rewards, 0.2),
            "train/reward_p80": percentile(raw_rewards, 0.8),
            "grpo/rewards": raw_rewards.tolist(),
            "grpo/zero_std_group_fraction": meta["zero_std_group_fraction"],
            "grpo/response_tokens_mean": sum(c.num_tokens for c in completions) / len(completions),
            **stats,
            **self._norm_keys(),
            "best_completions": [completions[p * config.group_size + b].text for p, b in enumerate(best)],
            "worst_completions": [completions[p * config.group_size + w].text for p, w in enumerate(worst)],
            "prompts": [e.prompt for e in examples],
        }
        gap = engine_logprob_gap(completions, first_pass, config)
        if gap is not None:
            row["grpo/engine_logprob_gap"] = gap
        row.update({f"time/{key}": value for key, value in timing.items()})
        return row

    # --- helpers --------------------------------------------------------------------------------
    def _budget(self) -> int:
        return self.config.num_steps

    def _norm_keys(self) -> dict:
        """``grpo/adapter_norm`` (LoRA), or ``grpo/weights_norm``: the trained weights' L2 norm (full)."""
        if self.trainer.full:
            flat = self.trainer.flat_weights()
            return {"grpo/weights_norm": float(torch.linalg.vector_norm(flat, dtype=torch.float64))}
        return {"grpo/adapter_norm": float(sum((v.float() ** 2).sum() for v in self.policy.tensors.values()) ** 0.5)}

    @property
    def adapter(self) -> AdapterWeights | None:
        """The adapter the run moves (the GRPO policy); None with policy_weights full, whose weights
        the engine serves as its base model."""
        return self.policy

    def save_checkpoint(self, row: dict | None = None) -> Path:
        """Write a checkpoint of the current step now: adapter (or the trained weights, float32), AdamW state, counters."""
        state = {**self._checkpoint_state(row), "step": self.generation}
        tensors = self.trainer.optimizer_tensors()
        if self.trainer.full:
            tensors.update({WEIGHTS_PREFIX + name: value.cpu() for name, value in self.trainer.weights().items()})
        return self._write_checkpoint(self.policy, tensors, state)

    @contextmanager
    def serving_base(self) -> Iterator[None]:
        """policy_weights full: inside the block the engine serves the model folder's weights (the base
        model), after it the policy again (for KL to the base model, as ``ModelWeights.serving_base``)."""
        self.engine_weights.load({"master": base_weights(self.model_dir, self.engine_weights.shapes)})
        try:
            yield
        finally:
            self.sync_engine()

    def replay(self, generations: Iterable[int]) -> Iterator[int]:
        """policy_weights full: serve the trained weights of each kept checkpoint among ``generations``
        (ascending), yielding its step while the engine serves it; afterwards the current policy again."""
        kept = {int(path.name): path for path in list_checkpoints(self.run_dir)}
        try:
            for generation in sorted(set(int(g) for g in generations) & set(kept)):
                tensors = load_checkpoint(kept[generation])[1]
                weights = {k.removeprefix(WEIGHTS_PREFIX): v for k, v in tensors.items() if k.startswith(WEIGHTS_PREFIX)}
                self.engine_weights.load({"master": torch.cat([weights[n].float().reshape(-1) for n in sorted(weights)])})
                yield generation
        finally:
            self.sync_engine()

    def save_final(self) -> Path:
        """The policy as a PEFT adapter under run_dir/final_adapter, or, with policy_weights full, the
        model under run_dir/final_model (safetensors in the engine's dtype, config, tokenizer)."""
        if not self.trainer.full:
            return super().save_final()
        self._check_writer()
        self._check_committed()
        return self.trainer.save_model(self.run_dir / "final_model", self.config.dtype)

    def close(self) -> None:
        """Release the run folder, the engine (if the run started it; a shared one serves the model
        folder's weights again) and the trainer's model (a policy process ends)."""
        try:
            if self.engine_weights is not None:
                if not self._owns_engine:
                    self.engine_weights.load({"master": base_weights(self.model_dir, self.engine_weights.shapes)})
                self.engine_weights.close()
                self.engine_weights = None
            super().close()
        finally:
            if self.trainer is not None:
                self.trainer.close()
            self.trainer = None


WEIGHTS_PREFIX = "policy_weights/"
"""Checkpoint tensors of policy_weights full: the trained weights, beside AdamW's state."""


def base_weights(model_dir: Path, shapes: dict) -> torch.Tensor:
    """The model folder's weights of ``shapes`` as one float32 vector in sorted-name order."""
    from ..lora import read_base_weights

    names = sorted(shapes)
    found = read_base_weights(model_dir, names)
    return torch.cat([found[name].to(torch.float32).reshape(-1) for name in names])
