"""es_mode full and eggroll (issue 19): ES on the model's own weights, on a real vLLM engine and on
the HF engine, checked against host-side references from the same seeds and fitness."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from evolm_lib import es
from evolm_lib.config import ConfigError, ESConfig
from evolm_lib.engines.weights.resident import targeted_weight_shapes
from evolm_lib.es import lowrank
from evolm_lib.train.es import ESRun
from evolm_lib.train.model_weights import SEED_LOG, SNAPSHOTS

TARGETS = ["q_proj", "v_proj", "down_proj"]
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BASE = dict(model="tiny-random", task="conciseness", population_size=4, sigma=0.1, learning_rate=0.05, lora_rank=1,
            target_modules=TARGETS, max_new_tokens=6, max_model_len=256, kv_cache_gb=0.0625, eval_every=1)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """An engine of these tests' own (its targeted layers get their weights back, and runs move them)."""
    from evolm_lib.engines.vllm.engine import VLLMEngine

    engine = VLLMEngine(str(tiny_model_dir), max_loras=8, max_lora_rank=8, max_model_len=256, kv_cache_gb=0.0625)
    yield engine
    engine.close()


def _config(**overrides) -> ESConfig:
    return ESConfig(**{**BASE, **overrides})


def _host_reference(model_dir, config: ESConfig, log: list[dict]) -> dict[str, torch.Tensor]:
    """The mean after the seed log's updates, computed on the host from the model folder's weights."""
    shapes = targeted_weight_shapes(model_dir, TARGETS)
    tensors = load_file(str(next(model_dir.glob("*.safetensors"))))
    mean = {name: tensors[name].float().clone() for name in shapes}
    optimizer = config.optimizer_config()
    state = es.init_optimizer_state(optimizer, mean)
    for entry in log:
        members = [es.Member(seed, sign) for seed, sign in entry["members"]]
        if config.es_mode == "full":
            gradient = es.es_gradient(members, entry["weights"], shapes, config.sigma)
        else:
            gradient = lowrank.lowrank_gradient(members, entry["weights"], shapes, config.noise_rank, config.sigma)
        mean, state = es.apply_update(optimizer, state, mean, gradient)
    return mean


def _engine_mean(run: ESRun) -> dict[str, torch.Tensor]:
    master = run.parameters.weights.read()["master"]
    return es.Layout.of(run.parameters.weights.shapes).split(master)


def _rows(run_dir) -> list[dict]:
    from evolm_lib.runs import read_metrics

    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in read_metrics(run_dir)]


@pytest.mark.parametrize("mode", ["full", "eggroll"])
def test_the_engines_weights_follow_the_host_reference_and_a_resume_gives_the_same_rows(mode, engine, tiny_model_dir,
                                                                                         tmp_path):
    config = _config(es_mode=mode, noise_rank=2, num_generations=3, checkpoint_every=2)
    run = ESRun.open(config, tmp_path / "a", engine=engine)
    run.run()
    log = run.parameters.read_log()
    assert [entry["generation"] for entry in log] == [1, 2, 3]
    reference = _host_reference(tiny_model_dir, config, log)
    for name, tensor in _engine_mean(run).items():
        assert torch.allclose(tensor, reference[name], atol=1e-6, rtol=0), name
    assert sorted(p.name for p in (tmp_path / "a" / SNAPSHOTS).iterdir()) == ["000002.safetensors", "000003.safetensors"]
    uninterrupted = _rows(tmp_path / "a")
    assert [r["generation"] for r in uninterrupted] == [0, 1, 2, 3]
    assert uninterrupted[-1]["policy/train_reward"] is not None
    run.close()  # the shared engine serves the model folder's weights again

    # stopped after generation 1, reopened: generation 2 replays the seed log, 3 comes from a snapshot-free resume
    first = ESRun.open(config, tmp_path / "b", engine=engine)
    first.run(1)
    first.close()
    again = ESRun.open(config, tmp_path / "b", engine=engine)
    again.run()
    assert _rows(tmp_path / "b") == uninterrupted
    again.close()


def test_a_mean_restored_from_a_snapshot_and_the_log_equals_the_uninterrupted_mean(engine, tmp_path):
    config = _config(es_mode="full", num_generations=5, checkpoint_every=2)
    run = ESRun.open(config, tmp_path / "r", engine=engine)
    run.run(3)  # snapshot at 2, generation 3 in the seed log only
    mean_at_3 = {k: v.clone() for k, v in _engine_mean(run).items()}
    checksum = run.parameters.weights.checksum()
    run.close()
    resumed = ESRun.open(config, tmp_path / "r", engine=engine)
    assert resumed.generation == 3
    assert resumed.parameters.weights.checksum() == checksum  # the same bits, served exactly
    for name, tensor in _engine_mean(resumed).items():
        assert torch.equal(tensor, mean_at_3[name])
    resumed.close()


def test_a_kill_mid_generation_resumes_to_the_rows_of_an_uninterrupted_run(tiny_model_dir, tmp_path):
    """SIGKILL inside generation 2's evaluation (after generation 1's seed log line and checkpoint)."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    config = _config(es_mode="full", num_generations=3, checkpoint_every=1, engine="hf")
    script = textwrap.dedent(f"""
        import os, signal
        from evolm_lib.config import ESConfig
        from evolm_lib.train.es import ESRun
        run = ESRun.open(ESConfig(**{config.to_dict()!r}), {str(tmp_path / 'k')!r})
        run.run(1)
        original = run.parameters.evaluate
        def dying(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        run.parameters.evaluate = dying
        run.run()
    """)
    process = subprocess.run([sys.executable, "-c", script], env=dict(os.environ), capture_output=True, text=True)
    assert process.returncode == -signal.SIGKILL, process.stderr[-2000:]
    resumed = ESRun.open(config, tmp_path / "k")
    assert resumed.generation == 1
    resumed.run()
    resumed.close()
    whole = ESRun.open(config, tmp_path / "w")
    whole.run()
    whole.close()
    assert _rows(tmp_path / "k") == _rows(tmp_path / "w")
    assert len((tmp_path / "k" / SEED_LOG).read_text().splitlines()) == 3


@pytest.mark.parametrize("mode", ["full", "eggroll"])
def test_the_hf_engine_runs_both_modes(mode, tiny_model_dir, tmp_path):
    config = _config(es_mode=mode, noise_rank=1, num_generations=2, engine="hf")
    run = ESRun.open(config, tmp_path / mode)
    run.run()
    reference = _host_reference(tiny_model_dir, config, run.parameters.read_log())
    for name, tensor in _engine_mean(run).items():
        assert torch.allclose(tensor, reference[name], atol=1e-6, rtol=0), name
    # the model folder save_final writes loads in transformers with the mean's weights
    from transformers import AutoModelForCausalLM

    folder = run.save_final()
    loaded = dict(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).named_parameters())
    for name, tensor in _engine_mean(run).items():
        assert torch.equal(loaded[name], tensor), name
    run.close()


def test_bad_mode_settings_name_the_setting(engine, tmp_path):
    with pytest.raises(ConfigError, match="adapter_transfer: es_mode full writes the engine's weights in place"):
        _config(es_mode="full", adapter_transfer="files")
    with pytest.raises(ConfigError, match="estimator: es_mode eggroll"):
        _config(es_mode="eggroll", estimator="zoar")
    with pytest.raises(ConfigError, match="es_weights: eggroll perturbs weight matrices"):
        _config(es_mode="eggroll", es_weights="all")
    with pytest.raises(ConfigError, match="noise_rank: noise_rank 16 exceeds the engine's max_lora_rank 8"):
        ESRun.open(_config(es_mode="eggroll", noise_rank=16), tmp_path / "rank", engine=engine)
    lora = ESRun.open(_config(num_generations=1), tmp_path / "lora", engine=engine)
    lora.close()
    with pytest.raises(ConfigError, match="es_mode"):
        ESRun.open(_config(num_generations=1, es_mode="full"), tmp_path / "lora", engine=engine)


def test_full_mode_without_room_for_the_master_is_refused_before_the_engine_starts(tiny_model_dir, monkeypatch, tmp_path):
    """The master and one member's noise must fit beside the engine: with 1 MiB free the check names both."""
    from evolm_lib import preflight

    config = _config(es_mode="full", es_weights="all", optimizer="adam")
    needed = preflight.weights_mode_bytes(config, tiny_model_dir)
    values = sum(torch.Size(s).numel() for s in targeted_weight_shapes(tiny_model_dir, "all").values())
    assert needed == 4 * values * 4  # master, noise, Adam's two moments
    monkeypatch.setattr(preflight, "_free_memory", lambda cuda: (config.kv_cache_gb * 2**30 + 2**20 + 50 * 2**20, 64 * 2**30))
    monkeypatch.setattr(preflight, "weights_bytes", lambda *a: 50 * 2**20)
    monkeypatch.setattr(preflight, "_engine_live", lambda: False)  # this module's engine holds no memory of its own here
    with pytest.raises(ConfigError, match=r"es_mode=full: the float32 master .* need .* beside the engine, which leaves 0\.000977 GiB"):
        ESRun.open(config, tmp_path / "tight")
    assert not (tmp_path / "tight").exists()


def test_the_throughput_measurement_serves_eggroll_and_times_the_weight_modes(engine, tiny_model_dir):
    from evolm_lib.throughput import ThroughputSpec, measure_throughput, measure_weight_modes, ratios, release_eggroll

    spec = ThroughputSpec(model=str(tiny_model_dir), population=4, prompts=2, new_tokens=5, rank=1, repeats=1)
    rows = measure_throughput(engine, spec, ("base", "eggroll"))
    assert [r["name"] for r in rows] == ["vllm base", "vllm eggroll"]
    assert all(r["tokens"] == 4 * 2 * 5 for r in rows)  # EOS ignored: every request its 5 tokens
    assert rows[1]["timing"]["slots_write_s"] > 0
    assert ratios(rows)["vllm eggroll / vllm base"] == rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    release_eggroll(engine)
    modes = measure_weight_modes(engine, spec, repeats=1)
    values = sum(torch.Size(s).numel() for s in targeted_weight_shapes(tiny_model_dir, ALL).values())
    assert modes["weights_values"] == values and modes["full_restored_exactly"]
    assert modes["eggroll_update_s"] > 0 and modes["full_write_s"] > 0 and modes["full_restore_s"] > 0


def test_the_report_and_the_benchmark_command_take_eggroll_and_the_weight_modes(engine, tiny_model_dir):
    from evolm_lib import benchmark
    from evolm_lib.throughput import ThroughputSpec, format_throughput, throughput_report

    spec = ThroughputSpec(model=str(tiny_model_dir), population=2, prompts=1, new_tokens=3, rank=1)
    report = throughput_report(spec, ("eggroll", "base"), engine=engine, weight_modes=True)
    assert [row["path"] for row in report["rows"]] == ["base", "eggroll"]  # eggroll last
    assert report["weight_modes"]["full_restored_exactly"]
    assert "EGGROLL update at population 2" in format_throughput(report)
    with pytest.raises(SystemExit):
        benchmark.main(["--paths", "in_place,nope"])


def test_a_sweep_of_the_three_modes_scores_every_held_out_problem_and_replays_each_checkpoints_kl(engine, tmp_path):
    from evolm_lib import sweep
    from evolm_lib.runs import read_jsonl

    spec = {"common": {k: v for k, v in BASE.items() if k not in ("population_size", "sigma", "learning_rate")},
            "es": {"population_size": 4, "sigma": 0.1, "learning_rate": 0.05, "checkpoint_every": 2,
                   "keep_checkpoints": 10},
            "es_modes": {"lora": {}, "full": {"es_mode": "full"}, "eggroll": {"es_mode": "eggroll", "noise_rank": 2}},
            "grpo": {"group_size": 4}, "generations": 3, "seeds": [0]}
    sweep.check_sections(spec)
    plan = sweep.select_methods(sweep.plan_sweep(spec), ["es_lora", "es_full", "es_eggroll"])
    assert [(r.name, r.label, r.config.es_mode) for r in plan] == [
        ("es_lora_seed0", "es lora", "lora"), ("es_full_seed0", "es full", "full"),
        ("es_eggroll_seed0", "es eggroll", "eggroll")]
    with pytest.raises(ValueError, match=r"--methods: \['es_ful'\] not in this sweep \(did you mean es_full\?\)"):
        sweep.select_methods(plan, ["es_ful"])
    base_before = engine.generate(["Hello"], [None], _greedy())[0][0].text
    sweep.run_sweep(plan, tmp_path, engine=engine, kl_settings={"num_samples": 2, "every_checkpoint": True})
    for run in plan:
        folder = tmp_path / run.name
        held_out = read_jsonl(folder / sweep.HELDOUT)
        assert [line["index"] for line in held_out] == list(range(8))  # conciseness: eight held-out questions
        assert all(line["success"] == (line["reward"] >= 0.0) for line in held_out)
        final_row = _rows(folder)[-1]
        assert sum(line["reward"] for line in held_out) / 8 == pytest.approx(final_row["eval/reward"])
        kls = {row["generation"]: row["policy/kl"] for row in read_jsonl(folder / "kl.jsonl")}
        assert set(kls) == {0, 2, 3}
        assert kls[0] == pytest.approx(0.0, abs=1e-4)  # generation 0's mean is the base model
        # the replayed last mean is the run's own: its KL is the one measured on the final mean
        assert kls[3] == pytest.approx(final_row["policy/kl"], rel=1e-6, abs=1e-9) and kls[3] > 1e-4
    assert engine.generate(["Hello"], [None], _greedy())[0][0].text == base_before  # the engine serves the base again
    assert {line["generation"] for line in read_jsonl(tmp_path / "es_full_seed0" / sweep.HELDOUT)} == {3}
    # a run extended by a generation is scored again; its KL file gains the new last generation
    longer = sweep.select_methods(sweep.plan_sweep({**spec, "generations": 4}), ["es_full"])
    sweep.run_sweep(longer, tmp_path, engine=engine, kl_settings={"num_samples": 2, "every_checkpoint": True})
    assert {line["generation"] for line in read_jsonl(tmp_path / "es_full_seed0" / sweep.HELDOUT)} == {4}
    assert [row["generation"] for row in read_jsonl(tmp_path / "es_full_seed0" / "kl.jsonl")] == [0, 2, 3, 4]


def _greedy():
    from evolm_lib.engines import SamplingSettings

    return SamplingSettings(max_new_tokens=6, temperature=0.0)
