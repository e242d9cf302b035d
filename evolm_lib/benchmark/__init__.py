"""The benchmarks behind the speed figures: ``python -m evolm_lib.benchmark SUBCOMMAND [options]``.

Each subcommand measures one figure side by side in one process (or one process per card where a
setting is process-wide) and prints ratios; ``--json PATH`` also writes what it measured. Speed
targets are read from these ratios on a named machine (``docs/measurements.md``, the README's
table), never asserted by tests.

Subcommands (each a module of this package with its own ``main(argv)``):
  engine        throughput on one engine (base, members in place, adapter files) and ES generations split
                into their phases; the default when no subcommand is named
  full-pool     full-parameter ES at Qiu et al.'s settings: one engine against several on one card
  ray           Ray engines: K=1 against K engines, each engine's own time against the call's
  modes         each ES mode against the base model with the LoRA kernel tiles it picks; EGGROLL's update
  grpo-update   the GRPO update with and without ``deterministic``, the policy in its own process
  engine-start  an engine's start with every CUDA-graph size against the sizes a run uses

Examples::

    python -m evolm_lib.benchmark                      # = engine, SmolLM2
    python -m evolm_lib.benchmark engine --model tiny-random --population 4 --generations 3 --prompts 2 --new-tokens 8
    python -m evolm_lib.benchmark full-pool --help
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Sequence

SUBCOMMANDS = {
    "engine": "engine",
    "full-pool": "full_pool",
    "ray": "ray_scaling",
    "modes": "modes",
    "grpo-update": "grpo_update",
    "engine-start": "engine_start",
}
"""subcommand -> module of this package holding its ``main(argv)``"""
DEFAULT = "engine"


def main(argv: Sequence[str] | None = None) -> Any:
    """Run one subcommand (``engine`` when the first argument is an option or missing); returns its results."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return None
    name = argv.pop(0) if argv and not argv[0].startswith("-") else DEFAULT
    if name not in SUBCOMMANDS:
        raise SystemExit(f"python -m evolm_lib.benchmark: unknown subcommand {name!r}; choose from {', '.join(SUBCOMMANDS)}")
    module = importlib.import_module(f"{__name__}.{SUBCOMMANDS[name]}")
    return module.main(argv)
