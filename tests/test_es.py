"""Tests for evolm_lib.es on hand-computed tensors, plus statistical checks on a quadratic."""
from __future__ import annotations

import math

import pytest
import torch

from evolm_lib import es
from evolm_lib.es import (
    SHAPING,
    AdamConfig,
    Member,
    SGDConfig,
    apply_update,
    centered_ranks,
    es_gradient,
    init_optimizer_state,
    member_noise,
    optimizer_state_from_tensors,
    optimizer_state_to_tensors,
    per_prompt_centering,
    perturb,
    population,
    raw,
    shape_fitness,
    tensor_seed,
    update_norm,
    z_score,
)

Q = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
V = "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"


def close(actual: torch.Tensor, expected: list[float], atol: float = 1e-5) -> None:
    """Assert a tensor equals literal numbers within atol."""
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# ----------------------------------------------------------------------------- seeded noise


def test_tensor_seed_is_stable_and_name_dependent():
    assert tensor_seed(3, Q) == tensor_seed(3, Q)
    assert tensor_seed(3, Q) != tensor_seed(3, V)
    assert tensor_seed(3, Q) != tensor_seed(4, Q)
    assert 0 <= tensor_seed(3, Q) < 2**63


def test_member_noise_regenerates_bit_for_bit():
    shapes = {Q: (4, 8), V: (4, 8)}
    first, second = member_noise(123, shapes), member_noise(123, shapes)
    for name in shapes:
        assert first[name].dtype == torch.float32 and first[name].shape == (4, 8)
        assert torch.equal(first[name], second[name])


def test_same_shaped_tensors_get_different_noise():
    noise = member_noise(123, {Q: (4, 8), V: (4, 8)})
    assert not torch.equal(noise[Q], noise[V])


def test_different_seeds_give_different_noise():
    assert not torch.equal(member_noise(1, {Q: (16,)})[Q], member_noise(2, {Q: (16,)})[Q])


def test_per_tensor_noise_of_a_tensor_does_not_depend_on_the_other_tensors():
    # V sorts after Q: its noise sits after Q's in a flat draw, so test V, the one that would move
    alone = member_noise(9, {V: (5,)}, scheme="per_tensor")[V]
    together = member_noise(9, {V: (5,), Q: (3, 3)}, scheme="per_tensor")[V]
    assert torch.equal(alone, together)
    expected = torch.randn((5,), generator=torch.Generator().manual_seed(tensor_seed(9, V)))
    assert torch.equal(alone, expected)


def test_flat_noise_is_one_draw_per_member_split_in_sorted_name_order():
    noise = member_noise(9, {V: (2, 3), Q: (4,)}, scheme="flat")
    draw = torch.randn((10,), generator=torch.Generator().manual_seed(es.flat_seed(9)))
    assert torch.equal(noise[Q], draw[:4])  # Q < V
    assert torch.equal(noise[V], draw[4:].view(2, 3))
    assert list(noise) == [V, Q]  # the caller's order is kept in the returned mapping


@pytest.mark.parametrize("scheme", ["flat", "per_tensor"])
def test_population_noise_rows_are_the_members_noise(scheme):
    shapes = {V: (2, 3), Q: (4,)}
    layout = es.Layout.of(shapes)
    rows = es.population_noise([5, 6, 5], layout, scheme=scheme)
    assert rows.shape == (3, 10) and torch.equal(rows[0], rows[2])
    for row, seed in zip(rows, (5, 6)):
        split = layout.split(row)
        for name, tensor in member_noise(seed, shapes, scheme=scheme).items():
            assert torch.equal(split[name], tensor)


def test_unknown_noise_scheme_is_refused():
    with pytest.raises(ValueError, match="noise_scheme"):
        member_noise(1, {Q: (2,)}, scheme="per_layer")


@pytest.mark.parametrize("scheme", ["flat", "per_tensor"])
def test_es_gradient_in_blocks_equals_the_member_by_member_sum(scheme, monkeypatch):
    shapes = {Q: (3, 4), V: (5,)}
    members = population(base_seed=2, generation=1, population_size=6)
    weights = [0.5, -1.0, 2.0, 0.25, -0.75, 1.5]
    expected = {name: torch.zeros(shape) for name, shape in shapes.items()}
    for member, weight in zip(members, weights):
        for name, tensor in member_noise(member.seed, shapes, scheme=scheme).items():
            expected[name] += member.sign * weight * tensor / len(members)
    whole = es_gradient(members, weights, shapes, sigma=0.1, scheme=scheme)
    monkeypatch.setattr(es.layout, "_BLOCK_ELEMENTS", 17)  # one member's noise per block
    blocked = es_gradient(members, weights, shapes, sigma=0.1, scheme=scheme)
    for name in shapes:
        torch.testing.assert_close(whole[name], expected[name], rtol=0, atol=1e-6)
        assert torch.equal(blocked[name], whole[name])


def test_member_noise_dtype_is_a_cast_of_the_float32_draw():
    noise32 = member_noise(5, {Q: (6,)})[Q]
    noise16 = member_noise(5, {Q: (6,)}, dtype=torch.bfloat16)[Q]
    assert noise16.dtype == torch.bfloat16
    assert torch.equal(noise16, noise32.to(torch.bfloat16))


# ----------------------------------------------------------------------------- population


def test_population_is_deterministic_and_changes_with_generation():
    assert population(0, 3, 6, antithetic=True) == population(0, 3, 6, antithetic=True)
    seeds_g3 = {m.seed for m in population(0, 3, 6, antithetic=True)}
    seeds_g4 = {m.seed for m in population(0, 4, 6, antithetic=True)}
    seeds_b1 = {m.seed for m in population(1, 3, 6, antithetic=True)}
    assert seeds_g3.isdisjoint(seeds_g4) and seeds_g3.isdisjoint(seeds_b1)


def test_antithetic_pairs_are_adjacent_with_opposite_signs():
    members = population(7, 0, 8, antithetic=True)
    assert len(members) == 8
    for plus, minus in zip(members[0::2], members[1::2]):
        assert (plus.seed, plus.sign, minus.sign) == (minus.seed, 1, -1)
    assert len({m.seed for m in members}) == 4
    assert all(0 <= m.seed < 2**31 for m in members)


def test_population_without_antithetic_has_distinct_positive_members():
    members = population(7, 0, 5, antithetic=False)
    assert len({m.seed for m in members}) == 5 and all(m.sign == 1 for m in members)


def test_odd_antithetic_population_is_rejected():
    with pytest.raises(ValueError, match="population_size"):
        population(0, 0, 5, antithetic=True)
    with pytest.raises(ValueError, match="population_size"):
        population(0, 0, 0, antithetic=False)


def test_member_sign_must_be_plus_or_minus_one():
    with pytest.raises(ValueError, match="sign"):
        Member(seed=1, sign=0)


# ----------------------------------------------------------------------------- perturb


def test_perturb_adds_signed_scaled_noise_per_tensor():
    mean = {Q: torch.tensor([1.0, 2.0, 3.0]), V: torch.tensor([[0.5, -0.5]])}
    before = {k: t.clone() for k, t in mean.items()}
    noise = member_noise(42, {Q: (3,), V: (1, 2)})
    plus = perturb(mean, Member(42, 1), {Q: 0.1, V: 0.01})
    minus = perturb(mean, Member(42, -1), 0.1)
    torch.testing.assert_close(plus[Q], mean[Q] + 0.1 * noise[Q])
    torch.testing.assert_close(plus[V], mean[V] + 0.01 * noise[V])
    torch.testing.assert_close(minus[V], mean[V] - 0.1 * noise[V])
    for name in mean:  # inputs untouched
        assert torch.equal(mean[name], before[name])


def test_perturb_keeps_dtype():
    mean = {Q: torch.zeros(4, dtype=torch.bfloat16)}
    assert perturb(mean, Member(1, 1), 0.5)[Q].dtype == torch.bfloat16


@pytest.mark.parametrize("sigma", [0.0, -1.0, float("nan"), {Q: 0.0}, {V: 0.1}])
def test_perturb_rejects_bad_sigma(sigma):
    with pytest.raises(ValueError, match="sigma"):
        perturb({Q: torch.zeros(2)}, Member(1, 1), sigma)


# ----------------------------------------------------------------------------- fitness shaping


def test_z_score_by_hand():
    # mean 2, population std sqrt(2/3) = 0.816497 -> +-1 / 0.816497 = +-1.224745
    close(z_score(torch.tensor([1.0, 2.0, 3.0])), [-1.224745, 0.0, 1.224745])


def test_z_score_of_equal_rewards_is_zero_not_nan():
    close(z_score(torch.tensor([5.0, 5.0, 5.0])), [0.0, 0.0, 0.0], atol=0)


def test_centered_ranks_by_hand():
    close(centered_ranks(torch.tensor([10.0, 30.0, 20.0])), [-0.5, 0.5, 0.0], atol=0)


def test_centered_ranks_ties_share_the_average_rank():
    # 0-based ranks 0, 1.5, 1.5, 3 -> /3 -> 0, .5, .5, 1 -> -0.5
    close(centered_ranks(torch.tensor([1.0, 2.0, 2.0, 3.0])), [-0.5, 0.0, 0.0, 0.5], atol=0)
    close(centered_ranks(torch.tensor([7.0, 7.0, 7.0])), [0.0, 0.0, 0.0], atol=0)
    close(centered_ranks(torch.tensor([4.0])), [0.0], atol=0)


def test_raw_returns_float32_copy():
    rewards = torch.tensor([1, 2, 3])
    out = raw(rewards)
    close(out, [1.0, 2.0, 3.0], atol=0)
    assert out.dtype == torch.float32


def test_per_prompt_centering_by_hand():
    # prompt means [2, 6]; centred [[-1, -2], [1, 2]]; global std sqrt(10/4) = 1.581139
    # scaled [[-0.632456, -1.264911], [0.632456, 1.264911]]; mean over prompts -> +-0.948683
    matrix = torch.tensor([[1.0, 4.0], [3.0, 8.0]])
    close(per_prompt_centering(matrix), [-0.948683, 0.948683])
    close(per_prompt_centering(torch.full((2, 3), 0.5)), [0.0, 0.0], atol=0)


def test_shape_fitness_averages_prompts_for_one_dimensional_shapers():
    matrix = torch.tensor([[1.0, 3.0], [2.0, 4.0], [3.0, 5.0]])  # member means 2, 3, 4
    close(shape_fitness("z_score", matrix), [-1.224745, 0.0, 1.224745])
    close(shape_fitness("centered_ranks", matrix), [-0.5, 0.0, 0.5])
    close(shape_fitness("raw", matrix), [2.0, 3.0, 4.0])
    close(shape_fitness("raw", torch.tensor([2.0, 3.0])), [2.0, 3.0])  # 1-D = one prompt


def test_shape_fitness_rejects_unknown_name_and_nan():
    with pytest.raises(ValueError, match="centered_ranks"):
        shape_fitness("nope", torch.zeros(2, 2))
    with pytest.raises(ValueError, match="non-finite"):
        shape_fitness("z_score", torch.tensor([[1.0], [float("nan")]]))


@pytest.mark.parametrize("name", sorted(SHAPING))
def test_every_shaper_is_float32_per_member_and_order_preserving(name):
    matrix = torch.tensor([[0.1, 0.9], [0.7, 0.8], [0.3, 0.2], [1.0, 1.0], [0.0, 0.5]])
    weights = shape_fitness(name, matrix)
    assert weights.dtype == torch.float32 and weights.shape == (5,)
    order = torch.argsort(matrix.mean(dim=1))
    assert torch.all(weights[order].diff() >= 0)


@pytest.mark.parametrize("name", sorted(set(SHAPING) - {"raw"}))
def test_shapers_ignore_a_constant_reward_offset(name):
    matrix = torch.tensor([[0.1, 0.9], [0.7, 0.8], [0.3, 0.2]])
    torch.testing.assert_close(shape_fitness(name, matrix + 10.0), shape_fitness(name, matrix), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- gradient


SHAPES = {Q: (2,), V: (1, 2)}


def test_es_gradient_qiu_and_textbook_match_the_hand_sum():
    members = [Member(5, 1), Member(7, -1)]
    eps5, eps7 = member_noise(5, SHAPES), member_noise(7, SHAPES)
    qiu = es_gradient(members, torch.tensor([2.0, 0.5]), SHAPES, 0.1, form="qiu")
    textbook = es_gradient(members, [2.0, 0.5], SHAPES, {Q: 0.1, V: 0.5}, form="textbook")
    for name in SHAPES:
        hand = (2.0 * eps5[name] - 0.5 * eps7[name]) / 2  # 1/N sum w_i sign_i eps_i
        torch.testing.assert_close(qiu[name], hand)
        assert qiu[name].dtype == torch.float32
    torch.testing.assert_close(textbook[Q], (2.0 * eps5[Q] - 0.5 * eps7[Q]) / (2 * 0.1))
    torch.testing.assert_close(textbook[V], (2.0 * eps5[V] - 0.5 * eps7[V]) / (2 * 0.5))


def test_es_gradient_combines_an_antithetic_pair():
    eps = member_noise(5, SHAPES)
    grad = es_gradient([Member(5, 1), Member(5, -1)], [1.0, -3.0], SHAPES, 0.1)
    for name in SHAPES:  # 1/2 * (1 * eps - (-3) * eps) = 2 eps
        torch.testing.assert_close(grad[name], 2.0 * eps[name])
    zero = es_gradient([Member(5, 1), Member(5, -1)], [0.4, 0.4], SHAPES, 0.1)
    assert all(torch.count_nonzero(t) == 0 for t in zero.values())


def test_es_gradient_validates_inputs():
    with pytest.raises(ValueError, match="weights"):
        es_gradient([Member(1, 1)], [1.0, 2.0], SHAPES, 0.1)
    with pytest.raises(ValueError, match="members"):
        es_gradient([], [], SHAPES, 0.1)
    with pytest.raises(ValueError, match="form"):
        es_gradient([Member(1, 1)], [1.0], SHAPES, 0.1, form="nope")
    with pytest.raises(ValueError, match="sigma"):
        es_gradient([Member(1, 1)], [1.0], SHAPES, 0.0)


# ----------------------------------------------------------------------------- optimizers


@pytest.mark.parametrize("formulas", [False, True])
def test_sgd_two_steps_by_hand(formulas):
    config = SGDConfig(learning_rate=0.1, momentum=0.9, weight_decay=0.01, formulas=formulas)
    params = {Q: torch.tensor([1.0, -2.0])}
    state = init_optimizer_state(config, params)
    params1, state1 = apply_update(config, state, params, {Q: torch.tensor([0.5, 1.0])})
    # v = g; theta + 0.1 v - 0.1*0.01 theta = [1 + .05 - .001, -2 + .1 + .002]
    close(params1[Q], [1.049, -1.898])
    close(state1.first_moment[Q], [0.5, 1.0])
    params2, state2 = apply_update(config, state1, params1, {Q: torch.tensor([-1.0, 0.0])})
    # v = 0.9 [.5, 1] + [-1, 0] = [-.55, .9]; [1.049 - .055 - .001049, -1.898 + .09 + .001898]
    close(params2[Q], [0.992951, -1.806102])
    assert (state.step, state1.step, state2.step) == (0, 1, 2)
    close(params[Q], [1.0, -2.0], atol=0)  # input untouched
    close(state.first_moment[Q], [0.0, 0.0], atol=0)


def test_plain_sgd_ascends_the_gradient():
    config = SGDConfig(learning_rate=0.5)
    params = {Q: torch.tensor([1.0])}
    new, state = apply_update(config, init_optimizer_state(config, params), params, {Q: torch.tensor([2.0])})
    close(new[Q], [2.0], atol=0)
    assert state.first_moment == {} and state.second_moment == {}


@pytest.mark.parametrize("formulas", [False, True])
def test_adam_two_steps_by_hand_with_bias_correction_and_decay(formulas):
    config = AdamConfig(learning_rate=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, formulas=formulas)
    params = {Q: torch.tensor([1.0, -2.0])}
    state = init_optimizer_state(config, params)
    params1, state1 = apply_update(config, state, params, {Q: torch.tensor([0.5, -1.0])})
    # m = [.05, -.1], v = [.00025, .001]; m_hat = [.5, -1], v_hat = [.25, 1]; direction = [1, -1]
    # theta + 0.1 dir - 0.1*0.1 theta = [1 + .1 - .01, -2 - .1 + .02]
    close(state1.first_moment[Q], [0.05, -0.1])
    close(state1.second_moment[Q], [0.00025, 0.001], atol=1e-9)
    close(params1[Q], [1.09, -2.08])
    params2, state2 = apply_update(config, state1, params1, {Q: torch.tensor([0.5, 2.0])})
    # m = [.095, .11], v = [.00049975, .004999]; m_hat = m/.19 = [.5, .578947]
    # v_hat = v/.001999 = [.25, 2.500750]; direction = [1, .578947/1.581376 = .366104]
    # theta = [1.09 + .1 - .0109, -2.08 + .0366104 + .0208]
    close(state2.first_moment[Q], [0.095, 0.11])
    close(state2.second_moment[Q], [0.00049975, 0.004999], atol=1e-9)
    close(params2[Q], [1.1791, -2.0225896])


@pytest.mark.parametrize("config, torch_optimizer", [
    (SGDConfig(learning_rate=0.1, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, maximize=True)),
    (AdamConfig(learning_rate=0.1, weight_decay=0.1),
     lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1, maximize=True, foreach=True)),
])
def test_the_ascent_step_is_torch_optims_maximising_step_bit_for_bit(config, torch_optimizer):
    """torch.optim's optimizers maximising the same gradient reach the same master, bit for bit; its
    moment buffers are those of the negated gradient, so the first moment is ours negated."""
    generator = torch.Generator().manual_seed(5)
    start = torch.randn(11, generator=generator)
    state = init_optimizer_state(config, {Q: start})
    parameter = torch.nn.Parameter(start.clone())
    optimizer = torch_optimizer([parameter])
    for _ in range(3):
        gradient = torch.randn(11, generator=generator)
        _, state = apply_update(config, state, {Q: start}, {Q: gradient})
        parameter.grad = gradient.clone()
        optimizer.step()
    assert torch.equal(state.master[Q], parameter.detach())
    moments = optimizer.state[parameter]
    assert torch.equal(state.first_moment[Q], -moments["momentum_buffer" if isinstance(config, SGDConfig) else "exp_avg"])
    if isinstance(config, AdamConfig):
        assert torch.equal(state.second_moment[Q], moments["exp_avg_sq"])


@pytest.mark.parametrize("config", [SGDConfig(0.1, momentum=0.9, weight_decay=0.01, formulas=True),
                                    AdamConfig(0.1, weight_decay=0.1, formulas=True)])
def test_the_formulas_step_is_the_formulas_on_the_whole_vector_however_the_gradient_is_cut(config):
    """``formulas`` (the step of runs made before torch.optim's): the master and the moments are
    ``formulas_step``'s on the whole vector, bit for bit, in chunks of any size."""
    generator = torch.Generator().manual_seed(3)
    start = torch.randn(23, generator=generator)
    gradients = [torch.randn(23, generator=generator) for _ in range(3)]
    theta, first, second = start.clone(), torch.zeros(23), torch.zeros(23)
    for step, gradient in enumerate(gradients, start=1):
        theta, first, second = (new if new is not None else old for new, old in
                                zip(es.formulas_step(config, step, theta, gradient, first, second), (theta, first, second)))
    for chunk in (23, 7, 1):
        state = init_optimizer_state(config, {Q: start})
        for gradient in gradients:
            state, _ = es.apply_update_in_place(config, state, gradient, chunk)
        assert torch.equal(state.master.flat, theta) and torch.equal(state.first_moment.flat, first)
        assert not state.second_moment or torch.equal(state.second_moment.flat, second)


def test_bf16_params_keep_small_updates_in_the_float32_master_copy():
    one = torch.tensor([1.0], dtype=torch.bfloat16)
    assert torch.equal(one + 1e-5, one)  # why the master copy exists: bf16 drops the update
    config = SGDConfig(learning_rate=1.0)
    params = {Q: one}
    state = init_optimizer_state(config, params)
    new, state = apply_update(config, state, params, {Q: torch.tensor([1e-5], dtype=torch.bfloat16)})
    assert new[Q].dtype == torch.bfloat16 and state.master[Q].dtype == torch.float32
    assert state.master[Q].item() - 1.0 == pytest.approx(1e-5, rel=1e-2)
    for _ in range(999):  # 1000 * 1e-5 = 0.01 > half the bf16 spacing (2**-8) near 1
        new, state = apply_update(config, state, new, {Q: torch.tensor([1e-5])})
    assert state.master[Q].item() == pytest.approx(1.01, abs=1e-4)
    assert new[Q].item() == 1.0078125  # the bf16 copy moved one step


def test_optimizer_state_round_trips_through_flat_tensors():
    config = AdamConfig(learning_rate=0.1)
    params = {Q: torch.tensor([1.0, 2.0]), V: torch.tensor([[3.0]])}
    _, state = apply_update(config, init_optimizer_state(config, params), params, {Q: torch.ones(2), V: torch.ones(1, 1)})
    tensors = optimizer_state_to_tensors(state)
    assert set(tensors) == {"step", f"master/{Q}", f"master/{V}", f"m/{Q}", f"m/{V}", f"v/{Q}", f"v/{V}"}
    assert tensors["step"].dtype == torch.int64 and tensors["step"].tolist() == [1]
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tensors = safetensors_torch.load(safetensors_torch.save(tensors))
    restored = optimizer_state_from_tensors(config, tensors)
    assert restored.step == 1
    for attribute in ("master", "first_moment", "second_moment"):
        for name in params:
            assert torch.equal(getattr(restored, attribute)[name], getattr(state, attribute)[name])


def test_optimizer_state_from_tensors_checks_buffers():
    with pytest.raises(ValueError, match="second_moment"):
        optimizer_state_from_tensors(AdamConfig(0.1), {"step": torch.tensor(0), f"master/{Q}": torch.zeros(1), f"m/{Q}": torch.zeros(1)})
    with pytest.raises(ValueError, match="unexpected"):
        optimizer_state_from_tensors(SGDConfig(0.1), {"step": torch.tensor(0), "x/y": torch.zeros(1)})


def test_update_norm_by_hand():
    assert update_norm({Q: torch.tensor([3.0]), V: torch.tensor([[4.0, 0.0]])}) == pytest.approx(5.0)
    flat = es.FlatParams.of({Q: torch.tensor([3.0]), V: torch.tensor([[4.0, 0.0]])})
    assert update_norm(flat) == 5.0


# ----------------------------------------------------------------------------- flat parameters


def test_flat_params_are_views_of_one_vector_in_sorted_name_order():
    params = {V: torch.tensor([[5.0, 6.0]]), Q: torch.tensor([[1.0, 2.0], [3.0, 4.0]])}
    flat = es.FlatParams.of(params)
    assert list(flat) == [Q, V] and len(flat) == 2 and Q in flat and "other" not in flat
    close(flat.flat, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], atol=0)
    assert flat[Q].shape == (2, 2) and flat[V].shape == (1, 2)
    flat.flat[4] = 9.0  # the values are views: they see the vector
    assert flat[V][0, 0].item() == 9.0
    assert es.FlatParams.of(flat) is not flat and es.flat_of(flat, flat.layout) is flat.flat  # no copy
    assert dict(flat).keys() == {Q, V}
    with pytest.raises(ValueError, match="do not match the layout"):
        es.flat_of({Q: torch.zeros(2, 2)}, flat.layout)
    with pytest.raises(ValueError, match="the layout says"):
        es.flat_of({Q: torch.zeros(4), V: torch.zeros(1, 2)}, flat.layout)
    with pytest.raises(ValueError, match="6 elements"):
        es.FlatParams(torch.zeros(5), flat.layout)


def test_flat_params_pickle_and_move_as_one_vector():
    import pickle

    flat = es.FlatParams.of({Q: torch.arange(4.0).reshape(2, 2), V: torch.ones(1, 3)})
    flat[Q]  # views made: not pickled
    again = pickle.loads(pickle.dumps(flat))
    assert again.layout == flat.layout and torch.equal(again.flat, flat.flat) and torch.equal(again[V], flat[V])
    assert flat.to("cpu") is flat
    half = flat.to(dtype=torch.bfloat16)
    assert half.flat.dtype == torch.bfloat16 and half[Q].dtype == torch.bfloat16


@pytest.mark.parametrize("config", [AdamConfig(learning_rate=0.1, weight_decay=0.1), SGDConfig(0.1, momentum=0.9)])
def test_update_on_flat_params_equals_the_update_on_a_dict_bit_for_bit(config):
    generator = torch.Generator().manual_seed(0)
    params = {Q: torch.randn(3, 4, generator=generator), V: torch.randn(2, 5, generator=generator)}
    dict_params, dict_state = params, init_optimizer_state(config, params)
    flat_params = es.FlatParams.of(params)
    flat_state = init_optimizer_state(config, flat_params)
    for _ in range(3):
        gradient = {Q: torch.randn(3, 4, generator=generator), V: torch.randn(2, 5, generator=generator)}
        dict_params, dict_state = apply_update(config, dict_state, dict(dict_params), gradient)
        flat_params, flat_state = apply_update(config, flat_state, flat_params, es.FlatParams.of(gradient))
        assert isinstance(flat_params, es.FlatParams) and isinstance(flat_state.master, es.FlatParams)
        for name in params:
            assert torch.equal(flat_params[name], dict_params[name])
            assert torch.equal(flat_state.first_moment[name], dict_state.first_moment[name])
    assert torch.equal(es.difference(flat_params, params).flat,
                       torch.cat([(flat_params[n] - params[n]).reshape(-1) for n in sorted(params)]))



@pytest.mark.parametrize("config", [SGDConfig(0.1), SGDConfig(0.1, momentum=0.9, weight_decay=0.01),
                                    AdamConfig(learning_rate=0.1, weight_decay=0.1)])
@pytest.mark.parametrize("chunk", [1, 7, 1 << 24])
def test_the_in_place_update_gives_apply_updates_bits_chunk_by_chunk(config, chunk):
    generator = torch.Generator().manual_seed(3)
    params = es.FlatParams.of({Q: torch.randn(3, 4, generator=generator), V: torch.randn(2, 5, generator=generator)})
    pure_params, pure_state = params, init_optimizer_state(config, params)
    state = init_optimizer_state(config, params)  # its own float32 master, written in place
    master = state.master
    for _ in range(3):
        gradient = torch.randn(params.layout.total, generator=generator)
        new_params, pure_state = apply_update(config, pure_state, pure_params, es.FlatParams(gradient.clone(), params.layout))
        expected_norm = es.update_norm(es.difference(new_params, pure_params))
        pure_params = new_params
        state, norm = es.apply_update_in_place(config, state, gradient, chunk=chunk)
        assert state.master is master and state.step == pure_state.step
        assert torch.equal(master.flat, pure_state.master.flat)
        for mine, theirs in ((state.first_moment, pure_state.first_moment), (state.second_moment, pure_state.second_moment)):
            assert (not mine and not theirs) or torch.equal(mine.flat, theirs.flat)
        assert norm == pytest.approx(expected_norm, rel=1e-12)  # only the summation order differs


def test_the_in_place_update_by_hand_and_its_errors():
    # SGD 0.5 on [1, 2] with gradient [2, -4]: master [2, 0], change [1, -2], norm sqrt(5)
    config = SGDConfig(0.5)
    state = init_optimizer_state(config, es.FlatParams.of({Q: torch.tensor([1.0, 2.0])}))
    state, norm = es.apply_update_in_place(config, state, torch.tensor([2.0, -4.0]), chunk=1)
    assert state.master.flat.tolist() == [2.0, 0.0] and norm == pytest.approx(math.sqrt(5), rel=1e-15)
    with pytest.raises(ValueError, match="a gradient of 2 values"):
        es.apply_update_in_place(config, state, torch.ones(3))
    with pytest.raises(ValueError, match="chunk must be at least 1"):
        es.apply_update_in_place(config, state, torch.ones(2), chunk=0)
    with pytest.raises(TypeError, match="float32 FlatParams master"):
        es.apply_update_in_place(config, es.OptimizerState(0, {Q: torch.ones(2)}), torch.ones(2))
    with torch.inference_mode():  # an engine worker's master: written under inference mode too
        made = init_optimizer_state(config, es.FlatParams.of({Q: torch.tensor([1.0, 2.0])}))
    made, _ = es.apply_update_in_place(config, made, torch.tensor([2.0, -4.0]))
    assert made.master.flat.tolist() == [2.0, 0.0]

def test_mixed_dtype_params_keep_their_dtypes_after_a_flat_update():
    config = SGDConfig(learning_rate=1.0)
    params = {Q: torch.tensor([1.0]), V: torch.tensor([2.0], dtype=torch.bfloat16)}
    new, _ = apply_update(config, init_optimizer_state(config, params), params, {Q: torch.tensor([0.5]), V: torch.tensor([0.25])})
    assert new[Q].dtype == torch.float32 and new[V].dtype == torch.bfloat16
    close(new[Q], [1.5], atol=0)
    assert new[V].item() == 2.25


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: SGDConfig(learning_rate=0.0), "learning_rate"),
        (lambda: SGDConfig(learning_rate=0.1, momentum=1.0), "momentum"),
        (lambda: SGDConfig(learning_rate=0.1, weight_decay=-1.0), "weight_decay"),
        (lambda: AdamConfig(learning_rate=-1.0), "learning_rate"),
        (lambda: AdamConfig(learning_rate=0.1, beta1=1.0), "beta1"),
        (lambda: AdamConfig(learning_rate=0.1, beta2=-0.1), "beta2"),
        (lambda: AdamConfig(learning_rate=0.1, eps=0.0), "eps"),
    ],
)
def test_configs_reject_out_of_range_fields(make, field):
    with pytest.raises(ValueError, match=field):
        make()


# ----------------------------------------------------------------------------- statistics on a quadratic


def quadratic(theta: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> float:
    """f(theta) = -||theta - target||^2 (maximised at target), exact evaluation."""
    return -sum(float((theta[k] - target[k]).pow(2).sum()) for k in theta)


@pytest.mark.parametrize("antithetic", [True, False])
def test_textbook_gradient_with_raw_rewards_is_unbiased_on_a_quadratic(antithetic):
    # For a quadratic, the Gaussian-smoothed objective differs by a constant (-sigma^2 d), so its
    # gradient is the true gradient -2 (theta - target).
    theta = {Q: torch.tensor([0.5, -0.3, 0.2]), V: torch.tensor([[1.0, 0.0]])}
    target = {Q: torch.tensor([0.0, 0.1, -0.2]), V: torch.tensor([[0.4, 0.3]])}
    sigma, num_populations, population_size = 0.5, 150, 20
    estimates = []  # (num_populations, 5)
    for generation in range(num_populations):
        members = population(11, generation, population_size, antithetic=antithetic)
        rewards = torch.tensor([quadratic(perturb(theta, m, sigma), target) for m in members])
        grad = es_gradient(members, shape_fitness("raw", rewards), es.shapes_of(theta), sigma, form="textbook")
        estimates.append(torch.cat([grad[Q].reshape(-1), grad[V].reshape(-1)]))
    stacked = torch.stack(estimates).double()
    mean = stacked.mean(dim=0)
    standard_error = stacked.std(dim=0) / math.sqrt(num_populations)
    true = torch.cat([-2 * (theta[k] - target[k]).reshape(-1) for k in (Q, V)]).double()
    # 4 standard errors per coordinate: ~1e-4 false-alarm chance over 5 coordinates (and seeded).
    assert torch.all((mean - true).abs() < 4 * standard_error), (mean, true, standard_error)


@pytest.mark.parametrize(
    "shaping, config",
    [
        ("centered_ranks", AdamConfig(learning_rate=0.05)),
        ("z_score", SGDConfig(learning_rate=0.02, momentum=0.5)),
    ],
)
def test_small_es_loop_converges_on_a_quadratic(shaping, config):
    dimension, sigma, population_size = 10, 0.1, 20
    target = {Q: torch.linspace(-1.0, 1.0, dimension)}
    mean = {Q: torch.zeros(dimension)}
    state = init_optimizer_state(config, mean)
    start_distance = math.sqrt(-quadratic(mean, target))
    for generation in range(250):
        members = population(0, generation, population_size, antithetic=True)  # ask
        rewards = torch.tensor([quadratic(perturb(mean, m, sigma), target) for m in members])  # evaluate
        weights = shape_fitness(shaping, rewards)
        gradient = es_gradient(members, weights, es.shapes_of(mean), sigma)  # tell
        mean, state = apply_update(config, state, mean, gradient)
    distance = math.sqrt(-quadratic(mean, target))
    assert start_distance > 2.0 and distance < 0.15, (start_distance, distance)
