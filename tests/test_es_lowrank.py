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
    lowrank_gradient_per_matrix,
    member_delta,
    member_factors,
    shape_groups,
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
    # also into a flat vector whose same-shaped weights are not evenly spaced (copied out of a buffer)
    shapes = {"a.q": (2, 2), "b.k": (1, 2), "c.q": (2, 2), "d.k": (1, 2), "e.k": (1, 2)}
    out = {name: torch.full(shape, float("nan")) for name, shape in shapes.items()}
    update = lowrank_gradient(members, [0.5, 0.5], shapes, rank=1, sigma=0.1, out=out)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in update.values())


def test_bad_rank_and_shapes_are_named():
    with pytest.raises(ValueError, match="noise_rank 5 exceeds the smaller side of layers.0.down_proj"):
        factor_layout({"layers.0.down_proj": (3, 5)}, 5)
    with pytest.raises(ValueError, match="noise_rank must be an integer >= 1"):
        factor_layout(SHAPES, 0)
    with pytest.raises(ValueError, match="2-D weights; norm has shape"):
        factor_layout({"norm": (8,)}, 1)
    assert math.isclose(factor_layout(SHAPES, 2).total, 2 * (6 + 4 + 3 + 5))


def test_combine_factors_batches_same_shaped_weights_by_hand():
    # weight 0: the members of test_combine_factors_by_hand; weight 1: a = [[1],[1]] and [[0],[1]], b = ones
    a = torch.tensor([[[[1.0], [2.0]], [[1.0], [0.0]]], [[[1.0], [1.0]], [[0.0], [1.0]]]])  # (2 weights, 2 members, 2, 1)
    b = torch.tensor([[[[3.0], [4.0], [5.0]], [[1.0], [1.0], [1.0]]], [[[1.0], [1.0], [1.0]], [[1.0], [1.0], [1.0]]]])
    got = combine_factors(a, b, torch.tensor([2.0, -1.0]))
    # weight 1: 2 * [[1,1,1],[1,1,1]] - [[0,0,0],[1,1,1]]
    assert torch.equal(got, torch.tensor([[[5.0, 7.0, 9.0], [12.0, 16.0, 20.0]], [[2.0, 2.0, 2.0], [1.0, 1.0, 1.0]]]))


def test_weights_are_grouped_by_shape_in_name_order():
    shapes = {"l.1.q": (4, 4), "l.0.k": (2, 4), "l.0.q": (4, 4), "l.1.k": (2, 4), "l.0.down": (4, 8)}
    assert shape_groups(shapes) == {(4, 8): ["l.0.down"], (2, 4): ["l.0.k", "l.1.k"], (4, 4): ["l.0.q", "l.1.q"]}


def test_grouped_update_by_hand():
    # two 1x2 weights of one shape, one member of rank 1 with coefficient w/N = 1: the update is a b^T per
    # weight, each weight's factors read from the member's draw
    shapes = {"a.w": (1, 2), "b.w": (1, 2)}
    members, weights = [Member(5, 1)], [1.0]
    factors = member_factors([5], shapes, rank=1)
    got = lowrank_gradient(members, weights, shapes, rank=1, sigma=0.1)
    for name in shapes:
        a, b = factors[name][0][0, :, 0], factors[name][1][0, :, 0]  # (1,), (2,)
        assert torch.equal(got[name], torch.stack([a[0] * b[0], a[0] * b[1]]).reshape(1, 2))


def _transformer_shapes(layers: int = 3) -> dict[str, tuple[int, int]]:
    projections = {"q_proj": (32, 32), "k_proj": (8, 32), "v_proj": (8, 32), "o_proj": (32, 32),
                   "gate_proj": (48, 32), "up_proj": (48, 32), "down_proj": (32, 48)}
    return {f"model.layers.{i}.{name}.weight": shape for i in range(layers) for name, shape in projections.items()}


@pytest.mark.parametrize("block", [None, 3])
@pytest.mark.parametrize("form", ["qiu", "textbook"])
def test_grouped_update_has_the_bits_of_the_per_matrix_path(form, block):
    # on the CPU a batched product runs the same float32 kernel per matrix as the single product did,
    # and later blocks add in the same order, so the bits match; into a flat vector's views (strided
    # groups written in place) and into separate tensors (the copy-out path) alike
    from evolm_lib.es import Layout

    shapes = _transformer_shapes()
    members = [Member(seed, sign) for seed in range(40, 48) for sign in (1, -1)]
    weights = torch.randn(16, generator=torch.Generator().manual_seed(3))
    reference = lowrank_gradient_per_matrix(members, weights, shapes, 2, 0.05, form, block=block)
    layout = Layout.of(shapes)
    flat = torch.full((layout.total,), float("nan"))
    into_flat = lowrank_gradient(members, weights, shapes, 2, 0.05, form, block=block, out=layout.split(flat))
    separate = lowrank_gradient(members, weights, shapes, 2, 0.05, form, block=block,
                                out={name: torch.full(shape, float("nan")) for name, shape in shapes.items()})
    for name in shapes:
        assert torch.equal(into_flat[name], reference[name]) and torch.equal(separate[name], reference[name]), name
    assert torch.equal(flat, torch.cat([reference[name].reshape(-1) for name in layout.names]))


def test_grouped_update_on_the_tiny_random_model_equals_the_per_matrix_path(tiny_model_dir):
    from evolm_lib.engines.weights.resident import targeted_weight_shapes
    from evolm_lib.lora import ALL_PROJECTIONS

    shapes = targeted_weight_shapes(tiny_model_dir, ALL_PROJECTIONS)
    assert len(shape_groups(shapes)) < len(shapes)  # something to batch
    members = [Member(seed, sign) for seed in (7, 8, 9) for sign in (1, -1)]
    weights = [0.5, -0.5, 1.0, 0.2, -1.0, 0.0]
    grouped = lowrank_gradient(members, weights, shapes, 1, 0.01)
    reference = lowrank_gradient_per_matrix(members, weights, shapes, 1, 0.01)
    assert all(torch.equal(grouped[name], reference[name]) for name in shapes)
