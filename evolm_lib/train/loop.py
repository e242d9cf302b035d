"""What ES and GRPO runs share: the loop, greedy scoring of the current adapter (when the scoring
plan says so, ``scoring.py``), sample counters, wall clock, and checkpoint-then-log commits. One
generation (ES, whose ``step`` spells out ask, evaluate and tell) or step (GRPO) is

    row = run.train_step()     # GRPO: rollouts -> rewards -> update
    row.update(run.score())    # greedy reward of the moved adapter on train and eval prompts, when due
    run.commit(row)            # checkpoint first, then the metrics line; the row is final
"""
from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Callable

import torch

from ..clock import timed
from ..config import ConfigError
from ..engines import Engine
from ..scoring import score_adapters
from ..lora import AdapterWeights, adapter_shapes, base_weight_magnitudes, init_adapter, save_adapter
from ..models import resolve_model
from ..preflight import check_engine_settings
from ..reporting import Reporters, check_backends, open_reporters
from ..runs import (
    RunState,
    WriterLock,
    append_metrics,
    extended_settings,
    list_checkpoints,
    load_latest,
    prepare_run_dir,
    write_checkpoint,
    write_run_config,
)
from ..seeds import derive_seed
from .scoring_plan import ScoringPlan, ScoringSettings, score_keys, scored_means, scoring_plan
from ..tasks import Example, Task, get_task


def percentile(values: torch.Tensor, q: float) -> float:
    """The q-quantile (0..1) of a tensor of rewards, in float64."""
    return float(torch.quantile(values.double(), q))


class RunLoop:
    """The loop ES and GRPO runs share. Subclasses provide ``train_step()`` (the update's metrics row)
    or a ``step()`` of their own, ``adapter`` (what the run moves), ``_budget()``, ``_build(state, ...)`` and ``save_checkpoint(row)``."""

    kind = "run"
    config_class: type = None  # set by subclasses

    # --- construction ----------------------------------------------------------------------------
    def __init__(self, state: RunState, *, run_dir: Path, engine: Engine, task: Task, model_dir: Path):
        self.config = state.config
        self.run_dir = Path(run_dir)
        self.engine = engine
        self.task = task
        self.generation = state.generation
        self.counters = dict(state.counters)
        self.history = list(state.rows)
        self.model_dir = model_dir
        self.train_examples = task.train_examples()
        self.eval_examples = task.eval_examples()
        self.validation_examples = task.validation_examples()
        self._started = time.perf_counter()
        self._wall_at_start = self.counters.get("wall_s", 0.0)
        self._writer: WriterLock | None = None  # the folder's writer lock, set by create/resume/open
        self._owns_engine = False  # whether close() closes the engine: only one the run started
        self._reporters = Reporters()  # report_to's, set by create/resume/open
        self._uncommitted: int | None = None  # a generation updated and not yet committed (_begin_update)

    @classmethod
    def _build(cls, state: RunState, *, run_dir: Path, engine: Engine | None, task: Task, model_dir: Path):
        """The run of this kind from ``state``, on ``engine`` (None: the engine its config asks for)."""
        raise NotImplementedError

    def placement(self) -> dict:
        """What this run resolved where it runs, beside its config (``env.record_placement``): here the
        generation this attempt starts from (0 new, a checkpoint's when resumed), so the rows after
        it are the ones whose times the line's placement explains; and, for Ray engines, where each one
        runs (``engine_info``: host, node, card, SMs, tiles), which this process's own line cannot say."""
        line = {"from_generation": self.generation}
        engines = self.engine.engine_info if self.engine is not None else ()
        if engines:
            line["engines"] = [dict(info) for info in engines]
        return line

    @classmethod
    def create(cls, config, run_dir: str | Path, *, engine: Engine | None = None, overwrite: bool = False,
               initial_adapter: AdapterWeights | None = None):
        """Start a new run in an empty folder (an existing run is refused unless ``overwrite``);
        ``initial_adapter`` replaces the config's initialisation (e.g. an adapter from notebook 02).
        The run holds the folder's writer lock until ``close()``; ``RunFolderBusy`` if another has it."""
        checked = cls._checked(config, initial_adapter)
        lock = WriterLock.acquire(run_dir)  # before the folder is touched and before any engine
        with lock.released_on_error():
            return cls._create(config, Path(run_dir), lock, checked, engine, overwrite)

    @classmethod
    def _checked(cls, config, initial_adapter: AdapterWeights | None) -> tuple:
        """(task, model folder, first adapter) of a new run, every setting checked before its folder."""
        task = get_task(config.task, **config.task_options)
        model_dir = resolve_model(config.model)
        check_engine_settings(config, model_dir, task)  # context, KV cache and memory, before the folder
        adapter = cls._first_adapter(config, model_dir, initial_adapter) if cls._moves_adapter(config) else None
        check_backends(config.report_to)  # a missing package fails here, before the folder and the engine
        return task, model_dir, adapter

    @classmethod
    def _create(cls, config, run_dir: Path, lock: WriterLock, checked: tuple, engine: Engine | None,
                overwrite: bool):
        task, model_dir, adapter = checked
        run_dir = prepare_run_dir(run_dir, overwrite)
        write_run_config(run_dir, config, cls.kind)
        run = cls._build(RunState(config=config, adapter=adapter), run_dir=run_dir, engine=engine,
                         task=task, model_dir=model_dir)
        run._writer, run._owns_engine = lock, engine is None
        run._reporters = open_reporters(config.report_to, run_dir)
        run.commit({"generation": 0, **run.row_header(), **run.score(force=True)})
        return run

    @classmethod
    def resume(cls, run_dir: str | Path, *, engine: Engine | None = None):
        """Continue a run from its latest checkpoint; it ends as if never interrupted. The run holds
        the folder's writer lock until ``close()``; ``RunFolderBusy`` if another has it."""
        lock = WriterLock.acquire(run_dir, create=False)
        with lock.released_on_error():
            return cls._resume(Path(run_dir), lock, engine)

    @classmethod
    def _resume(cls, run_dir: Path, lock: WriterLock, engine: Engine | None):
        state = load_latest(run_dir, cls.kind, cls.config_class)
        config = state.config
        check_backends(config.report_to)
        run = cls._build(state, run_dir=run_dir, engine=engine, task=get_task(config.task, **config.task_options),
                         model_dir=resolve_model(config.model))
        run._writer, run._owns_engine = lock, engine is None
        # the generations past the checkpoint are redone: their points go, metrics.jsonl's rows from it on come back
        run._reporters = open_reporters(config.report_to, run_dir, state.rows, first_step=state.generation)
        pending = state.pending_row()
        if pending is not None:  # a folder of the earlier layout: a checkpointed row still waiting for its scores
            run._log({**pending, **run._score_alone(run.scoring_plan(run.generation).sets, counted=False)})
        return run

    @classmethod
    def open(cls, config, run_dir: str | Path, *, resume: bool = True, overwrite: bool = False,
             engine: Engine | None = None, initial_adapter: AdapterWeights | None = None):
        """Resume the run in ``run_dir`` if it holds one with the same settings, else create it.

        Settings that do not change the science (``EXTENDABLE``: the budget, eval and checkpoint
        cadence) may differ: a finished run can be extended. ``initial_adapter`` is used only when
        the run is created. One writer at a time: ``RunFolderBusy`` (naming the holder) when another
        process, or a run still open in this one, writes the folder; nothing is written then."""
        run_dir = Path(run_dir)
        resuming = resume and not overwrite
        if resuming and list_checkpoints(run_dir):
            lock = WriterLock.acquire(run_dir, create=False)
            with lock.released_on_error():
                return cls._resume_with(config, run_dir, lock, engine)
        checked = cls._checked(config, initial_adapter)
        lock = WriterLock.acquire(run_dir)
        with lock.released_on_error():
            # another writer may have made the run between the look above and the lock: resume it
            if resuming and list_checkpoints(run_dir):
                return cls._resume_with(config, run_dir, lock, engine)
            return cls._create(config, run_dir, lock, checked, engine, overwrite)

    @classmethod
    def _resume_with(cls, config, run_dir: Path, lock: WriterLock, engine: Engine | None):
        """``_resume``, the folder's config first brought to ``config``'s budget and cadence."""
        if extended_settings(run_dir, config):  # a larger budget, another cadence: recorded
            write_run_config(run_dir, config, cls.kind)
        return cls._resume(run_dir, lock, engine)

    @staticmethod
    def _moves_adapter(config) -> bool:
        """Whether a run of these settings moves an adapter (else the engine's own weights)."""
        return True

    @staticmethod
    def _first_adapter(config, model_dir: Path, initial_adapter: AdapterWeights | None) -> AdapterWeights:
        """A new run's first adapter, after every check that can fail before the folder and the engine:
        LoRA targets and the given adapter's spec."""
        spec = config.lora_spec()
        shapes = adapter_shapes(model_dir, spec)  # bad targets / layers fail here, before any engine
        if initial_adapter is not None:
            if initial_adapter.spec != spec:
                raise ConfigError(f"initial adapter spec {initial_adapter.spec} differs from the config's {spec}")
            return initial_adapter
        magnitudes = base_weight_magnitudes(model_dir, spec) if config.init_scheme == "random_ab" else None
        return init_adapter(spec, shapes, config.init_scheme, config.seed, magnitudes, config.init_scale)

    # --- the loop ------------------------------------------------------------------------------
    def step(self) -> dict:
        """One generation (ES) or step (GRPO): update, score when due, commit; returns the final metrics row."""
        self._check_writer()
        self._check_committed()
        row = self.train_step()
        row.update(self.score())
        return self.commit(row)

    def run(self, num_generations: int | None = None, callback: Callable[[dict], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> list[dict]:
        """``step()`` up to this many generations or steps in all (default: the config's); returns the
        new rows, each handed to ``callback`` once committed. ``should_stop()`` is asked before each."""
        target = num_generations if num_generations is not None else self._budget()
        rows: list[dict] = []
        while self.generation < target and not (should_stop is not None and should_stop()):
            rows.append(self.step())
            if callback is not None:
                callback(rows[-1])
        return rows

    def row_header(self) -> dict:
        """The keys that open every metrics row of this run."""
        return {"method": self.kind, "seed": self.config.seed}

    def batch_examples(self, generation: int) -> list[Example]:
        """Train prompts of a generation or step: all, or a seeded draw of ``prompts_per_step``
        (the same draw for ES and GRPO at the same seed, so both train on the same prompts)."""
        k = self.config.prompts_per_step
        if k is None or k >= len(self.train_examples):
            return list(self.train_examples)
        return random.Random(derive_seed(self.config.seed, "prompts", generation)).sample(self.train_examples, k)

    def scoring_plan(self, generation: int) -> ScoringPlan:
        """Whether and what ``generation`` scores (``scoring.scoring_plan`` on this run's settings)."""
        settings = ScoringSettings(eval_every=self.config.eval_every, budget=self._budget(),
                                   rides=self._scores_in_population(), validation=bool(self.validation_examples))
        return scoring_plan(generation, settings, scored_means(self.history[-2:]))

    def _scores_in_population(self) -> bool:
        """Whether the mean's scoring rides in the training call (ES on an engine that batches grids)."""
        return False

    def score(self, force: bool = False) -> dict:
        """Greedy reward of the current adapter on the train and eval prompts, in one engine call of
        its own, when the scoring plan says so after this update, or forced; else ``{}``."""
        plan = self.scoring_plan(self.generation)
        if not (force or plan.after):
            return {}
        return self._score_alone(plan.sets)

    def _score_alone(self, sets: tuple[str, ...], counted: bool = True) -> dict:
        """The scoring keys of the current adapter on ``sets``, from an engine call of its own
        (``counted``: its completions join ``samples/eval_completions``)."""
        timing: dict[str, float] = {}
        examples = self._score_examples(sets)
        with timed(timing, "eval_s"):
            scores = score_adapters(self.engine, self.task, self.adapter, examples, self.config.max_new_tokens)
        if counted:
            self._count_scoring(sum(map(len, examples)))
        return score_keys(scores, timing["eval_s"])

    def _score_examples(self, sets: tuple[str, ...]) -> list[list[Example]]:
        """The prompts of each scored set, in the plan's order (train, held-out, validation)."""
        examples = {"train": self.train_examples, "eval": self.eval_examples, "validation": self.validation_examples}
        return [examples[name] for name in sets]

    def _count_scoring(self, completions: int) -> None:
        """Add a scoring's greedy completions to ``samples/eval_completions``."""
        self.counters["eval_completions"] = self.counters.get("eval_completions", 0) + completions

    def commit(self, row: dict) -> dict:
        """Add counters and timings to a row, then checkpoint (when due) and append the metrics line.

        Checkpoint first, then the metrics line: a kill in between reruns nothing finished (the
        checkpoint holds the row, and a resume writes it back)."""
        row.update(self._sample_counters())
        # phases are "time/<phase>"; "time/<phase>/<part>" splits a phase further and is not added again
        phases = [v for k, v in row.items() if k.startswith("time/") and k.count("/") == 1
                  and k not in ("time/generation_s", "time/wall_s")]
        if phases and self.generation > 0:
            row["time/generation_s"] = sum(phases)
        row["time/wall_s"] = self._wall()
        if self._checkpoint_due():
            self.save_checkpoint(row)
        row = self._log(row)
        self._uncommitted = None
        return row

    def _begin_update(self) -> None:
        """Where a generation (step) starts to change the run (its update): from here until its commit
        returns, the run is ahead of its folder. Cut in between (Ctrl-C in a notebook, an error), the
        run refuses to go on (``_check_committed``) instead of writing rows that skip or repeat one."""
        self._check_committed()
        self._uncommitted = self.generation + 1

    def _check_committed(self) -> None:
        if self._uncommitted is not None:
            name = type(self).__name__
            raise RuntimeError(
                f"{self.run_dir}: generation {self._uncommitted} was cut short after its update and before its commit "
                f"(Ctrl-C or an error), so this run is ahead of its folder and stops here. Open the run again to continue "
                f"from its last checkpoint, to the rows of an uninterrupted run: run.close(); "
                f"run = {name}.open(config, run_dir)")

    def _checkpoint_due(self) -> bool:
        """Whether ``commit`` checkpoints this generation: every ``checkpoint_every``, and at the end."""
        return self.generation % self.config.checkpoint_every == 0 or self.generation >= self._budget()

    def _log(self, row: dict) -> dict:
        self._check_writer()
        append_metrics(self.run_dir, row)  # the record first, then report_to's copies
        self.history.append(row)
        self._reporters.report(row)
        return row

    def _check_writer(self) -> None:
        """Every write to the folder goes through here: only a run that holds the folder writes."""
        if self._writer is None or not self._writer.held:
            raise RuntimeError(f"{self.run_dir}: this run was closed and no longer writes its folder; "
                               f"open it again ({type(self).__name__}.open) to continue it")

    def _write_checkpoint(self, adapter: AdapterWeights | None, optimizer_tensors: dict[str, torch.Tensor],
                          state: dict) -> Path:
        """Checkpoint the current generation (or step): adapter (None: none moves), optimizer tensors, state.json."""
        self._check_writer()
        return write_checkpoint(self.run_dir, self.generation, adapter, optimizer_tensors, state,
                                str(self.model_dir), keep=self.config.keep_checkpoints, rows=self.history)

    def _checkpoint_state(self, row: dict | None) -> dict:
        """What a checkpoint's state.json holds for the loop: generation, counters, the row."""
        if row is None:
            row = self.history[-1] if self.history else {}
        return {"generation": self.generation, "counters": self.counters, "row": row}

    def _sample_counters(self) -> dict:
        return {
            "samples/completions": self.counters.get("completions", 0),
            "samples/tokens": self.counters.get("tokens", 0),
            "samples/eval_completions": self.counters.get("eval_completions", 0),
        }

    def _wall(self) -> float:
        self.counters["wall_s"] = self._wall_at_start + time.perf_counter() - self._started
        return self.counters["wall_s"]

    def save_final(self) -> Path:
        """The adapter in PEFT format under run_dir/final_adapter (loadable by vLLM and peft)."""
        self._check_writer()
        self._check_committed()
        return save_adapter(self.adapter, self.run_dir / "final_adapter", base_model=str(self.model_dir))

    def close(self) -> None:
        """Close report_to's reporters, release the run folder (another process may open it now) and
        the engine, if the run started it; an engine passed in belongs to the caller (it may serve other runs)."""
        self._reporters.close()
        if self._writer is not None:
            self._writer.release()
        if self.engine is not None and self._owns_engine:
            self.engine.close()
