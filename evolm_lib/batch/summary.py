"""The summary of many runs, for `evolm batch` and `evolm sweep` alike: OUT/summary.csv and
OUT/summary.json, written by one function (`write_summary_files`); and the console tables of a batch."""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from .spec import INJECTED, BatchSpec
from .state import RunResult, now_text


def _setting_columns(results: list[RunResult], spec: BatchSpec | None,
                     defaults: dict[str, Any]) -> list[tuple[str, str | None]]:
    """(parameter, key) of every settings column: the spec's grid then its other parameters; a mapping
    parameter gives one column per key it has in any row (key None: the parameter itself)."""
    names = [*spec.grid, *(k for k in spec.parameters if k not in spec.grid)] if spec else []
    columns: list[tuple[str, str | None]] = []
    for name in (n for n in names if n not in INJECTED):
        values = [r.parameters.get(name, defaults.get(name)) for r in results]
        if any(isinstance(v, dict) for v in values):
            keys = dict.fromkeys(k for v in values if isinstance(v, dict) for k in v)
            columns += [(name, key) for key in keys]
        else:
            columns.append((name, None))
    return columns


def _setting_value(result: RunResult, name: str, key: str | None, defaults: dict[str, Any]) -> Any:
    value = result.parameters.get(name, defaults.get(name))
    if key is not None:
        value = value.get(key) if isinstance(value, dict) else None
    return json.dumps(value) if isinstance(value, (dict, list)) else value


def summary_rows(results: list[RunResult], spec: BatchSpec | None = None,
                 defaults: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The rows of summary.csv (columns in the package's doc string), a result column no row has left out."""
    defaults = defaults or {}
    settings = _setting_columns(results, spec, defaults)
    result_columns = [c for c in _result_columns() if any(r.results.get(c) is not None for r in results)]
    rows = []
    for r in results:
        row = {"run": r.name, "status": r.status, "wall_s": round(r.seconds, 1), "error": r.error}
        row.update({name if key is None else f"{name}.{key}": _setting_value(r, name, key, defaults)
                    for name, key in settings})
        row.update({c: r.results.get(c) for c in result_columns})
        row["notebook"] = str(r.notebook)
        rows.append(row)
    return rows


def _result_columns() -> tuple[str, ...]:
    from ..analysis import RUN_RESULT_COLUMNS

    # the run's own wall time is left to summary.json: the one wall-time column is the notebook's wall_s
    return tuple(c for c in RUN_RESULT_COLUMNS if c != "wall_s")


def varying_setting_columns(settings: Sequence[Mapping[str, Any]], present: Sequence[str] = ()) -> list[str]:
    """The settings that vary across the runs (`analysis.varying_settings` of each run's
    `analysis.method_settings`), less those a column already holds by name or as ``settings.<name>``."""
    from ..analysis import varying_settings

    return [name for name in varying_settings(settings) if name not in present and f"settings.{name}" not in present]


def write_summary_files(out_dir: str | Path, rows: Sequence[Mapping[str, Any]], runs: Sequence[Mapping[str, Any]],
                        columns: Sequence[str] = (), notebook: str | Path | None = None,
                        settings: Sequence[Mapping[str, Any]] | None = None) -> list[Mapping[str, Any]]:
    """Write OUT/summary.csv and OUT/summary.json, each atomically (a kill leaves the old file or the new one).

    summary.csv: one line per row; its columns are ``columns``, then one per setting that varies across
    the runs (``settings``: each row's run settings, `analysis.method_settings`; a setting a column
    already holds is not repeated), then every other key of the rows in the order they first appear; a
    mapping or list is written as JSON text, None as an empty cell. summary.json: ``{"notebook": the
    notebook the runs came from (or null), "written": when, "runs": runs}``, ``runs`` holding every
    detail of each run (parameters, results, what was done, and under ``settings`` its value of every
    setting that varies). Returns the rows as summary.csv holds them, setting columns included."""
    out_dir = Path(out_dir)
    if settings is not None:
        present = [*columns, *(key for row in rows for key in row)]
        varying = varying_setting_columns(settings, present)
        rows = [{**{k: v for k, v in row.items() if k in columns},
                 **{name: values.get(name) for name in varying},
                 **{k: v for k, v in row.items() if k not in columns}} for row, values in zip(rows, settings)]
        runs = [{**run, "settings": {name: values.get(name) for name in varying}} for run, values in zip(runs, settings)]
        columns = [*columns, *varying]
    header = list(dict.fromkeys([*columns, *(key for row in rows for key in row)]))
    cells = [{key: _cell(row.get(key)) for key in header} for row in rows]
    table = out_dir / ".summary.csv.tmp"
    from ..runs.durable import naming  # runs imports torch: not at the command's start

    with naming(out_dir / "summary.csv"), open(table, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=header)
        writer.writeheader()
        writer.writerows(cells)
    os.replace(table, out_dir / "summary.csv")
    payload = {"notebook": None if notebook is None else str(notebook), "written": now_text(), "runs": list(runs)}
    details = out_dir / ".summary.json.tmp"
    with naming(out_dir / "summary.json"):
        details.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(details, out_dir / "summary.json")
    return list(rows)


def _cell(value: Any) -> Any:
    """A summary.csv cell: a mapping or list as JSON text, None as empty."""
    if value is None:
        return ""
    return json.dumps(value) if isinstance(value, (dict, list)) else value


def write_summary(results: list[RunResult], out_dir: Path, spec: BatchSpec | None = None,
                  defaults: dict[str, Any] | None = None) -> None:
    """A batch's OUT/summary.csv (one row per grid point: status, wall time, settings, results; see the
    package's doc string) and OUT/summary.json (every parameter and result, and what this batch did)."""
    from ..analysis import folder_settings

    rows = summary_rows(results, spec, defaults)
    runs = [{"name": r.name, "status": r.status, "action": r.action, "reason": r.reason, "wall_s": r.seconds,
             "error": r.error, "attempt_error": r.attempt_error, "folder": str(r.folder), "notebook": str(r.notebook),
             "parameters": r.parameters, "results": r.results} for r in results]
    settings = [folder_settings(r.parameters.get("run_dir")) for r in results]
    write_summary_files(out_dir, rows, runs, columns=("run", "status", "wall_s", "error", *_parameter_columns(rows)) if rows else
                        ("run", "status", "wall_s", "error", "notebook"),
                        notebook=spec.notebook if spec else None, settings=settings)


def _parameter_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The columns of a batch's rows up to its results: run, status, wall_s, error, then the parameters."""
    results = {*_result_columns(), "notebook"}
    return list(dict.fromkeys(key for row in rows for key in row if key not in results
                              and key not in ("run", "status", "wall_s", "error")))


def _number(value: Any, digits: int = 4) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, (int, float)) and float(value).is_integer() and abs(value) >= 1:
        return f"{int(value):,}"
    return f"{value:.{digits}g}" if isinstance(value, (int, float)) else str(value)


def _reward_cell(results: dict[str, Any], name: str) -> str:
    start, final, best = (results.get(f"{name}_{k}") for k in ("start", "final", "best"))
    if final is None:
        return ""
    text = f"{_number(start)} -> {_number(final)}" if start is not None else _number(final)
    return text + (f" ({_number(best)})" if best is not None and best != final else "")


# the console table's result columns: (header, cell of a row's results); a column empty for every row is left out
RESULT_CELLS = (
    ("train reward: start -> end (best)", lambda res: _reward_cell(res, "train_reward")),
    ("eval reward: start -> end (best)", lambda res: _reward_cell(res, "eval_reward")),
    ("eval accuracy", lambda res: _number(res.get("eval_accuracy_final"), 2)),
    ("KL to base (nats/token)", lambda res: _number(res.get("kl_final"), 2)),
    ("completions", lambda res: _number(res.get("completions"))),
)


def format_summary(results: list[RunResult], error_width: int = 80) -> str:
    """A one-screen table with labelled columns: run, status, action, wall time in minutes, then its
    results (greedy train and eval reward: start -> end (best), eval accuracy, KL, training
    completions), or its error; a column empty for every point is left out."""
    cells = [[fn(r.results) for _, fn in RESULT_CELLS] for r in results]
    shown = [i for i in range(len(RESULT_CELLS)) if any(row[i] for row in cells)]
    header = ("run", "status", "action", "wall min", *(RESULT_CELLS[i][0] for i in shown))
    rows = [header]
    errors = []
    for r, row in zip(results, cells):
        rows.append((r.name, r.status, r.action, f"{r.seconds / 60:.1f}", *(row[i] for i in shown)))
        error = " ".join(r.error.split()) or (f"kept; its attempt failed: {' '.join(r.attempt_error.split())}"
                                              if r.attempt_error else "")
        errors.append(error if len(error) <= error_width else error[: error_width - 1] + "…")
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for row, error in zip(rows, [""] + errors):
        line = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].ljust(widths[2]), row[3].rjust(widths[3])]
        if error:  # a failed point: its error instead of its (empty) results
            lines.append("  ".join(line + [error]).rstrip())
        else:
            line += [row[i].rjust(widths[i]) for i in range(4, len(header))]
            lines.append("  ".join(line).rstrip())
    return "\n".join(lines)


PLUMBING_MODELS = ("tiny-random",)
"""Models with random weights, built to test the plumbing: their rewards say nothing about a method."""


def _model_of(result: RunResult) -> str | None:
    model = result.parameters.get("model")
    settings = result.parameters.get("settings")
    if isinstance(settings, dict) and settings.get("model"):
        model = settings["model"]
    run_dir = result.parameters.get("run_dir")
    if model is None and run_dir and (Path(run_dir) / "config.yaml").is_file():
        from ..runs import read_config_file

        try:
            model = read_config_file(run_dir).get("model")
        except Exception:  # noqa: BLE001 - a damaged config.yaml: its model is unknown here
            model = None
    return model


def plumbing_check_note(results: list[RunResult]) -> str:
    """A line saying which points ran on a random test model (tiny-random), whose rewards are
    meaningless: a plumbing check, not a result; "" when none did."""
    tiny = [r.name for r in results if _model_of(r) in PLUMBING_MODELS]
    if not tiny:
        return ""
    which = "every point" if len(tiny) == len(results) else ", ".join(tiny)
    return (f"note: {which} ran on tiny-random, a model with random weights: a plumbing check (the notebook, "
            "engine and files work), its rewards mean nothing about the method")
