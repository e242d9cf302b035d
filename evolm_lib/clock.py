"""Wall-clock accounting: the seconds each part of a generation or step took, summed by name."""
from __future__ import annotations

import contextlib
import time
from typing import Iterator


@contextlib.contextmanager
def timed(clock: dict[str, float], key: str) -> Iterator[None]:
    """Add the block's elapsed seconds to ``clock[key]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        clock[key] = clock.get(key, 0.0) + time.perf_counter() - start
