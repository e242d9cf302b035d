"""The host side of the model's own weights written in place inside a vLLM engine (es_mode full and
eggroll): ``EngineWeights`` names the targeted weights (HF names, shapes read from the model folder)
and calls the worker's ``evolm_weights_`` methods (``vllm_worker.WeightsExtension``) through
``engines.vllm.client.WorkerClient``."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from ... import es
from ...es import lowrank
from .resident import NoiseForm, targeted_weight_shapes
from ..vllm.client import WorkerClient
from ..vllm.rpc import optimizer_spec


class EngineWeights:
    """Client of a vLLM engine's resident weights (``WeightsExtension``): one member at a time
    (``full``), or the mean under a population of low-rank LoRA slots (``lowrank``)."""

    _keys = iter(range(1, 1 << 30))

    def __init__(self, llm, model_dir: str | Path, target_modules: Sequence[str] | str, *, noise: NoiseForm = "full",
                 noise_rank: int = 1, noise_scheme: es.NoiseScheme = "flat",
                 layers_to_transform: Sequence[int] | None = None):
        self.llm, self.noise, self.noise_rank = llm, noise, noise_rank
        self.shapes = targeted_weight_shapes(model_dir, target_modules, layers_to_transform)
        if noise == "lowrank":
            lowrank.check_rank(noise_rank, self.shapes)
        self.key = next(self._keys)
        self.worker = WorkerClient(llm)
        self.info = self.worker.weights_setup(self.key, self.shapes, noise, noise_rank, noise_scheme)

    def write_member(self, member: es.Member, sigma: float) -> float:
        """Serve one member; returns the write's seconds."""
        return self.worker.weights_write(self.key, member.seed, member.sign, sigma)["write_s"]

    def restore(self) -> float:
        """Serve the mean again; returns the restore's seconds."""
        return self.worker.weights_restore(self.key)["restore_s"]

    def step(self, optimizer: es.OptimizerConfig, members: Sequence[es.Member], weights: Sequence[float],
             sigma: float, form: es.GradientForm = "qiu") -> dict:
        """The update where the weights live: {"update_s", "update_norm"}."""
        return self.worker.weights_step(self.key, optimizer_spec(optimizer), [(m.seed, m.sign) for m in members],
                                        weights, sigma, form)

    def write_slots(self, population, members: Sequence[es.Member], sigma: float) -> float:
        """EGGROLL: the members' low-rank noise into the resident LoRA slots of ``population`` (a
        ``slots.ResidentSlots`` of rank ``noise_rank`` with alpha = rank over the same
        modules), which then serves them; returns the write's seconds."""
        if population.spec.rank != self.noise_rank or population.spec.alpha != population.spec.rank:
            raise ValueError(f"EGGROLL slots need rank {self.noise_rank} and alpha = rank, got {population.spec}")
        seconds = self.worker.weights_write_slots(self.key, population.key, [(m.seed, m.sign) for m in members],
                                                 sigma)["write_s"]
        population.mark_written(len(members))
        return seconds

    def checksum(self) -> dict:
        """{"master": SHA-256 of the float32 master, "restored": the engine serves it exactly, "step"}."""
        return self.worker.weights_checksum(self.key, self.shapes)

    def read(self) -> dict:
        """The master and optimizer buffers on the host (a full-size snapshot)."""
        return self.worker.weights_read(self.key, self.shapes)

    def served(self) -> dict:
        """Name -> the whole weight the engine serves now (float32; put together over the cards)."""
        return self.worker.weights_served(self.key, self.shapes)

    def load(self, snapshot: Mapping[str, Any]) -> None:
        """Serve the mean of a snapshot made by ``read``."""
        self.worker.weights_load(self.key, snapshot)

    def close(self) -> None:
        """Serve the mean and release the worker's master."""
        if self.llm is not None:
            self.worker.weights_release(self.key)
            self.llm = None
