"""Tests for evolm_lib.zo.updates: a hand-computed two-step example of every rule, with and without bias correction."""
from __future__ import annotations

import math

import pytest
import torch

from evolm_lib.zo.updates import UPDATE_RULES, UpdateConfig, UpdateState, apply_update, init_update_state

# Two steps from x0 = (1, -2) with g1 = (0.5, -0.2), then g2 = (0.1, 0.3); lr 0.1, betas (0.9, 0.99), eps 0.
X0 = torch.tensor([1.0, -2.0], dtype=torch.float64)
G1 = torch.tensor([0.5, -0.2], dtype=torch.float64)
G2 = torch.tensor([0.1, 0.3], dtype=torch.float64)
# m1 = 0.1 g1 = (0.05, -0.02); m2 = 0.9 m1 + 0.1 g2 = (0.055, 0.012)
# adam:   v1 = 0.01 g1^2 = (0.0025, 0.0004);    v2 = 0.99 v1 + 0.01 g2^2 = (0.002575, 0.001296)
# radazo: v1 = 0.01 m1^2 = (2.5e-5, 4e-6);       v2 = 0.99 v1 + 0.01 m2^2 = (5.5e-5, 5.4e-6)
EXPECTED = {
    # x1 = x0 - 0.1 g1; x2 = x1 - 0.1 g2
    ("sgd", False): ([0.95, -1.98], [0.94, -2.01]),
    # x1 = x0 - 0.1 m1 / sqrt(v1) = x0 - 0.1 sign(g1)
    ("adam", False): ([0.9, -1.9], [0.9 - 0.1 * 0.055 / math.sqrt(0.002575), -1.9 - 0.1 * 0.012 / math.sqrt(0.001296)]),
    # x1 = x0 - 0.1 * 10 sign(g1): sqrt(v1) = 0.1 |m1|
    ("radazo", False): ([0.0, -1.0], [0.0 - 0.1 * 0.055 / math.sqrt(5.5e-5), -1.0 - 0.1 * 0.012 / math.sqrt(5.4e-6)]),
    # corrected: m / (1 - 0.9^t), v / (1 - 0.99^t); at t = 1 the same sign step; at t = 2 divide by 0.19 and 0.0199
    ("adam", True): ([0.9, -1.9], [0.9 - 0.1 * (0.055 / 0.19) / math.sqrt(0.002575 / 0.0199),
                                   -1.9 - 0.1 * (0.012 / 0.19) / math.sqrt(0.001296 / 0.0199)]),
    # radazo's v is built from the uncorrected m, so its first corrected step is still 10 lr sign(g)
    ("radazo", True): ([0.0, -1.0], [0.0 - 0.1 * (0.055 / 0.19) / math.sqrt(5.5e-5 / 0.0199),
                                     -1.0 - 0.1 * (0.012 / 0.19) / math.sqrt(5.4e-6 / 0.0199)]),
}


@pytest.mark.parametrize("rule, bias_correction", list(EXPECTED), ids=[f"{r}-{'corrected' if b else 'plain'}" for r, b in EXPECTED])
def test_two_steps_by_hand(rule, bias_correction):
    config = UpdateConfig(rule=rule, learning_rate=0.1, eps=0.0, bias_correction=bias_correction)
    state = init_update_state(config, X0)
    x1, state = apply_update(config, state, X0, G1)
    x2, state = apply_update(config, state, x1, G2)
    first, second = EXPECTED[(rule, bias_correction)]
    assert x1.tolist() == pytest.approx(first, abs=1e-12)
    assert x2.tolist() == pytest.approx(second, abs=1e-12)
    assert state.step == 2
    if rule != "sgd":
        assert state.first_moment.tolist() == pytest.approx([0.055, 0.012], abs=1e-15)


def test_first_steps_of_the_reference_with_the_default_eps():
    """No bias correction (the reference): adam's first step is lr sign(g), radazo's 10 lr sign(g)."""
    g = torch.tensor([3.0, -0.05, 0.25], dtype=torch.float64)  # radazo: sqrt(v) = 0.01 |g| >> eps
    for rule, size in (("adam", 1.0), ("radazo", 10.0)):
        config = UpdateConfig(rule=rule, learning_rate=0.01)
        x1, _ = apply_update(config, init_update_state(config, X0.new_zeros(3)), X0.new_zeros(3), g)
        assert x1.tolist() == pytest.approx((-0.01 * size * torch.sign(g)).tolist(), rel=1e-4)  # eps = 1e-8


def test_inputs_are_not_modified_and_state_round_trips():
    config = UpdateConfig(rule="adam")
    state = init_update_state(config, X0)
    x, g = X0.clone(), G1.clone()
    _, new_state = apply_update(config, state, x, g)
    assert torch.equal(x, X0) and torch.equal(g, G1) and state.step == 0 and not state.first_moment.any()
    restored = UpdateState.from_dict(new_state.to_dict())
    assert restored.step == 1 and torch.equal(restored.second_moment, new_state.second_moment)
    assert init_update_state(UpdateConfig(rule="sgd"), X0) == UpdateState()


@pytest.mark.parametrize("settings, message", [
    ({"rule": "lion"}, r"update rule 'lion' is unknown; choose from \['sgd', 'adam', 'radazo'\]"),
    ({"learning_rate": 0.0}, "learning_rate must be > 0"),
    ({"beta1": 1.0}, r"beta1 must be in \[0, 1\)"),
    ({"beta2": -0.1}, r"beta2 must be in \[0, 1\)"),
    ({"eps": -1e-8}, "eps must be >= 0"),
])
def test_bad_settings_name_the_setting(settings, message):
    with pytest.raises(ValueError, match=message):
        UpdateConfig(**settings)


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match=r"gradient has shape \(3,\) but x has shape \(2,\)"):
        apply_update(UpdateConfig(), init_update_state(UpdateConfig(), X0), X0, torch.zeros(3, dtype=torch.float64))
    assert UPDATE_RULES == ("sgd", "adam", "radazo")
