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
  label-logits  the labels' log-probabilities and their backward: torch's gather against ``label_logits``
  engine-start  an engine's start with every CUDA-graph size against the sizes a run uses
  full-memory   full-parameter ES on a large model: the memory plan of a card against the card's use, a generation's time
  optimizer     SGD and Adam on a flat float32 master: the library's updates against torch.optim's functional forms
  plan          the memory a card holds for Qwen2.5-7B to 72B in each mode at tensor_parallel_size 1 to 8
                (computed from the models' shapes; nothing is loaded)

Examples::

    python -m evolm_lib.benchmark                      # = engine, SmolLM2
    python -m evolm_lib.benchmark engine --model tiny-random --population 4 --generations 3 --prompts 2 --new-tokens 8
    python -m evolm_lib.benchmark full-pool --help
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Sequence

SUBCOMMANDS = {
    "engine": "engine",
    "full-pool": "full_pool",
    "ray": "ray_scaling",
    "modes": "modes",
    "grpo-update": "grpo_update",
    "label-logits": "label_logits",
    "engine-start": "engine_start",
    "full-memory": "full_memory",
    "plan": "plan",
    "optimizer": "optimizer",
}
"""subcommand -> module of this package holding its ``main(argv)``"""
DEFAULT = "engine"


def add_population_options(parser: argparse.ArgumentParser, gpu: bool, cpu: tuple[int, int, int] = (4, 2, 8),
                           rank_help: str = "LoRA rank") -> None:
    """The options of a population call: ``--population``, ``--prompts``, ``--new-tokens`` (32 x 8 x
    128 on a GPU, ``cpu`` = (members, prompts, tokens) on a CPU) and ``--rank`` (1)."""
    members, prompts, tokens = (32, 8, 128) if gpu else cpu
    parser.add_argument("--population", type=int, default=members, help=f"members (32 on a GPU, {cpu[0]} on a CPU)")
    parser.add_argument("--prompts", type=int, default=prompts, help="prompts per member")
    parser.add_argument("--new-tokens", type=int, default=tokens, help="tokens per request (EOS ignored)")
    parser.add_argument("--rank", type=int, default=1, help=rank_help)


def int_list(parser: argparse.ArgumentParser, text: str, option: str) -> list[int]:
    """The comma-separated counts of ``--option`` (each >= 1), or the parser's error naming it."""
    try:
        values = [int(part) for part in text.split(",") if part]
    except ValueError:
        parser.error(f"--{option} must be comma-separated integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        parser.error(f"--{option} must be integers >= 1, got {text!r}")
    return values


def check_population_options(parser: argparse.ArgumentParser, args: argparse.Namespace, *more: str) -> None:
    """Refuse counts below 1 (the population's options and ``more``) and an odd population (antithetic pairs)."""
    for name in ("population", "prompts", "new_tokens", "rank", *more):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.population % 2:
        parser.error("--population must be even (antithetic pairs)")


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
