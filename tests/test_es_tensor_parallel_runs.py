"""ES runs on the model's own weights with the engine split over two CPU processes
(tensor_parallel_size 2) against the same runs on one: the rows, and a run killed and resumed at
two ranks against an uninterrupted one."""
from __future__ import annotations

import pytest

from evolm_lib.config import ESConfig
from evolm_lib.runs import read_metrics
from evolm_lib.train.es import ESRun

pytestmark = pytest.mark.slow

BASE = dict(model="tiny-random", task="conciseness", population_size=4, sigma=0.1, learning_rate=0.05, lora_rank=1,
            target_modules=("q_proj", "v_proj", "o_proj", "down_proj"), max_new_tokens=6, max_model_len=256,
            kv_cache_gb=0.0625, eval_every=1, num_generations=2, noise_scheme="tiled", checkpoint_every=1)


def _rows(run_dir) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in read_metrics(run_dir)]


def _run(config: ESConfig, run_dir, generations: int | None = None) -> None:
    run = ESRun.open(config, run_dir)
    try:
        run.run(generations)
    finally:
        run.close()


@pytest.mark.parametrize("mode", ["full", "eggroll"])
def test_two_ranks_give_one_ranks_rows_and_resume_to_them(mode, tmp_path):
    one = ESConfig(**BASE, es_mode=mode)
    two = ESConfig(**BASE, es_mode=mode, tensor_parallel_size=2)
    _run(one, tmp_path / "one")
    _run(two, tmp_path / "two", 1)  # a run stopped after its first generation, then opened again
    _run(two, tmp_path / "two")
    rows_one, rows_two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert len(rows_two) == len(rows_one) == 3  # the start's scoring and two generations
    for a, b in zip(rows_one, rows_two):
        assert a.keys() == b.keys()
        for key in a:
            if key == "es/update_norm" and mode == "full":
                # the same update: its norm summed over the cards' slices in another order
                assert b[key] == pytest.approx(a[key], rel=1e-9)
            elif key == "es/update_norm":
                # EGGROLL's products of the factors' slices round otherwise in float32
                assert b[key] == pytest.approx(a[key], rel=1e-5)
            else:
                assert b[key] == a[key], key
