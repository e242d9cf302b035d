"""Checkpoints of a run folder: written atomically and durably with a manifest (size and SHA-256 of each
file), verified on resume, a damaged one renamed aside (never deleted) and the run resumed from the
newest intact one."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file

from ..lora import AdapterWeights, load_adapter, save_adapter
from .durable import fsync_dir, fsync_tree, json_safe, naming
from .metrics_file import MISSING, read_metrics, rewrite_metrics, row_generation, rows_since

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"  # in a checkpoint: {"files": {relative path: {"bytes": n, "sha256": hex}}}
CHECKPOINT_FORMAT = 2  # state.json's "checkpoint_format": 2 = written with a manifest (none: written before)
CONFIG_COPY = "config_yaml"  # in state.json: the text of the run folder's config.yaml when the checkpoint was written
ROWS = "rows"  # in state.json: the metrics rows since the checkpoint before it (its own row is "row")
DAMAGED = ".damaged"  # suffix of a checkpoint folder that failed its check, renamed aside


class CheckpointDamaged(RuntimeError):
    """No checkpoint of a run folder is intact: the run cannot be resumed."""


class CheckpointFallback(UserWarning):
    """The latest checkpoint was damaged: the run resumes from an older one."""


_ASIDE = ".old"  # suffix of a checkpoint renamed aside while its replacement is renamed in


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(folder: Path) -> None:
    """manifest.json: size and SHA-256 of every other file of a checkpoint folder."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps({"files": entries}, indent=1) + "\n")


def write_checkpoint(
    run_dir: Path,
    step: int,
    adapter: AdapterWeights | None,
    optimizer_tensors: dict[str, torch.Tensor],
    state: dict,
    base_model: str,
    keep: int = 2,
    rows: Sequence[dict] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically and durably, its manifest last, and prune older ones beyond ``keep``.

    Beside ``state`` its state.json keeps a copy of config.yaml and the metrics rows since the
    checkpoint before it, so a damaged config.yaml or metrics line can be restored from it:
    ``rows``, the run's rows so far as the run holds them (None: read back from metrics.jsonl)."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{step:06d}"
    _remove_leftovers(run_dir)  # of a killed writer (one writer per run: nobody else writes them)
    tmp = Path(tempfile.mkdtemp(prefix=f".{step:06d}-", dir=root))
    if adapter is not None:  # None: the run moves the model's own weights (its snapshots hold them)
        with naming(tmp / "adapter"):
            save_adapter(adapter, tmp / "adapter", base_model=base_model)
    if optimizer_tensors:
        with naming(tmp / "optimizer.safetensors"):
            save_file({k: v.contiguous() for k, v in optimizer_tensors.items()}, str(tmp / "optimizer.safetensors"))
    earlier = [int(p.name.removesuffix(_ASIDE)) for p in list_checkpoints(run_dir)]
    previous = max([g for g in earlier if g < step], default=-1)
    since = rows_since(run_dir, previous) if rows is None else [
        r for r in rows if row_generation(r) > previous and not r.get(MISSING)]
    kept = {ROWS: [r for r in since if r["generation"] < step]}
    config = Path(run_dir) / "config.yaml"
    if config.is_file():
        kept[CONFIG_COPY] = config.read_text(errors="replace")
    with naming(tmp / "state.json"):
        (tmp / "state.json").write_text(json.dumps(json_safe({**state, **kept, "checkpoint_format": CHECKPOINT_FORMAT})))
    with naming(tmp / MANIFEST):
        _write_manifest(tmp)
    fsync_tree(tmp)
    aside = root / f"{step:06d}{_ASIDE}"
    if final.exists():  # re-written after a resume from an older checkpoint
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_dir(root)
    shutil.rmtree(aside, ignore_errors=True)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _remove_leftovers(run_dir: Path) -> None:
    """Remove what an interrupted write leaves: temporary checkpoint folders, a half-written metrics copy."""
    root = Path(run_dir) / CHECKPOINTS
    for stale in root.glob(".[0-9]*-*") if root.exists() else ():
        shutil.rmtree(stale, ignore_errors=True)
    (Path(run_dir) / ".metrics.jsonl.tmp").unlink(missing_ok=True)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint folders, oldest first (a copy renamed aside stands in while its replacement is
    missing); whether each is intact is ``verify_checkpoint``'s to say."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.exists():
        return []
    found: dict[int, Path] = {}
    for path in root.iterdir():
        name = path.name.removesuffix(_ASIDE)
        written = (path / "state.json").exists() or (path / MANIFEST).exists()
        if not (path.is_dir() and name.isdigit() and written):
            continue
        if path.name == name or int(name) not in found:  # the renamed-in copy wins over the aside one
            found[int(name)] = path
    return [found[step] for step in sorted(found)]


def load_checkpoint(path: Path) -> tuple[AdapterWeights | None, dict[str, torch.Tensor], dict]:
    """(adapter or None where the run moves no adapter, optimizer tensors, state) of one checkpoint folder."""
    optimizer_path = path / "optimizer.safetensors"
    optimizer = load_file(str(optimizer_path)) if optimizer_path.exists() else {}
    adapter = load_adapter(path / "adapter") if (path / "adapter").exists() else None
    return adapter, optimizer, json.loads((path / "state.json").read_text())


def _mismatch(name: str, entry: dict, size: int, sha256) -> str | None:
    """What differs between a checkpoint file and its manifest entry, in words, or None;
    ``sha256()`` is asked only when the size matches."""
    if size != entry["bytes"]:
        return f"{name} has {size} bytes, its manifest says {entry['bytes']}"
    if sha256() != entry["sha256"]:
        return f"{name} differs from its manifest's SHA-256"
    return None


def read_checkpoint_files(path: Path) -> dict[str, bytes] | None:
    """Every file of a checkpoint with a manifest, the manifest included, each read once and checked
    against it (a copy taken while the run writes: what is read is what was checked); None when the
    manifest is missing or unreadable, or a file is missing or differs from it."""
    path = Path(path)
    try:
        manifest = (path / MANIFEST).read_bytes()
        files = {MANIFEST: manifest}
        for name, entry in json.loads(manifest)["files"].items():
            data = (path / name).read_bytes()
            if _mismatch(name, entry, len(data), lambda: hashlib.sha256(data).hexdigest()) is not None:
                return None
            files[name] = data
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return files


def verify_checkpoint(path: Path) -> str | None:
    """What is wrong with a checkpoint folder, in words, or None when it is intact: every file of its
    manifest present with its size and SHA-256. One written before manifests existed (no manifest,
    no ``checkpoint_format`` in state.json) is intact when it loads."""
    path = Path(path)
    if (path / MANIFEST).exists():
        try:
            files = json.loads((path / MANIFEST).read_text())["files"]
        except (ValueError, KeyError, TypeError):
            return f"{MANIFEST} is unreadable"
        for name, entry in files.items():
            file = path / name
            if not file.is_file():
                return f"{name} is missing"
            problem = _mismatch(name, entry, file.stat().st_size, lambda: _sha256(file))
            if problem is not None:
                return problem
        return None
    try:
        state = json.loads((path / "state.json").read_text())
    except FileNotFoundError:
        return f"state.json and {MANIFEST} are missing"
    except ValueError:
        return "state.json is unreadable"
    if state.get("checkpoint_format", 1) >= CHECKPOINT_FORMAT:
        return f"{MANIFEST} is missing"
    try:  # written before manifests: intact if it loads
        load_checkpoint(path)
    except Exception as error:  # noqa: BLE001 - any failure to load is the damage to report
        return f"it does not load ({type(error).__name__}: {error})"
    return None


def free_name(folder: Path, stem: str, suffix: str = "") -> Path:
    """folder/stem+suffix, or stem-2+suffix, stem-3+suffix, ... when that name is taken (nothing is overwritten)."""
    candidate, number = folder / f"{stem}{suffix}", 1
    while candidate.exists():
        number += 1
        candidate = folder / f"{stem}-{number}{suffix}"
    return candidate


def latest_intact_checkpoint(run_dir: str | Path) -> Path:
    """The newest intact checkpoint of a run folder, after leftovers of an interrupted write are removed.

    Damaged newer ones are renamed aside (``NNNNNN.damaged``), never deleted, the metrics rows past
    the intact one move to metrics.after-NNNNNN.jsonl, and a ``CheckpointFallback`` warning says what
    was wrong. With none intact, ``CheckpointDamaged`` names the folder and what was found, and
    nothing is moved. Only the folder's writer calls this (it renames and rewrites)."""
    run_dir = Path(run_dir)
    _remove_leftovers(run_dir)
    checkpoints = list_checkpoints(run_dir)
    if not checkpoints:
        raise FileNotFoundError(f"{run_dir} holds no checkpoint to resume from")
    damaged: list[tuple[Path, str]] = []
    for path in reversed(checkpoints):
        problem = verify_checkpoint(path)
        if problem is None:
            break
        damaged.append((path, problem))
    else:
        found = "; ".join(f"{path.name}: {problem}" for path, problem in damaged)
        raise CheckpointDamaged(f"{run_dir} holds no intact checkpoint to resume from ({found}); nothing was "
                                f"moved: restore the checkpoints/ folder from a copy, or start the run again")
    if damaged:
        generation = int(json.loads((path / "state.json").read_text())["generation"])
        moved = []
        for bad, _ in damaged:
            target = free_name(bad.parent, bad.name + DAMAGED)
            os.rename(bad, target)
            moved.append(target.name)
        rows = read_metrics(run_dir)
        beyond = [r for r in rows if row_generation(r) > generation]
        kept = ""
        if beyond:
            side = free_name(run_dir, f"metrics.after-{generation:06d}", ".jsonl")
            with naming(side), open(side, "w") as handle:  # on disk before the rows leave metrics.jsonl
                handle.write("".join(json.dumps(json_safe(r)) + "\n" for r in beyond))
                handle.flush()
                os.fsync(handle.fileno())
            rewrite_metrics(run_dir, [r for r in rows if row_generation(r) <= generation])
            kept = f"; the metrics rows past generation {generation} are kept in {side.name}"
        what = "; ".join(f"{bad.name}: {problem}" for bad, problem in damaged)
        warnings.warn(f"{run_dir}: damaged checkpoint ({what}) renamed aside to {CHECKPOINTS}/{', '.join(moved)}; "
                      f"resuming from checkpoint {path.name} (generation {generation}){kept}",
                      CheckpointFallback, stacklevel=3)
    return path
