"""Runs on the model's own weights with the engine split over two CPU processes
(tensor_parallel_size 2) against the same runs on one: ES full and EGGROLL (rows, and a run reopened
after its first generation), GRPO on the model's weights, and ES with the split engine in a Ray actor."""
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


ENGINE = dict(max_loras=8, max_lora_rank=8, max_model_len=256, kv_cache_gb=0.0625)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """An engine on one process and one split over two, shared by the runs (a run serves the model
    folder's weights again when it closes)."""
    from evolm_lib.engines.vllm import startup
    from evolm_lib.engines.vllm.engine import VLLMEngine

    started = {1: VLLMEngine(str(tiny_model_dir), **ENGINE)}
    with pytest.MonkeyPatch.context() as patch:  # the suite binds each xdist worker to one core: the ranks choose theirs
        patch.delenv(startup.CPU_BIND_ENV, raising=False)
        started[2] = VLLMEngine(str(tiny_model_dir), **ENGINE, tensor_parallel_size=2)
    yield started
    for engine in started.values():
        engine.close()


def _run(config, run_dir, engine, steps: int | None = None, run_class=ESRun) -> None:
    run = run_class.open(config, run_dir, engine=engine)
    try:
        run.run(steps)
    finally:
        run.close()


@pytest.mark.parametrize("mode", ["full", "eggroll"])
def test_two_ranks_give_one_ranks_rows_and_resume_to_them(mode, engines, tmp_path):
    one = ESConfig(**BASE, es_mode=mode)
    two = ESConfig(**BASE, es_mode=mode, tensor_parallel_size=2)
    _run(one, tmp_path / "one", engines[1])
    _run(two, tmp_path / "two", engines[2], 1)  # a run stopped after its first generation, then opened again
    _run(two, tmp_path / "two", engines[2])
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


def test_grpo_on_the_models_weights_syncs_two_ranks_to_one_ranks_rows(engines, tmp_path):
    from evolm_lib.config import GRPOConfig
    from evolm_lib.train.grpo import GRPORun

    base = dict(model="tiny-random", task="conciseness", policy_weights="full", target_modules=("q_proj", "o_proj"),
                group_size=4, prompts_per_step=2, num_steps=2, max_new_tokens=6, max_model_len=256, kv_cache_gb=0.0625,
                eval_every=1, learning_rate=1e-3)
    for name, size in (("one", 1), ("two", 2)):
        _run(GRPOConfig(**base, tensor_parallel_size=size), tmp_path / name, engines[size], run_class=GRPORun)
    rows_one, rows_two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert len(rows_one) == len(rows_two) == 3
    gap = "grpo/engine_logprob_gap"  # the engine's log-probabilities: its split products summed across ranks
    for a, b in zip(rows_one, rows_two):
        assert {k: v for k, v in a.items() if k != gap} == {k: v for k, v in b.items() if k != gap}
        assert b.get(gap) == pytest.approx(a.get(gap), abs=1e-7)


def test_a_ray_actor_serves_a_split_engine_with_the_local_ones_rows(engines, tmp_path):
    """One Ray engine of two ranks (its actor holds two CPU slices of one node) against the same split
    engine in this process."""
    ray = pytest.importorskip("ray")
    from test_ray_engine import start_local_ray

    from evolm_lib.engines import make_engine

    config = ESConfig(**BASE, es_mode="full", tensor_parallel_size=2)
    _run(config, tmp_path / "local", engines[2])
    if ray.is_initialized():
        ray.shutdown()
    start_local_ray(ray)
    try:
        on_ray = config.replace(engine_host="ray", num_engines=1)
        engine = make_engine(on_ray)
        try:
            _run(on_ray, tmp_path / "ray", engine)
        finally:
            engine.close()
    finally:
        ray.shutdown()
    assert _rows(tmp_path / "ray") == _rows(tmp_path / "local")
