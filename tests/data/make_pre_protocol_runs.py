"""Write tests/data/pre_protocol/: run folders made by the code before a generation became one
explicit step and what ES moves one protocol (commit ed0985a), stopped part-way, for
tests/test_runs.py to resume with today's code:

- ``full`` and ``eggroll``: es_mode full / eggroll on the HF engine (checkpoints that still hold an
  unused LoRA mean, a seed log and snapshots);
- ``riding``: a LoRA run on an engine that batches grids, stopped while its last checkpointed row
  waited for its scores to ride in the next call (``scores_pending`` in state.json).

    git archive ed0985a evolm_lib | tar -x -C /tmp/pre_protocol
    PYTHONPATH=/tmp/pre_protocol python tests/data/make_pre_protocol_runs.py tests/data/pre_protocol

The settings are ``SETTINGS`` below; the test imports them to run the same settings uninterrupted.
tiny-random, a few seconds, a few hundred KB.
"""
from __future__ import annotations

import sys
from pathlib import Path

COMMON = dict(model="tiny-random", target_modules=["q_proj", "v_proj"], population_size=4, num_generations=5,
              sigma=0.02, learning_rate=0.05, seed=7)
SETTINGS = {
    "full": dict(COMMON, es_mode="full", engine="hf", max_new_tokens=4, checkpoint_every=2),
    "eggroll": dict(COMMON, es_mode="eggroll", engine="hf", max_new_tokens=4, checkpoint_every=2),
    "riding": dict(COMMON, eval_every=1, checkpoint_every=1),  # the synthetic engine: lengths move with the adapter
}
STOP = 3  # generations run before the folder was saved


def main(out: str) -> None:
    from evolm_lib.config import ESConfig
    from evolm_lib.engines.synthetic import SyntheticEngine
    from evolm_lib.train.es import ESRun

    class Batching(SyntheticEngine):
        batches_grids = True  # the mean's scoring rides in the population's call

    out_dir = Path(out)
    for name in ("full", "eggroll"):
        run = ESRun.create(ESConfig.from_dict(SETTINGS[name]), out_dir / name)
        run.run(STOP)
        run.close()
    run = ESRun.create(ESConfig.from_dict(SETTINGS["riding"]), out_dir / "riding", engine=Batching())
    for _ in range(STOP):
        run._advance(SETTINGS["riding"]["num_generations"])  # generation 3 is checkpointed, its row pending
    run.close()


if __name__ == "__main__":
    main(sys.argv[1])
