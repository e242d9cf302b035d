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


def test_grpo_on_the_models_weights_syncs_two_ranks_to_one_ranks_rows(tmp_path):
    from evolm_lib.config import GRPOConfig
    from evolm_lib.train.grpo import GRPORun

    base = dict(model="tiny-random", task="conciseness", policy_weights="full", target_modules=("q_proj", "o_proj"),
                group_size=4, prompts_per_step=2, num_steps=2, max_new_tokens=6, max_model_len=256, kv_cache_gb=0.0625,
                eval_every=1, learning_rate=1e-3)
    for name, size in (("one", 1), ("two", 2)):
        run = GRPORun.open(GRPOConfig(**base, tensor_parallel_size=size), tmp_path / name)
        try:
            run.run()
        finally:
            run.close()
    rows_one, rows_two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert len(rows_one) == len(rows_two) == 3
    gap = "grpo/engine_logprob_gap"  # the engine's log-probabilities: its split products summed across ranks
    for a, b in zip(rows_one, rows_two):
        assert {k: v for k, v in a.items() if k != gap} == {k: v for k, v in b.items() if k != gap}
        assert b.get(gap) == pytest.approx(a.get(gap), abs=1e-7)
