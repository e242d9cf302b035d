"""ES on the model's own weights (``ModelWeights``, one kind of ``ESParameters``): full-parameter ES and EGGROLL.

``es_mode: full`` (Qiu et al. 2025, https://arxiv.org/abs/2509.24372): member i is
theta + sign_i * sigma * eps_i over the targeted weights, written into the engine's weights from its
seed, its prompts generated, then the mean restored from a float32 master; members run one after
another. ``es_mode: eggroll`` (Sarkar et al. 2025, https://arxiv.org/abs/2511.16652): member i's
noise in each weight matrix is A_i B_i^T / sqrt(r), served from a LoRA slot, so the population is
one batched call on a vLLM engine (one member at a time on the HF engine); the mean lives in the
base weights and its greedy scoring is a base request in the same call. With ``engine_host: ray``
every engine keeps its own copy of the mean (the same updates from the same seeds and fitness) and
serves its block of the members. Both update the mean where
the weights live, from the members' seeds and shaped fitness (``engines.weights``).

What a run folder keeps, so that a resume gives the rows of an uninterrupted run without full-size
weights in every checkpoint:
- ``seed_log.jsonl``: per generation, the members (seed, sign), their shaped fitness, sigma and the
  learning rate, appended (fsynced) before the generation's checkpoint;
- ``snapshots/NNNNNN.safetensors``: the float32 mean and the optimizer's buffers every
  ``checkpoint_every`` generations (the last two kept);
- on resume the mean is the newest snapshot at or before the checkpoint's generation (or the model
  folder's weights), then the seed log's updates after it, replayed in order: the same bits.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file

from ..config import ConfigError, ESConfig
from ..engines import Engine, SamplingSettings, WeightsEngine
from .. import es
from ..es import state as es_state
from ..lora import LoraSpec, read_base_weights
from ..runs import RunFolderDamaged, keep_damaged_lines, place_damaged, read_jsonl, scan_jsonl
from .es_parameters import Checkpointed, ScoringRequest, Served, Update, es_settings


SEED_LOG = "seed_log.jsonl"
DAMAGED_SEED_LOG = "seed_log.damaged.jsonl"  # the seed log's lines that do not parse, kept byte for byte
SNAPSHOTS = "snapshots"
KEEP_SNAPSHOTS = 2


class ModelWeights:
    """The ES mean as the model's own weights, held where the engine keeps them (``es_mode`` full or eggroll)."""

    adapter = None  # the engine's own weights serve the mean: scoring asks for the base model

    def __init__(self, config: ESConfig, engine: Engine, run_dir: Path, model_dir: Path, generation: int):
        if not isinstance(engine, WeightsEngine):
            raise ConfigError(f"es_mode: {config.es_mode} needs an engine that writes its weights in place "
                              f"(vLLM, HF or Ray), not {type(engine).__name__}")
        self.config, self.engine, self.run_dir, self.model_dir = config, engine, Path(run_dir), Path(model_dir)
        targets, layers = config.weight_targets()
        noise = "full" if config.es_mode == "full" else "lowrank"
        self.weights = engine.resident_weights(targets, noise=noise, noise_rank=config.noise_rank,
                                                  noise_scheme=config.noise_scheme, layers_to_transform=layers)
        self.slots = None  # EGGROLL's members in LoRA slots, where the engine has them (else one at a time)
        if config.es_mode == "eggroll":
            spec = LoraSpec(target_modules=tuple(targets), rank=config.noise_rank, alpha=float(config.noise_rank),
                            layers_to_transform=layers)
            try:
                self.slots = engine.lowrank_slots(spec, config.population_size)
            except ValueError as error:
                raise ConfigError(f"noise_rank: {error}") from None
        self.optimizer = config.optimizer_config()
        # the generation and what ask needs; the mean and the optimizer's state live in the engine
        self.state = es_state.ESState(es_settings(config, config.sigma, config.noise_device), None, None, generation)
        if hasattr(self.weights, "replay_source"):  # Ray engines: a lost engine gets the mean back from the folder
            self.weights.replay_source = self._replay_source
        self.restore_to(generation)

    # --- a generation ---------------------------------------------------------------------------
    def evaluate(self, members: Sequence[es.Member], prompts, sampling: SamplingSettings,
                 scoring: ScoringRequest | None = None) -> Served:
        """The members written in place one after another, or served from EGGROLL's slots in one
        call, on one engine or spread over Ray engines; the mean's scoring is a base-model request."""
        return Served(*self.engine.run_members(self.weights, members, self.config.sigma, prompts, sampling,
                                                  scoring, slots=self.slots))

    def update(self, generation: int, members: Sequence[es.Member], rewards: torch.Tensor) -> Update:
        """The update where the weights live, from seeds and shaped fitness; its seed-log line is on
        disk before this returns."""
        fitness = es.shape_fitness(self.config.fitness_shaping, rewards)
        info = self.weights.step(self.optimizer, members, fitness.tolist(), self.config.sigma, self.config.gradient_form)
        self._append_log({"generation": generation, "members": [[m.seed, m.sign] for m in members],
                          "weights": [float(w) for w in fitness.tolist()], "sigma": self.config.sigma,
                          "learning_rate": self.config.learning_rate})
        self.state = dataclasses.replace(self.state, generation=generation)
        return Update(fitness, info["update_norm"])

    def checkpoint(self, generation: int, snapshot_due: bool) -> Checkpointed:
        """A small checkpoint every generation (the seed log holds the update); a snapshot of the
        float32 mean when due."""
        state = {"snapshot": self.snapshot(generation).name} if snapshot_due and generation > 0 else {}
        return Checkpointed(None, {}, state)

    def save(self, run_dir: Path) -> Path:
        """The model with the mean's weights under run_dir/final_model (safetensors, config, tokenizer)."""
        return self.save_model(Path(run_dir) / "final_model", self.config.dtype)

    # --- the folder: seed log and snapshots -----------------------------------------------------
    def _append_log(self, entry: dict[str, Any]) -> None:
        with open(self.run_dir / SEED_LOG, "a") as handle:
            handle.write(json.dumps(entry) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def read_log(self) -> list[dict[str, Any]]:
        """The seed log's entries (a torn last line from a kill is skipped)."""
        return read_jsonl(self.run_dir / SEED_LOG)

    def snapshot(self, generation: int) -> Path:
        """The float32 mean and optimizer buffers of this generation, written atomically; older ones pruned."""
        folder = self.run_dir / SNAPSHOTS
        folder.mkdir(exist_ok=True)
        data = self.weights.read()
        tensors = {k: v.contiguous() for k, v in data.items() if isinstance(v, torch.Tensor)}
        tensors["step"] = torch.tensor([int(data.get("step", 0))], dtype=torch.int64)
        final = folder / f"{generation:06d}.safetensors"
        handle, temporary = tempfile.mkstemp(dir=folder, prefix=".snapshot-")
        os.close(handle)
        save_file(tensors, temporary)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, final)
        for old in sorted(folder.glob("*.safetensors"))[:-KEEP_SNAPSHOTS]:
            old.unlink()
        return final

    def model_weights(self) -> torch.Tensor:
        """The targeted weights as the model folder has them: one float32 vector in layout order (the
        mean of generation 0, whatever an engine shared with earlier runs holds now)."""
        layout = es.Layout.of(self.weights.shapes)
        found = read_base_weights(self.model_dir, layout.names)
        return torch.cat([found[name].to(torch.float32).reshape(-1) for name in layout.names])

    def _snapshot_at(self, generation: int) -> tuple[int, dict]:
        """(its generation, the snapshot) of the newest snapshot at or before ``generation``, else
        (0, the model folder's weights)."""
        snapshots = [p for p in sorted((self.run_dir / SNAPSHOTS).glob("*.safetensors")) if int(p.stem) <= generation]
        if not snapshots:
            return 0, {"master": self.model_weights()}
        tensors = load_file(str(snapshots[-1]))
        snapshot = {k: v for k, v in tensors.items() if k != "step"}
        snapshot["step"] = int(tensors["step"][0])
        return int(snapshots[-1].stem), snapshot

    def _checked_log(self, start: int, generation: int) -> list[dict[str, Any]]:
        """The seed log's entries; its damaged lines (not a torn last one) are kept byte for byte in
        seed_log.damaged.jsonl, and one the mean of ``generation`` needs (after the snapshot at
        ``start``) raises ``RunFolderDamaged``, naming the file and the line."""
        path = self.run_dir / SEED_LOG
        scanned = scan_jsonl(path, lambda entry: isinstance(entry.get("generation"), int))
        if scanned.damaged:
            damaged = place_damaged(scanned)
            keep_damaged_lines(path, damaged, self.run_dir / DAMAGED_SEED_LOG)
            needed = [d for d in damaged if d.generation is None or start < d.generation <= generation]
            if needed:
                raise RunFolderDamaged(
                    f"{path}, line {needed[0].line}: the seed log's update of generation "
                    f"{'?' if needed[0].generation is None else needed[0].generation} does not parse, and the mean of "
                    f"generation {generation} is rebuilt from it (kept in {DAMAGED_SEED_LOG}); restore the file "
                    "from a copy, or start the run again in this folder with overwrite=True")
        return [entry for _, entry in scanned.rows]

    def _replay_source(self) -> tuple[dict, list[tuple]]:
        """The mean now as the run folder has it, for an engine that lost it with no other engine to
        copy from: the newest snapshot, and the seed log's updates after it as ``step`` arguments."""
        entries = self.read_log()
        now = max((e["generation"] for e in entries), default=0)
        start, snapshot = self._snapshot_at(now)
        return snapshot, [self._update_args(e) for e in self._checked_log(start, now) if e["generation"] > start]

    def restore_to(self, generation: int) -> None:
        """Make the engine's mean that of ``generation``: the newest snapshot at or before it (else
        the model folder's weights), then the seed log's updates after it; later log lines go (a
        damaged line is kept aside first: ``_checked_log``)."""
        start, snapshot = self._snapshot_at(generation)
        entries = self._checked_log(start, generation)
        self.weights.load(snapshot)
        for entry in entries:
            if start < entry["generation"] <= generation:
                self._replay_update(entry)
        # later generations' lines go, and so does a line torn by a kill (the next append would join it)
        kept = "".join(json.dumps(e) + "\n" for e in entries if e["generation"] <= generation)
        path = self.run_dir / SEED_LOG
        if path.exists() and path.read_text(errors="replace") != kept:
            temporary = path.with_suffix(".jsonl.tmp")
            temporary.write_text(kept)
            os.replace(temporary, path)
        for stale in (self.run_dir / SNAPSHOTS).glob("*.safetensors"):
            if int(stale.stem) > generation:
                stale.unlink()  # from a generation whose checkpoint never landed

    def _update_args(self, entry: dict[str, Any]) -> tuple:
        """A seed log line as ``weights.step``'s arguments: the same members, fitness and step size."""
        members = [es.Member(int(seed), int(sign)) for seed, sign in entry["members"]]
        return self.optimizer, members, entry["weights"], float(entry["sigma"]), self.config.gradient_form

    def _replay_update(self, entry: dict[str, Any]) -> None:
        """A seed log line's update, applied again."""
        self.weights.step(*self._update_args(entry))

    @contextmanager
    def serving_base(self) -> Iterator[None]:
        """Inside the block the engine serves the model folder's weights (the base model), after it
        the mean and optimizer buffers it served before, bit for bit (from the float32 master)."""
        saved = self.weights.read()
        self.weights.load({"master": self.model_weights()})
        try:
            yield
        finally:
            self.weights.load(saved)

    def replay(self, generations: Iterable[int]) -> Iterator[int]:
        """Serve the mean of each of ``generations`` in turn (ascending), rebuilt from the model
        folder's weights and the seed log as a resume does, so each is the run's own mean bit for
        bit; yields the generation while the engine serves it. Afterwards the engine serves the mean
        it served before. For measurements per checkpoint (KL to the base model) after a run."""
        wanted = sorted(set(int(g) for g in generations))
        saved = self.weights.read()
        try:
            self.weights.load({"master": self.model_weights()})
            done = 0
            entries = sorted(self.read_log(), key=lambda e: e["generation"])
            for generation in wanted:
                for entry in entries:
                    if done < entry["generation"] <= generation:
                        self._replay_update(entry)
                done = generation
                yield generation
        finally:
            self.weights.load(saved)

    def save_model(self, out: Path, dtype: str) -> Path:
        """The model with the mean's weights as a folder transformers and vLLM load (safetensors,
        config, tokenizer), the targeted weights in ``dtype``."""
        model_dir = self.model_dir
        master = self.weights.read()["master"]
        layout = es.Layout.of(self.weights.shapes)
        moved = layout.split(master)
        staging = Path(tempfile.mkdtemp(prefix=".final-", dir=out.parent))
        for item in Path(model_dir).iterdir():  # config, tokenizer, generation config: as they are
            if item.is_file() and item.suffix != ".safetensors" and not item.name.endswith(".index.json"):
                shutil.copy2(item, staging / item.name)
        tensors: dict[str, torch.Tensor] = {}
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            for name, tensor in load_file(str(path)).items():
                tensors[name] = moved[name].to(getattr(torch, dtype)).contiguous() if name in moved else tensor
        missing = set(moved) - set(tensors)
        if missing:
            raise ValueError(f"{model_dir} has no tensor {sorted(missing)[:3]}")
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
        return out

    def close(self, reset: bool = False) -> None:
        """Release EGGROLL's slots and the engine's master; the engine then serves the current mean,
        or with ``reset`` the model folder's weights again (an engine that serves other runs next)."""
        if reset and self.weights is not None:
            self.weights.load({"master": self.model_weights()})
        if self.slots is not None:
            self.slots.close()
            self.slots = None
        if self.weights is not None:
            self.weights.close()
            self.weights = None


