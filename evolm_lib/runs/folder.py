"""A run folder's place and creation: the notebooks' default folders, and an empty folder for a new run."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..paths import project_root
from .checkpoints import CHECKPOINTS, list_checkpoints
from .config_io import EXTENDABLE
from .lock import LOCK_FILE
from .metrics_file import read_metrics

NOTEBOOK_RUNS_ENV = "EVOLM_NOTEBOOK_RUNS"  # the folder of the notebooks' default run folders (tests set it)


class RunFolderExists(FileExistsError):
    """A run folder already holds a run and overwriting was not asked for."""


def notebook_run_dir(name: str, config: Any = None) -> Path:
    """A notebook's default run folder: runs/notebooks/<name> in the project, or <name> under the
    folder that the environment variable EVOLM_NOTEBOOK_RUNS names (the tests' nbval run sets it, so
    it never writes into the run a user has open in JupyterLab). With ``config`` (the run's settings),
    <name>-<hash>: a short hash of the settings that change the science (all but budget, cadence and
    engine placement, `EXTENDABLE`), so changed settings start a new run, the same ones resume it, and
    a raised budget extends it."""
    if config is not None:
        science = {k: v for k, v in sorted(config.to_dict().items()) if k not in EXTENDABLE}
        digest = hashlib.sha256(json.dumps(science, sort_keys=True, default=str).encode()).hexdigest()[:8]
        name = f"{name}-{digest}"
    root = os.environ.get(NOTEBOOK_RUNS_ENV)
    return Path(root) / name if root else project_root() / "runs" / "notebooks" / name


def prepare_run_dir(run_dir: str | Path, overwrite: bool = False) -> Path:
    """Create an empty run folder; refuse an existing non-empty one unless ``overwrite`` (the
    writer's lock file stays: the caller holds it)."""
    run_dir = Path(run_dir)
    contents = [p for p in run_dir.iterdir() if p.name != LOCK_FILE] if run_dir.exists() else []
    if contents:
        # Only config.yaml and no finished generation: a creation that failed before its first
        # checkpoint (e.g. the engine did not start). Nothing to lose; reuse the folder.
        aborted = not list_checkpoints(run_dir) and not read_metrics(run_dir) and \
            {p.name for p in contents} <= {"config.yaml", CHECKPOINTS}
        if not overwrite and not aborted:
            raise RunFolderExists(
                f"run folder {run_dir} already holds a run: resume it, pick another folder, or pass overwrite=True"
            )
        for path in contents:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir
