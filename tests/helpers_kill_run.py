"""Run an ES run and SIGKILL the process inside the population call of one generation.

Usage: python tests/helpers_kill_run.py RUN_DIR N_KILL [--vllm [--tp2]]

On the synthetic engine, or with ``--vllm`` on a real vLLM engine (tiny-random) whose members are
written in place into resident slots and whose mean's scoring rides in the population call;
``--tp2``: that engine split over two tensor-parallel ranks (tests/test_tensor_parallel.py).
tests/test_es_run.py launches this as a subprocess, then resumes the run in-process and checks it
ends bit for bit like an uninterrupted one. ``kill_config`` / ``vllm_kill_config`` are the runs'
settings, shared with those tests.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from evolm_lib.config import ESConfig
from evolm_lib.engines import SamplingSettings
from evolm_lib.train.es import ESRun
from evolm_lib.engines.synthetic import SyntheticEngine
from evolm_lib.engines.vllm.engine import VLLMEngine


def kill_config() -> ESConfig:
    """Settings of the killed run; checkpoint_every=2 so the kill also strands a metrics row past the checkpoint."""
    return ESConfig(
        model="tiny-random",
        target_modules=("q_proj", "v_proj"),
        sigma=0.02,
        learning_rate=0.05,
        optimizer="sgd",
        momentum=0.5,  # a momentum buffer, so resume must restore optimizer state too
        population_size=4,
        num_generations=6,
        checkpoint_every=2,
        seed=11,
    )


class KillingEngine(SyntheticEngine):
    """SyntheticEngine that SIGKILLs its own process in the population call of generation ``kill_at``."""

    def __init__(self, kill_at: int):
        super().__init__()
        self.kill_at = kill_at
        self.run: ESRun | None = None  # set once the run exists; its generation tells which call this is

    def generate(self, prompts, adapters=(None,), sampling=SamplingSettings()):
        """The synthetic completions, or SIGKILL in the population call of generation ``kill_at``."""
        # the population call has one adapter per member; the scoring call of the mean has one
        if self.run is not None and len(adapters) > 1 and self.run.generation + 1 == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().generate(prompts, adapters, sampling)


def vllm_kill_config(tensor_parallel_size: int = 1) -> ESConfig:
    """Settings of the run killed on vLLM: greedy (the CPU engine repeats it token for token), a
    momentum buffer, and checkpoints every 2 generations."""
    return ESConfig(model="tiny-random", population_size=4, num_generations=5, max_new_tokens=8, sigma=0.5,
                    learning_rate=0.5, optimizer="sgd", momentum=0.5, temperature=0.0, seed=3, lora_rank=1,
                    checkpoint_every=2, tensor_parallel_size=tensor_parallel_size)


def vllm_engine(killer: bool = False, tensor_parallel_size: int = 1) -> VLLMEngine:
    """The in-place tiny-random engine of the vLLM kill test (``KillingVLLMEngine`` when ``killer``)."""
    kind = KillingVLLMEngine if killer else VLLMEngine
    return kind("tiny-random", max_lora_rank=1, max_loras=5, max_model_len=256, kv_cache_gb=0.0625,
                adapter_transfer="in_place", tensor_parallel_size=tensor_parallel_size)


class KillingVLLMEngine(VLLMEngine):
    """VLLMEngine that SIGKILLs its own process in the population call of generation ``kill_at``."""

    kill_at = 0
    run: ESRun | None = None

    def generate_grids(self, grids):
        """The engine's completions, or SIGKILL in the population call of generation ``kill_at``."""
        population = any(len(adapters) > 1 for _, adapters, _ in grids)
        if self.run is not None and population and self.run.generation + 1 == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().generate_grids(grids)


def main(run_dir: str, kill_at: int, on_vllm: bool = False, tensor_parallel_size: int = 1) -> None:
    if on_vllm:
        engine = vllm_engine(killer=True, tensor_parallel_size=tensor_parallel_size)
        engine.kill_at = kill_at
        run = ESRun.open(vllm_kill_config(tensor_parallel_size), Path(run_dir), engine=engine)
        engine.run = run
        run.run()
        raise SystemExit(f"generation {kill_at} was never reached")
    engine = KillingEngine(kill_at)
    run = ESRun.open(kill_config(), Path(run_dir), engine=engine)
    engine.run = run
    run.run()
    raise SystemExit(f"generation {kill_at} was never reached")  # exit code 1, not -9


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), "--vllm" in sys.argv[3:], 2 if "--tp2" in sys.argv[3:] else 1)
