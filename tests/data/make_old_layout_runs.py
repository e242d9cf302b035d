"""Write tests/data/old_layout/: an ES and a GRPO run folder made by the code before the runs moved to
evolm_lib/train/ (commit 3456869), stopped part-way, for tests/test_runs.py to resume with today's code.

    git archive 3456869 | tar -x -C /tmp/oldlayout
    PYTHONPATH=/tmp/oldlayout python tests/data/make_old_layout_runs.py tests/data/old_layout

The settings are ``OLD_ES`` and ``OLD_GRPO`` below; the test imports them to run the same settings
uninterrupted and compare. Runs on the synthetic engine and tiny-random (a few seconds, ~100 KB).
"""
from __future__ import annotations

import sys
from pathlib import Path

# tiny-random, q and v of both layers; checkpoints every 2 generations and a momentum buffer, so the
# resume also drops a row past the checkpoint and restores optimizer state
OLD_ES = dict(model="tiny-random", target_modules=["q_proj", "v_proj"], sigma=0.02, learning_rate=0.05,
              optimizer="sgd", momentum=0.5, population_size=4, num_generations=5, checkpoint_every=2, seed=7)
OLD_ES_STOP = 3  # generations run before the folder was saved: checkpoint 2, rows 0..3
OLD_GRPO = dict(model="tiny-random", target_modules=["q_proj", "v_proj"], lora_rank=2, lora_alpha=2.0,
                max_new_tokens=4, loss_type="no_baseline", normalize_by_std=False, group_size=2,
                learning_rate=1e-2, num_steps=3, seed=1)
OLD_GRPO_STOP = 2


def main(out: str) -> None:
    from evolm_lib.config import ESConfig, GRPOConfig
    from evolm_lib.engines.synthetic import SyntheticEngine
    from evolm_lib.es.run import ESRun  # the layout before evolm_lib/train/
    from evolm_lib.grpo.run import GRPORun

    out_dir = Path(out)
    es_run = ESRun.create(ESConfig.from_dict(OLD_ES), out_dir / "es", engine=SyntheticEngine())
    es_run.run(OLD_ES_STOP)
    es_run.close()
    grpo_run = GRPORun.create(GRPOConfig.from_dict(OLD_GRPO), out_dir / "grpo", engine=SyntheticEngine())
    grpo_run.run(OLD_GRPO_STOP)
    grpo_run.close()


if __name__ == "__main__":
    main(sys.argv[1])
