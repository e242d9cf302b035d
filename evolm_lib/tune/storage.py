"""The studies' storage, shared by every worker: the SQLite file OUT/optuna.db by default, a database
URL, or Optuna's journal file (``journal:PATH``).

Its calls run with Ctrl-C and SIGTERM held until they return (``stop_signals_held``): a storage call
cut in the middle leaves its connection holding the database's lock (or SQLAlchemy a lock of its
own), and the worker's next write, the one that fails the cut trial and queues its retry, then waits
for it until SQLite's timeout, or for ever. The stop acts as soon as the call returns.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import sqlite3
import sys
import warnings
from pathlib import Path

from ..stop_signals import stop_signals_held
from .spec import TuneSpec

STORAGE = "optuna.db"
JOURNAL = "journal:"
"""The prefix of ``--storage`` for Optuna's journal file storage (``journal:PATH``)."""


def held(path: str | Path, what: str):
    """An exclusive ``filelock`` on ``path`` held for ``what``; a worker that waits for it more than a
    few seconds says so once (the holder is another live process: the OS frees the lock of a killed
    one, and a stopped one holds it until it is continued)."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=10)
    except Timeout:
        print(f"waiting for {path}: another process holds it while it {what} (a process stopped with Ctrl-Z "
              "holds it until continued: fg, or kill -CONT PID)", file=sys.stderr, flush=True)
        lock.acquire()
    return lock


class StudyStorageError(RuntimeError):
    """The study's storage cannot be used as it is (damaged, or not this study folder's)."""


def storage_url(out: str | Path) -> str:
    """The SQLite URL of a study folder's storage (what ``optuna-dashboard`` opens)."""
    return f"sqlite:///{Path(out).resolve() / STORAGE}"


def check_sqlite(path: Path) -> None:
    """StudyStorageError naming ``path`` and what is wrong with it where SQLite finds it damaged
    (``PRAGMA quick_check``; a file another process holds locked is not checked); the file is opened
    read-only, so neither its bytes nor its time change."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    try:
        connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            found = [row[0] for row in connection.execute("PRAGMA quick_check").fetchall()]
        finally:
            connection.close()
        problem = None if found == ["ok"] else "; ".join(found[:2]) + (f" ({len(found)} problems)" if len(found) > 2 else "")
    except sqlite3.DatabaseError as error:  # locked: another worker writes it (or was stopped doing so), intact
        problem = None if isinstance(error, sqlite3.OperationalError) and "locked" in str(error) else str(error)
    if problem:
        raise StudyStorageError(
            f"{path} is damaged ({problem}); it was left as it is. Your run folders under {path.parent} are "
            f"intact. To go on: move the file aside and recover what SQLite can "
            f"(sqlite3 {path.name}.damaged .recover | sqlite3 {path.name}), or import an export of the study "
            f"(evolm tune import EXPORT {path.parent}), or tune into a new --out")


def open_storage(spec: TuneSpec):
    """The studies' storage: ``spec.storage`` (a database URL, or ``journal:PATH``), else the SQLite
    file OUT/optuna.db. SQL storages carry heartbeats and retries of killed workers' trials; a damaged
    SQLite file is refused (``check_sqlite``) before anything is written into it."""
    import optuna

    spec.out.mkdir(parents=True, exist_ok=True)
    url = spec.storage or storage_url(spec.out)
    if url.startswith(JOURNAL):
        from optuna.storages.journal import JournalFileBackend

        return _holding_stop_signals(optuna.storages.JournalStorage)(JournalFileBackend(url.removeprefix(JOURNAL)))
    path = Path(url.removeprefix("sqlite:///")) if url.startswith("sqlite:///") else None
    if path is not None:
        check_sqlite(path)
    beat = max(1, math.ceil(spec.settings.heartbeat_s))
    kwargs = {"connect_args": {"timeout": 120}} if path is not None else {}
    with warnings.catch_warnings():
        # heartbeats are marked experimental in Optuna 5.0; used as documented
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # two processes creating an SQLite file's tables at once collide: one does it at a time
        with held(f"{path}.lock", "creates the storage's tables") if path is not None else contextlib.nullcontext():
            storage = _holding_stop_signals(optuna.storages.RDBStorage)
            return storage(url, engine_kwargs=kwargs, heartbeat_interval=beat, grace_period=3 * beat,
                           heartbeat_stale_trial_callback=retry_callback(spec))


def retry_callback(spec: TuneSpec):
    """Optuna's retry of a failed trial with its setting, ``tune.max_retries`` times at most: the
    storage's heartbeat callback, and the hand-over of a trial cut by Ctrl-C or SIGTERM."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # experimental in Optuna 5.0
        return optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=spec.settings.max_retries)


@functools.cache
def _holding_stop_signals(cls: type) -> type:
    """``cls`` (an Optuna storage) whose public methods run inside ``stop_signals_held``."""
    def with_signals_held(method):
        @functools.wraps(method)
        def call(*args, **kwargs):
            with stop_signals_held():
                return method(*args, **kwargs)
        return call

    methods = {name: with_signals_held(method) for name, method in inspect.getmembers(cls, inspect.isfunction)
               if not name.startswith("_")}
    return type(cls.__name__, (cls,), {**methods, "__module__": __name__})
