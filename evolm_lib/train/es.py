"""ES runs over LoRA populations: ask, evaluate, tell; resumable to the bit.

A generation: seeds -> member adapters (mean + sigma * noise) -> one engine call for the whole
population -> rewards -> shaped weights -> update of the float32 mean adapter -> metrics row.
Scoring the new mean and the checkpoint are the loop's next steps (``evolm_lib.train.loop``).
Qiu et al. 2025, "Evolution Strategies at Scale" (arXiv 2509.24372).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..config import ESConfig
from ..engines import CompletionTable, Evaluator, Population, SamplingSettings, make_evaluator, resolve_noise_device
from ..evaluation import scoring_grid, scores_of
from ..lora import AdapterWeights, base_weight_magnitudes, noise_below_resolution, noise_scales
from ..models import resolve_model
from ..runs import RunState, timed
from ..seeds import derive_seed
from ..tasks import Example, Task
from .. import zo
from ..es import core as es
from .loop import RunLoop, percentile
from .modes import WeightsES


@dataclass(frozen=True)
class PopulationResult:
    """What one population call produced."""

    rewards: torch.Tensor  # (population, prompts)
    completions: CompletionTable  # [member][prompt]
    examples: list[Example]
    timing: dict[str, float]
    mean_scores: list | None = None  # the current mean's (train, held-out) scores, when they rode along

    @property
    def num_tokens(self) -> int:
        """Tokens the members generated in this call."""
        return self.completions.num_tokens


class ESRun(RunLoop):
    """One ES run bound to a run folder. ``train_step()`` is ask -> evaluate -> tell."""

    kind = "es"
    config_class = ESConfig
    weights_es: WeightsES | None = None  # es_mode full / eggroll: the mean is the model's own weights

    def __init__(self, state: RunState, *, run_dir: Path, evaluator: Evaluator, task: Task, model_dir: Path):
        super().__init__(state, run_dir=run_dir, evaluator=evaluator, task=task, model_dir=model_dir)
        config, mean = self.config, state.adapter
        # Resolved once (cuda falls back to cpu without a GPU): members, update and slots draw the same bits.
        self.noise_device = resolve_noise_device(config.noise_device)
        # With noise on the GPU the mean adapter and the optimizer's buffers live there too: the
        # update and the slot writes then move no tensor between host and card (checkpoints copy).
        self.device = self.noise_device
        self.shapes = {k: tuple(v.shape) for k, v in mean.tensors.items()}
        # The mean and the optimizer's buffers are flat vectors (es.FlatParams): an update is a dozen
        # kernels and the slot writes take the mean in one piece, however many LoRA tensors there are.
        self.layout = es.Layout.of(self.shapes)
        self.mean = AdapterWeights(mean.spec, es.FlatParams.of(mean.tensors, self.layout)).to(self.device)
        self.optimizer_config = config.optimizer_config()
        if state.optimizer_tensors is None:  # a new run
            optimizer_state = es.init_optimizer_state(self.optimizer_config, dict(mean.tensors))
        else:
            optimizer_state = es.optimizer_state_from_tensors(self.optimizer_config, state.optimizer_tensors)
        self.optimizer_state = es.optimizer_state_to(optimizer_state, self.device)
        magnitudes = base_weight_magnitudes(model_dir, mean.spec) if config.noise_mode == "per_layer" else None
        self.sigmas = noise_scales(self.shapes, config.sigma, config.noise_mode, magnitudes)
        # a zeroth-order estimator's memory of past generations (zoar, zohs); checkpointed with the run
        self.estimator_state = None
        if config.estimator is not None:  # a resumed run restores its buffer; a new one starts empty
            saved = state.saved
            self.estimator_state = zo.HistoryState.from_dict(saved["estimator"]) if saved else zo.HistoryState()
        coarse = noise_below_resolution(mean.tensors, self.sigmas, getattr(torch, config.dtype)) if config.es_mode == "lora" else []
        if coarse:
            name, sigma, ulp = min(coarse, key=lambda c: c[1] / c[2])
            warnings.warn(
                f"sigma is within a few {config.dtype} ulps of the adapter's values in {len(coarse)} tensor(s) "
                f"(e.g. {name}: sigma {sigma:.2g}, ulp {ulp:.2g}): the engine rounds part of the noise away, so "
                "the members it serves differ from those the update assumes; use dtype float32 or a larger sigma",
                stacklevel=2)
        # es_mode full / eggroll: the mean is the model's own weights, in the engine (issue 19)
        self.weights_es = None
        if config.es_mode != "lora":
            self.weights_es = WeightsES(config, self.evaluator, self.run_dir, model_dir)
            self.weights_es.restore_to(self.generation)

    @classmethod
    def _build(cls, state: RunState, *, run_dir: Path, evaluator: Evaluator | None, task: Task,
               model_dir: Path) -> "ESRun":
        config = state.config
        evaluator = evaluator or make_evaluator(config)
        return cls(state, run_dir=run_dir, evaluator=evaluator, task=task, model_dir=model_dir)

    # --- the loop ------------------------------------------------------------------------------
    def ask(self) -> list[es.Member]:
        """The members of the next generation: integer seeds and signs."""
        return es.population(self.config.seed, self.generation + 1, self.config.population_size, self.config.antithetic)

    def population(self, members: Sequence[es.Member]) -> Population:
        """The members as the engine takes them: the mean, their seeds and signs, the noise scale."""
        return Population(self.mean, tuple(members), self.sigmas, self.noise_device, self.config.noise_scheme)

    def member_adapters(self, members: Sequence[es.Member]) -> list[AdapterWeights]:
        """Mean adapter + sigma * regenerated noise, one per member, made on the host."""
        return self.population(members).adapters()

    def evaluate(self, members: Sequence[es.Member], score_mean: bool = False) -> PopulationResult:
        """Score every member on this generation's prompts in ONE engine call (the engine makes the
        members' weights from their seeds: on the host, or where the weights live); with
        ``score_mean`` the same call also scores the current mean greedily (``mean_scores``)."""
        timing: dict[str, float] = {}
        generation = self.generation + 1
        examples = self.batch_examples(generation)
        sampling = SamplingSettings(
            max_new_tokens=self.config.max_new_tokens,
            temperature=self.config.temperature,
            top_p=self.config.top_p,
            seed=derive_seed(self.config.seed, "sampling", generation),  # same seed for every member: common random numbers
        )
        started = time.perf_counter()
        prompts = [self.task.prompt(e) for e in examples]
        if self.weights_es is not None:
            return self._evaluate_weights(members, examples, prompts, sampling, score_mean)
        if score_mean:
            tables = self.evaluator.generate_grids([
                (prompts, self.population(members), sampling),
                scoring_grid(self.task, self.mean, self._score_sets(), self.config.max_new_tokens)])
        else:
            tables = [self.evaluator.generate(prompts, self.population(members), sampling)]
        completions = tables[0]
        call = time.perf_counter() - started
        timing["adapters_s"] = completions.timing.get("adapters_s", 0.0)
        timing["generate_s"] = completions.timing.get("generate_s", call - timing["adapters_s"])
        for key in ("slots_write_s", "slots_call_s"):  # resident slots: the worker's write, and the whole call
            if key in completions.timing:
                timing[f"adapters/{key}"] = completions.timing[key]  # parts of adapters_s
        with timed(timing, "reward_s"):
            rewards = torch.tensor(
                [self.task.reward_fn([c.text for c in row], examples) for row in completions], dtype=torch.float32
            )
            mean_scores = scores_of(self.task, tables[1][0], self._score_sets()) if score_mean else None
        return PopulationResult(rewards, completions, examples, timing, mean_scores)

    def _evaluate_weights(self, members, examples, prompts, sampling, score_mean: bool) -> PopulationResult:
        """``evaluate`` when the mean is the model's own weights (es_mode full / eggroll)."""
        score = scoring_grid(self.task, None, self._score_sets(), self.config.max_new_tokens) if score_mean else None
        completions, scored, timing = self.weights_es.evaluate(members, prompts, sampling, score)
        with timed(timing, "reward_s"):
            rewards = torch.tensor(
                [self.task.reward_fn([c.text for c in row], examples) for row in completions], dtype=torch.float32
            )
            mean_scores = scores_of(self.task, scored[0], self._score_sets()) if scored is not None else None
        return PopulationResult(rewards, completions, examples, timing, mean_scores)

    def tell(self, members: Sequence[es.Member], result: PopulationResult) -> dict:
        """Update the mean adapter from the members' rewards; return the update's metrics row
        (scoring the new mean and committing the row are the loop's next steps)."""
        config = self.config
        timing = dict(result.timing)
        mean_norm = None
        with timed(timing, "update_s"):
            if self.weights_es is not None:  # where the weights live, from seeds and shaped fitness
                weights = es.shape_fitness(config.fitness_shaping, result.rewards)
                update_norm = self.weights_es.tell(self.generation + 1, members, weights)["update_norm"]
            else:
                weights, gradient = self.estimate(members, result.rewards)
                new_params, self.optimizer_state = es.apply_update(
                    self.optimizer_config, self.optimizer_state, self.mean.tensors, gradient
                )
                update_norm = es.update_norm(es.difference(new_params, self.mean.tensors))
                self.mean = AdapterWeights(self.mean.spec, new_params)
                mean_norm = es.update_norm(self.optimizer_state.master)  # the mean's global L2 norm (float32 master)
                if self.device == "cuda":
                    torch.cuda.synchronize()  # the update's kernels finish inside its timing
        self.generation += 1
        self.counters["completions"] = self.counters.get("completions", 0) + result.rewards.numel()
        self.counters["tokens"] = self.counters.get("tokens", 0) + result.num_tokens
        per_member = result.rewards.mean(dim=1)  # (population,)
        best, worst = int(per_member.argmax()), int(per_member.argmin())
        row = {
            "generation": self.generation,
            **self.row_header(),
            "train/reward_mean": float(per_member.mean()),
            "train/reward_std": float(per_member.std(unbiased=False)),
            "train/reward_best": float(per_member[best]),
            "train/reward_worst": float(per_member[worst]),
            "train/reward_p20": percentile(per_member, 0.2),
            "train/reward_p80": percentile(per_member, 0.8),
            "es/rewards": per_member.tolist(),
            "es/weights": weights.tolist(),
            "es/update_norm": update_norm,
            **({"es/mean_norm": mean_norm} if mean_norm is not None else {}),
            "best_completions": [c.text for c in result.completions[best]],
            "worst_completions": [c.text for c in result.completions[worst]],
            "prompts": [e.prompt for e in result.examples],
            **{f"time/{key}": value for key, value in timing.items()},
        }
        return row

    def estimate(self, members: Sequence[es.Member], rewards: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(members' weights, ascent direction) from a generation's rewards (population, prompts).

        Without ``estimator``: shaped fitness and the ES gradient (Qiu et al.). With one: the
        zeroth-order estimator of evolm_lib.zo on f = -mean reward, which may reuse past
        generations' seeds (zoar); the direction is -g_f, and a member's weight its coefficient."""
        config = self.config
        if config.estimator is None:
            weights = es.shape_fitness(config.fitness_shaping, rewards)
            return weights, es.es_gradient(members, weights, self.shapes, self.sigmas, form=config.gradient_form,
                                           noise_device=self.noise_device, scheme=config.noise_scheme)
        current = zo.Generation.from_members(members, -rewards.mean(dim=1))  # the zo package minimises f
        coefficient, self.estimator_state = zo.coefficients(config.estimator_config(), current, self.estimator_state)
        g = zo.seeded_gradient(coefficient, self.shapes, config.sigma, noise_device=self.noise_device,
                               scheme=config.noise_scheme)
        weights = torch.tensor([-m.sign * coefficient.get(m.seed, 0.0) for m in members], dtype=torch.float32)
        return weights, es.FlatParams(-es.flat_of(g, self.layout), self.layout)

    def train_step(self) -> dict:
        """One generation's update: ask, evaluate, tell."""
        members = self.ask()
        return self.tell(members, self.evaluate(members))

    def train_step_scoring(self) -> tuple[dict, list]:
        """``train_step`` whose population call also scores the current mean (before it moves)."""
        members = self.ask()
        result = self.evaluate(members, score_mean=True)
        return self.tell(members, result), result.mean_scores

    def save_final(self) -> Path:
        """The adapter in PEFT format under run_dir/final_adapter; for es_mode full / eggroll the
        model itself under run_dir/final_model (safetensors, config, tokenizer)."""
        if self.weights_es is None:
            return super().save_final()
        self._check_writer()
        return self.weights_es.save_model(self.run_dir / "final_model", self.config.dtype)

    def close(self) -> None:
        """Release the engine's resident weights, then the folder and the engine (see RunLoop.close)."""
        if self.weights_es is not None:
            self.weights_es.close(reset=not self._owns_evaluator)  # a shared engine serves the model again
            self.weights_es = None
        super().close()

    def _rides(self) -> bool:
        # Only engines that batch several grids in one call gain anything (vLLM, Ray).
        return self.config.score_in_population and bool(getattr(self.evaluator, "batches_grids", False))

    # --- helpers --------------------------------------------------------------------------------
    def _budget(self) -> int:
        return self.config.num_generations

    @property
    def adapter(self) -> AdapterWeights | None:
        """The adapter the run moves (the ES mean); None when the mean is the model's own weights,
        which the engine then serves as its base model."""
        return self.mean if self.weights_es is None else None

    def _checkpoint_due(self) -> bool:
        # es_mode full / eggroll: a checkpoint every generation is small (the seed log holds the
        # update); the full-size snapshot comes every checkpoint_every generations
        return self.weights_es is not None or super()._checkpoint_due()

    def save_checkpoint(self, row: dict | None = None) -> Path:
        """Write a checkpoint of the current generation now (and, for the model's own weights, a
        snapshot of them when one is due)."""
        state = self._checkpoint_state(row)
        if self.estimator_state is not None:
            state["estimator"] = self.estimator_state.to_dict()
        if self.weights_es is not None and self.generation > 0 and (
                self.generation % self.config.checkpoint_every == 0 or self.generation >= self._budget()):
            state["snapshot"] = self.weights_es.snapshot(self.generation).name
        return self._write_checkpoint(self.mean, es.optimizer_state_to_tensors(self.optimizer_state), state)
