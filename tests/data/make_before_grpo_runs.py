"""Write tests/data/before_grpo/: GRPO run folders made by the code before the ES and GRPO run code was
restructured (a scoring plan, the ``kl_penalty`` setting, ConfigError's checks in a module of their
own; commit 5c54530), stopped part-way, for tests/test_grpo_full.py to resume with today's code:

- ``lora``: ``policy_weights: lora`` on a real vLLM engine (AdamW on the LoRA tensors, a KL penalty
  to the base model, two micro-batches a step, scored after every step);
- ``full``: ``policy_weights: full`` on the same engine (AdamW on the model's q_proj and v_proj
  weights of layer 1, written into the engine in place after each step; the checkpoints hold those
  weights and AdamW's state in float32), scored at steps 0, 3 and 4 (``eval_every`` 3 and the
  budget's last step), so the folder's last two rows have no scores.

Each ran 2 of its 4 steps with a checkpoint after each (both kept: ``keep_checkpoints`` 2), then
stopped (``run.run(2)``, ``run.close()``); the writer's lock file was removed afterwards:

    git worktree add /tmp/old5c 5c54530
    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 PYTHONPATH=/tmp/old5c \\
        python tests/data/make_before_grpo_runs.py tests/data/before_grpo

The settings are ``SETTINGS`` below; the test imports them to run the same settings uninterrupted.
tiny-random, about 20 s, 250 KB (150 KB of it the two float32 checkpoints of ``full``).
"""
from __future__ import annotations

import sys
from pathlib import Path

COMMON = dict(model="tiny-random", task="conciseness", target_modules=["q_proj", "v_proj"], group_size=4,
              prompts_per_step=2, max_new_tokens=6, max_model_len=256, kv_cache_gb=0.0625, beta=0.05,
              checkpoint_every=1, num_steps=4, seed=11)
SETTINGS = {
    "lora": dict(COMMON, lora_rank=2, lora_alpha=2.0, learning_rate=1e-2, micro_batch_size=4, eval_every=1),
    "full": dict(COMMON, policy_weights="full", layers_to_transform=[1], learning_rate=1e-3, eval_every=3),
}
STOP = 2  # steps run before the folder was saved
ENGINE = dict(max_loras=2, max_lora_rank=8, max_model_len=256, kv_cache_gb=0.0625)


def main(out: str) -> None:
    from evolm_lib.config import GRPOConfig
    from evolm_lib.engines.vllm.engine import VLLMEvaluator  # the names of the code that runs this
    from evolm_lib.models import resolve_model
    from evolm_lib.train.grpo import GRPORun

    engine = VLLMEvaluator(str(resolve_model("tiny-random")), **ENGINE)
    try:
        for name, settings in SETTINGS.items():
            run = GRPORun.create(GRPOConfig.from_dict(settings), Path(out) / name, evaluator=engine)
            run.run(STOP)
            run.close()  # the shared engine serves the model folder's weights again
    finally:
        engine.close()


if __name__ == "__main__":
    main(sys.argv[1])
