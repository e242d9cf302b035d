"""Runs a kept pack hands on to a study about to be restored, even where the pack was cut short:
``python -m evolm_lib.tune.salvage STUDY KEPT...``.

A lent machine taken back between two calls keeps what its workers did since the last pack that came
back whole; but each call returns a pack's first parts (``gpu_tune_study.sh pack``), and a pack
begins with its index and the runs under way, furthest first, each whole (``tune.pack``). So the
parts of a pack that did come back hold those runs' newest checkpoints and rows, and a kept pack
from an earlier lease may hold checkpoints that a study restored from its compacted files lacks
(a LoRA's or GRPO's tensors, which ``tune.compact`` does not keep).

Each KEPT is a folder of one pack's parts (``tune_study.tar.gz.part-NN``, as
``gpu_stage_study.sh keep`` stores a reply), read from its first part for as far as it goes. A run
folder under ``final/``, ``long/`` or ``control/`` is taken from it only where every file the
pack's index lists for it came whole (a pack packed before the index existed: where the pack read
whole to its end), its settings are the study's run's where the study has it, its checkpoint (if
any) matches its manifest, and it is further on than the study's own:

- finished (scored on the held-out problems) where the study's is not, or finished in both where
  only the pack's holds a checkpoint (its continuation then goes on from there);
- unfinished in both (or absent in the study), with a newer checkpoint than the study's.

A taken run replaces the study's folder whole (moved aside first, then removed); nothing else of the
study changes, and trials are never taken (their folders belong to the storage's trials). What was
taken, and why anything else was not, is printed and returned.
"""
from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tarfile
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Sequence

from ..runs import list_checkpoints, read_checkpoint_files
from .final import STAGES, finished_rerun
from .pack import PACK_INDEX, checkpoint_generation

PARTS = "tune_study.tar.gz.part-*"
"""A kept pack's parts in its folder."""


class _Joined(io.RawIOBase):
    """The parts of a split file read one after another as one stream."""

    def __init__(self, parts: Sequence[Path]):
        self._parts, self._file = list(parts), None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while True:
            if self._file is None:
                if not self._parts:
                    return 0
                self._file = open(self._parts.pop(0), "rb")
            read = self._file.readinto(buffer)
            if read:
                return read
            self._file.close()
            self._file = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        super().close()


@dataclass
class PackRead:
    """What a pack held as far as it read: its study's name, each run folder's files that came whole
    (``runs``: run -> relative path -> bytes), the index's files for each run (None: no index), and
    whether it read to its end."""

    study: str | None = None
    runs: dict[str, dict[str, bytes]] = field(default_factory=dict)
    index: dict[str, list[str]] | None = None
    whole: bool = False


def _run_of(relative: PurePosixPath) -> str | None:
    """The run folder (stage/method/seedN) a path under final/, long/ or control/ belongs to."""
    return "/".join(relative.parts[:3]) if len(relative.parts) > 3 and relative.parts[0] in STAGES else None


def read_pack(parts: Sequence[Path]) -> PackRead:
    """The runs a pack's parts hold whole, read from the first part on until the data stops (a part
    missing or cut short ends it; what was read whole before stays)."""
    read = PackRead()
    try:
        with tarfile.open(fileobj=io.BufferedReader(_Joined(parts)), mode="r|gz") as tar:
            for member in tar:
                name = PurePosixPath(member.name)
                if not member.isfile() or len(name.parts) < 2 or ".." in name.parts:
                    continue
                if read.study is None:
                    read.study = name.parts[0]
                relative = PurePosixPath(*name.parts[1:])
                handle = tar.extractfile(member)
                data = handle.read() if handle is not None else b""
                if len(data) != member.size:
                    break
                if str(relative) == PACK_INDEX:
                    read.index = json.loads(data)["runs"]
                elif (run := _run_of(relative)) is not None:
                    read.runs.setdefault(run, {})[str(relative)] = data
            else:
                read.whole = True
    except (tarfile.TarError, EOFError, zlib.error, OSError, ValueError):
        pass  # cut short: what came whole before this point stands
    return read


def whole_runs(read: PackRead) -> dict[str, dict[str, bytes]]:
    """The runs of a pack all of whose files came: those the index lists, each file present; without
    an index, every run of a pack read to its end."""
    if read.index is None:
        return read.runs if read.whole else {}
    return {run: read.runs[run] for run, files in read.index.items()
            if run in read.runs and set(files) <= set(read.runs[run])}


def _newest_generation(folder: Path) -> int:
    found = list_checkpoints(folder)
    return checkpoint_generation(found[-1]) if found else -1


def _why_not(study: Path, run: str, files: dict[str, bytes], staged: Path) -> str | None:
    """Why the pack's run (written out at ``staged``) is not taken over the study's, or None to take it."""
    own = study / run
    if "config.yaml" not in {PurePosixPath(name).name for name in files}:
        return "no config.yaml"
    if (own / "config.yaml").is_file() and (own / "config.yaml").read_bytes() != (staged / "config.yaml").read_bytes():
        return "its settings differ from the study's run"
    checkpoints = list_checkpoints(staged)
    if checkpoints and read_checkpoint_files(checkpoints[-1]) is None:
        return "its checkpoint does not match its manifest"
    generation = checkpoint_generation(checkpoints[-1]) if checkpoints else -1
    finished, own_finished = finished_rerun(staged), own.is_dir() and finished_rerun(own)
    if own_finished:
        if finished and generation >= 0 and _newest_generation(own) < 0:
            return None
        return "finished here already"
    if finished:
        return None
    if generation < 0:
        return "unfinished, with no checkpoint"
    if generation <= _newest_generation(own):
        return f"its checkpoint ({generation}) is not newer than the study's ({_newest_generation(own)})"
    return None


def salvage(study: str | Path, kept: str | Path, log=print) -> list[str]:
    """Lay the runs of the pack kept in folder ``kept`` over the study folder ``study`` where they are
    further on (see the module docstring); returns the runs taken, and logs each run's outcome."""
    study, kept = Path(study), Path(kept)
    parts = sorted(kept.glob(PARTS))
    if not parts:
        log(f"{kept}: no {PARTS}")
        return []
    # the parts from 00 up to the first one missing: data after a gap would be read out of place
    numbers = [int(part.name.rsplit("-", 1)[1]) for part in parts]
    gap = next((i for i, number in enumerate(numbers) if number != i), len(parts))
    if gap < len(parts):
        log(f"{kept}: part {gap:02d} missing: read up to it")
        parts = parts[:gap]
    read = read_pack(parts)
    if read.study is not None and read.study != study.name:
        log(f"{kept}: a pack of the study {read.study!r}, not {study.name!r}: nothing taken")
        return []
    runs = whole_runs(read)
    state = "whole" if read.whole else "cut short"
    if read.index is None and not read.whole:
        log(f"{kept}: {len(parts)} parts, cut short, and packed without an index: nothing can be told whole")
    taken = []
    for run, files in sorted(runs.items()):
        with tempfile.TemporaryDirectory(dir=study, prefix=".salvaging-") as tmp:
            staged = Path(tmp) / "run"
            for name, data in files.items():
                path = Path(tmp) / "run" / PurePosixPath(name).relative_to(run)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            why = _why_not(study, run, files, staged)
            if why is not None:
                log(f"{kept.name}: {run} left: {why}")
                continue
            own = study / run
            aside = own.with_name(f".{own.name}.replaced")
            shutil.rmtree(aside, ignore_errors=True)  # one a killed salvage left
            if own.exists():
                own.rename(aside)
            own.parent.mkdir(parents=True, exist_ok=True)
            staged.rename(own)
            shutil.rmtree(aside, ignore_errors=True)
        generation = _newest_generation(own)
        taken.append(run)
        log(f"{kept.name}: {run} taken ({'finished' if finished_rerun(own) else 'under way'}"
            f"{f', checkpoint {generation}' if generation >= 0 else ''})")
    log(f"{kept.name}: {len(parts)} parts, {state}; runs whole: {len(runs)}, taken: {len(taken)}")
    return taken


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evolm_lib.tune.salvage", description=__doc__.split("\n\n")[0])
    parser.add_argument("study", type=Path, help="the study folder to lay the runs over (restored, or unpacked)")
    parser.add_argument("kept", type=Path, nargs="+", help="folders of kept packs' parts, applied in this order")
    args = parser.parse_args(argv)
    if not args.study.is_dir():
        print(f"salvage: {args.study}: no such study folder", file=sys.stderr)
        return 1
    taken = [run for kept in args.kept for run in salvage(args.study, kept)]
    print(f"salvaged {len(taken)} runs into {args.study}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
