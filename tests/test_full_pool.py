"""``python -m evolm_lib.benchmark full-pool`` on the CPU: es_mode full on one Ray engine, then on two
(CPU slices of a local 2-CPU cluster), with tiny-random and a population of 4. It checks what the
command reports: the JSON's structure, speed-ups computed from the measured generation times, the
two engines' metrics rows equal to the one engine's, and a count stopped by SIGTERM reported from
the rows it wrote. Starting the engines (one, then two) takes
a minute or more on this shared 2-core machine: the test is ``slow``."""
from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time

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
    assert (config.engine_host, config.num_engines, config.engines_per_gpu) == ("ray", 4, 4)
    assert not config.deterministic and config.dtype == "float32"  # a CPU; on a GPU: bfloat16 and deterministic
    gpu = full_pool.pool_config("tiny-random", 1, population=30, generations=3, new_tokens=100, gpu=True, kv_cache_gb=None)
    assert gpu.deterministic and gpu.dtype == "bfloat16" and gpu.noise_device == "cuda"


def test_each_engine_of_a_count_above_one_gets_its_share_of_the_card_under_mps():
    assert [full_pool.thread_percentage("auto", n) for n in (1, 2, 3, 4, 8)] == [None, 50, 34, 25, 13]
    assert [full_pool.thread_percentage("40", n) for n in (1, 4)] == [None, 40]  # the reference has the whole card
    assert full_pool.thread_percentage("none", 4) is None
    with pytest.raises(ValueError, match="mps_thread_percentage: 2 options for 3 engine counts"):  # before Ray
        full_pool.full_pool("tiny-random", [1, 2, 2], 4, 2, 8, False, 0.0625, mps_thread_percentage=["none", "auto"])
    config = full_pool.pool_config("tiny-random", 4, population=30, generations=3, new_tokens=100, gpu=False,
                                   kv_cache_gb=0.0625, mps_thread_percentage=25)
    assert config.mps_thread_percentage == 25


def test_bad_engine_counts_are_refused_before_any_engine():
    for engines in ("2,4", "1,x", "1,0"):
        with pytest.raises(SystemExit):
            full_pool.main(["--model", "tiny-random", "--engines", engines])
    with pytest.raises(SystemExit):
        full_pool.main(["--model", "tiny-random", "--engines", "1,2", "--population", "3"])
    for share in ("0", "101", "half", "none,auto,auto", "auto,"):
        with pytest.raises(SystemExit):
            full_pool.main(["--model", "tiny-random", "--engines", "1,2", "--mps-thread-percentage", share])


@pytest.mark.slow
def test_full_pool_measures_one_engine_then_two_and_keeps_a_count_cut_short(ray_cluster, tmp_path, capsys):
    """One engine's count runs to its end; the two engines' count is stopped by SIGTERM (what a device
    call's time limit sends) after a few generations: the JSON and the table keep what it measured."""
    out, kept = tmp_path / "full_pool.json", tmp_path / "kept"

    def stop_the_second_count():  # SIGTERM once the two engines have written two generations' rows
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:  # the walk can meet a checkpoint's temporary folder as it is renamed away
                rows = list(kept.rglob("engines_2_sm50/metrics.jsonl"))
            except FileNotFoundError:
                continue
            if rows and len(rows[0].read_text().splitlines()) >= 3:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=stop_the_second_count, daemon=True)
    watcher.start()
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        full_pool.main(["--model", "tiny-random", "--engines", "1,2", "--generations", "10", "--population", "4",
                        "--json", str(out), "--workdir", str(kept), "--mps-thread-percentage", "none,auto"])
    watcher.join()
    assert stopped.value.code == 128 + signal.SIGTERM and signal.getsignal(signal.SIGTERM) is previous
    result = json.loads(out.read_text())
    folders = sorted(part for path in kept.rglob("metrics.jsonl") for part in path.parts if part.startswith("engines_"))
    assert folders == ["engines_1", "engines_2_sm50"], "--workdir keeps each count's run folder and its metrics rows"
    assert result["settings"]["population"] == 4 and result["settings"]["device"] == "cpu"
    one, two = result["counts"]
    assert (one["engines"], two["engines"]) == (1, 2) and two["engines_per_gpu"] == 2
    # on a CPU the share reaches the engines (as CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) and changes nothing
    assert (one["mps_thread_percentage"], two["mps_thread_percentage"]) == (None, 50)
    assert result["settings"]["mps_thread_percentage"] == "none,auto" and two["engine_sm_count"] == [None, None]
    assert "cut_short" not in one and len(one["generation_s_each"]) == 9  # generations 2-10
    assert two["cut_short"] is True and 2 <= two["generations_done"] < 10
    assert len(two["generation_s_each"]) == two["generations_done"] - 1  # from generation 2 to the last written
    for count in (one, two):
        assert count["generation_s"] == statistics.median(count["generation_s_each"]) and count["generation_s"] > 0
        assert 0 < count["engine_share"] <= 1 and count["start_s"] > 0 and count["cards"] == 0  # CPU slices
        assert count["rows_identical"] is True  # the cut count's rows are the first rows of one engine's
    assert two["speedup"] == one["generation_s"] / two["generation_s"] and one["speedup"] == 1.0
    printed = capsys.readouterr().out
    assert "(50 % of the SMs each)" in printed and "(reference)" in printed and f"(cut short after {two['generations_done']} generations)" in printed
