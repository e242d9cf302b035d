"""A study's folder packed while its workers run, so a machine taken back loses nothing packed:
``python -m evolm_lib.tune.pack OUT ARCHIVE``.

The archive holds a consistent copy of the study's SQLite storage (taken with SQLite's backup API,
so a worker writing at that moment cannot tear it), the summary and logs, and the text files (rows,
seed logs, settings, held-out scores) of every finished run: each trial the storage lists as
complete or pruned, and each rerun, continued rerun and control (``final/``, ``long/``, ``control/``)
whose held-out scores are written. Weights (checkpoints, snapshots, saved models) stay behind: a
full-parameter run's are hundreds of megabytes each, and a finished run needs none of them again
(``final.run_unfinished`` leaves it be). A run still going (or a failed trial, whose retry reuses
its folder) is left out whole: unpacked on a new machine, its trial's stale heartbeat makes Optuna
retry it with the same setting, and a rerun is run again, each in an empty folder instead of one
whose rows have no checkpoint to resume from.

Unpack with ``tar -xzf ARCHIVE -C PARENT`` (the archive's top folder is OUT's name), then run the
same ``evolm tune`` commands: each study continues where it stopped.
"""
from __future__ import annotations

import argparse
import sqlite3
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Sequence

from ..sweep import HELDOUT
from .final import STAGES, SUMMARY
from .study import STORAGE

TEXT_SUFFIXES = (".jsonl", ".json", ".yaml", ".yml", ".txt", ".log", ".csv")
"""What a packed run folder keeps: its rows, seed log, settings and scores."""
WEIGHT_FOLDERS = ("checkpoints", "snapshots", "final_model", "final_adapter", "adapter")
"""Folders of weights, left out wherever they are."""
FINISHED = ("COMPLETE", "PRUNED")
"""Trial states whose folders are packed: no retry will write into them again."""


def finished_trial_folders(storage_file: Path) -> tuple[list[str], list[str]]:
    """(run folders of finished trials, run folders of the others) of every study in a storage file
    (the copy :func:`pack_study` takes): a trial's folder is its ``run_dir`` user attribute where it
    finished, else ``trials/<study>/trial_NNNN``."""
    import optuna

    storage = f"sqlite:///{storage_file}"
    finished, running = [], []
    for name in optuna.get_all_study_names(storage):
        for trial in optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False):
            run_dir = trial.user_attrs.get("run_dir")
            folder = Path(run_dir).name if run_dir else f"trial_{trial.number:04d}"
            (finished if trial.state.name in FINISHED else running).append(f"trials/{name}/{folder}")
    return finished, running


def _keep(path: Path, root: Path) -> bool:
    relative = path.relative_to(root)
    return path.is_file() and path.suffix in TEXT_SUFFIXES and not set(relative.parts[:-1]) & set(WEIGHT_FOLDERS)


def pack_study(out: str | Path, archive: str | Path) -> dict[str, Any]:
    """Pack the study folder ``out`` into the gzipped tar ``archive`` (see the module docstring);
    returns what went in and what was left out."""
    out, archive = Path(out), Path(archive)
    storage = out / STORAGE
    if not storage.is_file():
        raise FileNotFoundError(f"{out}: no {STORAGE} here; is this the `out` folder of a tune spec?")
    report: dict[str, Any] = {"finished": [], "running": [], "files": 0}
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / STORAGE
        with sqlite3.connect(f"file:{storage}?mode=ro", uri=True) as source, sqlite3.connect(copy) as target:
            source.backup(target)
        finished, running = finished_trial_folders(copy)
        report["finished"], report["running"] = sorted(finished), sorted(running)
        archive.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(copy, arcname=f"{out.name}/{STORAGE}")
            started = {p.parent for stage in STAGES for p in (out / stage).rglob("config.yaml")}
            reruns = sorted(p.parent for stage in STAGES for p in (out / stage).rglob(HELDOUT))
            report["running"] += sorted(str(folder.relative_to(out)) for folder in started - set(reruns))
            folders = [out / folder for folder in finished] + reruns
            files = [out / SUMMARY, *out.glob("*.log")] + [p for folder in folders if folder.is_dir()
                                                           for p in sorted(folder.rglob("*")) if _keep(p, folder)]
            for path in files:
                if path.is_file():
                    tar.add(path, arcname=f"{out.name}/{path.relative_to(out)}")
                    report["files"] += 1
    report["bytes"] = archive.stat().st_size
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evolm_lib.tune.pack", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the study's folder (the spec's sweep.out)")
    parser.add_argument("archive", type=Path, help="the .tar.gz to write")
    args = parser.parse_args(argv)
    try:
        report = pack_study(args.out, args.archive)
    except (FileNotFoundError, sqlite3.Error) as error:
        print(f"pack: {error}", file=sys.stderr)
        return 1
    print(f"packed {report['files']} files of {len(report['finished'])} finished trials ({report['bytes'] / 2**20:.1f} MiB); "
          f"left out {len(report['running'])} unfinished (running, or failed and retried): {', '.join(report['running']) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
