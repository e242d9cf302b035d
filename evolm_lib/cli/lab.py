"""`evolm lab`: JupyterLab on the project's notebooks/, with the engine's environment defaults
(one OpenMP thread on a CPU machine: a generation took 47 s instead of 6 s without it)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from ..env import apply_engine_defaults
from ..paths import project_root


def main(argv: list[str] | None = None) -> int:
    """Start JupyterLab (extra arguments go to it); returns its exit code."""
    parser = argparse.ArgumentParser(prog="evolm lab", description=__doc__)
    parser.add_argument("lab_args", nargs=argparse.REMAINDER, help="passed to jupyter lab (e.g. --port 8890)")
    args = parser.parse_args(argv)
    apply_engine_defaults()  # the kernels inherit this environment
    root = project_root()
    command = [sys.executable, "-m", "jupyter", "lab", str(root / "notebooks"), *args.lab_args]
    print(" ".join(command), flush=True)
    return subprocess.call(command, cwd=root, env=os.environ.copy())
