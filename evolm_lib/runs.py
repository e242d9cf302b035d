"""Run folders shared by ES and GRPO runs: resolved config, metrics.jsonl, atomic checkpoints, one writer.

Layout::

    run_dir/
      config.yaml            resolved settings (kind: es | grpo)
      metrics.jsonl          one row per generation/step, appended as each finishes
      checkpoints/000012/    adapter (PEFT format), optimizer.safetensors, state.json (with that row),
                             manifest.json (size and SHA-256 of each of those files, written last)
      final_adapter/         PEFT format, loadable by vLLM and peft
      tensorboard/           with report_to: [tensorboard], the rows as event files (evolm_lib.reporting)
      .writer.lock           the writer's lock: who writes the folder now (pid, host, since when)

One process writes a run folder at a time: the run that opens it holds an exclusive OS lock
(``flock``) on .writer.lock until it is closed, and the operating system drops the lock when the
process ends, a crash or SIGKILL included, so no stale lock survives its holder. A second writer
fails at open with ``RunFolderBusy``, naming the holder. Readers (analysis, summaries, notebook 04)
take no lock and are never blocked.

A checkpoint is written to a temporary folder, fsynced, and renamed into place, so a kill at any
moment leaves either the previous checkpoint or the new one, never half of one. Rewriting an existing
checkpoint (after a resume from an older one) renames the old folder aside first, renames the new one
in, then deletes the old: a kill between the steps still leaves one loadable copy.

A resume verifies the latest checkpoint against its manifest (one written before manifests existed
must load instead). A damaged one (a truncated, changed or missing file, as a partial copy between
machines or a failing disk leaves) is renamed aside to checkpoints/NNNNNN.damaged, never deleted;
the run falls back to the newest intact checkpoint with a warning that says what was wrong, and the
metrics rows past it move to metrics.after-NNNNNN.jsonl. Leftover temporary folders of an
interrupted write are removed on that resume.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import hashlib
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import yaml
from safetensors.torch import load_file, save_file

from .config import ConfigError, config_class
from .lora import AdapterWeights, load_adapter, save_adapter
from .paths import project_root

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"  # in a checkpoint: {"files": {relative path: {"bytes": n, "sha256": hex}}}
CHECKPOINT_FORMAT = 2  # state.json's "checkpoint_format": 2 = written with a manifest (none: written before)
DAMAGED = ".damaged"  # suffix of a checkpoint folder that failed its check, renamed aside
LOCK_FILE = ".writer.lock"
NOTEBOOK_RUNS_ENV = "EVOLM_NOTEBOOK_RUNS"  # the folder of the notebooks' default run folders (tests set it)


# --- the folder and its one writer ------------------------------------------------------------


class RunFolderExists(FileExistsError):
    """A run folder already holds a run and overwriting was not asked for."""


class RunFolderBusy(RuntimeError):
    """Another writer holds the folder: another process, or a run still open in this one."""

    def __init__(self, folder: Path, holder: dict, this_process: bool):
        self.folder, self.holder = Path(folder), holder
        if this_process:
            message = (f"{folder} is already open for writing in this process (since {holder.get('since', '?')}): "
                       "close that run first (run.close()), or restart the kernel")
        else:
            message = (f"{folder} is being written by {describe_holder(holder)}: wait until it finishes "
                       "or stop it, or use another folder")
        super().__init__(message)


def describe_holder(holder: dict) -> str:
    """A lock holder in words: process, host, since when, and its command line."""
    if not holder.get("pid"):
        return "another process (starting: it has not written its name yet)"
    return (f"process {holder['pid']} on {holder.get('host', '?')} since {holder.get('since', '?')}"
            f" ({holder.get('command') or '?'})")


_HELD: dict[tuple[int, int], "weakref.ref[WriterLock]"] = {}  # this process's locks, by lock file (device, inode)


class WriterLock:
    """The one-writer lock of a folder: an exclusive ``flock`` on its lock file, held until
    ``release()``, until the object is collected, or until the process ends (crash and SIGKILL
    included: the operating system drops the lock with the process)."""

    def __init__(self, folder: Path, path: Path, descriptor: int):
        self.folder, self.path, self._descriptor = folder, path, descriptor
        stat = os.fstat(descriptor)
        self._key = (stat.st_dev, stat.st_ino)

    @classmethod
    def acquire(cls, folder: str | Path, *, create: bool = True, lock_file: str | Path | None = None) -> "WriterLock":
        """Take the folder's lock (``lock_file``, default folder/.writer.lock) and write the holder into
        it; ``RunFolderBusy`` when another writer has it. ``create``: make a missing folder."""
        folder = Path(folder)
        path = Path(lock_file) if lock_file is not None else folder / LOCK_FILE
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        elif not folder.is_dir():
            raise FileNotFoundError(f"{folder} does not exist")
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            if not _flock(descriptor, fcntl.LOCK_EX):
                stat = os.fstat(descriptor)
                if _held_here(stat):
                    gc.collect()  # a run dropped but not yet collected (a reference cycle) still holds it
                if not _flock(descriptor, fcntl.LOCK_EX):
                    raise RunFolderBusy(folder, _read_holder(descriptor), _held_here(stat))
            holder = {"pid": os.getpid(), "host": socket.gethostname(),
                      "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)[:300]}
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, (json.dumps(holder) + "\n").encode(), 0)
        except BaseException:
            os.close(descriptor)
            raise
        lock = cls(folder, path, descriptor)
        _HELD[lock._key] = weakref.ref(lock)
        return lock

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._descriptor is not None

    def release(self) -> None:
        """Give the lock up (the file stays: deleting it would let two writers lock two files)."""
        if self._descriptor is None:
            return
        descriptor, self._descriptor = self._descriptor, None
        _HELD.pop(self._key, None)
        try:
            os.ftruncate(descriptor, 0)  # no holder named while none holds it
        finally:
            os.close(descriptor)  # closing the last descriptor drops the flock

    @contextlib.contextmanager
    def released_on_error(self) -> Iterator["WriterLock"]:
        """Keep the lock for what the block opens, but give it up if the block fails."""
        try:
            yield self
        except BaseException:
            self.release()
            raise

    def __del__(self):
        # a run dropped without close(): closing the descriptor drops the lock (no cleanup of the
        # file's text here: at interpreter exit the modules it would need may be gone)
        descriptor, self._descriptor = getattr(self, "_descriptor", None), None
        if descriptor is not None:
            with contextlib.suppress(OSError, TypeError):
                os.close(descriptor)

    def __enter__(self) -> "WriterLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _flock(descriptor: int, operation: int, attempts: int = 25) -> bool:
    """Try a non-blocking flock a few times over ~0.25 s: a reader's probe holds a shared lock for
    microseconds, which must not turn a free folder into a busy one."""
    for attempt in range(attempts):
        try:
            fcntl.flock(descriptor, operation | fcntl.LOCK_NB)
            return True
        except OSError as error:
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        if attempt + 1 < attempts:
            time.sleep(0.01)
    return False


def _held_here(stat: os.stat_result) -> bool:
    """Whether a live WriterLock of this process holds this lock file."""
    ref = _HELD.get((stat.st_dev, stat.st_ino))
    return ref is not None and ref() is not None and ref().held


def _read_holder(descriptor: int) -> dict:
    try:
        return json.loads(os.pread(descriptor, 4096, 0).decode() or "{}")
    except ValueError:
        return {}


def lock_holder(folder: str | Path, lock_file: str | Path | None = None) -> dict | None:
    """Who writes the folder now: {pid, host, since, command}, or None when no writer holds its lock.

    For readers: it takes no lock that a writer would wait for (a shared probe of microseconds)."""
    path = Path(lock_file) if lock_file is not None else Path(folder) / LOCK_FILE
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        if _flock(descriptor, fcntl.LOCK_SH, attempts=1):
            return None  # closing the descriptor drops the probe's shared lock
        return _read_holder(descriptor)
    finally:
        os.close(descriptor)


def _forget_inherited_locks() -> None:
    # A child forked while a run is open (an engine worker) inherits the lock's descriptor; closing
    # it in the child keeps the lock with the parent alone, so the parent's death frees the folder.
    for ref in list(_HELD.values()):
        lock = ref()
        if lock is not None and lock._descriptor is not None:
            os.close(lock._descriptor)
            lock._descriptor = None
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_inherited_locks)


def notebook_run_dir(name: str) -> Path:
    """A notebook's default run folder: runs/notebooks/<name> in the project, or <name> under the
    folder that the environment variable EVOLM_NOTEBOOK_RUNS names (the tests' nbval run sets it, so
    it never writes into the run a user has open in JupyterLab)."""
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


# --- metrics.jsonl ---------------------------------------------------------------------------


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf: store them as null so every line stays valid JSON.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _clean(value.tolist())
    return value


def append_metrics(run_dir: Path, row: dict) -> None:
    """Append one row to metrics.jsonl and flush it to disk."""
    with open(Path(run_dir) / "metrics.jsonl", "a") as handle:
        handle.write(json.dumps(_clean(row)) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_metrics(run_dir: str | Path) -> list[dict]:
    """All rows of a run's metrics.jsonl (a torn last line from a kill is skipped)."""
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


def read_jsonl(path: str | Path) -> list[dict]:
    """Every JSON line of an append-only log (none if the file is missing); a line torn by a kill
    mid-write is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def read_checkpoint_kls(run_dir: str | Path) -> list[dict]:
    """The rows of a run's kl.jsonl (``generation``, ``policy/kl``: KL to the base model of each
    measured checkpoint, written by ``evolm sweep``), by generation; [] when none was measured."""
    path = Path(run_dir) / "kl.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return sorted(rows, key=lambda r: r["generation"])


def rewrite_metrics(run_dir: Path, rows: Iterable[dict]) -> None:
    """Replace metrics.jsonl atomically (used on resume to drop rows past the checkpoint)."""
    run_dir = Path(run_dir)
    tmp = run_dir / ".metrics.jsonl.tmp"
    with open(tmp, "w") as handle:
        handle.write("".join(json.dumps(_clean(r)) + "\n" for r in rows))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, run_dir / "metrics.jsonl")
    _fsync_dir(run_dir)


# --- checkpoints -------------------------------------------------------------------------------


class CheckpointDamaged(RuntimeError):
    """No checkpoint of a run folder is intact: the run cannot be resumed."""


class CheckpointFallback(UserWarning):
    """The latest checkpoint was damaged: the run resumes from an older one."""


def _fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and the folders themselves, so a rename publishes durable data."""
    for folder, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(Path(folder))


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


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
) -> Path:
    """Write checkpoint ``step`` atomically and durably, its manifest last, and prune older ones beyond ``keep``."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{step:06d}"
    _remove_leftovers(run_dir)  # of a killed writer (one writer per run: nobody else writes them)
    tmp = Path(tempfile.mkdtemp(prefix=f".{step:06d}-", dir=root))
    if adapter is not None:  # None: the run moves the model's own weights (its snapshots hold them)
        save_adapter(adapter, tmp / "adapter", base_model=base_model)
    if optimizer_tensors:
        save_file({k: v.contiguous() for k, v in optimizer_tensors.items()}, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps(_clean({**state, "checkpoint_format": CHECKPOINT_FORMAT})))
    _write_manifest(tmp)
    _fsync_tree(tmp)
    aside = root / f"{step:06d}{_ASIDE}"
    if final.exists():  # re-written after a resume from an older checkpoint
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(tmp, final)
    _fsync_dir(root)
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
            if file.stat().st_size != entry["bytes"]:
                return f"{name} has {file.stat().st_size} bytes, its manifest says {entry['bytes']}"
            if _sha256(file) != entry["sha256"]:
                return f"{name} differs from its manifest's SHA-256"
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


def _free_name(folder: Path, stem: str, suffix: str = "") -> Path:
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
            target = _free_name(bad.parent, bad.name + DAMAGED)
            os.rename(bad, target)
            moved.append(target.name)
        rows = read_metrics(run_dir)
        beyond = [r for r in rows if r.get("generation", -1) > generation]
        kept = ""
        if beyond:
            side = _free_name(run_dir, f"metrics.after-{generation:06d}", ".jsonl")
            with open(side, "w") as handle:  # on disk before the rows leave metrics.jsonl
                handle.write("".join(json.dumps(_clean(r)) + "\n" for r in beyond))
                handle.flush()
                os.fsync(handle.fileno())
            rewrite_metrics(run_dir, [r for r in rows if r.get("generation", -1) <= generation])
            kept = f"; the metrics rows past generation {generation} are kept in {side.name}"
        what = "; ".join(f"{bad.name}: {problem}" for bad, problem in damaged)
        warnings.warn(f"{run_dir}: damaged checkpoint ({what}) renamed aside to {CHECKPOINTS}/{', '.join(moved)}; "
                      f"resuming from checkpoint {path.name} (generation {generation}){kept}",
                      CheckpointFallback, stacklevel=3)
    return path


# --- settings and resuming ---------------------------------------------------------------------


# Settings that do not change the science: a finished run may be extended with other values.
# Where the engines run and how adapters reach them do not change the rows either (tested equal),
# nor where else the rows are streamed (report_to: a run gains TensorBoard with all its rows so far).
EXTENDABLE = frozenset({"num_generations", "num_steps", "eval_every", "checkpoint_every", "keep_checkpoints",
                        "evaluator", "num_engines", "ray_address", "adapter_transfer", "score_in_population",
                        "report_to"})


def write_run_config(run_dir: str | Path, config, kind: str) -> None:
    """config.yaml: the resolved settings plus the run's kind (es | grpo)."""
    (Path(run_dir) / "config.yaml").write_text(yaml.safe_dump({"kind": kind, **config.to_dict()}, sort_keys=False))


def read_config_kind(run_dir: str | Path) -> str:
    """'es' or 'grpo', from a run folder's config.yaml."""
    data = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    return data.get("kind", "es")


def load_run_config(run_dir: str | Path, cls=None):
    """The settings a run folder was created with (``cls``: the config class; default from its kind)."""
    data = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    kind = data.pop("kind", "es")
    data.pop("label", None)  # a display label for analysis, not a setting
    if kind == "es" and "noise_scheme" not in data:
        data["noise_scheme"] = "per_tensor"  # runs recorded before the setting existed drew noise tensor by tensor
    return (cls or config_class(kind)).from_dict(data)


def extended_settings(run_dir: str | Path, config) -> list[str]:
    """The settings ``config`` changes in the run that ``run_dir`` holds, all of them ``EXTENDABLE``
    (a larger budget, another cadence: the run may continue with them); ``ConfigError`` naming the
    others, which would make a different run."""
    existing = load_run_config(run_dir, type(config)).to_dict()
    changed = sorted(k for k, v in config.to_dict().items() if existing.get(k) != v)
    fixed = [k for k in changed if k not in EXTENDABLE]
    if fixed:
        hint = ("; it was made before noise_scheme existed and draws noise per tensor: pass "
                "noise_scheme='per_tensor' to continue it" if "noise_scheme" in fixed
                and existing.get("noise_scheme") == "per_tensor" else "")
        if "deterministic" in fixed and existing.get("deterministic"):
            hint += ("; it ran with deterministic decoding, and continuing it without would give rows an "
                     "uninterrupted run cannot: pass deterministic=True")
        raise ConfigError(f"{run_dir} holds a run with other settings ({', '.join(fixed)}); "
                          f"use another run_dir or overwrite=True{hint}")
    return changed


@dataclass(frozen=True)
class RunState:
    """What a run is built from: a new run's settings and first adapter, or what its latest checkpoint holds."""

    config: Any
    """The run's settings (ESConfig or GRPOConfig)."""
    adapter: AdapterWeights | None
    """The adapter the run moves (the ES mean, the GRPO policy); None when it moves the model's own weights."""
    optimizer_tensors: dict[str, torch.Tensor] | None = None
    """The optimizer's state as named tensors; None: a fresh optimizer."""
    generation: int = 0
    """Generations (ES) or steps (GRPO) done."""
    counters: dict = field(default_factory=dict)
    """Sample counters and wall clock (completions, tokens, eval_completions, wall_s)."""
    rows: list[dict] = field(default_factory=list)
    """The metrics rows so far, as metrics.jsonl now holds them."""
    saved: dict = field(default_factory=dict)
    """The checkpoint's state.json ({} for a new run): what the run kinds keep beyond the loop's."""

    def pending_row(self) -> dict | None:
        """A checkpoint of the earlier layout whose row waited for its scores (they rode in the next
        engine call) and never reached metrics.jsonl: the row, to be scored again on resume; else None."""
        logged = bool(self.rows) and self.rows[-1].get("generation") == self.generation
        return dict(self.saved["row"]) if self.saved.get("scores_pending") and not logged else None


def load_latest(run_dir: str | Path, kind: str, cls) -> RunState:
    """The state of a run folder's latest intact checkpoint (``kind``: es | grpo; ``cls``: its config
    class; a damaged newer one is set aside: ``latest_intact_checkpoint``).

    metrics.jsonl is made to match it: rows past the checkpoint come from a generation whose
    checkpoint never landed and are dropped (that generation reruns); a row lost between
    checkpoint and log comes back from state.json (or, in a folder of the earlier layout whose row
    waited for its scores, is scored again: ``RunState.pending_row``)."""
    run_dir = Path(run_dir)
    found = read_config_kind(run_dir)
    if found != kind:
        raise ConfigError(f"{run_dir} holds a {found!r} run, not a {kind.upper()} run")
    config = load_run_config(run_dir, cls)
    adapter, optimizer_tensors, state = load_checkpoint(latest_intact_checkpoint(run_dir))
    if adapter is not None and adapter.spec != config.lora_spec():
        raise ConfigError(f"checkpoint adapter {adapter.spec} does not match config {config.lora_spec()}")
    generation = int(state["generation"])
    rows = [r for r in read_metrics(run_dir) if r.get("generation", -1) <= generation]
    if (not rows or rows[-1].get("generation") != generation) and not state.get("scores_pending"):
        rows.append(state["row"])
    rewrite_metrics(run_dir, rows)
    return RunState(config=config, adapter=adapter, optimizer_tensors=optimizer_tensors, generation=generation,
                    counters=dict(state["counters"]), rows=rows, saved=state)


@contextlib.contextmanager
def timed(clock: dict[str, float], key: str) -> Iterator[None]:
    """Add the block's elapsed seconds to ``clock[key]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        clock[key] = clock.get(key, 0.0) + time.perf_counter() - start
