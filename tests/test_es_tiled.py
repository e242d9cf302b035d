"""The "tiled" noise scheme: a slice of a weight's noise drawn alone equals the whole weight's noise
there, bit for bit, so a card of a tensor-parallel engine makes exactly its slice of every member
and of the update; and ResidentWeights' weight-by-weight path equals the whole-vector maths."""
from __future__ import annotations

import math

import pytest
import torch

from evolm_lib import es
from evolm_lib.config import ESConfig
from evolm_lib.engines.weights.resident import ResidentWeights, WeightSlice
from evolm_lib.es import lowrank, noise


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 4 x 4, so small tensors cross many tile borders."""
    monkeypatch.setattr(noise, "TILE", 4)


def test_a_block_drawn_alone_is_the_whole_tensor_there(small_tiles):
    whole = es.tiled_noise(7, "w", (11, 9))
    for rows, cols in [(slice(0, 6), slice(None)), (slice(6, 11), slice(None)), (slice(None), slice(3, 8)),
                       (slice(5, 7), slice(1, 2)), (slice(4, 8), slice(4, 8))]:
        assert torch.equal(es.tiled_noise(7, "w", (11, 9), rows, cols), whole[rows, cols])


def test_real_tile_border_rows_and_a_vector():
    whole = es.tiled_noise(3, "w", (2050, 3))  # two tiles of TILE rows
    assert torch.equal(es.tiled_noise(3, "w", (2050, 3), slice(2040, 2050)), whole[2040:2050])
    vector = es.tiled_noise(3, "b", (4100,))  # a vector is one row of three tiles
    assert vector.shape == (1, 4100)
    assert torch.equal(es.tiled_noise(3, "b", (4100,), cols=slice(4000, 4100)), vector[:, 4000:])


def test_each_tile_has_its_own_stream(small_tiles):
    a = es.tiled_noise(1, "w", (8, 8))
    assert not torch.equal(a[:4, :4], a[:4, 4:])  # neighbouring tiles differ
    assert not torch.equal(a, es.tiled_noise(2, "w", (8, 8)))  # seeds differ
    assert not torch.equal(a, es.tiled_noise(1, "v", (8, 8)))  # tensors differ
    # the value at a position is the tile's generator's, seeded by (seed, tensor, tile)
    generator = torch.Generator().manual_seed(es.noise.tile_seed(1, "w", 1, 0))
    assert torch.equal(a[4:8, 0:4], torch.randn((4, 4), generator=generator))


def test_tiled_values_are_standard_normal():
    values = es.tiled_noise(11, "w", (3000, 700)).double()  # two tile rows
    assert abs(values.mean().item()) < 0.01
    assert abs(values.std().item() - 1) < 0.01


def test_population_noise_in_the_tiled_scheme_is_the_tiles_weight_by_weight(small_tiles):
    layout = es.Layout.of({"a": (5, 6), "b": (7,)})
    rows = es.population_noise([4, 9], layout, scheme="tiled")
    for row, seed in zip(rows, [4, 9]):
        views = layout.split(row)
        assert torch.equal(views["a"], es.tiled_noise(seed, "a", (5, 6)))
        assert torch.equal(views["b"], es.tiled_noise(seed, "b", (7,)).view(7))


def _weights(shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


SHAPES = {"layer.0.q.weight": (10, 6), "layer.0.o.weight": (6, 10), "norm.weight": (6,)}
MEMBERS = [es.Member(5, 1), es.Member(5, -1), es.Member(8, 1), es.Member(8, -1)]
FITNESS = [0.5, -0.25, 1.0, -1.25]


@pytest.mark.parametrize("optimizer", [es.SGDConfig(0.1, momentum=0.9), es.AdamConfig(0.01)])
def test_weight_by_weight_equals_the_whole_vector_maths(small_tiles, optimizer):
    live = _weights(SHAPES)
    resident = ResidentWeights({n: t.clone() for n, t in live.items()}, scheme="tiled")
    assert resident.streams
    resident.write_member(es.Member(5, -1), 0.1)
    expected = es.perturb(live, es.Member(5, -1), 0.1, scheme="tiled")
    for name, tensor in zip(resident.layout.names, resident.live):
        assert torch.equal(tensor, expected[name])
    resident.restore()
    norm = resident.step(optimizer, MEMBERS, FITNESS, 0.1)
    # the reference: the whole gradient at once, then the in-place update of a flat master
    reference = es.init_optimizer_state(optimizer, es.FlatParams(es.flat_of(live, resident.layout).clone(), resident.layout),
                                        copy=False)
    gradient = es.flat_of(es.es_gradient(MEMBERS, FITNESS, SHAPES, 0.1, scheme="tiled"), resident.layout)
    reference, reference_norm = es.apply_update_in_place(optimizer, reference, gradient)
    assert torch.equal(resident.master.flat, reference.master.flat)
    assert norm == pytest.approx(reference_norm, rel=1e-12)
    assert resident.is_restored()


def _halves(shapes, split_rows):
    """Two cards' slices of every weight: rows (a column-parallel layer) or columns (row-parallel)."""
    cards = [{}, {}]
    for name, shape in shapes.items():
        n_rows, n_cols = es.matrix_shape(shape)
        size = (n_rows if split_rows[name] else n_cols) // 2
        for rank, card in enumerate(cards):
            part = slice(rank * size, (rank + 1) * size)
            card[name] = WeightSlice(tuple(shape), part, slice(None)) if split_rows[name] else \
                WeightSlice(tuple(shape), slice(None), part)
    return cards


def _cut(tensor, part: WeightSlice):
    matrix = tensor.reshape(es.matrix_shape(part.shape))
    return matrix[part.rows, part.cols]


@pytest.mark.parametrize("optimizer", [es.SGDConfig(0.1), es.AdamConfig(0.01)])
def test_two_cards_hold_the_slices_of_one_card_bit_for_bit(small_tiles, optimizer):
    live = _weights(SHAPES)
    whole = ResidentWeights({n: t.clone() for n, t in live.items()}, scheme="tiled")
    split = {"layer.0.q.weight": True, "layer.0.o.weight": False, "norm.weight": False}
    cards = []
    for slices in _halves(SHAPES, split):
        held = {name: _cut(live[name], part).clone() for name, part in slices.items()}
        cards.append(ResidentWeights(held, scheme="tiled", slices=slices))
    whole.write_member(es.Member(8, 1), 0.05)
    for card in cards:
        card.write_member(es.Member(8, 1), 0.05)
        for name, tensor in zip(card.layout.names, card.live):
            assert torch.equal(tensor, _cut(dict(zip(whole.layout.names, whole.live))[name], card.slices[name]))
    norms = [card.step(optimizer, MEMBERS, FITNESS, 0.05) for card in cards]
    whole_norm = whole.step(optimizer, MEMBERS, FITNESS, 0.05)
    for card in cards:
        for name, tensor in card.master.items():
            assert torch.equal(tensor.reshape(-1), _cut(whole.master[name], card.slices[name]).reshape(-1))
    # the update's norm gathers the cards' norms: another summation order, so equal to rounding
    assert math.hypot(*norms) == pytest.approx(whole_norm, rel=1e-12)


def test_full_rank_noise_on_a_slice_needs_the_tiled_scheme():
    live = {"w": torch.zeros(2, 4)}
    # holding and loading slices draws no noise (GRPO's sync); drawing a member or an update does
    resident = ResidentWeights(live, scheme="flat", slices={"w": WeightSlice((4, 4), slice(0, 2))})
    resident.load_master(torch.ones(8))
    with pytest.raises(ValueError, match="noise_scheme 'tiled'"):
        resident.write_member(es.Member(1), 0.1)
    with pytest.raises(ValueError, match="noise_scheme 'tiled'"):
        resident.step(es.SGDConfig(0.1), [es.Member(1)], [1.0], 0.1)


@pytest.mark.parametrize("rank", [1, 2])
def test_lowrank_slices_are_the_whole_weights_slices(rank):
    shapes = {"q.weight": (8, 6), "o.weight": (6, 8)}
    slices = {"q.weight": (slice(4, 8), slice(None)), "o.weight": (slice(None), slice(0, 4))}
    whole = lowrank.member_delta(es.Member(3, -1), shapes, rank, 0.1)
    cut = lowrank.member_delta(es.Member(3, -1), shapes, rank, 0.1, slices=slices)
    for name, (rows, cols) in slices.items():
        torch.testing.assert_close(cut[name], whole[name][rows, cols], rtol=0, atol=0 if rank == 1 else 1e-7)
    gradient = lowrank.lowrank_gradient(MEMBERS, FITNESS, shapes, rank, 0.1)
    gradient_cut = lowrank.lowrank_gradient(MEMBERS, FITNESS, shapes, rank, 0.1, slices=slices)
    for name, (rows, cols) in slices.items():
        torch.testing.assert_close(gradient_cut[name], gradient[name][rows, cols], rtol=1e-6, atol=1e-7)


def test_apply_update_in_parts_is_the_same_update_however_cut():
    layout = es.Layout.of({"a": (7,), "b": (5,)})
    start = torch.randn(12, generator=torch.Generator().manual_seed(1))
    gradient = torch.randn(12, generator=torch.Generator().manual_seed(2))
    config = es.AdamConfig(0.01)
    one = es.init_optimizer_state(config, es.FlatParams(start.clone(), layout), copy=False)
    one, norm_one = es.apply_update_in_place(config, one, gradient, chunk=5)
    parts = es.init_optimizer_state(config, es.FlatParams(start.clone(), layout), copy=False)
    parts, norm_parts = es.apply_update_in_parts(config, parts, [(slice(0, 7), gradient[:7]), (slice(7, 12), gradient[7:])],
                                                 chunk=3)
    assert torch.equal(one.master.flat, parts.master.flat)
    assert torch.equal(one.second_moment.flat, parts.second_moment.flat)
    assert norm_parts == pytest.approx(norm_one, rel=1e-12)
    with pytest.raises(ValueError, match="cover 7 of the master's 12"):
        es.apply_update_in_parts(config, parts, [(slice(0, 7), gradient[:7])])


def test_full_mode_split_over_cards_needs_tiled_noise():
    with pytest.raises(ValueError, match="noise_scheme: es_mode full at tensor_parallel_size=2 needs noise_scheme: tiled"):
        ESConfig(es_mode="full", tensor_parallel_size=2)
    assert ESConfig(es_mode="full", tensor_parallel_size=2, noise_scheme="tiled").noise_scheme == "tiled"
