"""Evolution Strategies over LoRA adapters.

``evolm_lib.es`` is the pure update math: ``noise`` (seeded members and their noise), ``layout``
(named tensors as one flat vector), ``shaping`` (fitness shaping), ``gradient`` (the ES direction),
``optimizers`` (SGD and Adam with their state) and ``state`` (an ES state with pure ``ask`` and
``tell``), every name of them importable from ``evolm_lib.es``. The run that drives it against an engine is
``evolm_lib.train.es.ESRun``; nothing in this package imports an engine, a run or a model.
"""
from .gradient import GradientForm, es_gradient, member_coefficients, seeded_combination
from .layout import FlatParams, Layout, Params, Shapes, difference, flat_of, layout_of, shapes_of, update_norm
from .noise import (NOISE_DEVICE, NOISE_SCHEMES, Member, NoiseDevice, NoiseScheme, Sigma, check_noise_device,
                    check_noise_scheme, check_population_size, check_sigma, flat_seed, matrix_shape, member_noise,
                    perturb, population, population_noise, sigma_of, tensor_seed, tiled_noise)
from .optimizers import (IN_PLACE_CHUNK, AdamConfig, OptimizerConfig, OptimizerState, SGDConfig, apply_update, apply_update_in_parts,
                         apply_update_in_place, formulas_step, init_optimizer_state, optimizer_state_from_tensors, optimizer_state_to,
                         optimizer_state_to_tensors)
from .shaping import SHAPING, centered_ranks, per_prompt_centering, raw, shape_fitness, z_score
from .state import ESSettings, ESState, ask, tell

__all__ = [
    "ESSettings",
    "ESState",
    "ask",
    "tell",
    "SHAPING",
    "NOISE_SCHEMES",
    "NOISE_DEVICE",
    "NoiseDevice",
    "check_noise_device",
    "FlatParams",
    "Layout",
    "difference",
    "flat_of",
    "NoiseScheme",
    "check_noise_scheme",
    "flat_seed",
    "population_noise",
    "seeded_combination",
    "tensor_seed",
    "tiled_noise",
    "matrix_shape",
    "member_noise",
    "shapes_of",
    "Member",
    "population",
    "check_population_size",
    "check_sigma",
    "perturb",
    "raw",
    "z_score",
    "centered_ranks",
    "per_prompt_centering",
    "shape_fitness",
    "es_gradient",
    "member_coefficients",
    "SGDConfig",
    "AdamConfig",
    "OptimizerState",
    "init_optimizer_state",
    "apply_update",
    "apply_update_in_place",
    "formulas_step",
    "apply_update_in_parts",
    "optimizer_state_to",
    "update_norm",
    "optimizer_state_to_tensors",
    "optimizer_state_from_tensors",
    "Params",
    "Shapes",
    "Sigma",
    "GradientForm",
    "OptimizerConfig",
    "IN_PLACE_CHUNK",
    "layout_of",
    "sigma_of",
]
