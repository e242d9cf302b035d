"""An ES state and the two pure steps that advance it: ``ask`` (the members of the next generation)
and ``tell`` (the state after the members' fitness). Neither mutates its input, so a caller can keep
any state, rerun a step from it and get the same bits.

    members = ask(state, key)                 # integer seeds and signs, nothing drawn yet
    fitness = shape_fitness(name, rewards)    # (population,) from (population, prompts) rewards
    state = tell(state, members, fitness)     # the mean moved by the optimizer, generation + 1

evosax's OpenES has the same shape (``ask(key, state, params)``, ``tell(key, population, fitness,
state, params)``); here members are seeds, so ``ask`` returns no tensors, and rewards are
maximised (evosax minimises).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .gradient import GradientForm, es_gradient
from .layout import FlatParams, Params, Shapes
from .noise import NOISE_DEVICE, Member, NoiseScheme, Sigma, population
from .optimizers import OptimizerConfig, OptimizerState, apply_update, init_optimizer_state


@dataclass(frozen=True)
class ESSettings:
    """What ``ask`` and ``tell`` need beside the state; fixed for a run."""

    population_size: int
    """Members per generation."""
    sigma: Sigma
    """Noise scale, one value or one per tensor."""
    optimizer: OptimizerConfig
    """SGD or Adam (ascent)."""
    antithetic: bool = True
    """Members in (seed, +1), (seed, -1) pairs."""
    gradient_form: GradientForm = "qiu"
    """"qiu": 1/N sum w_i eps_i; "textbook": divided by sigma too."""
    noise_device: str = NOISE_DEVICE
    """Where the noise is drawn (the CPU stream is the same bits on every machine)."""
    noise_scheme: NoiseScheme = "flat"
    """How a member's noise is drawn from its seed."""


@dataclass(frozen=True)
class ESState:
    """The mean, the optimizer's state and the generation that produced the mean (0: the start).
    ``mean`` and ``optimizer`` are None where an engine holds the mean in its own weights (``ask``
    needs only the generation; the update then runs where the weights live)."""

    settings: ESSettings
    mean: Params | None  # float32 named tensors (a FlatParams), on settings.noise_device
    optimizer: OptimizerState | None
    generation: int = 0

    @property
    def shapes(self) -> Shapes:
        """The shape of every tensor of the mean."""
        return {name: tuple(tensor.shape) for name, tensor in self.mean.items()}


def init(settings: ESSettings, mean: Params, optimizer: OptimizerState | None = None, generation: int = 0) -> ESState:
    """A state from a mean (a copy is not taken: the state owns ``mean`` from here on, and no step
    writes into it) and the optimizer's state (None: a fresh one)."""
    if optimizer is None:
        optimizer = init_optimizer_state(settings.optimizer, mean)
    return ESState(settings, mean, optimizer, generation)


def ask(state: ESState, key: int) -> list[Member]:
    """The members of generation ``state.generation + 1``: seeds derived from (key, generation, index)."""
    settings = state.settings
    return population(key, state.generation + 1, settings.population_size, settings.antithetic)


def gradient(state: ESState, members: list[Member], fitness: torch.Tensor) -> FlatParams:
    """The ES ascent direction of the members' fitness weights (population,), noise regenerated from the seeds."""
    settings = state.settings
    return es_gradient(members, fitness, state.shapes, settings.sigma, form=settings.gradient_form,
                       noise_device=settings.noise_device, scheme=settings.noise_scheme)


def step(state: ESState, direction: Params) -> ESState:
    """The state after one optimizer step along ``direction`` (an ascent direction): a new mean and
    optimizer state, generation + 1; ``state`` is left as it was."""
    mean, optimizer = apply_update(state.settings.optimizer, state.optimizer, state.mean, direction)
    return dataclasses.replace(state, mean=mean, optimizer=optimizer, generation=state.generation + 1)


def tell(state: ESState, members: list[Member], fitness: torch.Tensor) -> ESState:
    """The state after the members' shaped fitness (population,): the ES gradient, one optimizer step."""
    return step(state, gradient(state, members, fitness))
