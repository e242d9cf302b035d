"""The one writer of a folder: an exclusive OS lock (``flock``) on its lock file, held by the process
that writes the folder and dropped by the operating system when that process ends (a crash or
SIGKILL included), so no stale lock survives its holder. Readers take no lock and are never blocked.

This is the library's one direct use of ``fcntl`` (its other locks are ``filelock``'s): readers ask
who holds a folder with a shared probe of microseconds, which filelock's FileLock (exclusive only) does
not offer; the holder's name is kept in the lock file itself, read through the same descriptor; and
a child forked while a run is open closes the descriptor it inherited, so the lock stays with its
writer alone."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import json
import os
import socket
import sys
import time
import weakref
from pathlib import Path
from typing import Iterator

LOCK_FILE = ".writer.lock"


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
