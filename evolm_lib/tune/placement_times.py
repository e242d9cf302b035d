"""How fast each run of a study went where it ran, attempt by attempt:

    python -m evolm_lib.tune.placement_times STUDY [--commit SHA] [--before EARLIER_STUDY]

A run folder's placement.jsonl has a line per attempt (``env.record_placement``): the card, the
engines declared to share it, the CUDA MPS pipe its processes used (``scripts/gpu_tune_study.sh``'s
``MPS_CARDS``) and the generation the attempt started from (``from_generation``). An attempt's rows
are those after that generation, up to the next attempt's. For each attempt (those of the commit
``--commit`` names, where given) the table gives the medians of its rows' seconds a generation or
step (``time/generation_s``), in the engine (``time/generate_s``, GRPO's ``time/rollout_s``) and in
the update, with the population or group size, since a setting changes the work as much as a card.
It gives the training tokens a generation or step decoded (the step in ``samples/tokens``) and the
engine's milliseconds per 1,000 of them as well: decoding time follows the completions' length,
which training changes (a conciseness run whose answers shrink to a word decodes ten times faster),
so the time per token is what compares placements.
A second table groups the attempts by method, engines a card and MPS. ``--launched-at EPOCH`` (the
time ``gpu_tune_study.sh start`` launched its workers, in its status file) adds how long after it each
worker's first run began: its engine's start, from the compile cache that machine had.

Lines written before attempts recorded their start carry no ``from_generation``: a run's only
attempt starts at 0; a later one starts at the newest checkpoint the same run had in
``--before`` (the unpacked pack the attempt's machine started from, where it resumed), and is left
out, and counted, without it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Sequence

from ..env import PLACEMENT
from ..runs import list_checkpoints, read_config_file, read_jsonl, read_metrics, row_generation
from .compact import locate

ENGINE_KEYS = ("time/generate_s", "time/rollout_s")
"""Seconds in the engine: an ES generation's members, a GRPO step's rollouts."""


def _median(rows: list[dict], keys: Sequence[str]) -> float | None:
    values = [row[key] for row in rows for key in keys if isinstance(row.get(key), (int, float))]
    return statistics.median(values) if values else None


def _token_steps(rows: list[dict]) -> dict[int, float]:
    """Training tokens decoded in each row's generation or step: its ``samples/tokens`` less the row
    before it's (the counter is cumulative), keyed by the row's generation; rows without the counter
    or their predecessor's are left out."""
    steps, previous = {}, None
    for row in sorted(rows, key=row_generation):
        tokens = row.get("samples/tokens")
        if isinstance(tokens, (int, float)) and previous is not None:
            steps[row_generation(row)] = tokens - previous
        previous = tokens if isinstance(tokens, (int, float)) else None
    return steps


def _engine_ms_per_1k(rows: list[dict], tokens: dict[int, float]) -> float | None:
    """Median over the rows of the engine's milliseconds per 1,000 training tokens decoded."""
    values = []
    for row in rows:
        engine = next((row[key] for key in ENGINE_KEYS if isinstance(row.get(key), (int, float))), None)
        decoded = tokens.get(row_generation(row))
        if engine is not None and decoded:
            values.append(1e6 * engine / decoded)
    return statistics.median(values) if values else None


def _start(lines: list[dict], index: int, run: Path, study: Path, before: Path | None) -> int | None:
    """The generation attempt ``index`` of the run's placement lines started from (None: unknown)."""
    recorded = lines[index].get("from_generation")
    if recorded is not None:
        return recorded
    if index == 0:
        return 0
    earlier = before / run.relative_to(study) if before else None
    if earlier is None or not earlier.exists():
        return None  # a continuation copied from its rerun has the rerun's lines before its own
    checkpoints = list_checkpoints(earlier)
    return int(checkpoints[-1].name) if checkpoints else 0


def attempts(study: str | Path, commit: str | None = None, before: str | Path | None = None) -> tuple[list[dict], list[str]]:
    """(one dict per attempt of every run under ``study``, of ``commit`` where given; the runs whose
    attempt's start is unknown)."""
    study, found, unknown, seen = Path(study), [], [], set()
    before = Path(before) if before else None
    for placement in sorted(study.rglob(PLACEMENT)):
        run = placement.parent
        lines = read_jsonl(placement)
        if commit and not any(str(line.get("code_commit") or "").startswith(commit) for line in lines):
            continue  # an earlier lease's run: its rows are not read
        every_row = read_metrics(run)
        tokens = _token_steps(every_row)
        rows = [row for row in every_row if "time/generation_s" in row]
        config = read_config_file(run)
        method = locate(study, run)["method"]
        for index, line in enumerate(lines):
            if commit and not str(line.get("code_commit") or "").startswith(commit):
                continue
            if (line.get("pid"), line.get("time")) in seen:
                continue  # a continuation's copy of its rerun's line: that attempt is the rerun's
            seen.add((line.get("pid"), line.get("time")))
            start = _start(lines, index, run, study, before)
            if start is None:
                unknown.append(str(run.relative_to(study)))
                continue
            end = _start(lines, index + 1, run, study, before) if index + 1 < len(lines) else None
            mine = [row for row in rows if row_generation(row) > start and (end is None or row_generation(row) <= end)]
            if not mine:
                continue
            found.append({
                "run": str(run.relative_to(study)), "method": method,
                "card": line.get("cuda_visible_devices"), "engines_per_card": line.get("engines_per_card"),
                "mps": bool(line.get("cuda_mps_pipe_directory")), "device": line.get("device"),
                "size": config.get("population_size") if "population_size" in config else config.get("group_size"),
                "rows": len(mine), "from": start,
                "generation_s": _median(mine, ("time/generation_s",)),
                "engine_s": _median(mine, ENGINE_KEYS), "update_s": _median(mine, ("time/update_s",)),
                "tokens": statistics.median(t) if (t := [tokens[g] for g in map(row_generation, mine) if g in tokens]) else None,
                "engine_ms_per_1k_tokens": _engine_ms_per_1k(mine, tokens),
            })
    return found, unknown


def first_run_delays(study: str | Path, launched_at: float) -> list[float]:
    """Seconds from ``launched_at`` to each worker's first run begun after it (a worker: a process id
    on the runs' placement lines), the shortest first. A worker refilled later counts from the same
    time, and one that waited for work (tune.parallel) from its launch too: their delays include the wait."""
    first: dict[int, float] = {}
    for placement in Path(study).rglob(PLACEMENT):
        for line in read_jsonl(placement):
            when, pid = line.get("time"), line.get("pid")
            if isinstance(when, (int, float)) and when >= launched_at and pid is not None:
                first[pid] = min(first.get(pid, when), when)
    return sorted(when - launched_at for when in first.values())


def _seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def _whole(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


def table(found: list[dict]) -> str:
    """The attempts as a Markdown table, by method, MPS and card."""
    lines = ["| run | card | MPS | engines a card | size | rows | s a generation or step | engine s | update s "
             "| tokens a generation or step | engine ms per 1k tokens |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for a in sorted(found, key=lambda a: (a["method"], not a["mps"], str(a["card"]), a["run"])):
        lines.append(f"| {a['run']} (from {a['from']}) | {a['card']} | {'yes' if a['mps'] else 'no'} | "
                     f"{a['engines_per_card']} | {a['size']} | {a['rows']} | {_seconds(a['generation_s'])} | "
                     f"{_seconds(a['engine_s'])} | {_seconds(a['update_s'])} | {_whole(a['tokens'])} | "
                     f"{_whole(a['engine_ms_per_1k_tokens'])} |")
    return "\n".join(lines)


def grouped(found: list[dict]) -> str:
    """Medians of the attempts' medians by method, size, engines a card and MPS, as a Markdown table."""
    groups: dict[tuple, list[dict]] = {}
    for a in found:
        groups.setdefault((a["method"], a["size"], a["engines_per_card"], a["mps"]), []).append(a)
    lines = ["| method | size | engines a card | MPS | attempts | s a generation or step | engine s | update s "
             "| tokens a generation or step | engine ms per 1k tokens |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (method, size, engines, mps), members in sorted(groups.items(), key=lambda g: tuple(str(k) for k in g[0])):
        medians = [_median(members, (key,)) for key in ("generation_s", "engine_s", "update_s", "tokens",
                                                        "engine_ms_per_1k_tokens")]
        lines.append(f"| {method} | {size} | {engines} | {'yes' if mps else 'no'} | {len(members)} | "
                     + " | ".join(_seconds(m) for m in medians[:3]) + " | "
                     + " | ".join(_whole(m) for m in medians[3:]) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evolm_lib.tune.placement_times", description=__doc__.split("\n\n")[0])
    parser.add_argument("study", help="a study folder (or any folder of run folders)")
    parser.add_argument("--commit", help="only attempts of this code commit (a prefix will do)")
    parser.add_argument("--before", help="the unpacked pack these attempts started from (for lines without from_generation)")
    parser.add_argument("--launched-at", type=float, metavar="EPOCH",
                        help="when the workers were launched: say how long after it each one's first run began")
    args = parser.parse_args(argv)
    if not Path(args.study).is_dir():
        parser.error(f"{args.study}: no such folder")
    found, unknown = attempts(args.study, args.commit, args.before)
    print(table(found) + "\n\n" + grouped(found))
    if args.launched_at is not None:
        delays = first_run_delays(args.study, args.launched_at)
        print(f"\nEach worker's first run began, in seconds after the workers were launched ({len(delays)} workers; "
              "one that waited for work, or was refilled, began later): " + (", ".join(f"{d:.0f}" for d in delays) or "none yet"))
    if unknown:
        print(f"\n{len(unknown)} attempts left out, their start unknown (give --before): {', '.join(unknown[:5])}"
              + (" ..." if len(unknown) > 5 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
