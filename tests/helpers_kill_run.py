"""Run an ES run on the synthetic engine and SIGKILL the process inside the population call of one generation.

Usage: python tests/helpers_kill_run.py RUN_DIR N_KILL

tests/test_es_run.py launches this as a subprocess, then resumes the run in-process and checks it
ends bit for bit like an uninterrupted one. ``kill_config`` is the run's settings, shared with that test.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from evolm_lib.config import ESConfig
from evolm_lib.engines import SamplingSettings
from evolm_lib.es.run import ESRun
from evolm_lib.engines.synthetic import SyntheticEvaluator


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


class KillingEvaluator(SyntheticEvaluator):
    """SyntheticEvaluator that SIGKILLs its own process in the population call of generation ``kill_at``."""

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


def main(run_dir: str, kill_at: int) -> None:
    evaluator = KillingEvaluator(kill_at)
    run = ESRun.open(kill_config(), Path(run_dir), evaluator=evaluator)
    evaluator.run = run
    run.run()
    raise SystemExit(f"generation {kill_at} was never reached")  # exit code 1, not -9


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
