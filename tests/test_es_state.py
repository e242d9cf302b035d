"""Tests for evolm_lib.es.state: the ES state and its pure ask and tell (the same state and key give
the same members; tell returns a new state and leaves its input as it was), checked against the
update written out by hand."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from evolm_lib import es
from evolm_lib.es import state as es_state

SHAPES = {"a": (2, 3), "b": (4,)}


def _state(optimizer: es.OptimizerConfig, population_size: int = 4, antithetic: bool = True) -> es_state.ESState:
    generator = torch.Generator().manual_seed(3)
    mean = es.FlatParams.of({name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()})
    settings = es_state.ESSettings(population_size=population_size, sigma=0.1, optimizer=optimizer,
                                   antithetic=antithetic)
    return es_state.init(settings, mean)


def _snapshot(state: es_state.ESState) -> dict[str, torch.Tensor]:
    """Copies of every tensor a state holds, to check later that nothing wrote into them."""
    tensors = {f"mean/{k}": v.clone() for k, v in state.mean.items()}
    tensors.update({f"opt/{k}": v.clone() for k, v in es.optimizer_state_to_tensors(state.optimizer).items()})
    return tensors


@pytest.mark.parametrize("antithetic", [True, False])
def test_ask_gives_the_same_members_for_the_same_state_and_key(antithetic):
    state = _state(es.SGDConfig(learning_rate=0.1), population_size=6, antithetic=antithetic)
    first, again = es_state.ask(state, 7), es_state.ask(state, 7)
    assert first == again and len(first) == 6
    assert first == es.population(7, 1, 6, antithetic)  # generation 1's members of seed 7
    assert es_state.ask(state, 8) != first  # another key, other seeds
    later = dataclasses.replace(state, generation=1)
    assert {m.seed for m in es_state.ask(later, 7)}.isdisjoint({m.seed for m in first})  # the next generation's


@pytest.mark.parametrize("optimizer", [es.SGDConfig(learning_rate=0.1, momentum=0.5), es.AdamConfig(learning_rate=0.01)])
def test_tell_returns_a_new_state_and_leaves_its_input_as_it_was(optimizer):
    state = _state(optimizer)
    before = _snapshot(state)
    members = es_state.ask(state, 11)
    fitness = torch.tensor([1.0, -1.0, 0.5, 0.25])
    told = es_state.tell(state, members, fitness)
    for name, tensor in _snapshot(state).items():
        assert torch.equal(tensor, before[name]), name  # nothing written into the input
    assert state.generation == 0 and state.optimizer.step == 0
    assert told.generation == 1 and told.optimizer.step == 1 and told.settings == state.settings
    assert not torch.equal(told.mean.flat, state.mean.flat)
    again = es_state.tell(state, members, fitness)  # the same state told the same again: the same bits
    for name, tensor in _snapshot(again).items():
        assert torch.equal(tensor, _snapshot(told)[name]), name


def test_tell_is_the_es_update_written_out_by_hand():
    """SGD without momentum, qiu form: mean + lr / N * sum_i w_i sign_i eps(seed_i)."""
    lr, sigma = 0.1, 0.1
    state = _state(es.SGDConfig(learning_rate=lr))
    members = es_state.ask(state, 5)
    fitness = torch.tensor([0.5, -0.5, 0.25, -0.25])
    told = es_state.tell(state, members, fitness)
    for name in SHAPES:
        step = sum(float(w) * m.sign * es.member_noise(m.seed, SHAPES)[name] for m, w in zip(members, fitness))
        expected = state.mean[name] + lr * step / len(members)
        torch.testing.assert_close(told.mean[name], expected, rtol=1e-6, atol=1e-7)
    # the members tell used are the noise ask's seeds stand for: mean + sign * sigma * eps
    member = es.perturb(state.mean, members[0], sigma)
    for name in SHAPES:
        torch.testing.assert_close(member[name], state.mean[name] + sigma * es.member_noise(members[0].seed, SHAPES)[name])


def test_equal_fitness_leaves_the_mean_where_it_was():
    """All members equally fit: a zero direction, so SGD without decay keeps the mean (bit for bit)."""
    state = _state(es.SGDConfig(learning_rate=0.1))
    members = es_state.ask(state, 2)
    told = es_state.tell(state, members, es.centered_ranks(torch.ones(4)))
    assert torch.equal(told.mean.flat, state.mean.flat) and told.generation == 1
