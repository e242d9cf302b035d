"""GRPO runs on the same LoRA adapters, engine, tasks and run folders as ES; resumable to the bit.

A step: the policy adapter -> G seeded samples per prompt from the engine (vLLM) -> rewards ->
group-normalised advantages -> log-probs and gradients with transformers + peft on exactly the
tokens the engine produced -> AdamW on the LoRA tensors -> metrics row and checkpoint.

References:
- GRPO (DeepSeekMath): https://arxiv.org/abs/2402.03300
- Stanford CS336 assignment 5, whose primitives `evolm_lib.grpo.primitives` implements:
  https://github.com/stanford-cs336/assignment5-alignment
- Dr. GRPO, constant length normaliser: https://arxiv.org/abs/2503.20783
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..config import GRPOConfig
from ..engines import Evaluator, SamplingSettings, TokenScorer, make_evaluator
from ..lora import AdapterWeights
from ..clock import timed
from ..runs import RunState
from ..seeds import derive_seed
from ..tasks import Example, Task
from ..types import Completion
from ..grpo.primitives import compute_group_normalized_rewards
from .loop import RunLoop, percentile
from .policy import PolicyTrainer, engine_logprob_gap, rollout_batch


# ---------------------------------------------------------------------------- the run


class GRPORun(RunLoop):
    """One GRPO run bound to a run folder, with ESRun's API; ``generation`` counts steps done."""

    kind = "grpo"
    config_class = GRPOConfig

    def __init__(self, state: RunState, *, trainer: PolicyTrainer, run_dir: Path, evaluator: Evaluator, task: Task,
                 model_dir: Path):
        super().__init__(state, run_dir=run_dir, evaluator=evaluator, task=task, model_dir=model_dir)
        self.trainer = trainer
        self.policy = trainer.adapter()

    @classmethod
    def _build(cls, state: RunState, *, run_dir: Path, evaluator: Evaluator | None, task: Task,
               model_dir: Path) -> "GRPORun":
        config = state.config
        trainer = PolicyTrainer(model_dir, state.adapter, config)
        if state.optimizer_tensors is not None:
            trainer.load_optimizer_tensors(state.optimizer_tensors)
        evaluator = evaluator or make_evaluator(config)  # sized for one policy adapter per call
        return cls(state, trainer=trainer, run_dir=run_dir, evaluator=evaluator, task=task, model_dir=model_dir)

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
        # A fresh AdapterWeights each step: the evaluator gives every call new LoRA names and ids.
        return self.evaluator.generate(prompts, [self.policy], sampling)[0]

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
        with timed(timing, "update_s"):
            encode = self.evaluator.encode if isinstance(self.evaluator, TokenScorer) else self.trainer.encode
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
            "grpo/adapter_norm": float(sum((v.float() ** 2).sum() for v in self.policy.tensors.values()) ** 0.5),
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

    @property
    def adapter(self) -> AdapterWeights:
        """The adapter the run moves (the GRPO policy)."""
        return self.policy

    def save_checkpoint(self, row: dict | None = None) -> Path:
        """Write a checkpoint of the current step now: adapter, AdamW state, counters."""
        state = {**self._checkpoint_state(row), "step": self.generation}
        return self._write_checkpoint(self.policy, self.trainer.optimizer_tensors(), state)

    def close(self) -> None:
        """Release the run folder, the engine (if the run started it) and the trainer's model."""
        super().close()
        self.trainer = None
