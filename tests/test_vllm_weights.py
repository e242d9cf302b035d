"""The model's own weights written in place inside a real vLLM engine (issue 19): full-parameter
members and EGGROLL's low-rank slots, against a transformers model perturbed on the host."""
from __future__ import annotations

import pytest
import torch

from evolm_lib import es
from evolm_lib.engines import SamplingSettings
from evolm_lib.es import lowrank
from evolm_lib.lora import LoraSpec

TARGETS = ("q_proj", "v_proj", "down_proj")
PROMPTS = ["Name a colour.", "Count to three.", "What is two plus two?"]
GREEDY = SamplingSettings(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """An engine of its own: its targeted layers get their weights back (F.linear on the CPU)."""
    from evolm_lib.engines.vllm.engine import VLLMEngine

    engine = VLLMEngine(str(tiny_model_dir), max_loras=4, max_lora_rank=2, max_model_len=256, kv_cache_gb=0.0625)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    """The transformers reference (the same prompt encoding and greedy settings as the engine's)."""
    from evolm_lib.engines.hf_engine import HFEngine

    engine = HFEngine(str(tiny_model_dir))
    yield engine
    engine.close()


def _hf_greedy(hf, weights: dict[str, torch.Tensor]) -> list[tuple[int, ...]]:
    """Greedy tokens of the transformers model with these weights put in (then the originals back)."""
    params = dict(hf.model.named_parameters())
    kept = {name: params[name].detach().clone() for name in weights}
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
        try:
            table = hf.generate(PROMPTS, [None], GREEDY)
        finally:
            for name, tensor in kept.items():
                params[name].copy_(tensor)
    return [tuple(c.token_ids) for c in table[0]]


def _engine_greedy(engine, adapters=(None,)) -> list[list[tuple[int, ...]]]:
    table = engine.generate(PROMPTS, list(adapters), GREEDY)
    return [[tuple(c.token_ids) for c in row] for row in table]


def test_full_members_are_the_host_perturbed_model_and_the_mean_comes_back(engine, hf, tiny_model_dir):
    from evolm_lib.engines.weights.vllm import EngineWeights

    weights = EngineWeights(engine.llm, tiny_model_dir, TARGETS, noise="full")
    try:
        host = {name: p.detach().clone() for name, p in hf.model.named_parameters() if name in weights.shapes}
        assert set(host) == set(weights.shapes) and len(host) == 3 * 2
        base = _engine_greedy(engine)[0]
        assert base == _hf_greedy(hf, host)  # the given-back weights serve the model as loaded
        before, original = weights.checksum(), weights.read()
        assert before["restored"]
        member = es.Member(seed=99, sign=-1)
        weights.write_member(member, sigma=0.3)
        perturbed = es.perturb(host, member, 0.3)
        served = _engine_greedy(engine)[0]
        assert served == _hf_greedy(hf, perturbed)
        assert served != base
        weights.restore()
        after = weights.checksum()
        assert after == before  # the master untouched, the engine serving it exactly again
        assert _engine_greedy(engine)[0] == base

        # an update computed on the engine equals the host's from the same seeds and fitness
        optimizer = es.SGDConfig(learning_rate=0.05)
        state = es.init_optimizer_state(optimizer, host)
        reference = dict(host)
        for generation in range(2):
            members = es.population(3, generation, 4)
            fitness = [1.0, -0.5, 0.25, -0.75]
            weights.step(optimizer, members, fitness, sigma=0.3)
            gradient = es.es_gradient(members, fitness, {n: tuple(t.shape) for n, t in host.items()}, 0.3)
            reference, state = es.apply_update(optimizer, state, reference, gradient)
        snapshot = weights.read()
        mean = es.Layout.of({n: tuple(t.shape) for n, t in host.items()}).split(snapshot["master"])
        for name in host:
            assert torch.allclose(mean[name], reference[name], atol=1e-6, rtol=0), name
        assert weights.checksum()["restored"] and snapshot["step"] == 2
        assert _engine_greedy(engine)[0] == _hf_greedy(hf, {n: mean[n] for n in host})
        weights.load({"master": original["master"]})  # a snapshot brings the mean back, and the engine serves it
        assert weights.checksum()["master"] == before["master"] and _engine_greedy(engine)[0] == base
    finally:
        weights.close()


def test_eggroll_slots_serve_the_low_rank_members_over_the_mean(engine, hf, tiny_model_dir):
    from evolm_lib.engines.vllm.slots import ResidentSlots
    from evolm_lib.engines.weights.vllm import EngineWeights

    rank = 2
    weights = EngineWeights(engine.llm, tiny_model_dir, TARGETS, noise="lowrank", noise_rank=rank)
    population = ResidentSlots(engine.llm, LoraSpec(target_modules=TARGETS, rank=rank, alpha=float(rank)), 2,
                                    tiny_model_dir, first_id=9000)
    try:
        host = {name: p.detach().clone() for name, p in hf.model.named_parameters() if name in weights.shapes}
        members = [es.Member(5, 1), es.Member(5, -1)]
        weights.write_slots(population, members, sigma=0.5)
        served = population.generate(PROMPTS, GREEDY, with_base=True)
        rows = [[tuple(c.token_ids) for c in row] for row in served]
        for member, row in zip(members, rows):
            delta = lowrank.member_delta(member, weights.shapes, rank, 0.5)
            assert row == _hf_greedy(hf, {n: host[n] + delta[n] for n in host}), member
        assert rows[0] != rows[1]
        assert rows[2] == _hf_greedy(hf, host)  # the zero slot: the mean itself
        with pytest.raises(ValueError, match="EGGROLL slots need rank 2 and alpha = rank"):
            weights.write_slots(type("P", (), {"spec": LoraSpec(target_modules=TARGETS, rank=2, alpha=1.0)})(), members, 0.5)
    finally:
        population.close()
        weights.close()
