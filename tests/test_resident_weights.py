"""Full-parameter and EGGROLL members written into a real model's weights in place (issue 19)."""
from __future__ import annotations

import pytest
import torch

from evolm_lib import es
from evolm_lib.engines.weights.resident import ResidentWeights, targeted_weights
from evolm_lib.es import lowrank

TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model


def _weights(model):
    return targeted_weights(dict(model.named_parameters()), TARGETS)


def _greedy(model, tokens=12):
    ids = torch.tensor([[1, 42, 77, 310, 5]])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_targets_pick_the_named_modules(tiny_model):
    picked = _weights(tiny_model)
    assert picked and all(name.split(".")[-2] in TARGETS for name in picked)
    assert len(picked) == 3 * tiny_model.config.num_hidden_layers
    with pytest.raises(ValueError, match="matched no 2-D weight"):
        targeted_weights(dict(tiny_model.named_parameters()), ["nonexistent_proj"])


@pytest.mark.parametrize("noise", ["full", "lowrank"])
def test_member_equals_the_host_perturbation_and_restores_bit_exactly(tiny_model, noise):
    live = _weights(tiny_model)
    original = {name: tensor.detach().clone() for name, tensor in live.items()}
    resident = ResidentWeights(live, noise=noise, noise_rank=2)
    base_tokens = _greedy(tiny_model)
    member = es.Member(seed=1234, sign=-1)
    sigma = 0.2
    if noise == "full":
        expected = es.perturb(original, member, sigma)
    else:
        delta = lowrank.member_delta(member, resident.shapes, 2, sigma)
        expected = {name: (tensor.float() + delta[name]).to(tensor.dtype) for name, tensor in original.items()}
    resident.write_member(member, sigma)
    for name, tensor in live.items():
        assert torch.equal(tensor, expected[name]), name
    # the member's greedy completion is the host-perturbed model's: the engine serves these weights
    member_tokens = _greedy(tiny_model)
    assert member_tokens != base_tokens  # sigma 0.2 on a random model moves the argmax
    resident.restore()
    assert resident.is_restored()
    for name, tensor in live.items():
        assert torch.equal(tensor, original[name]), name
    assert _greedy(tiny_model) == base_tokens


def test_bfloat16_mean_survives_many_members_bit_exactly():
    torch.manual_seed(0)
    live = {"a.weight": torch.randn(32, 16).to(torch.bfloat16), "b.weight": torch.randn(8, 32).to(torch.bfloat16)}
    original = {name: tensor.clone() for name, tensor in live.items()}
    resident = ResidentWeights(live)
    for seed in range(50):
        resident.write_member(es.Member(seed, 1 if seed % 2 else -1), 1e-3)
        resident.restore()
    for name in live:
        assert torch.equal(live[name], original[name])
    # what add-then-subtract in bfloat16 would have done: the weights drift
    drifted = original["a.weight"].clone()
    for seed in range(50):
        noise = es.member_noise(seed, {"a.weight": (32, 16), "b.weight": (8, 32)})["a.weight"].to(torch.bfloat16)
        drifted += 1e-3 * noise
        drifted -= 1e-3 * noise
    assert not torch.equal(drifted, original["a.weight"])


@pytest.mark.parametrize("noise, optimizer", [("full", es.SGDConfig(learning_rate=0.5)),
                                              ("lowrank", es.AdamConfig(learning_rate=0.01))])
def test_updates_equal_a_host_reference(noise, optimizer):
    torch.manual_seed(1)
    live = {"x.weight": torch.randn(6, 5), "y.weight": torch.randn(4, 6)}
    host = {name: tensor.clone() for name, tensor in live.items()}
    resident = ResidentWeights(live, noise=noise, noise_rank=1)
    state = es.init_optimizer_state(optimizer, host)
    shapes = {name: tuple(t.shape) for name, t in host.items()}
    for generation in range(3):
        members = es.population(7, generation, 6)
        weights = torch.tensor([0.5, -0.5, 1.0, 0.25, -1.0, 0.0])
        resident.step(optimizer, members, weights, sigma=0.1)
        if noise == "full":
            gradient = es.es_gradient(members, weights, shapes, 0.1)
        else:
            gradient = lowrank.lowrank_gradient(members, weights, shapes, 1, 0.1)
        host, state = es.apply_update(optimizer, state, host, gradient)
        for name in live:
            assert torch.allclose(live[name], host[name], atol=1e-6, rtol=0), (generation, name)
    assert resident.is_restored()
