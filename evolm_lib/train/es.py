"""ES runs: ask, evaluate, tell, commit; resumable to the bit.

A generation: seeds -> members (mean + sigma * noise, made by the engine from their seeds) -> one
engine call for the whole population (and the current mean's greedy scoring, when due) -> rewards
-> shaped fitness -> update of the mean (``ESParameters``) -> metrics row -> checkpoint.
Qiu et al. 2025, "Evolution Strategies at Scale" (arXiv 2509.24372).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..config import ESConfig
from ..engines import CompletionTable, Engine, SamplingSettings, make_engine, resolve_noise_device
from ..env import sm_count
from ..scoring import scoring_grid, scores_of
from ..lora import AdapterWeights
from ..clock import timed
from ..runs import RunState
from ..seeds import derive_seed
from ..tasks import Example, Task
from .. import es
from ..es import state as es_state
from .es_parameters import ESParameters, LoraMean, Update, population_rewards
from .loop import RunLoop, percentile
from .scoring_plan import score_keys
from .model_weights import ModelWeights


@dataclass(frozen=True)
class GenerationResult:
    """What one generation's engine call produced, with the members' rewards."""

    rewards: torch.Tensor  # (population, prompts)
    completions: CompletionTable  # [member][prompt]
    examples: list[Example]
    timing: dict[str, float]
    mean_scores: list | None = None  # the current mean's (train, held-out) scores, when they rode along

    @property
    def num_tokens(self) -> int:
        """Tokens the members generated in this call."""
        return self.completions.num_tokens


def noise_cards_problem(es_mode: str, here_sms: int | None, engine_sms: Sequence[int | None]) -> str | None:
    """Why noise drawn on these cards would not be one run's noise, or None. torch's CUDA random
    kernels size their grid from the SMs a process sees, and an element's value follows its place in
    the grid, so one seed gives other noise on another count: every engine must see the same count
    (each draws its members, and in es_mode full or eggroll its update), and with es_mode lora this
    process too (it draws the mean's update). ``here_sms``: this process's count; ``engine_sms``: the
    Ray engines' (none for an engine in this process)."""
    counts = sorted({c for c in engine_sms if c is not None})
    if len(counts) > 1:
        return (f"the engines see {', '.join(map(str, counts))} SMs: each draws other noise from the same seeds "
                "(torch sizes its CUDA random kernels from the SM count); run the engines on cards of one kind, "
                "none of them limited (mps_thread_percentage), or set noise_device: cpu")
    if es_mode == "lora" and counts and here_sms is not None and counts[0] != here_sms:
        return (f"the engines see {counts[0]} SMs and this process {here_sms}: the members' noise (drawn on the "
                "engines) would not be the LoRA mean's update's (drawn here); run this process on a card of the "
                "engines' kind, or set noise_device: cpu")
    return None


NOISE_SM_COUNT = "noise_sm_count"  # in a checkpoint's state.json: the SMs of the cards that drew the noise (None: the CPU)


def noise_sm_count(noise_device: str, es_mode: str, engine) -> int | None:
    """The SMs of the cards a run draws its noise on (None: it draws on the CPU): the Ray engines'
    (``engine_info``), else this process's. Raises RuntimeError where they would not draw one run's
    noise (``noise_cards_problem``)."""
    if noise_device != "cuda":
        return None
    engine_sms = [info.get("sm_count") for info in engine.engine_info]  # Ray engines; none in this process
    here = sm_count()
    problem = noise_cards_problem(es_mode, here, engine_sms)
    if problem:
        raise RuntimeError(problem)
    return next((count for count in engine_sms if count is not None), here)


def resumed_noise_problem(es_mode: str, before: int | None, now: int | None) -> None:
    """A run resumed where its noise is drawn on cards of another SM count (or on the CPU after a
    card, or the reverse): with the model's own weights (es_mode full, eggroll) the mean is rebuilt
    by replaying the seed log's noise, which would give another mean, so RuntimeError; a LoRA mean is
    in the checkpoint itself, so a warning that the members from here on are not an unbroken run's."""
    if before == now:
        return
    then, here = ("on the CPU" if count is None else f"on cards showing {count} SMs" for count in (before, now))
    said = (f"this run drew its noise {then} and would now draw it {here}: the same seeds give other noise there "
            "(torch sizes its CUDA random kernels from the SM count)")
    if es_mode != "lora":
        raise RuntimeError(f"{said}, and es_mode {es_mode} rebuilds its mean by replaying the seed log's noise, which "
                           "would rebuild another mean; resume it where it ran (or on cards of its SM count)")
    warnings.warn(f"{said}: the LoRA mean is the checkpoint's, but its members from here on are not those of an "
                  "unbroken run", RuntimeWarning, stacklevel=3)


class ESRun(RunLoop):
    """One ES run bound to a run folder: ask -> evaluate -> tell -> commit, one generation at a time.
    What it moves (a LoRA mean, or the model's own weights) is ``parameters``."""

    kind = "es"
    config_class = ESConfig
    parameters: ESParameters
    _closed = False  # close() releases what the engine holds once; the mean stays readable

    def __init__(self, state: RunState, *, run_dir: Path, engine: Engine, task: Task, model_dir: Path):
        super().__init__(state, run_dir=run_dir, engine=engine, task=task, model_dir=model_dir)
        config = self.config
        # Resolved once (cuda falls back to cpu without a GPU): members, update and slots draw the same bits.
        self.noise_device = resolve_noise_device(config.noise_device)
        self.noise_sm_count = noise_sm_count(self.noise_device, config.es_mode, engine)
        if NOISE_SM_COUNT in state.saved:  # resumed: the noise must be drawn as it was before the checkpoint
            resumed_noise_problem(config.es_mode, state.saved[NOISE_SM_COUNT], self.noise_sm_count)
        if config.es_mode == "lora":
            self.parameters = LoraMean(config, engine, state.adapter, state.optimizer_tensors, state.saved,
                                       model_dir, self.noise_device, self.generation)
        else:
            self.parameters = ModelWeights(config, engine, self.run_dir, model_dir, self.generation)

    @classmethod
    def _build(cls, state: RunState, *, run_dir: Path, engine: Engine | None, task: Task,
               model_dir: Path) -> "ESRun":
        owned = engine is None
        engine = engine or make_engine(state.config)
        try:
            return cls(state, run_dir=run_dir, engine=engine, task=task, model_dir=model_dir)
        except BaseException:
            if owned:  # the engines this run started end with its failed start
                engine.close()
            raise

    @staticmethod
    def _moves_adapter(config: ESConfig) -> bool:
        return config.es_mode == "lora"  # full / eggroll move the model's own weights: no LoRA mean is built

    # --- one generation: ask -> evaluate -> tell -> commit -------------------------------------
    def step(self) -> dict:
        """One generation, top to bottom: the members, one engine call (with the current mean's
        scoring when the plan rides it there), fitness and the update with its row, the new mean's
        scoring when the plan says so, the commit (checkpoint, then the metrics line)."""
        self._check_writer()
        members = self.ask()
        result = self.evaluate(members)
        row = self.tell(members, result)
        row.update(self.score())
        return self.commit(row)

    def ask(self) -> list[es.Member]:
        """The members of the next generation: integer seeds and signs (``es.state.ask``)."""
        self._check_committed()
        return es_state.ask(self.parameters.state, self.config.seed)

    def evaluate(self, members: Sequence[es.Member]) -> GenerationResult:
        """Every member on this generation's prompts in ONE engine call (the engine makes the
        members from their seeds); on engines that batch grids, the same call scores the current
        mean greedily when its scoring is due (``mean_scores``)."""
        generation = self.generation + 1
        examples = self.batch_examples(generation)
        sampling = SamplingSettings(
            max_new_tokens=self.config.max_new_tokens,
            temperature=self.config.temperature,
            top_p=self.config.top_p,
            seed=derive_seed(self.config.seed, "sampling", generation),  # same seed for every member: common random numbers
        )
        plan = self.scoring_plan(generation)
        scored = self._score_examples(plan.sets)
        scoring = None
        if plan.ride:
            prompts, _, greedy = scoring_grid(self.task, None, scored, self.config.max_new_tokens)
            scoring = (prompts, greedy)
        served = self.parameters.evaluate(members, [self.task.prompt(e) for e in examples], sampling, scoring)
        timing = dict(served.timing)
        with timed(timing, "reward_s"):
            rewards = population_rewards(self.task, served.completions, examples)
            mean_scores = None if served.scoring is None else scores_of(self.task, served.scoring[0], scored)
        return GenerationResult(rewards, served.completions, examples, timing, mean_scores)

    def tell(self, members: Sequence[es.Member], result: GenerationResult) -> dict:
        """Move the mean from the members' rewards and return the generation's metrics row: the
        population's rewards, the update, and the scores of the mean that produced the generation
        when they rode along (``policy/generation`` names that mean)."""
        self._begin_update()
        timing = dict(result.timing)
        with timed(timing, "update_s"):
            rewards = controlled_rewards(self.config, self.generation + 1, result.rewards)
            update = self.parameters.update(self.generation + 1, members, rewards)
        row = generation_row(self.generation + 1, self.row_header(), members, result, update, timing)
        if result.mean_scores is not None:
            row.update(score_keys(result.mean_scores, None), **{"policy/generation": self.generation})
            self._count_scoring(sum(len(score.completions) for score in result.mean_scores))
        self.generation += 1
        self.counters["completions"] = self.counters.get("completions", 0) + result.rewards.numel()
        self.counters["tokens"] = self.counters.get("tokens", 0) + result.num_tokens
        return row

    def _scores_in_population(self) -> bool:
        # only engines that batch several grids in one call gain anything (vLLM, Ray)
        return self.config.score_in_population and self.engine.batches_grids

    # --- the folder -----------------------------------------------------------------------------
    def _budget(self) -> int:
        return self.config.num_generations

    @property
    def adapter(self) -> AdapterWeights | None:
        """The adapter that serves the mean (scoring, KL); None when the mean is the model's own
        weights, which the engine then serves as its base model."""
        return self.parameters.adapter

    @property
    def mean(self) -> AdapterWeights:
        """The mean adapter (``es_mode: lora``)."""
        if not isinstance(self.parameters, LoraMean):
            raise AttributeError(f"es_mode: {self.config.es_mode} moves the model's own weights; it has no mean adapter")
        return self.parameters.mean

    def _checkpoint_due(self) -> bool:
        # the model's own weights: a checkpoint every generation is small (the seed log holds the
        # update); the full-size snapshot comes every checkpoint_every generations
        return isinstance(self.parameters, ModelWeights) or super()._checkpoint_due()

    def save_checkpoint(self, row: dict | None = None) -> Path:
        """Write a checkpoint of the current generation now (with a snapshot of the model's own
        weights when one is due)."""
        state = {**self._checkpoint_state(row), NOISE_SM_COUNT: self.noise_sm_count}
        snapshot_due = self.generation % self.config.checkpoint_every == 0 or self.generation >= self._budget()
        kept = self.parameters.checkpoint(self.generation, snapshot_due)
        state.update(kept.state)
        return self._write_checkpoint(kept.adapter, kept.optimizer_tensors, state)

    def save_final(self) -> Path:
        """The mean as a PEFT adapter under run_dir/final_adapter, or, for the model's own weights,
        the model under run_dir/final_model (safetensors, config, tokenizer)."""
        self._check_writer()
        self._check_committed()
        return self.parameters.save(self.run_dir)

    def close(self) -> None:
        """Release what the engine holds for the run (a shared engine serves the model again), then
        the folder and the engine (see RunLoop.close)."""
        if not self._closed:
            self.parameters.close(reset=not self._owns_engine)
            self._closed = True
        super().close()


def controlled_rewards(config: ESConfig, generation: int, rewards: torch.Tensor) -> torch.Tensor:
    """The rewards the update sees: as measured, or with ``fitness_control: shuffled`` the members'
    rows of ``rewards`` (population, prompts) permuted by a seeded permutation of the generation, so
    every member is credited with another member's rewards (a control: what it still learns is drift)."""
    if config.fitness_control == "none":
        return rewards
    generator = torch.Generator().manual_seed(derive_seed(config.seed, "fitness_control", generation))
    return rewards[torch.randperm(rewards.shape[0], generator=generator)]


def generation_row(generation: int, header: dict, members: Sequence[es.Member], result: GenerationResult,
                   update: Update, timing: dict[str, float]) -> dict:
    """A generation's metrics row from its population's rewards and the update."""
    per_member = result.rewards.mean(dim=1)  # (population,)
    best, worst = int(per_member.argmax()), int(per_member.argmin())
    return {
        "generation": generation,
        **header,
        "train/reward_mean": float(per_member.mean()),
        "train/reward_std": float(per_member.std(unbiased=False)),
        "train/reward_best": float(per_member[best]),
        "train/reward_worst": float(per_member[worst]),
        "train/reward_p20": percentile(per_member, 0.2),
        "train/reward_p80": percentile(per_member, 0.8),
        "es/rewards": per_member.tolist(),
        "es/weights": update.fitness.tolist(),
        "es/update_norm": update.update_norm,
        **({"es/mean_norm": update.mean_norm} if update.mean_norm is not None else {}),
        "best_completions": [c.text for c in result.completions[best]],
        "worst_completions": [c.text for c in result.completions[worst]],
        "prompts": [e.prompt for e in result.examples],
        **{f"time/{key}": value for key, value in timing.items()},
    }
