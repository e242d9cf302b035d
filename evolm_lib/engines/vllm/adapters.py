"""Adapters handed to vLLM as files: each version written under a new LoRA name and id, in a folder
that goes with the engine."""
from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Iterator, Sequence

from ...lora import AdapterWeights, save_adapter


def _default_adapter_root() -> Path:
    # RAM-backed where it exists: a population is written every generation.
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class AdapterFiles:
    """Adapters handed to vLLM as files in a folder of their own, each version under a new LoRA name
    and id: vLLM caches adapters by id and its prefix cache by name."""

    def __init__(self, model_dir: Path, dtype: str, root: str | Path | None = None):
        self.model_dir, self.dtype = model_dir, dtype
        self.workdir = Path(tempfile.mkdtemp(prefix="evolm-adapters-", dir=Path(root) if root else _default_adapter_root()))
        # A kernel restarted or a script that never calls close() must not leave adapters in RAM.
        weakref.finalize(self, shutil.rmtree, str(self.workdir), True)
        self._ids = itertools.count(1)

    @contextlib.contextmanager
    def written(self, adapters: Sequence[AdapterWeights | None]) -> Iterator[list]:
        """One ``LoRARequest`` per adapter (None stays None: the base model), files deleted on leaving."""
        from vllm.lora.request import LoRARequest
        import torch

        requests, paths, seen = [], [], {}
        try:
            for adapter in adapters:
                if adapter is None:
                    requests.append(None)
                    continue
                if id(adapter) not in seen:  # the same object twice in one call: one adapter, one slot
                    lora_id = next(self._ids)
                    # Written in the engine's dtype: the engine would round to it anyway, and at GPU
                    # scale float32 doubles the bytes written per generation.
                    path = save_adapter(adapter, self.workdir / f"a{lora_id}", base_model=str(self.model_dir),
                                        dtype=getattr(torch, self.dtype))
                    paths.append(path)
                    seen[id(adapter)] = LoRARequest(f"evolm-{lora_id}", lora_id, str(path))
                requests.append(seen[id(adapter)])
            yield requests
        finally:
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        """Delete the folder."""
        shutil.rmtree(self.workdir, ignore_errors=True)
