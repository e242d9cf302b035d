"""Ctrl-C (SIGINT) and SIGTERM: the signals that stop a long command or worker, and a block they
cannot cut in the middle (``stop_signals_held``). The command line's own handling of them (a line
saying what was kept, the exit status) is ``evolm_lib.cli.interrupt``."""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop a long command the same way: Ctrl-C, and SIGTERM (``kill``, a scheduler, a closing session)."""


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Ctrl-C or SIGTERM that arrives inside the block acts when the block ends (its handler runs
    then, e.g. KeyboardInterrupt is raised there), not at whatever line it lands on. Signals without
    a Python handler (ignored, or the OS's default) are left as they are."""
    if threading.current_thread() is not threading.main_thread():
        yield  # Python runs signal handlers in the main thread only: nothing lands here
        return
    arrived: list[int] = []
    previous = {}
    for number in STOP_SIGNALS:
        if callable(signal.getsignal(number)):
            previous[number] = signal.signal(number, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for number in arrived:
            previous[number](number, None)
