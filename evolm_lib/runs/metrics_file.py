"""A run's metrics.jsonl: one row per generation or step, appended as each finishes, read back with a
torn last line skipped, rewritten atomically on resume; and the other append-only logs of a run
folder (kl.jsonl, the seed log).

No row is dropped without a word. A line that does not parse anywhere but at the very end without
its newline (a kill mid-write) is damage, not a torn write: reading says so (``DamagedLines``, naming
the file and the generations), the row comes back from the checkpoints that keep it (each keeps the
rows since the one before it, ``checkpoint_rows``), else a row ``{"generation": g, "missing": true}``
stands in its place, so every table and plot shows the gap. Before any rewrite of the file the
damaged lines are kept byte for byte in ``metrics.damaged.jsonl`` with their line numbers."""
from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence

from ..types import NotARunFolder
from .durable import fsync_dir, json_safe, naming

METRICS = "metrics.jsonl"
DAMAGED_METRICS = "metrics.damaged.jsonl"  # the damaged lines of metrics.jsonl: {"line", "generation", "raw"}
MISSING = "missing"  # a row's key: True where the generation's line was damaged and no checkpoint kept it
_GENERATION = re.compile(rb'"generation":\s*(\d+)')


class DamagedLines(UserWarning):
    """Lines of a run folder's log that do not parse: kept aside, their rows restored or marked missing."""


@dataclass(frozen=True)
class DamagedLine:
    """A line of a JSON-lines log that does not parse into a row, as it is on disk."""

    line: int
    "its line number, from 1"
    raw: bytes
    "its bytes, without the newline"
    generation: int | None = None
    "the generation (ES) or step (GRPO) whose row it was, where the line or its neighbours tell"

    def record(self) -> dict:
        """The side file's line: ``raw`` holds each byte as the character of the same code (latin-1),
        so ``record["raw"].encode("latin-1")`` gives the bytes back exactly."""
        return {"line": self.line, "generation": self.generation, "raw": self.raw.decode("latin-1")}


@dataclass(frozen=True)
class JsonLines:
    """What a JSON-lines log holds: the rows that parse, each with its line number, the damaged lines,
    and whether the last line was torn by a kill mid-write (no newline, does not parse; skipped)."""

    rows: list[tuple[int, dict]] = field(default_factory=list)
    damaged: list[DamagedLine] = field(default_factory=list)
    torn: bool = False


def is_metrics_row(row: Mapping[str, Any]) -> bool:
    """Whether a parsed line is a metrics row: it names its generation (or step)."""
    return isinstance(row.get("generation"), int) or row.get(MISSING) is True


def scan_jsonl(path: str | Path, is_row: Callable[[Mapping[str, Any]], bool] = lambda row: True) -> JsonLines:
    """Every line of a JSON-lines log, sorted into rows, damaged lines and a torn last line (an empty
    result where the file is missing). Blank lines are neither. A line that parses into a mapping
    that ``is_row`` refuses (damage that left valid JSON) is a damaged line too."""
    path = Path(path)
    if not path.exists():
        return JsonLines()
    data = path.read_bytes()
    lines = data.split(b"\n")
    complete = data.endswith(b"\n")
    if complete or not data:
        lines = lines[:-1]  # the empty piece after the last newline
    rows, damaged, torn = [], [], False
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except ValueError:  # JSONDecodeError, and bytes that are not UTF-8
            row = None
        if isinstance(row, dict) and is_row(row):
            rows.append((number, row))
        elif number == len(lines) and not complete:
            torn = True  # a kill in the middle of the last append: nothing finished is lost
        else:
            damaged.append(DamagedLine(number, raw))
    return JsonLines(rows, damaged, torn)


def append_metrics(run_dir: Path, row: dict) -> None:
    """Append one row to metrics.jsonl and flush it to disk."""
    with naming(Path(run_dir) / METRICS), open(Path(run_dir) / METRICS, "a") as handle:
        handle.write(json.dumps(json_safe(row)) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_metrics(run_dir: str | Path) -> list[dict]:
    """All rows of a run's metrics.jsonl, in file order (a torn last line from a kill is skipped).

    A damaged line elsewhere is never dropped silently: its row comes back from the checkpoints that
    keep it, or ``{"generation": g, "missing": True, "damaged_line": n}`` stands in for it, and a
    ``DamagedLines`` warning names the file and the generations. Reading changes nothing on disk."""
    rows, damaged, restored = mend_metrics(run_dir)
    if damaged:
        warnings.warn(describe_damage(Path(run_dir) / METRICS, damaged, restored), DamagedLines, stacklevel=2)
    return rows


def mend_metrics(run_dir: str | Path) -> tuple[list[dict], list[DamagedLine], set[int]]:
    """(rows with each damaged line's row restored or marked missing, the damaged lines with their
    generations, the generations restored from checkpoints)."""
    run_dir = Path(run_dir)
    scanned = scan_jsonl(run_dir / METRICS, is_metrics_row)
    if not scanned.damaged:
        return [row for _, row in scanned.rows], [], set()
    kept = checkpoint_rows(run_dir)
    damaged = place_damaged(scanned, kept)
    at_line = {number: row for number, row in scanned.rows}
    # a line no generation is left for (an extra line) stands for no row: named, never a phantom gap
    at_line.update({d.line: kept.get(d.generation) or _missing(d) for d in damaged if d.generation is not None})
    restored = {d.generation for d in damaged if d.generation in kept}
    return [at_line[number] for number in sorted(at_line)], damaged, restored


def _missing(line: DamagedLine) -> dict:
    return {"generation": line.generation, MISSING: True, "damaged_line": line.line}


def place_damaged(scanned: JsonLines, kept: Collection[int] | None = None) -> list[DamagedLine]:
    """The damaged lines with the generation each held: the one its bytes still name, where that fits
    between its neighbours, else the one left between its neighbours (generations count up by one);
    None for a line no generation is left for (an extra line between consecutive rows). With ``kept``
    (the generations the checkpoints keep), a line after the last row is placed only where its bytes
    still name a generation or a checkpoint keeps the next one: otherwise it is an extra line too."""
    placed = []
    for line in scanned.damaged:
        before = [row.get("generation") for number, row in scanned.rows if number < line.line]
        after = [row.get("generation") for number, row in scanned.rows if number > line.line]
        low = before[-1] if before and isinstance(before[-1], int) else -1
        high = after[0] if after and isinstance(after[0], int) else None
        found = _GENERATION.search(line.raw)
        generation = int(found.group(1)) if found else None
        if generation is None or not (low < generation and (high is None or generation < high)):
            between = [d for d in scanned.damaged if _between(d.line, line.line, scanned.rows)]
            generation = low + 1 + between.index(line) if high is None or high - low - 1 == len(between) else None
            if (high is None and kept is not None and generation is not None and b'"generation"' not in line.raw
                    and generation not in kept):
                generation = None  # garbage after the last row: no sign that it was a row
        placed.append(DamagedLine(line.line, line.raw, generation))
    return placed


def _between(line: int, other: int, rows: list[tuple[int, dict]]) -> bool:
    """Whether no row lies between two line numbers (the damaged lines of one gap)."""
    low, high = min(line, other), max(line, other)
    return not any(low < number < high for number, _ in rows)


def describe_damage(path: Path, damaged: list[DamagedLine], restored: set[int]) -> str:
    """One sentence: which lines of which file are damaged, which generations came back, which are missing."""
    extra = [d for d in damaged if d.generation is None]
    damaged = [d for d in damaged if d.generation is not None]
    side = path.with_name(DAMAGED_METRICS).name
    told = (f"{path}: line{'s' if len(extra) > 1 else ''} {', '.join(str(d.line) for d in extra)} "
            f"do{'es' if len(extra) == 1 else ''} not parse and name{'s' if len(extra) == 1 else ''} no generation: "
            f"an extra line, not a row (no generation is missing for it); it stays in the file, and is kept in "
            f"{side} when the run's writer next rewrites the file") if extra else ""
    if not damaged:
        return told
    lines = ", ".join(str(d.line) for d in damaged)
    generations = [d.generation for d in damaged]
    back = sorted(g for g in generations if g in restored)
    lost = [g for g in generations if g not in restored]
    parts = [f"{path}: line{'s' if len(damaged) > 1 else ''} {lines} do{'es' if len(damaged) == 1 else ''} not "
             f"parse (generation{'s' if len(damaged) > 1 else ''} {', '.join('?' if g is None else str(g) for g in generations)})"]
    if back:
        parts.append(f"restored from the checkpoints: generation {', '.join(map(str, back))}")
    if lost:
        parts.append(f"no checkpoint keeps generation {', '.join('?' if g is None else str(g) for g in lost)}: "
                     f"marked missing ({MISSING!r}: true)")
    parts.append(f"the damaged bytes are kept in {side} when the run's writer next rewrites the file")
    return "; ".join(parts) + (f". {told}" if told else "")


def checkpoint_rows(run_dir: str | Path) -> dict[int, dict]:
    """The metrics rows the run folder's checkpoints keep (each its own row and the rows since the
    checkpoint before it), by generation; checkpoints set aside as damaged are not read."""
    root = Path(run_dir) / "checkpoints"
    found: dict[int, dict] = {}
    for state_file in sorted(root.glob("*/state.json")) if root.exists() else ():
        name = state_file.parent.name
        if not name.removesuffix(".old").isdigit():
            continue
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError):
            continue
        for row in [*state.get("rows", []), state.get("row")]:
            if isinstance(row, dict) and isinstance(row.get("generation"), int) and not row.get(MISSING):
                found.setdefault(row["generation"], row)
    return found


def row_generation(row: Mapping[str, Any]) -> int:
    """A row's generation (or step); -1 where it has none (a damaged line no neighbour placed)."""
    generation = row.get("generation")
    return generation if isinstance(generation, int) else -1


def rows_since(run_dir: str | Path, generation: int) -> list[dict]:
    """The rows of metrics.jsonl after ``generation`` that parse (what a checkpoint keeps beside its own row)."""
    return [row for _, row in scan_jsonl(Path(run_dir) / METRICS, is_metrics_row).rows
            if isinstance(row.get("generation"), int) and row["generation"] > generation and not row.get(MISSING)]


def read_jsonl(path: str | Path) -> list[dict]:
    """Every JSON line of an append-only log (none if the file is missing); a line torn by a kill
    mid-write is skipped, and a damaged line elsewhere raises a ``DamagedLines`` warning naming the
    file and the line (its row is left out)."""
    scanned = scan_jsonl(path)
    if scanned.damaged:
        warnings.warn(f"{path}: line{'s' if len(scanned.damaged) > 1 else ''} "
                      f"{', '.join(str(d.line) for d in scanned.damaged)} do not parse and are left out",
                      DamagedLines, stacklevel=2)
    return [row for _, row in scanned.rows]


def write_jsonl(path: str | Path, lines: Sequence[Mapping[str, Any]]) -> None:
    """Write a JSON-lines file whole, atomically (a temporary file beside it, then renamed): a kill
    leaves the old file or the new one, never part of it."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    with naming(path):
        temporary.write_text("".join(json.dumps(line) + "\n" for line in lines))
    os.replace(temporary, path)


def read_checkpoint_kls(run_dir: str | Path) -> list[dict]:
    """The rows of a run's kl.jsonl (``generation``, ``policy/kl``: KL to the base model of each
    measured checkpoint, written by ``evolm sweep``), by generation; [] when none was measured."""
    return sorted(read_jsonl(Path(run_dir) / "kl.jsonl"), key=lambda r: r["generation"])


def keep_damaged_lines(path: Path, damaged: Iterable[DamagedLine], side: Path) -> list[DamagedLine]:
    """Append the damaged lines of ``path`` to the side file ``side`` (fsynced), those it does not
    hold yet; returns the lines added."""
    damaged = list(damaged)
    held = {(r.get("line"), r.get("raw")) for _, r in scan_jsonl(side).rows}
    new = [d for d in damaged if (d.line, d.raw.decode("latin-1")) not in held]
    if new:
        with naming(side), open(side, "a") as handle:
            handle.write("".join(json.dumps(d.record()) + "\n" for d in new))
            handle.flush()
            os.fsync(handle.fileno())
        fsync_dir(side.parent)
    return new


def rewrite_metrics(run_dir: Path, rows: Iterable[dict]) -> None:
    """Replace metrics.jsonl atomically (used on resume to drop rows past the checkpoint). Its damaged
    lines are first kept byte for byte in metrics.damaged.jsonl: a rewrite never takes them away."""
    run_dir = Path(run_dir)
    damaged = scan_jsonl(run_dir / METRICS, is_metrics_row).damaged
    if damaged:
        _, placed, _ = mend_metrics(run_dir)
        keep_damaged_lines(run_dir / METRICS, placed, run_dir / DAMAGED_METRICS)
    tmp = run_dir / ".metrics.jsonl.tmp"
    with naming(run_dir / METRICS), open(tmp, "w") as handle:
        handle.write("".join(json.dumps(json_safe(r)) + "\n" for r in rows))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, run_dir / METRICS)
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
