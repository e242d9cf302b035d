"""A study's folder packed while its workers run, so a machine taken back loses nothing packed:
``python -m evolm_lib.tune.pack OUT ARCHIVE [--checkpoint-mib N]``.

The archive holds a consistent copy of the study's SQLite storage (taken with SQLite's backup API,
so a worker writing at that moment cannot tear it), the summary and logs, the base model's held-out
lines where ``tune.base`` wrote them (``final.BASE_HELDOUT``), and:

- the text files (rows, seed logs, settings, held-out scores) of every finished run: each trial the
  storage lists as complete or pruned, and each rerun, continued rerun and control (``final/``,
  ``long/``, ``control/``) whose held-out scores are written;
- every unfinished run's text files with its newest intact checkpoint past its start, so that a new
  machine resumes it from there (a trial's retry resumes its first attempt's folders, a rerun its
  own; a checkpoint at generation 0 holds nothing a fresh start lacks, so it never takes the budget
  from one that does), then the newest checkpoint of each finished rerun in ``final/`` whose
  continuation in ``long/`` is not finished and carries no checkpoint of its own, for it to start from;
- within what the budget leaves after those, the last checkpoint of each finished rerun the
  geometry reads (``rebuild.chosen_seeds``: the first three final seeds), so that the machine that
  measures the geometry need not rebuild it.

A checkpoint of ES on the model's own weights (``es_mode`` full or eggroll) holds no tensors: the
mean is the model's weights with the seed log's updates replayed, as a resume on the same machine
does without a snapshot. A checkpoint of a LoRA mean or of GRPO holds tensors (the adapter, the
optimizer's moments): checkpoints go in smallest first while they stay within ``checkpoint_bytes``
(what a lent machine sends back is limited), so a full-weight GRPO checkpoint never does. Snapshots and
saved models stay behind. An unfinished run whose checkpoint does not go in is left out whole and
named: on a new machine it runs again from its start in an empty folder (a trial's stale heartbeat
makes Optuna retry it with the same setting). A checkpoint's files are read once and checked
against its manifest as they go in, so a checkpoint pruned or rewritten while the pack reads it is
never carried torn: the run falls back to its previous checkpoint, or is left out.

The archive begins with an index of the runs it carries (``PACK_INDEX``), then the unfinished runs
that go on from a checkpoint, furthest first, each whole (its checkpoint, then its text files), then
the storage and the rest: a pack cut short still hands its first runs on (``tune.salvage``).

Unpack with ``tar -xzf ARCHIVE -C PARENT`` (the archive's top folder is OUT's name), then run the
same ``evolm tune`` commands: each study continues where it stopped.
"""
from __future__ import annotations

import argparse
import io
import json
import sqlite3
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..geometry import checkpoint_holds_weights
from ..runs import CHECKPOINTS, list_checkpoints, read_checkpoint_files
from ..sweep import HELDOUT
from .final import BASE_HELDOUT, STAGES, SUMMARY
from .rebuild import chosen_seeds, stage_methods
from .study import STORAGE, study_trial_folder

TEXT_SUFFIXES = (".jsonl", ".json", ".yaml", ".yml", ".txt", ".log", ".csv")
"""What a packed run folder keeps besides its checkpoint: its rows, seed log, settings and scores."""
WEIGHT_FOLDERS = (CHECKPOINTS, "snapshots", "final_model", "final_adapter", "adapter")
"""Folders of weights, left out wherever they are (a checkpoint goes in on its own terms)."""
FINISHED = ("COMPLETE", "PRUNED")
"""Trial states whose folders are finished: no retry will write into them again."""
TO_RUN = ("RUNNING", "WAITING")
"""Trial states whose folders a worker will write into again (a retry waits as WAITING)."""
PACK_INDEX = "pack_index.json"
"""A pack's first member: each run folder under ``final/``, ``long/`` and ``control/`` it carries,
with its files in the order they follow, so that a pack cut short tells which runs came whole
(``tune.salvage``)."""
CHECKPOINT_BYTES = 24 * 2**20
"""The checkpoints' bytes a pack carries at most (before compression)."""


def trial_folders(storage_file: Path) -> tuple[list[str], list[str], list[str]]:
    """(folders of finished trials, folders of trials a worker will go on with, folders of failed
    trials nobody retries) of every study in a storage file (the copy :func:`pack_study` takes), as
    ``trials/<study>/trial_NNNN``. A trial's folder is its ``run_dir`` user attribute where it
    finished, else its first attempt's (a retry resumes the folder of the trial it retries); a failed
    trial's folder belongs to its retry where it has one."""
    import optuna

    storage = f"sqlite:///{storage_file}"
    finished, to_run, failed = set(), set(), set()
    for name in optuna.get_all_study_names(storage):
        for trial in optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False):
            run_dir = trial.user_attrs.get("run_dir")
            first = trial.system_attrs.get("failed_trial", trial.number)  # Optuna's retried_trial_number
            folder = study_trial_folder(name, run_dir or f"trial_{first:04d}")
            if trial.state.name in FINISHED:
                finished.add(folder)
            elif trial.state.name in TO_RUN:
                to_run.add(folder)
            else:
                failed.add(folder)
    return sorted(finished), sorted(to_run - finished), sorted(failed - to_run - finished)


def _keep(path: Path, root: Path) -> bool:
    relative = path.relative_to(root)
    return path.is_file() and path.suffix in TEXT_SUFFIXES and not set(relative.parts[:-1]) & set(WEIGHT_FOLDERS)


@dataclass
class _Checkpoint:
    """A checkpoint folder's files as read once, each matching its manifest."""

    folder: Path
    files: dict[str, bytes]

    @property
    def bytes(self) -> int:
        return sum(len(data) for data in self.files.values())

    @property
    def generation(self) -> int:
        return checkpoint_generation(self.folder)


def checkpoint_generation(checkpoint_folder: Path) -> int:
    """The generation (or step) a checkpoint was written at, from its folder's name."""
    return int(checkpoint_folder.name.split(".")[0])


def newest_checkpoint(run_folder: Path) -> _Checkpoint | None:
    """The newest checkpoint of a run folder that reads whole (its files as bytes, each matching its
    manifest), or None."""
    for folder in reversed(list_checkpoints(run_folder)):
        files = read_checkpoint_files(folder)  # one being pruned or rewritten, or damaged, is not carried
        if files is not None:
            return _Checkpoint(folder, files)
    return None


def _newest_on_disk(run_folder: Path) -> tuple[int, int] | None:
    """(generation, bytes on disk) of a run folder's newest checkpoint, its files not read; None without one."""
    found = list_checkpoints(run_folder)
    if not found:
        return None
    return checkpoint_generation(found[-1]), sum(p.stat().st_size for p in found[-1].rglob("*") if p.is_file())


def _run_folders(folder: Path) -> list[Path]:
    """The run folders at or under ``folder`` (a trial's are its seed folders): those with a config,
    not inside a checkpoint, and not a hidden folder (a continuation's copy being made)."""
    found = (p.parent for p in folder.rglob("config.yaml"))
    return sorted(run for run in found if CHECKPOINTS not in run.relative_to(folder).parts
                  and not any(part.startswith(".") for part in run.relative_to(folder).parts))


def pack_study(out: str | Path, archive: str | Path, checkpoint_bytes: int = CHECKPOINT_BYTES) -> dict[str, Any]:
    """Pack the study folder ``out`` into the gzipped tar ``archive`` (see the module docstring);
    returns what went in and what was left out: ``finished`` trial folders, ``failed``: folders of
    failed trials nobody retries (left out, named), ``resumed``: unfinished run folders whose
    checkpoint went in (with its generation), ``continued``: finished reruns whose checkpoint went in
    for their continuation, ``left_out``: unfinished run folders, ``over_budget``: (run folder, bytes)
    of each checkpoint that did not fit within ``checkpoint_bytes``, ``files``, ``checkpoint_bytes``
    and the archive's ``bytes``."""
    out, archive = Path(out), Path(archive)
    storage = out / STORAGE
    if not storage.is_file():
        raise FileNotFoundError(f"{out}: no {STORAGE} here; is this the `out` folder of a tune spec?")
    report: dict[str, Any] = {"finished": [], "failed": [], "resumed": [], "continued": [], "solutions": [],
                              "left_out": [], "over_budget": [], "files": 0, "checkpoint_bytes": 0}
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / STORAGE
        with sqlite3.connect(f"file:{storage}?mode=ro", uri=True) as source, sqlite3.connect(copy) as target:
            source.backup(target)
        finished, to_run, failed = trial_folders(copy)
        report["finished"], report["failed"] = finished, failed
        reruns = sorted(p.parent for stage in STAGES for p in (out / stage).rglob(HELDOUT))
        trial_runs = {folder: _run_folders(out / folder) for folder in to_run}
        unfinished = [run for runs in trial_runs.values() for run in runs]
        unfinished += [run for stage in STAGES for run in _run_folders(out / stage) if run not in reruns]
        continued = [run for run in reruns if run.parent.parent == out / "final"
                     and out / "long" / run.relative_to(out / "final") not in reruns]
        chosen: dict[Path, _Checkpoint] = {}

        def take(runs: list[Path], past_start: bool = False) -> None:
            """The runs' newest intact checkpoints, smallest first while they stay within the budget (the
            model-weight ES ones hold no tensors). One over what is left is named with its size, so
            whoever packs can tell what a larger budget would carry, and never read (a full-weight GRPO
            checkpoint is gigabytes). ``past_start``: a run whose newest checkpoint is at generation 0
            is passed over, as it holds nothing a fresh start lacks."""
            on_disk = {run: found for run in runs if (found := _newest_on_disk(run)) is not None}
            for size, _, run in sorted((size, str(run), run) for run, (generation, size) in on_disk.items()
                                       if generation > 0 or not past_start):
                left = checkpoint_bytes - report["checkpoint_bytes"]
                checkpoint = newest_checkpoint(run) if size <= left else None
                if checkpoint is None:
                    if size > left:
                        report["over_budget"].append((str(run.relative_to(out)), size))
                elif checkpoint.bytes <= left:
                    chosen[run] = checkpoint
                    report["checkpoint_bytes"] += checkpoint.bytes
                else:  # its newest was torn, and the older one it falls back to is larger
                    report["over_budget"].append((str(run.relative_to(out)), checkpoint.bytes))

        # first what a run goes on from: the unfinished runs' checkpoints past their start, then the
        # finished reruns' whose continuation is not under way from a checkpoint of its own
        take(unfinished, past_start=True)
        continued = [run for run in continued if out / "long" / run.relative_to(out / "final") not in chosen]
        take(continued)
        # then, within what is left, the solutions the geometry reads (rebuild.chosen_seeds: the first
        # three final seeds), each a finished rerun's last checkpoint where that holds the weights (a
        # LoRA's or GRPO's; ES on the model's own weights keeps them in snapshots, which stay behind):
        # carried, it need not be rebuilt where the geometry is measured
        seeds = set(chosen_seeds(out, "final", stage_methods(out, "final"), None))
        take([run for run in reruns if run.parent.parent == out / "final" and run not in continued
              and run.name.removeprefix("seed").isdigit() and int(run.name.removeprefix("seed")) in seeds
              and checkpoint_holds_weights(run)])
        # The archive's order makes each of its first parts worth the most it can be (a call returns
        # only a few parts, and a machine taken back before the rest are fetched leaves a pack cut
        # short, which `tune.salvage` reads as far as it goes): the index, then each unfinished run
        # that goes on from a checkpoint, furthest first, its checkpoint then its text files (rows
        # read after the checkpoint reach it), then the storage, and then every other folder, a
        # rerun's checkpoint just before its text files.
        going_on = sorted((run for run in unfinished if run in chosen), key=lambda run: (-chosen[run].generation, str(run)))
        folders = going_on + [out / folder for folder in finished] + [run for run in reruns if run not in going_on]
        members = {folder: [p for p in sorted(folder.rglob("*")) if _keep(p, folder)] if folder.is_dir() else []
                   for folder in folders}

        def listed(folder: Path) -> list[str]:
            """The folder's files in the order they go in: its checkpoint's, then its text files."""
            checkpoint = chosen.get(folder)
            names = [checkpoint.folder / name for name in sorted(checkpoint.files)] if checkpoint else []
            return [str(path.relative_to(out)) for path in names + members[folder]]

        index = {"study": out.name, "runs": {str(folder.relative_to(out)): listed(folder) for folder in folders
                                             if folder.relative_to(out).parts[0] in STAGES}}
        archive.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive, "w:gz") as tar:

            def add_bytes(relative: Path | str, data: bytes) -> None:
                info = tarfile.TarInfo(f"{out.name}/{relative}")
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
                report["files"] += 1

            def add(path: Path) -> None:
                if path.is_file():
                    tar.add(path, arcname=f"{out.name}/{path.relative_to(out)}")
                    report["files"] += 1

            def add_folder(folder: Path) -> None:
                checkpoint = chosen.get(folder)
                if checkpoint is not None:
                    for name, data in sorted(checkpoint.files.items()):
                        add_bytes(checkpoint.folder.relative_to(out) / name, data)
                    at = f"{folder.relative_to(out)} at {checkpoint.generation}"
                    report["resumed" if folder in unfinished else "continued" if folder in continued else "solutions"].append(at)
                for path in members[folder]:
                    add(path)

            add_bytes(PACK_INDEX, json.dumps(index, indent=1).encode())
            for run in going_on:
                add_folder(run)
            tar.add(copy, arcname=f"{out.name}/{STORAGE}")
            report["files"] += 1
            for path in [out / SUMMARY, out / BASE_HELDOUT, *sorted(out.glob("*.log"))]:
                add(path)
            for folder in folders[len(going_on):]:
                add_folder(folder)
        for key in ("resumed", "continued", "solutions"):
            report[key].sort()
        left = [str(run.relative_to(out)) for run in unfinished if run not in chosen]
        # a trial folder nobody wrote into yet, or whose runs hold no config: named as the trial
        left += [folder for folder, runs in trial_runs.items() if not runs]
        report["left_out"] = sorted(left)
    report["bytes"] = archive.stat().st_size
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evolm_lib.tune.pack", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the study's folder (the spec's sweep.out)")
    parser.add_argument("archive", type=Path, help="the .tar.gz to write")
    parser.add_argument("--checkpoint-mib", type=float, default=CHECKPOINT_BYTES / 2**20,
                        help="the checkpoints' MiB the pack carries at most, before compression (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        report = pack_study(args.out, args.archive, checkpoint_bytes=int(args.checkpoint_mib * 2**20))
    except (FileNotFoundError, sqlite3.Error) as error:
        print(f"pack: {error}", file=sys.stderr)
        return 1
    print(f"packed {report['files']} files of {len(report['finished'])} finished trials ({report['bytes'] / 2**20:.1f} MiB, "
          f"checkpoints {report['checkpoint_bytes'] / 2**20:.1f} MiB of them before compression); "
          f"{len(report['resumed'])} unfinished runs go on from their checkpoints: {', '.join(report['resumed']) or 'none'}; "
          f"{len(report['continued'])} finished reruns' checkpoints for their continuations; "
          f"{len(report['solutions'])} for the geometry: {', '.join(report['solutions']) or 'none'}; "
          f"left out {len(report['left_out'])} unfinished runs, to run from their start: "
          f"{', '.join(report['left_out']) or 'none'}; failed trials left out: {', '.join(report['failed']) or 'none'}")
    if report["over_budget"]:
        sizes = [size / 2**20 for _, size in report["over_budget"]]
        print(f"{len(sizes)} checkpoints over --checkpoint-mib {args.checkpoint_mib:g} stayed behind "
              f"({min(sizes):.1f}-{max(sizes):.1f} MiB each, {sum(sizes):.1f} MiB in all): "
              f"{', '.join(sorted(run for run, _ in report['over_budget']))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
