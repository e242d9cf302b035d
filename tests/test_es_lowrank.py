"""EGGROLL's low-rank noise and full-rank update: hand-computed values and dense references."""
from __future__ import annotations

import math

import pytest
import torch

from evolm_lib.es import Member
from evolm_lib.es.lowrank import (
    combine_factors,
    factor_layout,
    lowrank_gradient,
    member_delta,
    member_factors,
    slot_factors,
)

SHAPES = {"layers.0.q_proj": (6, 4), "layers.0.down_proj": (3, 5)}


def test_combine_factors_by_hand():
    # member 0: a=[[1],[2]], b=[[3],[4],[5]] -> a b^T = [[3,4,5],[6,8,10]]; member 1: a=[[1],[0]], b=[[1],[1],[1]]
    a = torch.tensor([[[1.0], [2.0]], [[1.0], [0.0]]])  # (2 members, out 2, r 1)
    b = torch.tensor([[[3.0], [4.0], [5.0]], [[1.0], [1.0], [1.0]]])  # (2, in 3, 1)
    got = combine_factors(a, b, torch.tensor([2.0, -1.0]))
    assert torch.equal(got, torch.tensor([[5.0, 7.0, 9.0], [12.0, 16.0, 20.0]]))


def test_combine_factors_rank_two_by_hand():
    a = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # one member, identity factors: a b^T = b^T
    b = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    assert torch.equal(combine_factors(a, b, torch.tensor([0.5])), torch.tensor([[0.5, 1.5], [1.0, 2.0]]))


def test_factors_are_seeded_and_shaped():
    first = member_factors([11, 12], SHAPES, rank=2)
    again = member_factors([11, 12], SHAPES, rank=2)
    for name, (out_features, in_features) in SHAPES.items():
        a, b = first[name]
        assert a.shape == (2, out_features, 2) and b.shape == (2, in_features, 2)
        assert torch.equal(a, again[name][0]) and torch.equal(b, again[name][1])
        assert not torch.equal(a[0], a[1])  # two seeds, two draws
    # a member's factors do not depend on who else is in the block
    alone = member_factors([12], SHAPES, rank=2)
    assert torch.equal(alone["layers.0.q_proj"][0][0], first["layers.0.q_proj"][0][1])


def test_member_delta_is_low_rank_with_unit_variance_entries():
    big = {"w": (256, 256)}
    delta = member_delta(Member(5, 1), big, rank=4, sigma=1.0)["w"]
    assert torch.linalg.matrix_rank(delta).item() == 4
    # E = A B^T / sqrt(r): each entry a sum of r products of unit normals, scaled to variance 1
    assert abs(delta.var().item() - 1.0) < 0.1
    negative = member_delta(Member(5, -1), big, rank=4, sigma=0.5)["w"]
    assert torch.allclose(negative, -0.5 * delta)


def test_slot_factors_serve_the_member_delta():
    member = Member(7, -1)
    delta = member_delta(member, SHAPES, rank=3, sigma=0.02)
    for name, (lora_a, lora_b) in slot_factors(member, SHAPES, rank=3, sigma=0.02).items():
        out_features, in_features = SHAPES[name]
        assert lora_a.shape == (3, in_features) and lora_b.shape == (out_features, 3)
        assert torch.allclose(lora_b @ lora_a, delta[name], atol=1e-7)


@pytest.mark.parametrize("form", ["qiu", "textbook"])
def test_gradient_equals_the_dense_sum(form):
    members = [Member(21, 1), Member(21, -1), Member(22, 1), Member(22, -1), Member(23, 1)]
    weights = torch.tensor([0.9, -0.4, 0.1, 0.3, -1.2])
    sigma = 0.05
    got = lowrank_gradient(members, weights, SHAPES, rank=2, sigma=sigma, form=form, block=2)
    for name in SHAPES:
        dense = sum(float(w) * member_delta(m, SHAPES, 2, 1.0)[name] for m, w in zip(members, weights))
        expected = dense / (len(members) * (sigma if form == "textbook" else 1.0))
        assert torch.allclose(got[name], expected, atol=1e-6), name


def test_the_sum_of_rank_one_members_is_full_rank():
    members = [Member(seed, 1) for seed in range(40)]
    update = lowrank_gradient(members, torch.linspace(-1, 1, 40), {"w": (16, 12)}, rank=1, sigma=1.0)["w"]
    assert torch.linalg.matrix_rank(update).item() == 12


def test_block_size_does_not_change_the_bits():
    members = [Member(seed, 1) for seed in range(9)]
    weights = torch.randn(9, generator=torch.Generator().manual_seed(0))
    one = lowrank_gradient(members, weights, SHAPES, rank=1, sigma=0.1, block=1)
    all_at_once = lowrank_gradient(members, weights, SHAPES, rank=1, sigma=0.1, block=9)
    for name in SHAPES:
        assert torch.allclose(one[name], all_at_once[name], atol=1e-7)


def test_equal_antithetic_rewards_give_a_zero_update():
    members = [Member(3, 1), Member(3, -1)]
    update = lowrank_gradient(members, [0.5, 0.5], SHAPES, rank=1, sigma=0.1)
    assert all(torch.count_nonzero(t) == 0 for t in update.values())


def test_bad_rank_and_shapes_are_named():
    with pytest.raises(ValueError, match="noise_rank 5 exceeds the smaller side of layers.0.down_proj"):
        factor_layout({"layers.0.down_proj": (3, 5)}, 5)
    with pytest.raises(ValueError, match="noise_rank must be an integer >= 1"):
        factor_layout(SHAPES, 0)
    with pytest.raises(ValueError, match="2-D weights; norm has shape"):
        factor_layout({"norm": (8,)}, 1)
    assert math.isclose(factor_layout(SHAPES, 2).total, 2 * (6 + 4 + 3 + 5))
