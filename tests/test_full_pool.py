"""``python -m evolm_lib.benchmark full-pool`` on the CPU: es_mode full on one Ray engine, then on two
(CPU slices of a local 2-CPU cluster), with tiny-random and a population of 4. It checks what the
command reports: the JSON's structure, speed-ups computed from the measured generation times, and
the two engines' metrics rows equal to the one engine's. Starting the engines (one, then two) takes
a minute or more on this shared 2-core machine: the test is ``slow``."""
from __future__ import annotations

import json
import statistics

import pytest

from evolm_lib.benchmark import full_pool
from test_ray_engine import ray_cluster  # noqa: F401 (the fixture: a local 2-CPU cluster for this module)


def test_the_settings_are_qiu_et_al_s_in_es_mode_full():
    config = full_pool.pool_config("tiny-random", 4, population=30, generations=3, new_tokens=100, gpu=False,
                                   kv_cache_gb=0.0625)
    assert (config.es_mode, config.es_weights, config.population_size, config.sigma, config.learning_rate) == \
           ("full", "all", 30, 1e-3, 5e-4)
    assert (config.fitness_shaping, config.max_new_tokens, config.prompts_per_step, config.temperature) == \
           ("z_score", 100, None, 0.0)
    assert (config.evaluator, config.num_engines, config.engines_per_gpu) == ("ray", 4, 4)
    assert not config.deterministic and config.dtype == "float32"  # a CPU; on a GPU: bfloat16 and deterministic
    gpu = full_pool.pool_config("tiny-random", 1, population=30, generations=3, new_tokens=100, gpu=True, kv_cache_gb=None)
    assert gpu.deterministic and gpu.dtype == "bfloat16" and gpu.noise_device == "cuda"


def test_bad_engine_counts_are_refused_before_any_engine():
    for engines in ("2,4", "1,x", "1,0"):
        with pytest.raises(SystemExit):
            full_pool.main(["--model", "tiny-random", "--engines", engines])
    with pytest.raises(SystemExit):
        full_pool.main(["--model", "tiny-random", "--engines", "1,2", "--population", "3"])


@pytest.mark.slow
def test_full_pool_measures_one_engine_then_two_on_the_cpu(ray_cluster, tmp_path, capsys):
    out = tmp_path / "full_pool.json"
    result = full_pool.main(["--model", "tiny-random", "--engines", "1,2", "--generations", "2", "--population", "4",
                             "--json", str(out), "--workdir", str(tmp_path / "kept")])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    kept = sorted(part for path in (tmp_path / "kept").rglob("metrics.jsonl") for part in path.parts
                  if part.startswith("engines_"))
    assert kept == ["engines_1", "engines_2"], "--workdir keeps each count's run folder and its metrics rows"
    assert result["settings"]["population"] == 4 and result["settings"]["device"] == "cpu"
    one, two = result["counts"]
    assert (one["engines"], two["engines"]) == (1, 2) and two["engines_per_gpu"] == 2
    for count in (one, two):
        assert len(count["generation_s_each"]) == 1 and count["generation_s_each"][0] > 0  # generation 2
        assert count["generation_s"] == statistics.median(count["generation_s_each"])
        assert 0 < count["engine_share"] <= 1 and count["start_s"] > 0 and count["cards"] == 0  # CPU slices
        assert count["rows_identical"] is True
    assert two["speedup"] == one["generation_s"] / two["generation_s"] and one["speedup"] == 1.0
    printed = capsys.readouterr().out
    assert "same rows" in printed and "(reference)" in printed and f"2: {two['speedup']:.2f}x" in printed
