"""`evolm lab`: JupyterLab on the project folder (notebooks/, runs/ and figures/ all browsable), opened
at notebooks/, with the engine's environment defaults (one OpenMP thread on a CPU machine, quiet engine
logs) and notebook saves that keep git diffs clean.

    evolm lab                                   on this machine, a browser opens
    evolm lab --port 8890 --no-browser          on a remote GPU machine; from your own machine:
                                                ssh -L 8890:localhost:8890 gpu-host, then open the
                                                http://localhost:8890/lab?token=... URL the lab prints
    evolm lab --ip 0.0.0.0 --port 8890          every interface (a trusted network only)
    evolm lab --port 8890 --ServerApp.token=T   any other jupyter-lab option passes through

In this lab a notebook is written to disk only when you save it (Ctrl-S, File > Save): autosave is
off, so trying other parameters in notebooks/03_es_stepper leaves the tracked notebooks as they are
until you decide to keep the change; closing a tab with unsaved changes asks first. A notebook's
percent-format .py (notebooks/*.py) opens as a notebook on a double click. A save of
notebooks/*.ipynb drops outputs, execution counts and the lab's own metadata, so its diff is the
change you made. Notebooks elsewhere (runs/, your own) keep their outputs.

JupyterLab's question whether to fetch its news from the internet (a pop-up over the notebook until
answered) is answered no.

Run as root (the usual container), `--allow-root` is added. Ctrl-C, or `kill` of the evolm process,
stops the server and its kernels. The settings live in the project's `.jupyter/` folder
(`jupyter_server_config.py`, `lab/settings/overrides.json`), which the server reads first; with
plain jupyter: `JUPYTER_CONFIG_PATH=.jupyter jupyter lab`.
"""
from __future__ import annotations

import argparse
import copy
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from ..env import apply_engine_defaults, child_environment
from ..paths import project_root
from .help import HelpFormatter

# jupyter-lab options that choose another folder to serve: with one of them, the lab's root and
# start page are the user's, not ours.
ROOT_OPTIONS = ("--ServerApp.root_dir", "--ServerApp.notebook_dir", "--notebook-dir", "--root-dir")
DEFAULT_URL_OPTIONS = ("--ServerApp.default_url", "--LabApp.default_url")
CONFIG_FOLDER = ".jupyter"  # in the project folder: jupyter_server_config.py


def _given(options: Sequence[str], names: Sequence[str]) -> bool:
    return any(option == name or option.startswith(name + "=") for option in options for name in names)


def is_root() -> bool:
    """True when this process runs as root (jupyter refuses to start as root without --allow-root)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def lab_command(argv: Sequence[str], root: Path, as_root: bool | None = None) -> list[str]:
    """The jupyter-lab command line for ``evolm lab ARGV`` in the project folder ``root``: our options
    translated, every other one passed through (after a ``--`` too), ``--allow-root`` when root."""
    parser = _parser()
    options, passed = parser.parse_known_args(list(argv))
    if "--" in passed:  # `evolm lab -- --port 8890`: what follows is jupyter-lab's, verbatim
        passed.remove("--")
    command = [sys.executable, "-m", "jupyter", "lab"]
    if options.port is not None:
        command.append(f"--ServerApp.port={options.port}")
    if options.ip is not None:
        command.append(f"--ServerApp.ip={options.ip}")
    if options.no_browser:
        command.append("--no-browser")
    if (is_root() if as_root is None else as_root) and "--allow-root" not in passed:
        command.append("--allow-root")
    if not _given(passed, ROOT_OPTIONS):
        command.append(f"--ServerApp.root_dir={root}")
        if not _given(passed, DEFAULT_URL_OPTIONS) and (root / "notebooks").is_dir():
            command.append("--LabApp.default_url=/lab/tree/notebooks")
    return command + passed


def lab_environment(root: Path) -> dict[str, str]:
    """The server's environment: the engine defaults (kernels inherit them) and the project's jupyter
    config folder first on ``JUPYTER_CONFIG_PATH`` (the user's own config still applies after it)."""
    apply_engine_defaults()
    env = child_environment()
    config = root / CONFIG_FOLDER
    if config.is_dir():
        env["JUPYTER_CONFIG_PATH"] = os.pathsep.join(filter(None, [str(config), env.get("JUPYTER_CONFIG_PATH")]))
    return env


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="evolm lab", usage="evolm lab [--port N] [--no-browser] [--ip ADDR] [jupyter-lab options...]",
        description=__doc__, formatter_class=HelpFormatter,
        allow_abbrev=False,  # an abbreviation of a jupyter-lab option must reach jupyter-lab, not match ours
        epilog="Every other option goes to jupyter-lab (see `jupyter lab --help-all`).",
    )
    parser.add_argument("--port", type=int, help="the port to serve on (jupyter's default 8888, or the next free one)")
    parser.add_argument("--no-browser", action="store_true",
                        help="do not open a browser (a remote machine: reach it through an SSH tunnel)")
    parser.add_argument("--ip", help="the address to listen on (default localhost; 0.0.0.0: every interface)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Start JupyterLab on the project folder (unknown options go to jupyter-lab); returns its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _parser().parse_known_args(argv)  # --help and bad values of our options, before anything starts
    root = project_root()
    env = lab_environment(root)
    command = lab_command(argv, root)
    print(" ".join(command), flush=True)
    return run_forwarding_signals(command, cwd=root, env=env)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # stopping `evolm lab` stops its server


def run_forwarding_signals(command: Sequence[str], **popen: Any) -> int:
    """Run ``command`` and wait for it; SIGTERM, SIGINT or SIGHUP sent to this process reaches it as
    SIGTERM, on which jupyter-lab shuts its kernels down and exits at once. So `kill <pid of evolm lab>`
    or a closed terminal stops the server instead of leaving it serving, and Ctrl-C in the terminal
    (whose SIGINT the server gets too, and would otherwise answer with a yes/no question) stops it
    without asking. Returns the command's exit code."""
    process = subprocess.Popen(list(command), **popen)

    def stop(_signum: int, _frame: Any) -> None:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)

    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        return process.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# --------------------------------------------------------------------------- clean notebook saves

def clean_notebook_save(model: dict[str, Any], path: str, contents_manager: Any, **kwargs: Any) -> None:
    """Jupyter's pre-save hook for the project's notebooks/*.ipynb: outputs, execution counts and the
    metadata the lab adds (language_info, widget state, per-cell UI state) are dropped, so a notebook
    saved after running holds what its paired .py holds. Other notebooks (runs/, your own) are untouched."""
    if model.get("type") != "notebook" or not path.endswith(".ipynb") or not _in_project_notebooks(path, contents_manager):
        return
    model["content"] = strip_notebook(copy.deepcopy(model["content"]))  # jupytext writes the .py from the original


def strip_notebook(notebook: dict[str, Any]) -> dict[str, Any]:
    """Drop outputs and execution counts, and keep only the metadata the notebook's jupytext filters
    keep in its .py (default: kernelspec and jupytext; cell tags); changes ``notebook`` in place."""
    from jupytext.metadata_filter import filter_metadata

    jupytext_settings = notebook.get("metadata", {}).get("jupytext", {})
    notebook["metadata"] = filter_metadata(notebook.get("metadata", {}),
                                           jupytext_settings.get("notebook_metadata_filter", "kernelspec,jupytext"), "-all")
    for cell in notebook.get("cells", []):
        cell["metadata"] = filter_metadata(cell.get("metadata", {}),
                                           jupytext_settings.get("cell_metadata_filter", "tags,-all"), "-all")
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
    return notebook


def _in_project_notebooks(path: str, contents_manager: Any) -> bool:
    server_root = Path(getattr(contents_manager, "root_dir", "") or ".").resolve()
    try:
        notebooks = project_root(server_root) / "notebooks"
    except FileNotFoundError:  # the lab serves something else than a project
        return False
    return (server_root / path.strip("/")).resolve().parent == notebooks.resolve()
