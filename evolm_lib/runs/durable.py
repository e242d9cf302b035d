"""Writing that survives a kill: JSON-safe values, and fsync of files and folders before a rename publishes them."""
from __future__ import annotations

import contextlib
import errno
import math
import os
from pathlib import Path
from typing import Any, Iterator

import torch


def json_safe(value: Any) -> Any:
    # JSON has no NaN/inf: store them as null so every line stays valid JSON.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, torch.Tensor):
        return json_safe(value.tolist())
    return value


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """Inside the block, an error of writing that names no file (a full disk met by a buffered write,
    an fsync, or safetensors' writer) is raised again as an OSError naming ``path``, the file written:
    "[Errno 28] No space left on device: '.../metrics.jsonl'"."""
    try:
        yield
    except OSError as error:
        if error.filename is not None:
            raise
        raise OSError(error.errno, error.strerror or str(error), str(path)) from error
    except Exception as error:  # noqa: BLE001 - safetensors reports a full disk as its own error type
        if "os error 28" in str(error) or "No space left on device" in str(error):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from error
        raise


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and the folders themselves, so a rename publishes durable data."""
    for folder, _, files in os.walk(path):
        for name in files:
            with naming(os.path.join(folder, name)), open(os.path.join(folder, name), "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(Path(folder))


def fsync_dir(path: Path) -> None:
    """fsync a folder, so the names renamed into it are on disk."""
    with naming(path):
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
