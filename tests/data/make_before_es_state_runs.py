"""Write tests/data/before_es_state/: run folders made by the code before an ES generation became
an explicit state with pure ``ask`` and ``tell``, a scoring plan and a typed engine client (commit
5c54530), stopped part-way, for tests/test_es_run.py to resume with today's code:

- ``lora``: es_mode lora on a real vLLM engine (resident slots; the mean's scoring rides in the
  population's call);
- ``full``: es_mode full on the same engine (the model's own weights, a seed log and snapshots);
- ``eggroll``: es_mode eggroll on the same engine (low-rank members served from LoRA slots).

    git worktree add /tmp/orig 5c54530
    VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONPATH=/tmp/orig python tests/data/make_before_es_state_runs.py tests/data/before_es_state

The settings are ``SETTINGS`` below; the test imports them to run the same settings uninterrupted.
tiny-random, a minute, a few hundred KB.
"""
from __future__ import annotations

import sys
from pathlib import Path

COMMON = dict(model="tiny-random", task="conciseness", population_size=4, sigma=0.1, learning_rate=0.05,
              lora_rank=1, target_modules=["q_proj", "v_proj"], max_new_tokens=6, max_model_len=256,
              kv_cache_gb=0.0625, eval_every=1, checkpoint_every=1, num_generations=4, seed=11)
SETTINGS = {
    "lora": dict(COMMON, optimizer="adam"),
    "full": dict(COMMON, es_mode="full", checkpoint_every=2),
    "eggroll": dict(COMMON, es_mode="eggroll", noise_rank=2, checkpoint_every=2),
}
STOP = 2  # generations run before the folder was saved
ENGINE = dict(max_loras=8, max_lora_rank=8, max_model_len=256, kv_cache_gb=0.0625)


def main(out: str) -> None:
    from evolm_lib.config import ESConfig
    from evolm_lib.engines.vllm.engine import VLLMEvaluator  # the names of the code that runs this
    from evolm_lib.models import resolve_model
    from evolm_lib.train.es import ESRun

    engine = VLLMEvaluator(str(resolve_model("tiny-random")), **ENGINE)
    try:
        for name, settings in SETTINGS.items():
            run = ESRun.create(ESConfig.from_dict(settings), Path(out) / name, evaluator=engine)
            run.run(STOP)
            run.close()
    finally:
        engine.close()


if __name__ == "__main__":
    main(sys.argv[1])
