"""Ctrl-C (SIGINT) or SIGTERM in a long command: the notebook kernels it started are stopped, and one
line says what was kept and how to continue, instead of a traceback from wherever the interrupt
landed (or, for SIGTERM, nothing at all). The exit status is 128 + the signal: 130 or 143."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import Iterator

from ..stop_signals import STOP_SIGNALS

EXIT_INTERRUPTED = 128 + signal.SIGINT  # what a shell reports for a command that Ctrl-C ended
_received: list[int] = []  # the stop signal this process got, for its exit status


def child_processes(pid: int | None = None) -> list[int]:
    """The ids of the processes whose parent is ``pid`` (this process by default; psutil); [] when it is gone."""
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid or os.getpid()).children()]
    except psutil.NoSuchProcess:
        return []


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


def ignore_stop_signals() -> None:
    """Ignore further Ctrl-Cs and SIGTERMs: a second one must not cut the cleanup short."""
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)


@contextlib.contextmanager
def stop_signals_restored() -> Iterator[None]:
    """The stop signals' handlers given back after a command: inside the block a stopped command
    ignores further ones while it cleans up (``ignore_stop_signals``); after it, a caller in Python (a
    notebook, a script) has its own Ctrl-C again, as have the processes it starts later (they inherit
    an ignored signal), and the next command's exit status is its own."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield  # handlers belong to the main thread: a command run elsewhere changes none
        return
    previous = {number: signal.getsignal(number) for number in STOP_SIGNALS}
    try:
        yield
    finally:
        _received.clear()
        for number, handler in previous.items():
            if handler is not None:
                signal.signal(number, handler)


@contextlib.contextmanager
def kernels_stopped_first() -> Iterator[None]:
    """Inside the block, Ctrl-C or SIGTERM ends this process's children (the notebook kernels) before
    anything else runs, then raises KeyboardInterrupt here: otherwise the notebook client closes its
    sockets while unwinding, and a kernel still inside a cell prints their errors into this command's
    output before the cleanup reaches it (and SIGTERM would end the command with no word and no
    cleanup). Further stop signals are ignored until the block's caller is done."""
    def interrupted(signum, frame):
        ignore_stop_signals()
        _received.append(signum)
        stop_children()
        raise KeyboardInterrupt

    previous = {number: signal.signal(number, interrupted) for number in STOP_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            if signal.getsignal(number) is interrupted:
                signal.signal(number, handler)


def report_interrupt(line: str) -> int:
    """Print ``line`` (what was kept, how to continue) on stderr; returns the exit status of the stop
    signal received (130 for Ctrl-C, 143 for SIGTERM)."""
    print(line, file=sys.stderr, flush=True)
    return 128 + _received[-1] if _received else EXIT_INTERRUPTED
