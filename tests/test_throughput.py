"""The one throughput measurement (evolm_lib.throughput): tokens counted from the completions, rates
and ratios computed from the measured calls, on a real vLLM engine (tiny-random)."""
from __future__ import annotations

import statistics

import pytest

from evolm_lib.engines import CompletionTable, SamplingSettings
from evolm_lib.throughput import (
    ThroughputSpec, bench_prompts, format_throughput, mean_adapter, measure_es_overhead, measure_throughput,
    population_of, ratios,
)
from evolm_lib.types import Completion


def _completion(tokens: int) -> Completion:
    return Completion(text="x" * tokens, token_ids=tuple(range(tokens)), finish_reason="length")


def test_a_completion_table_counts_every_completions_tokens():
    table = CompletionTable([[_completion(3), _completion(5)], [_completion(0), _completion(7)]], {"generate_s": 1.0})
    assert table.num_tokens == 3 + 5 + 0 + 7
    assert CompletionTable().num_tokens == 0


def test_ratios_divide_the_named_rows_rates_and_skip_rows_not_measured():
    rows = [{"name": "vllm base", "tokens_per_s": 200.0}, {"name": "vllm in_place", "tokens_per_s": 150.0},
            {"name": "vllm files", "tokens_per_s": 50.0}]
    assert ratios(rows) == {"vllm in_place / vllm base": 0.75, "vllm files / vllm base": 0.25}
    assert ratios(rows, [("vllm base", "vllm files")]) == {"vllm base / vllm files": 4.0}


@pytest.mark.parametrize("setting, value", [("population", 0), ("prompts", 0), ("new_tokens", 0), ("repeats", 0),
                                            ("sigma", 0.0), ("noise_device", "tpu")])
def test_a_bad_setting_is_refused_by_name(setting, value):
    with pytest.raises(ValueError, match=setting):
        ThroughputSpec(model="tiny-random", **{setting: value})


def test_every_path_counts_the_tokens_its_completions_hold(tiny_vllm):
    spec = ThroughputSpec(model="tiny-random", population=4, prompts=2, new_tokens=8, repeats=3)
    # the calls the measurement times: every completion holds new_tokens tokens (EOS ignored)
    population = population_of(spec, mean_adapter(spec), 1)
    sampling = SamplingSettings(max_new_tokens=spec.new_tokens, ignore_eos=True)
    prompts = bench_prompts(spec.prompts)
    for adapters in (population, population.adapters()):
        table = tiny_vllm.generate(prompts, adapters, sampling)
        assert [[c.num_tokens for c in row] for row in table] == [[8, 8]] * 4
        assert table.num_tokens == 4 * 2 * 8

    rows = measure_throughput(tiny_vllm, spec)
    assert [row["name"] for row in rows] == ["vllm base", "vllm in_place", "vllm files"]
    for row in rows:
        assert row["requests"] == 8 and len(row["calls"]) == 3
        assert [call["tokens"] for call in row["calls"]] == [64, 64, 64] and row["tokens"] == 64
        rates = [call["tokens"] / call["seconds"] for call in row["calls"]]
        assert [call["tokens_per_s"] for call in row["calls"]] == pytest.approx(rates)
        assert row["tokens_per_s"] == pytest.approx(statistics.median(rates))
        assert row["best_tokens_per_s"] == pytest.approx(max(rates))
        assert row["seconds"] == pytest.approx(statistics.median(call["seconds"] for call in row["calls"]))
        assert row["timing"]["generate_s"] <= row["seconds"]
    by_name = {row["name"]: row for row in rows}
    assert by_name["vllm in_place"]["timing"]["slots_write_s"] > 0  # the members went into the resident slots
    assert 0 < by_name["vllm files"]["timing"]["host_adapters_s"] < by_name["vllm files"]["seconds"]
    rate = {name: row["tokens_per_s"] for name, row in by_name.items()}
    assert ratios(rows) == pytest.approx({"vllm in_place / vllm base": rate["vllm in_place"] / rate["vllm base"],
                                          "vllm files / vllm base": rate["vllm files"] / rate["vllm base"]})


def test_the_hf_engine_is_measured_batched_and_member_by_member(tiny_hf):
    spec = ThroughputSpec(model="tiny-random", population=2, prompts=2, new_tokens=4)
    rows = measure_throughput(tiny_hf, spec, ("base", "files"), label="hf")
    assert [row["name"] for row in rows] == ["hf base", "hf files"]
    assert [row["tokens"] for row in rows] == [2 * 2 * 4] * 2
    assert "hf base / hf files" in ratios(rows)


def test_an_unknown_path_is_refused_before_any_call(tiny_vllm):
    with pytest.raises(ValueError, match="unknown throughput paths"):
        measure_throughput(tiny_vllm, ThroughputSpec(model="tiny-random", population=2, prompts=1), ("base", "slots"))


def test_the_report_prints_every_row_and_ratio():
    report = {"model": "m", "population": 2, "rank": 1, "prompts": 1, "new_tokens": 4, "repeats": 1,
              "machine": {"cpu": "c", "cpus": 2}, "load_before": [], "load_after": [], "engine": "local",
              "engine_start_s": 1.0,
              "rows": [{"engine": "vllm", "path": "base", "requests": 2, "tokens": 8, "seconds": 0.5, "tokens_per_s": 16.0},
                       {"engine": "vllm", "path": "files", "requests": 2, "tokens": 8, "seconds": 1.0, "tokens_per_s": 8.0}]}
    report["ratios"] = ratios([{"name": "vllm base", "tokens_per_s": 16.0}, {"name": "vllm files", "tokens_per_s": 8.0}])
    text = format_throughput(report)
    assert "base model" in text and "population, adapter files" in text and "16.0" in text
    assert "vllm files / vllm base  0.50" in text


def test_the_es_overhead_parts_add_up(tiny_model_dir):
    spec = ThroughputSpec(model=str(tiny_model_dir), population=4, prompts=2)
    result = measure_es_overhead(spec, repeats=1)
    parts = ("noise_perturb_s", "write_adapters_s", "es_update_s")
    assert all(result[part] > 0 for part in parts)
    assert result["overhead_s"] == pytest.approx(sum(result[part] for part in parts))
    assert result["num_adapter_parameters"] == mean_adapter(spec).num_parameters()
