"""What ES moves, behind one protocol: ``ESParameters``.

An ES run holds exactly one of these and never asks which kind it is:

- ``LoraMean`` (``es_mode: lora``): the mean is a LoRA adapter (a float32 flat vector); a member is
  mean + sign * sigma * eps(seed), made by the engine in a resident slot (vLLM), on its Ray actors,
  or on the host; the update runs here, on the host or the GPU (``noise_device``).
- ``ModelWeights`` (``es_mode: full`` and ``eggroll``, in ``train/model_weights.py``): the mean is
  the model's own weights, held by the engine with a float32 master beside them; members are
  written in place from their seeds (or served from EGGROLL's low-rank slots) and the update is
  sent to the engine as seeds and shaped fitness.

Every kind answers the same calls: ``evaluate`` (serve the members and, when asked, the mean in one
engine call), ``update`` (move the mean from the members' rewards), ``checkpoint`` (what a
checkpoint keeps), ``save`` (the final adapter or model folder) and ``close``.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import torch

from ..config import ESConfig
from ..engines import CompletionTable, Engine, Population, SamplingSettings
from .. import es
from ..es import state as es_state
from ..lora import AdapterWeights, base_weight_magnitudes, noise_below_resolution, noise_scales, save_adapter
from ..types import PromptLike
from .. import zo

# (prompts, sampling) of the mean's greedy scoring when it rides in the members' engine call
ScoringRequest = tuple[Sequence[PromptLike], SamplingSettings]


@dataclass(frozen=True)
class Served:
    """What one engine call for a generation gave back."""

    completions: CompletionTable  # [member][prompt]
    scoring: CompletionTable | None  # the mean's one-row table when its scoring rode along, else None
    timing: dict[str, float]  # seconds: adapters_s, generate_s and their parts


@dataclass(frozen=True)
class Update:
    """What one update of the mean measured."""

    fitness: torch.Tensor  # (population,) the members' weights in the update (shaped fitness or coefficients)
    update_norm: float  # L2 norm of the mean's change (float32)
    mean_norm: float | None = None  # L2 norm of the new mean, where it is cheap to know


@dataclass(frozen=True)
class Checkpointed:
    """What a checkpoint keeps of the moved parameters."""

    adapter: AdapterWeights | None  # the mean adapter, or None when the engine holds the mean
    optimizer_tensors: dict[str, torch.Tensor]
    state: dict  # extra entries of state.json


class ESParameters(Protocol):
    """What an ES run moves: members perturbed from it, served, and the mean updated."""

    adapter: AdapterWeights | None
    """The adapter that serves the mean (scoring, KL); None when the engine's own weights are the mean."""

    def evaluate(self, members: Sequence[es.Member], prompts: Sequence[PromptLike], sampling: SamplingSettings,
                 scoring: ScoringRequest | None = None) -> Served:
        """Every member on ``prompts`` (and the mean greedily on ``scoring``'s prompts) in one engine call."""

    def update(self, generation: int, members: Sequence[es.Member], rewards: torch.Tensor) -> Update:
        """Move the mean from the members' rewards, (population, prompts)."""

    def checkpoint(self, generation: int, snapshot_due: bool) -> Checkpointed:
        """What the checkpoint of ``generation`` keeps."""

    def save(self, run_dir: Path) -> Path:
        """The final mean as a folder others load (a PEFT adapter, or a model folder)."""

    def close(self, reset: bool) -> None:
        """Release what the engine holds for the run; ``reset``: the engine serves the model folder's weights again."""


def es_settings(config: ESConfig, sigma: es.Sigma, noise_device: str) -> es_state.ESSettings:
    """What ``es.state``'s ask and tell need of a run's settings (``sigma``: as resolved per tensor)."""
    return es_state.ESSettings(population_size=config.population_size, sigma=sigma,
                               optimizer=config.optimizer_config(), antithetic=config.antithetic,
                               gradient_form=config.gradient_form, noise_device=noise_device,
                               noise_scheme=config.noise_scheme)


def population_rewards(task, completions: CompletionTable, examples) -> torch.Tensor:
    """(population, prompts) rewards of a members' completion table."""
    return torch.tensor([task.reward_fn([c.text for c in row], examples) for row in completions], dtype=torch.float32)


class LoraMean:
    """The ES mean as a LoRA adapter: a float32 flat vector and its optimizer state, on ``noise_device``."""

    def __init__(self, config: ESConfig, engine: Engine, adapter: AdapterWeights,
                 optimizer_tensors: dict[str, torch.Tensor] | None, saved: dict, model_dir: Path, noise_device: str,
                 generation: int = 0):
        self.config, self.engine, self.model_dir = config, engine, Path(model_dir)
        # With noise on the GPU the mean and the optimizer's buffers live there too: the update and
        # the slot writes then move no tensor between host and card (checkpoints copy).
        self.noise_device = self.device = noise_device
        self.shapes = {k: tuple(v.shape) for k, v in adapter.tensors.items()}
        # one flat vector: an update is a dozen kernels and slot writes take the mean in one piece
        self.layout = es.Layout.of(self.shapes)
        mean = AdapterWeights(adapter.spec, es.FlatParams.of(adapter.tensors, self.layout)).to(self.device)
        self.spec, self._mean = adapter.spec, mean
        self.optimizer_config = config.optimizer_config()
        if optimizer_tensors is None:  # a new run
            optimizer = es.init_optimizer_state(self.optimizer_config, dict(adapter.tensors))
        else:
            optimizer = es.optimizer_state_from_tensors(self.optimizer_config, optimizer_tensors)
        magnitudes = base_weight_magnitudes(model_dir, adapter.spec) if config.noise_mode == "per_layer" else None
        self.sigmas = noise_scales(self.shapes, config.sigma, config.noise_mode, magnitudes)
        # the mean, its optimizer's state and the generation, advanced by es.state's pure tell
        self.state = es_state.init(es_settings(config, self.sigmas, noise_device), mean.tensors,
                                   es.optimizer_state_to(optimizer, self.device), generation)
        # a zeroth-order estimator's memory of past generations (zoar, zohs), checkpointed with the run
        self.estimator_state = None
        if config.estimator is not None:
            self.estimator_state = zo.HistoryState.from_dict(saved["estimator"]) if saved else zo.HistoryState()
        self._warn_if_sigma_rounds_away(adapter)
        # what serves the population (vLLM's resident slots) is set up now: a generation only writes it
        engine.prepare_population(adapter.spec, config.population_size)

    def _warn_if_sigma_rounds_away(self, adapter: AdapterWeights) -> None:
        coarse = noise_below_resolution(adapter.tensors, self.sigmas, getattr(torch, self.config.dtype))
        if coarse:
            name, sigma, ulp = min(coarse, key=lambda c: c[1] / c[2])
            warnings.warn(
                f"sigma is within a few {self.config.dtype} ulps of the adapter's values in {len(coarse)} tensor(s) "
                f"(e.g. {name}: sigma {sigma:.2g}, ulp {ulp:.2g}): the engine rounds part of the noise away, so "
                "the members it serves differ from those the update assumes; use dtype float32 or a larger sigma",
                stacklevel=4)

    @property
    def mean(self) -> AdapterWeights:
        """The mean adapter: the state's float32 mean, one object per state (engines recognise the
        mean by identity when it is served twice in one call)."""
        if self._mean is None or self._mean.tensors is not self.state.mean:
            self._mean = AdapterWeights(self.spec, self.state.mean)
        return self._mean

    @property
    def adapter(self) -> AdapterWeights:
        """The mean adapter."""
        return self.mean

    @property
    def optimizer_state(self) -> es.OptimizerState:
        """The optimizer's state (step, float32 master, moments)."""
        return self.state.optimizer

    def population(self, members: Sequence[es.Member]) -> Population:
        """The members as the engine takes them: the mean, their seeds and signs, the noise scale."""
        return Population(self.mean, tuple(members), self.sigmas, self.noise_device, self.config.noise_scheme)

    def member_adapters(self, members: Sequence[es.Member]) -> list[AdapterWeights]:
        """Mean + sigma * regenerated noise, one adapter per member, made on the host."""
        return self.population(members).adapters()

    def evaluate(self, members, prompts, sampling, scoring: ScoringRequest | None = None) -> Served:
        """The population in one engine call (the engine makes each member from its seed); the
        mean's greedy scoring, when asked, is a second grid of the same call."""
        started = time.perf_counter()
        population = self.population(members)
        if scoring is None:
            tables = [self.engine.generate(prompts, population, sampling)]
        else:
            tables = self.engine.generate_grids([(prompts, population, sampling), (scoring[0], [self.mean], scoring[1])])
        completions, call = tables[0], time.perf_counter() - started
        timing = {"adapters_s": completions.timing.get("adapters_s", 0.0)}
        timing["generate_s"] = completions.timing.get("generate_s", call - timing["adapters_s"])
        for key in ("slots_write_s", "slots_call_s"):  # resident slots: the worker's write, and the whole call
            if key in completions.timing:
                timing[f"adapters/{key}"] = completions.timing[key]  # parts of adapters_s
        return Served(completions, tables[1] if len(tables) > 1 else None, timing)

    def update(self, generation: int, members: Sequence[es.Member], rewards: torch.Tensor) -> Update:
        """The ES (or zeroth-order) step on the float32 master of the mean adapter: a new state."""
        before = self.state
        if self.config.estimator is None:
            fitness = es.shape_fitness(self.config.fitness_shaping, rewards)
            self.state = es_state.tell(before, list(members), fitness)
        else:
            fitness, direction = self.estimate(members, rewards)
            self.state = es_state.step(before, direction)
        update_norm = es.update_norm(es.difference(self.state.mean, before.mean))
        mean_norm = es.update_norm(self.state.optimizer.master)  # the mean's global L2 norm (float32 master)
        if self.device == "cuda":
            torch.cuda.synchronize()  # the update's kernels finish inside its timing
        return Update(fitness, update_norm, mean_norm)

    def estimate(self, members: Sequence[es.Member], rewards: torch.Tensor) -> tuple[torch.Tensor, es.FlatParams]:
        """(members' weights, ascent direction) from a generation's rewards (population, prompts).

        Without ``estimator``: shaped fitness and the ES gradient (Qiu et al.). With one: the
        zeroth-order estimator of evolm_lib.zo on f = -mean reward, which may reuse past
        generations' seeds (zoar); the direction is -g_f, and a member's weight its coefficient."""
        config = self.config
        if config.estimator is None:
            fitness = es.shape_fitness(config.fitness_shaping, rewards)
            return fitness, es.es_gradient(members, fitness, self.shapes, self.sigmas, form=config.gradient_form,
                                           noise_device=self.noise_device, scheme=config.noise_scheme)
        current = zo.Generation.from_members(members, -rewards.mean(dim=1))  # the zo package minimises f
        coefficient, self.estimator_state = zo.coefficients(config.estimator_config(), current, self.estimator_state)
        g = zo.seeded_gradient(coefficient, self.shapes, config.sigma, noise_device=self.noise_device,
                               scheme=config.noise_scheme)
        fitness = torch.tensor([-m.sign * coefficient.get(m.seed, 0.0) for m in members], dtype=torch.float32)
        return fitness, es.FlatParams(-es.flat_of(g, self.layout), self.layout)

    def checkpoint(self, generation: int, snapshot_due: bool) -> Checkpointed:
        """The mean adapter, the optimizer's buffers and the estimator's memory."""
        state = {} if self.estimator_state is None else {"estimator": self.estimator_state.to_dict()}
        return Checkpointed(self.mean, es.optimizer_state_to_tensors(self.optimizer_state), state)

    def save(self, run_dir: Path) -> Path:
        """The mean in PEFT format under run_dir/final_adapter (loadable by vLLM and peft)."""
        return save_adapter(self.mean, Path(run_dir) / "final_adapter", base_model=str(self.model_dir))

    def close(self, reset: bool) -> None:
        """Nothing to release: the engine's slots are rewritten by the next population."""
