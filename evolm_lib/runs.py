"""Run folders shared by ES and GRPO runs: resolved config, metrics.jsonl, atomic checkpoints.

Layout::

    run_dir/
      config.yaml            resolved settings (kind: es | grpo)
      metrics.jsonl          one row per generation/step, appended as each finishes
      checkpoints/000012/    adapter (PEFT format), optimizer.safetensors, state.json (with that row)
      final_adapter/         PEFT format, loadable by vLLM and peft

A checkpoint is written to a temporary folder and renamed into place, so a kill at any moment
leaves either the previous checkpoint or the new one, never half of one.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import load_file, save_file

from .lora import AdapterWeights, load_adapter, save_adapter

CHECKPOINTS = "checkpoints"


class RunFolderExists(FileExistsError):
    """A run folder already holds a run and overwriting was not asked for."""


def prepare_run_dir(run_dir: str | Path, overwrite: bool = False) -> Path:
    """Create an empty run folder; refuse an existing non-empty one unless ``overwrite``."""
    run_dir = Path(run_dir)
    if run_dir.exists() and any(run_dir.iterdir()):
        # Only config.yaml and no finished generation: a creation that failed before its first
        # checkpoint (e.g. the engine did not start). Nothing to lose; reuse the folder.
        aborted = not list_checkpoints(run_dir) and not read_metrics(run_dir) and \
            {p.name for p in run_dir.iterdir()} <= {"config.yaml", CHECKPOINTS}
        if not overwrite and not aborted:
            raise RunFolderExists(
                f"run folder {run_dir} already holds a run: resume it, pick another folder, or pass overwrite=True"
            )
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


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
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def rewrite_metrics(run_dir: Path, rows: Iterable[dict]) -> None:
    """Replace metrics.jsonl atomically (used on resume to drop rows past the checkpoint)."""
    run_dir = Path(run_dir)
    tmp = run_dir / ".metrics.jsonl.tmp"
    tmp.write_text("".join(json.dumps(_clean(r)) + "\n" for r in rows))
    os.replace(tmp, run_dir / "metrics.jsonl")


def write_checkpoint(
    run_dir: Path,
    step: int,
    adapter: AdapterWeights,
    optimizer_tensors: dict[str, torch.Tensor],
    state: dict,
    base_model: str,
    keep: int = 2,
) -> Path:
    """Write checkpoint ``step`` atomically and prune older ones beyond ``keep``."""
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{step:06d}-", dir=root))
    save_adapter(adapter, tmp / "adapter", base_model=base_model)
    if optimizer_tensors:
        save_file({k: v.contiguous() for k, v in optimizer_tensors.items()}, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps(_clean(state)))
    if final.exists():  # re-written after a resume from an older checkpoint
        shutil.rmtree(final)
    os.rename(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.isdigit() and (p / "state.json").exists())


def load_checkpoint(path: Path) -> tuple[AdapterWeights, dict[str, torch.Tensor], dict]:
    """(adapter, optimizer tensors, state) of one checkpoint folder."""
    optimizer_path = path / "optimizer.safetensors"
    optimizer = load_file(str(optimizer_path)) if optimizer_path.exists() else {}
    return load_adapter(path / "adapter"), optimizer, json.loads((path / "state.json").read_text())


def read_config_kind(run_dir: str | Path) -> str:
    """'es' or 'grpo', from a run folder's config.yaml."""
    import yaml

    data = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    return data.get("kind", "es")


def timed(clock: dict[str, float], key: str) -> "_Timer":
    """Context manager adding elapsed seconds to ``clock[key]``."""
    return _Timer(clock, key)


class _Timer:
    def __init__(self, clock: dict[str, float], key: str):
        self.clock, self.key = clock, key

    def __enter__(self):
        import time

        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import time

        self.clock[self.key] = self.clock.get(self.key, 0.0) + time.perf_counter() - self.start
