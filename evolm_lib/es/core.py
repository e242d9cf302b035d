"""The ES update math under one name, for code that imports ``evolm_lib.es.core``: each piece lives
in a module of its own (``layout``, ``noise``, ``shaping``, ``gradient``, ``optimizers``).

Sign convention, written once: rewards are MAXIMISED and every optimizer here ascends.
"""
from __future__ import annotations

from .gradient import GradientForm, es_gradient, member_coefficients, seeded_combination
from .layout import FlatParams, Layout, Params, Shapes, difference, flat_of, layout_of, shapes_of, update_norm
from .noise import (NOISE_DEVICE, NOISE_SCHEMES, Member, NoiseDevice, NoiseScheme, Sigma, check_noise_device,
                    check_noise_scheme, check_population_size, check_sigma, flat_seed, member_noise, perturb,
                    population, population_noise, sigma_of, tensor_seed)
from .optimizers import (IN_PLACE_CHUNK, AdamConfig, OptimizerConfig, OptimizerState, SGDConfig, apply_update,
                         apply_update_in_place, init_optimizer_state, optimizer_state_from_tensors, optimizer_state_to,
                         optimizer_state_to_tensors)
from .shaping import SHAPING, centered_ranks, per_prompt_centering, raw, shape_fitness, z_score

__all__ = [
    "GradientForm", "es_gradient", "member_coefficients", "seeded_combination",
    "FlatParams", "Layout", "Params", "Shapes", "difference", "flat_of", "layout_of", "shapes_of", "update_norm",
    "NOISE_DEVICE", "NOISE_SCHEMES", "Member", "NoiseDevice", "NoiseScheme", "Sigma", "check_noise_device",
    "check_noise_scheme", "check_population_size", "check_sigma", "flat_seed", "member_noise", "perturb",
    "population", "population_noise", "sigma_of", "tensor_seed",
    "IN_PLACE_CHUNK", "AdamConfig", "OptimizerConfig", "OptimizerState", "SGDConfig", "apply_update",
    "apply_update_in_place", "init_optimizer_state", "optimizer_state_from_tensors", "optimizer_state_to",
    "optimizer_state_to_tensors",
    "SHAPING", "centered_ranks", "per_prompt_centering", "raw", "shape_fitness", "z_score",
]
