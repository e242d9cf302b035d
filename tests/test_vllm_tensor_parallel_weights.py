"""The model's own weights in a real vLLM engine split over two CPU processes (tensor_parallel_size 2):
each card holds its slices, and the weights the engine serves, put together from the cards, are
those one card would serve, bit for bit: the mean, a full-rank member, the update's master, a
snapshot loaded back (how GRPO on the model's weights syncs the engine), EGGROLL's low-rank members
in the LoRA slots; EGGROLL's update equal to one card's up to the products' rounding."""
from __future__ import annotations

import os

import pytest
import torch

from evolm_lib import es
from evolm_lib.engines import SamplingSettings
from evolm_lib.engines.weights.resident import ResidentWeights
from evolm_lib.es import lowrank
from evolm_lib.lora import LoraSpec
from evolm_lib.lora import read_base_weights

pytestmark = pytest.mark.slow

GREEDY = SamplingSettings(max_new_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = ["Name a colour.", "Count to three."]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """One engine split over two processes, one core each."""
    from evolm_lib.engines.vllm import startup
    from evolm_lib.engines.vllm.engine import VLLMEngine

    with pytest.MonkeyPatch.context() as patch:  # the suite binds each xdist worker to one core: the ranks choose theirs
        patch.delenv(startup.CPU_BIND_ENV, raising=False)
        engine = VLLMEngine(str(tiny_model_dir), max_loras=4, max_lora_rank=2, max_model_len=256, kv_cache_gb=0.0625,
                            tensor_parallel_size=2)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def weights(engine, tiny_model_dir):
    from evolm_lib.engines.weights.vllm import EngineWeights

    resident = EngineWeights(engine.llm, tiny_model_dir, "all", noise="full", noise_scheme="tiled")
    yield resident
    resident.close()


def _host(tiny_model_dir, names) -> dict[str, torch.Tensor]:
    return {name: tensor.float() for name, tensor in read_base_weights(tiny_model_dir, list(names)).items()}


def _assert_served(weights, expected):
    served = weights.served()
    for name, tensor in expected.items():
        assert torch.equal(served[name].view(tensor.shape), tensor), name


def test_the_cards_hold_slices_and_serve_the_whole_mean(weights, tiny_model_dir):
    assert weights.info["cards"] == 2
    whole = sum(t.numel() for t in _host(tiny_model_dir, weights.shapes).values())
    assert whole < weights.info["values"] < 2 * whole  # sliced, with norms (and KV heads) on both cards
    _assert_served(weights, _host(tiny_model_dir, weights.shapes))


def test_a_member_and_the_update_are_one_cards_bit_for_bit(weights, tiny_model_dir):
    host = _host(tiny_model_dir, weights.shapes)
    member = es.Member(seed=1234, sign=-1)
    weights.write_member(member, 0.05)
    _assert_served(weights, es.perturb(host, member, 0.05, scheme="tiled"))
    weights.restore()
    _assert_served(weights, host)

    # the same update on one card in this process, from the same seeds and fitness
    one_card = ResidentWeights({name: tensor.clone() for name, tensor in host.items()}, scheme="tiled")
    optimizer = es.AdamConfig(0.01)
    for generation in range(2):
        members = es.population(7, generation, 4)
        fitness = [0.3, -0.1, 0.5, -0.7]
        norm = weights.step(optimizer, members, fitness, 0.05)["update_norm"]
        # the norm sums the same float32 changes' squares in float64, cut otherwise over the cards:
        # equal to float64 rounding over millions of terms, not bit for bit (the master is, below)
        assert norm == pytest.approx(one_card.step(optimizer, members, fitness, 0.05), rel=1e-9)
    snapshot = weights.read()
    assert torch.equal(snapshot["master"], one_card.master.flat)
    assert torch.equal(snapshot["second_moment"], one_card.optimizer_state.second_moment.flat)
    assert weights.checksum() == {"master": one_card.checksum(), "restored": True, "step": 2}
    _assert_served(weights, {name: tensor.clone() for name, tensor in one_card.master.items()})


def test_a_snapshot_of_the_whole_weights_loads_into_the_slices(weights, tiny_model_dir, engine):
    host = _host(tiny_model_dir, weights.shapes)
    layout = es.Layout.of({name: tuple(t.shape) for name, t in host.items()})
    weights.load({"master": es.flat_of(host, layout)})
    before = engine.generate(PROMPTS, [None], GREEDY)
    moved = {name: tensor + 0.01 * torch.arange(tensor.numel()).reshape(tensor.shape) % 3 for name, tensor in host.items()}
    weights.load({"master": es.flat_of(moved, layout)})  # as GRPO on the model's weights syncs the engine
    _assert_served(weights, moved)
    assert engine.generate(PROMPTS, [None], GREEDY) != before
    weights.load({"master": es.flat_of(host, layout)})
    _assert_served(weights, host)
    assert [[c.token_ids for c in row] for row in engine.generate(PROMPTS, [None], GREEDY)] == \
        [[c.token_ids for c in row] for row in before]


TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")  # column- and row-parallel layers


def test_eggroll_members_and_update_over_two_cards(engine, tiny_model_dir):
    from evolm_lib.engines.vllm.slots import ResidentSlots
    from evolm_lib.engines.weights.vllm import EngineWeights

    rank, sigma = 2, 0.5
    weights = EngineWeights(engine.llm, tiny_model_dir, TARGETS, noise="lowrank", noise_rank=rank)
    population = ResidentSlots(engine.llm, LoraSpec(target_modules=TARGETS, rank=rank, alpha=float(rank)), 2,
                               tiny_model_dir, first_id=9000)
    try:
        members = [es.Member(5, 1), es.Member(6, -1)]
        weights.write_slots(population, members, sigma)
        for index, member in enumerate(members):
            served = population.read(index)  # gathered from the two ranks' shards
            for name, (lora_a, lora_b) in lowrank.slot_factors(member, weights.shapes, rank, sigma).items():
                peft = "base_model.model." + name.removesuffix(".weight")
                assert torch.equal(served[peft + ".lora_A.weight"], lora_a), name
                assert torch.equal(served[peft + ".lora_B.weight"], lora_b), name
        host = _host(tiny_model_dir, weights.shapes)
        one_card = ResidentWeights({name: tensor.clone() for name, tensor in host.items()}, noise="lowrank",
                                   noise_rank=rank)
        optimizer = es.SGDConfig(0.5)
        fitness = [1.0, -0.5]
        norm = weights.step(optimizer, members, fitness, sigma)["update_norm"]
        # each card multiplies its rows or columns of the factors: sums of the same products, in
        # another blocking, so equal to float32 rounding, not bit for bit
        assert norm == pytest.approx(one_card.step(optimizer, members, fitness, sigma), rel=1e-5)
        snapshot = weights.read()
        torch.testing.assert_close(snapshot["master"], one_card.master.flat, rtol=1e-6, atol=1e-7)
    finally:
        population.close()
        weights.close()
