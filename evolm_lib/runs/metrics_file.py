"""A run's metrics.jsonl: one row per generation or step, appended as each finishes, read back with a
torn last line skipped, rewritten atomically on resume; and the other append-only logs of a run
folder (kl.jsonl)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..types import NotARunFolder
from .durable import fsync_dir, json_safe


def append_metrics(run_dir: Path, row: dict) -> None:
    """Append one row to metrics.jsonl and flush it to disk."""
    with open(Path(run_dir) / "metrics.jsonl", "a") as handle:
        handle.write(json.dumps(json_safe(row)) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_metrics(run_dir: str | Path) -> list[dict]:
    """All rows of a run's metrics.jsonl (a torn last line from a kill is skipped)."""
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


def read_jsonl(path: str | Path) -> list[dict]:
    """Every JSON line of an append-only log (none if the file is missing); a line torn by a kill
    mid-write is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def read_checkpoint_kls(run_dir: str | Path) -> list[dict]:
    """The rows of a run's kl.jsonl (``generation``, ``policy/kl``: KL to the base model of each
    measured checkpoint, written by ``evolm sweep``), by generation; [] when none was measured."""
    path = Path(run_dir) / "kl.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return sorted(rows, key=lambda r: r["generation"])


def rewrite_metrics(run_dir: Path, rows: Iterable[dict]) -> None:
    """Replace metrics.jsonl atomically (used on resume to drop rows past the checkpoint)."""
    run_dir = Path(run_dir)
    tmp = run_dir / ".metrics.jsonl.tmp"
    with open(tmp, "w") as handle:
        handle.write("".join(json.dumps(json_safe(r)) + "\n" for r in rows))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, run_dir / "metrics.jsonl")
    fsync_dir(run_dir)


def record_final_metrics(run_dir: str | os.PathLike, values: Mapping[str, Any]) -> dict:
    """Add `values` (e.g. {"policy/kl": 0.02}) to the last row of a run's metrics.jsonl, atomically;
    returns that row. For numbers measured after a run ends (KL to the base model)."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise NotARunFolder(f"{run_dir}/metrics.jsonl holds no rows")
    rows[-1] = {**rows[-1], **values}
    rewrite_metrics(run_dir, rows)
    return rows[-1]
