"""Writing that survives a kill: JSON-safe values, and fsync of files and folders before a rename publishes them."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

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


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and the folders themselves, so a rename publishes durable data."""
    for folder, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(Path(folder))


def fsync_dir(path: Path) -> None:
    """fsync a folder, so the names renamed into it are on disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
