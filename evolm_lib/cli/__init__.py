"""The `evolm` command: one entry point for the project's jobs.

    evolm demo     ES on conciseness with SmolLM2 through the stepper notebook (what `make demo` runs)
    evolm bench    engine throughput and ES overhead
    evolm batch    a notebook once per grid point of a batch file (papermill)
    evolm sweep    ES vs GRPO at equal sample budgets, then the comparison notebook
    evolm tune     an equal number of Optuna trials per method, the winners rerun on fresh seeds
    evolm lab      JupyterLab on the project (notebooks/, runs/, figures/), with the engine's environment defaults

`evolm` alone prints this list and exits with 2 (a command is missing); `evolm --version` prints the version.

Each subcommand's module is imported only when it runs, so `evolm --help` is instant.
"""
from __future__ import annotations

import importlib
import sys
from typing import Sequence

from .interrupt import stop_signals_restored

COMMANDS = {
    "demo": ("evolm_lib.cli.demo", "ES on conciseness with SmolLM2 through the stepper notebook"),
    "bench": ("evolm_lib.cli.bench", "engine throughput and ES overhead"),
    "batch": ("evolm_lib.cli.batch", "run a notebook once per grid point of a batch file"),
    "sweep": ("evolm_lib.cli.sweep", "ES vs GRPO at equal sample budgets, then notebook 04"),
    "tune": ("evolm_lib.cli.tune", "equal Optuna trials per method on a validation split, winners rerun on fresh seeds"),
    "lab": ("evolm_lib.cli.lab", "JupyterLab on the project, opened at notebooks/ (--port, --no-browser, --ip)"),
}


EXAMPLES = (
    ("evolm demo", "ES on conciseness with SmolLM2, the fitness plot under runs/demo/"),
    ("evolm batch papermill_runs/ci_tiny.yaml --dry-run", "check a batch file's grid, run nothing"),
    ("evolm lab --port 8890 --no-browser", "JupyterLab on the project, for an SSH tunnel"),
)


def usage() -> str:
    """The top-level help text: commands to run first, then the list of commands."""
    width = max(map(len, COMMANDS))
    example_width = max(len(command) for command, _ in EXAMPLES)
    lines = ["usage: evolm COMMAND [ARGS...]   (evolm COMMAND --help for a command's options; evolm --version)", ""]
    lines += [f"    {command:<{example_width}}   {about}" for command, about in EXAMPLES]
    lines += ["", "commands:"]
    lines += [f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()]
    return "\n".join(lines)


def version() -> str:
    """The installed package's version (pyproject.toml's, for a checkout on PYTHONPATH without an install)."""
    from importlib.metadata import PackageNotFoundError, version as installed_version

    try:
        return installed_version("evolm")
    except PackageNotFoundError:
        import tomllib
        from pathlib import Path

        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a subcommand's ``main(argv)``; returns its exit code (2 without a command)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # a command is missing: the list, and a failure for scripts
        print(usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"evolm {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"evolm: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    with stop_signals_restored():
        result = importlib.import_module(COMMANDS[name][0]).main(rest)
    return result if isinstance(result, int) else 0
