"""Ctrl-C in a long command: the notebook kernels it started are stopped, and one line says what was
kept and how to continue, instead of a traceback from wherever the interrupt landed."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Iterator

EXIT_INTERRUPTED = 128 + signal.SIGINT  # what a shell reports for a command that Ctrl-C ended


def child_processes(pid: int | None = None) -> list[int]:
    """The ids of the processes whose parent is ``pid`` (this process by default); [] where /proc is missing."""
    tasks = Path(f"/proc/{pid or os.getpid()}/task")
    if not tasks.is_dir():
        return []
    children: list[int] = []
    for task in tasks.iterdir():
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except OSError:  # a thread that ended meanwhile
            continue
    return children


def stop_children(timeout: float = 10.0) -> None:
    """End this process's children (a notebook's kernel runs in a session of its own, so the terminal's
    Ctrl-C never reached it) and wait up to ``timeout`` seconds for them. A kernel that kept running
    would hold its run folder, and the next command would find it busy. SIGKILL, not SIGTERM: the
    kernel is inside a cell whose client is gone, and on SIGTERM it prints tracebacks of its closed
    sockets into this command's output; a run resumes from its last checkpoint either way."""
    children = child_processes()
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while children and time.monotonic() < deadline:
        children = [pid for pid in children if not _reaped(pid)]
        time.sleep(0.1)


def _reaped(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:  # reaped elsewhere (the kernel manager's own wait)
        return True


@contextlib.contextmanager
def kernels_stopped_first() -> Iterator[None]:
    """Inside the block, Ctrl-C ends this process's children (the notebook kernels) before anything
    else runs, then raises KeyboardInterrupt here: otherwise the notebook client closes its sockets
    while unwinding, and a kernel still inside a cell prints their errors into this command's output
    before the cleanup reaches it. Further Ctrl-Cs are ignored until the block's caller is done."""
    def interrupted(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        stop_children()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is interrupted:
            signal.signal(signal.SIGINT, previous)


def report_interrupt(line: str) -> int:
    """Print ``line`` (what was kept, how to continue) on stderr; returns the exit status for Ctrl-C."""
    print(line, file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED
