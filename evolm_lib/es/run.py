"""ES runs over LoRA populations: ask, evaluate, tell, log; resumable to the bit.

A generation: seeds -> member adapters (mean + sigma * noise) -> one engine call for the whole
population -> rewards -> shaped weights -> update of the float32 mean adapter -> metrics row
and checkpoint. Qiu et al. 2025, "Evolution Strategies at Scale" (arXiv 2509.24372).
"""
from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from . import es
from .config import ConfigError, ESConfig
from .evaluation import score_adapters
from .evaluators import Evaluator, SamplingSettings, make_evaluator
from .lora import AdapterWeights, adapter_shapes, base_weight_magnitudes, init_adapter, noise_scales, save_adapter
from .models import resolve_model
from .runs import (
    append_metrics,
    list_checkpoints,
    load_checkpoint,
    prepare_run_dir,
    read_metrics,
    rewrite_metrics,
    timed,
    write_checkpoint,
)
from .tasks import Example, Task, get_task
from .types import Completion


@dataclass(frozen=True)
class PopulationResult:
    """What one population call produced."""

    rewards: torch.Tensor  # (population, prompts)
    completions: list[list[Completion]]  # [member][prompt]
    examples: list[Example]
    timing: dict[str, float]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for row in self.completions for c in row)


def _derive(*parts) -> int:
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def _percentile(values: torch.Tensor, q: float) -> float:
    return float(torch.quantile(values.double(), q))


class RunLoop:
    """What ES and GRPO runs share: the loop driver, greedy scoring of the current adapter,
    sample counters, wall clock, and checkpoint-then-log commits. Subclasses provide ``step()``,
    ``adapter``, ``_budget()`` and ``save_checkpoint(row)``."""

    kind = "run"
    config_class: type = None  # set by subclasses

    @classmethod
    def _start_folder(cls, config, run_dir, overwrite: bool, initial_adapter: AdapterWeights | None):
        """Everything a new run needs before its engine: validated targets, the folder, the first adapter."""
        task = get_task(config.task, **config.task_options)
        model_dir = resolve_model(config.model)
        spec = config.lora_spec()
        shapes = adapter_shapes(model_dir, spec)  # bad targets / layers fail here, before any engine
        if initial_adapter is not None and initial_adapter.spec != spec:
            raise ConfigError(f"initial adapter spec {initial_adapter.spec} differs from the config's {spec}")
        run_dir = prepare_run_dir(run_dir, overwrite)
        write_run_config(run_dir, config, cls.kind)
        if initial_adapter is None:
            magnitudes = base_weight_magnitudes(model_dir, spec) if config.init_scheme == "random_ab" else None
            initial_adapter = init_adapter(spec, shapes, config.init_scheme, config.seed, magnitudes, config.init_scale)
        return task, model_dir, run_dir, initial_adapter

    @classmethod
    def _load_latest(cls, run_dir: Path):
        """(config, adapter, optimizer tensors, generation, counters, rows) of a run's latest checkpoint.

        Rows past the checkpoint come from a generation whose checkpoint never landed: they are
        dropped and that generation reruns; a row lost between checkpoint and log comes back."""
        from .runs import read_config_kind

        kind = read_config_kind(run_dir)
        if kind != cls.kind:
            raise ConfigError(f"{run_dir} holds a {kind!r} run, not a {cls.kind.upper()} run")
        config = load_run_config(run_dir, cls.config_class)
        checkpoints = list_checkpoints(run_dir)
        if not checkpoints:
            raise FileNotFoundError(f"{run_dir} holds no checkpoint to resume from")
        adapter, optimizer_tensors, state = load_checkpoint(checkpoints[-1])
        if adapter.spec != config.lora_spec():
            raise ConfigError(f"checkpoint adapter {adapter.spec} does not match config {config.lora_spec()}")
        generation = int(state["generation"])
        rows = [r for r in read_metrics(run_dir) if r.get("generation", -1) <= generation]
        if not rows or rows[-1].get("generation") != generation:
            rows.append(state["row"])
        rewrite_metrics(run_dir, rows)
        return config, adapter, optimizer_tensors, generation, dict(state["counters"]), rows

    @classmethod
    def open(cls, config, run_dir: str | Path, *, resume: bool = True, overwrite: bool = False,
             evaluator: Evaluator | None = None):
        """Resume the run in ``run_dir`` if it holds one with the same settings, else create it.

        Settings that do not change the science (``EXTENDABLE``: the budget, eval and checkpoint
        cadence) may differ: a finished run can be extended."""
        run_dir = Path(run_dir)
        if resume and not overwrite and list_checkpoints(run_dir):
            existing = load_run_config(run_dir, type(config))
            changed = sorted(k for k, v in config.to_dict().items() if existing.to_dict().get(k) != v)
            fixed = [k for k in changed if k not in EXTENDABLE]
            if fixed:
                raise ConfigError(f"{run_dir} holds a run with other settings ({', '.join(fixed)}); "
                                  "use another run_dir or overwrite=True")
            if changed:
                write_run_config(run_dir, config, cls.kind)
            return cls.resume(run_dir, evaluator=evaluator)
        return cls.create(config, run_dir, evaluator=evaluator, overwrite=overwrite)

    def run(self, num_generations: int | None = None, callback: Callable[[dict], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> list[dict]:
        """Run generations (ES) or steps (GRPO) up to this total (default: the config's); returns the new rows."""
        target = num_generations if num_generations is not None else self._budget()
        rows = []
        while self.generation < target:
            if should_stop is not None and should_stop():
                break
            rows.append(self.step())
            if callback is not None:
                callback(rows[-1])
        return rows

    def batch_examples(self, generation: int) -> list[Example]:
        """Train prompts of a generation or step: all, or a seeded draw of ``prompts_per_step``
        (the same draw for ES and GRPO at the same seed, so both train on the same prompts)."""
        k = self.config.prompts_per_step
        if k is None or k >= len(self.train_examples):
            return list(self.train_examples)
        return random.Random(_derive(self.config.seed, "prompts", generation)).sample(self.train_examples, k)

    def _score_current(self) -> dict:
        """Greedy reward of the current adapter on the train and eval prompts, in one engine call."""
        train, held_out = score_adapters(
            self.evaluator, self.task, self.adapter, [self.train_examples, self.eval_examples], self.config.max_new_tokens
        )
        self.counters["eval_completions"] = self.counters.get("eval_completions", 0) + len(train.rewards) + len(held_out.rewards)
        return {
            "policy/train_reward": train.mean,
            "eval/reward": held_out.mean,
            "policy/train_completions": [c.text for c in train.completions],
            "policy/eval_completions": [c.text for c in held_out.completions],
            "policy/train_tokens": train.num_tokens,
        }

    def _finish_row(self, row: dict, timing: dict) -> dict:
        """Score the current adapter when due, add counters and timings, commit; return the row."""
        with timed(timing, "eval_s"):
            if self._scoring_due():
                row.update(self._score_current())
        row.update(self._sample_counters())
        for key, value in timing.items():
            row[f"time/{key}"] = value
        row["time/generation_s"] = sum(timing.values())
        row["time/wall_s"] = self._wall()
        self._commit(row)
        return row

    def _scoring_due(self) -> bool:
        """Score every ``eval_every`` generations/steps, and always at the end of the budget."""
        last = max(self._budget(), self.generation)
        every = self.config.eval_every
        return bool(every and self.generation % every == 0) or self.generation == last

    def _sample_counters(self) -> dict:
        return {
            "samples/completions": self.counters.get("completions", 0),
            "samples/tokens": self.counters.get("tokens", 0),
            "samples/eval_completions": self.counters.get("eval_completions", 0),
        }

    def _wall(self) -> float:
        self.counters["wall_s"] = self._wall_at_start + time.perf_counter() - self._started
        return self.counters["wall_s"]

    def _commit(self, row: dict) -> None:
        """Checkpoint first, then the metrics line: a kill in between reruns nothing finished."""
        if self.generation % self.config.checkpoint_every == 0 or self.generation >= self._budget():
            self.save_checkpoint(row)
        append_metrics(self.run_dir, row)
        self.history.append(row)


class ESRun(RunLoop):
    """One ES run bound to a run folder. ``step()`` is ask -> evaluate -> tell."""

    kind = "es"
    config_class = ESConfig

    def __init__(self, config: ESConfig, run_dir: Path, evaluator: Evaluator, task: Task, mean: AdapterWeights,
                 optimizer_state, generation: int, counters: dict, history: list[dict], model_dir: Path):
        self.config = config
        self.run_dir = Path(run_dir)
        self.evaluator = evaluator
        self.task = task
        self.mean = mean
        self.optimizer_config = config.optimizer_config()
        self.optimizer_state = optimizer_state
        self.generation = generation
        self.counters = counters
        self.history = history
        self.model_dir = model_dir
        self.shapes = {k: tuple(v.shape) for k, v in mean.tensors.items()}
        magnitudes = base_weight_magnitudes(model_dir, mean.spec) if config.noise_mode == "per_layer" else None
        self.sigmas = noise_scales(self.shapes, config.sigma, config.noise_mode, magnitudes)
        self.train_examples = task.train_examples()
        self.eval_examples = task.eval_examples()
        self._started = time.perf_counter()
        self._wall_at_start = counters.get("wall_s", 0.0)

    # --- construction ----------------------------------------------------------------------------
    @classmethod
    def create(cls, config: ESConfig, run_dir: str | Path, *, evaluator: Evaluator | None = None,
               overwrite: bool = False, initial_adapter: AdapterWeights | None = None) -> "ESRun":
        """Start a new run in an empty folder (an existing run is refused unless ``overwrite``)."""
        task, model_dir, run_dir, initial_adapter = cls._start_folder(config, run_dir, overwrite, initial_adapter)
        evaluator = evaluator or make_evaluator(config, max_loras=config.population_size + 1)
        state = es.init_optimizer_state(config.optimizer_config(), dict(initial_adapter.tensors))
        run = cls(config, run_dir, evaluator, task, initial_adapter, state, 0, {}, [], model_dir)
        row = {"generation": 0, "method": "es", "seed": config.seed, **run._score_current(), **run._sample_counters()}
        row["time/wall_s"] = run._wall()
        run._commit(row)
        return run

    @classmethod
    def resume(cls, run_dir: str | Path, *, evaluator: Evaluator | None = None) -> "ESRun":
        """Continue a run from its latest checkpoint; it ends as if never interrupted."""
        config, adapter, optimizer_tensors, generation, counters, rows = cls._load_latest(Path(run_dir))
        optimizer_state = es.optimizer_state_from_tensors(config.optimizer_config(), optimizer_tensors)
        task = get_task(config.task, **config.task_options)
        evaluator = evaluator or make_evaluator(config, max_loras=config.population_size + 1)
        return cls(config, Path(run_dir), evaluator, task, adapter, optimizer_state, generation,
                   counters, rows, resolve_model(config.model))

    # --- the loop ------------------------------------------------------------------------------
    def ask(self) -> list[es.Member]:
        """The members of the next generation: integer seeds and signs."""
        return es.population(self.config.seed, self.generation + 1, self.config.population_size, self.config.antithetic)

    def member_adapters(self, members: Sequence[es.Member]) -> list[AdapterWeights]:
        """Mean adapter + sigma * regenerated noise, one per member."""
        device = self.config.noise_device
        return [AdapterWeights(self.mean.spec, es.perturb(dict(self.mean.tensors), m, self.sigmas, device)) for m in members]

    def evaluate(self, members: Sequence[es.Member]) -> PopulationResult:
        """Score every member on this generation's prompts in ONE engine call."""
        timing: dict[str, float] = {}
        generation = self.generation + 1
        with timed(timing, "adapters_s"):
            adapters = self.member_adapters(members)
        examples = self.batch_examples(generation)
        sampling = SamplingSettings(
            max_new_tokens=self.config.max_new_tokens,
            temperature=self.config.temperature,
            top_p=self.config.top_p,
            seed=_derive(self.config.seed, "sampling", generation),  # same seed for every member: common random numbers
        )
        started = time.perf_counter()
        completions = self.evaluator.generate([self.task.prompt(e) for e in examples], adapters, sampling)
        engine = dict(getattr(self.evaluator, "last_timing", {}) or {})
        call = time.perf_counter() - started
        timing["adapters_s"] += engine.get("adapters_s", 0.0)
        timing["generate_s"] = engine.get("generate_s", call - engine.get("adapters_s", 0.0))
        with timed(timing, "reward_s"):
            rewards = torch.tensor(
                [self.task.reward_fn([c.text for c in row], examples) for row in completions], dtype=torch.float32
            )
        return PopulationResult(rewards, completions, examples, timing)

    def tell(self, members: Sequence[es.Member], result: PopulationResult) -> dict:
        """Update the mean adapter from the members' rewards; log, checkpoint, return the metrics row."""
        config = self.config
        timing = dict(result.timing)
        with timed(timing, "update_s"):
            weights = es.shape_fitness(config.fitness_shaping, result.rewards)
            gradient = es.es_gradient(members, weights, self.shapes, self.sigmas, form=config.gradient_form,
                                      noise_device=config.noise_device)
            gradient = {k: v.to(self.mean.tensors[k].device) for k, v in gradient.items()}
            new_params, self.optimizer_state = es.apply_update(
                self.optimizer_config, self.optimizer_state, dict(self.mean.tensors), gradient
            )
            update = {k: new_params[k] - self.mean.tensors[k] for k in new_params}
            self.mean = AdapterWeights(self.mean.spec, new_params)
        self.generation += 1
        self.counters["completions"] = self.counters.get("completions", 0) + result.rewards.numel()
        self.counters["tokens"] = self.counters.get("tokens", 0) + result.num_tokens
        per_member = result.rewards.mean(dim=1)  # (population,)
        best, worst = int(per_member.argmax()), int(per_member.argmin())
        row = {
            "generation": self.generation,
            "method": "es",
            "seed": config.seed,
            "train/reward_mean": float(per_member.mean()),
            "train/reward_std": float(per_member.std(unbiased=False)),
            "train/reward_best": float(per_member[best]),
            "train/reward_worst": float(per_member[worst]),
            "train/reward_p20": _percentile(per_member, 0.2),
            "train/reward_p80": _percentile(per_member, 0.8),
            "es/rewards": per_member.tolist(),
            "es/weights": weights.tolist(),
            "es/update_norm": es.update_norm(update),
            "es/mean_norm": float(sum((v.float() ** 2).sum() for v in new_params.values()) ** 0.5),
            "best_completions": [c.text for c in result.completions[best]],
            "worst_completions": [c.text for c in result.completions[worst]],
            "prompts": [e.prompt for e in result.examples],
        }
        return self._finish_row(row, timing)

    def step(self) -> dict:
        """One generation: ask, evaluate, tell."""
        members = self.ask()
        return self.tell(members, self.evaluate(members))

    # --- helpers --------------------------------------------------------------------------------
    def _budget(self) -> int:
        return self.config.num_generations

    @property
    def adapter(self) -> AdapterWeights:
        """The adapter the run moves (the ES mean)."""
        return self.mean

    def save_checkpoint(self, row: dict | None = None) -> Path:
        """Write a checkpoint of the current generation now."""
        row = row if row is not None else (self.history[-1] if self.history else {})
        state = {"generation": self.generation, "counters": self.counters, "row": row}
        return write_checkpoint(self.run_dir, self.generation, self.mean, es.optimizer_state_to_tensors(self.optimizer_state),
                                state, str(self.model_dir), keep=self.config.keep_checkpoints)

    def save_final(self) -> Path:
        """The mean adapter in PEFT format under run_dir/final_adapter (loadable by vLLM and peft)."""
        return save_adapter(self.mean, self.run_dir / "final_adapter", base_model=str(self.model_dir))

    def close(self) -> None:
        """Release the engine."""
        if self.evaluator is not None:
            self.evaluator.close()


EXTENDABLE = frozenset({"num_generations", "num_steps", "eval_every", "checkpoint_every", "keep_checkpoints"})


def write_run_config(run_dir: Path, config, kind: str) -> None:
    """config.yaml: the resolved settings plus the run's kind (es | grpo)."""
    import yaml

    (Path(run_dir) / "config.yaml").write_text(yaml.safe_dump({"kind": kind, **config.to_dict()}, sort_keys=False))


def load_run_config(run_dir: str | Path, cls=ESConfig):
    """The settings a run folder was created with."""
    import yaml

    data = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    data.pop("kind", None)
    data.pop("label", None)  # a display label for analysis, not a setting
    return cls.from_dict(data)
