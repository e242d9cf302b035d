"""Metrics rows as data: series, final values, seed aggregates and tables, for analysis and plots alike."""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Row = Mapping[str, Any]
Runs = Mapping[str, Sequence[Sequence[Row]]]  # method label -> one list of rows per seed


def finite(value: Any) -> bool:
    """True for a real number that is not None/NaN/inf (bools are not numbers here)."""
    if value is None or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def without_times(rows: Iterable[Row]) -> list[dict]:
    """Rows without their ``time/`` keys, which differ from run to run: what two runs of the same
    settings must agree on (``deterministic``)."""
    return [{key: value for key, value in row.items() if not key.startswith("time/")} for row in rows]


def x_key(rows: Sequence[Row]) -> str:
    """The x-axis key of a run's rows: "generation" (ES) or "step" (GRPO)."""
    for key in ("generation", "step"):
        if any(key in row for row in rows):
            return key
    return "generation"


def x_values(rows: Sequence[Row]) -> list[Any]:
    """The x value of every row (its generation or step; its position where a row lacks it)."""
    key = x_key(rows)
    # rows without the key fall back to their position, so a plot never fails on a partial row
    return [row.get(key, i) for i, row in enumerate(rows)]


def scored_here(key: str) -> bool:
    """Whether ``key`` is one of the greedy scores of a mean (train, held-out and validation prompts)."""
    return key.startswith(("eval/", "validation/")) or key in ("policy/train_reward", "policy/train_completions",
                                               "policy/eval_completions", "policy/train_tokens")


def by_mean(rows: Sequence[Row]) -> list[Row]:
    """The rows with every mean's scores moved to that mean's own row. An ES row whose scores rode
    in its generation's engine call holds the scores of the mean that produced the generation
    (``policy/generation``, one earlier); plotted against samples, they belong to that mean's row."""
    if not any("policy/generation" in row for row in rows):
        return list(rows)
    out = [{k: v for k, v in row.items() if "policy/generation" not in row or not scored_here(k)} for row in rows]
    position = {row.get("generation"): i for i, row in enumerate(rows)}
    for row in rows:
        if "policy/generation" in row and row["policy/generation"] in position:
            out[position[row["policy/generation"]]].update({k: v for k, v in row.items() if scored_here(k)})
    return out


def series(rows: Sequence[Row], key: str, x: str | None = None) -> tuple[list[float], list[float]]:
    """(xs, ys) over the rows where both the x key and `key` hold finite numbers (a mean's scores at
    that mean's own row: ``by_mean``)."""
    if scored_here(key):
        rows = by_mean(rows)
    xs_all = x_values(rows) if x is None else [row.get(x) for row in rows]
    xs, ys = [], []
    for xv, row in zip(xs_all, rows):
        yv = row.get(key)
        if finite(xv) and finite(yv):
            xs.append(float(xv))
            ys.append(float(yv))
    return xs, ys


TRAINING_SECONDS = "time/training_s"
"""A derived key (``with_training_seconds``): the seconds a run has spent training so far."""


def with_training_seconds(rows: Sequence[Row]) -> list[Row]:
    """Copies of ``rows`` with ``TRAINING_SECONDS``: the running sum of each generation's (or step's)
    ``time/generation_s`` less its ``time/eval_s``. Scoring, checkpoints and the engine's start are
    left out, so methods that score or checkpoint at other cadences (per step against per
    generation) compare by the time their training took; ``time/wall_s`` keeps everything."""
    total, out = 0.0, []
    for row in rows:
        spent = row.get("time/generation_s")
        if finite(spent):
            scoring = row.get("time/eval_s")
            total += float(spent) - (float(scoring) if finite(scoring) else 0.0)
        out.append({**row, TRAINING_SECONDS: total})
    return out


def final_value(rows: Sequence[Row], key: str) -> float | None:
    """The last finite value of `key` in a run's rows (None when it never appears)."""
    for row in reversed(rows):
        if finite(row.get(key)):
            return float(row[key])
    return None


def first_value(rows: Sequence[Row], key: str) -> float | None:
    """The first finite value of `key` in a run's rows (None when it never appears)."""
    for row in rows:
        if finite(row.get(key)):
            return float(row[key])
    return None


def best_value(rows: Sequence[Row], key: str) -> float | None:
    """The largest finite value of `key` in a run's rows (rewards are maximised; None when absent)."""
    values = [float(row[key]) for row in rows if finite(row.get(key))]
    return max(values) if values else None


# The result columns of a run, in the order summaries show them.
RESULT_COLUMNS = (
    "generation", "train_reward_start", "train_reward_final", "train_reward_best",
    "eval_reward_start", "eval_reward_final", "eval_reward_best", "kl_final",
    "completions", "tokens", "wall_s",
)


def run_summary(rows: Sequence[Row]) -> dict[str, float | None]:
    """A run's results from its metrics rows: the greedy reward of the solution (ES's mean, GRPO's
    policy) on train and eval prompts at the start (generation 0, the base or initial adapter), at the
    end and at its best; the last KL to the base model; training completions and tokens; wall time
    (s). None where not logged."""
    rows = list(rows)
    last = rows[-1] if rows else {}
    steps = last.get("generation", last.get("step"))
    summary: dict[str, float | None] = {"generation": steps if finite(steps) else None}
    for name, key in (("train_reward", "policy/train_reward"), ("eval_reward", "eval/reward")):
        summary[f"{name}_start"] = first_value(rows, key)
        summary[f"{name}_final"] = final_value(rows, key)
        summary[f"{name}_best"] = best_value(rows, key)
    summary["kl_final"] = final_value(rows, "policy/kl")
    for name, key in (("completions", "samples/completions"), ("tokens", "samples/tokens")):
        value = final_value(rows, key)
        summary[name] = int(value) if value is not None and value.is_integer() else value
    summary["wall_s"] = final_value(rows, "time/wall_s")
    return {key: summary.get(key) for key in RESULT_COLUMNS}


def aggregate_seeds(seed_rows: Sequence[Sequence[Row]], x: str, y: str,
                    max_points: int = 200) -> dict[str, list[float]]:
    """Mean, std, min and max of `y` across seeds, interpolated on a common `x` grid.

    The grid covers only the x range every seed reached (no extrapolation); it is the union of the
    seeds' own x values there, thinned to `max_points`.
    """
    curves = []
    for rows in seed_rows:
        xs, ys = series(list(rows), y, x=x)
        pairs = sorted(zip(xs, ys))
        if pairs:
            curves.append(([p[0] for p in pairs], [p[1] for p in pairs]))
    if not curves:
        return {k: [] for k in ("x", "mean", "std", "min", "max")}
    lo = max(c[0][0] for c in curves)
    hi = min(c[0][-1] for c in curves)
    if lo > hi:  # seeds do not overlap: fall back to the union of their ranges
        lo, hi = min(c[0][0] for c in curves), max(c[0][-1] for c in curves)
    grid = sorted({v for c in curves for v in c[0] if lo <= v <= hi})
    if len(grid) > max_points:
        grid = [lo + (hi - lo) * i / (max_points - 1) for i in range(max_points)]
    values = [[interp(g, cx, cy) for cx, cy in curves] for g in grid]  # (len(grid), seeds)
    mean = [sum(v) / len(v) for v in values]
    std = [math.sqrt(sum((a - m) ** 2 for a in v) / len(v)) for v, m in zip(values, mean)]
    return {"x": grid, "mean": mean, "std": std,
            "min": [min(v) for v in values], "max": [max(v) for v in values]}


def interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Linear interpolation, clamped at the ends (like numpy.interp)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    lo, hi = 0, len(xs) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if xs[mid] <= x:
            lo = mid
        else:
            hi = mid
    if xs[hi] == xs[lo]:
        return ys[hi]
    t = (x - xs[lo]) / (xs[hi] - xs[lo])
    return ys[lo] + t * (ys[hi] - ys[lo])


def completions_table(rows: Iterable[Mapping[str, Any]], max_chars: int | None = 200):
    """A pandas DataFrame of dicts (prompts, completions, rewards), long strings shortened."""
    import pandas as pd  # imported here: only tables need pandas

    def short(v: Any) -> Any:
        if max_chars is not None and isinstance(v, str) and len(v) > max_chars:
            return v[: max_chars - 1] + "…"
        return v

    return pd.DataFrame([{k: short(v) for k, v in dict(r).items()} for r in rows])


def wrap_table(table, max_width: str = "40em", precision: int = 3):
    """A DataFrame for display with every text whole and wrapped (pandas cuts cells at 50 characters):
    a Styler with pre-wrapped cells of at most ``max_width``, numbers to ``precision`` decimals."""
    cells = f"white-space: pre-wrap; max-width: {max_width}; text-align: left; vertical-align: top"
    return table.style.format(precision=precision).set_table_styles([{"selector": "td", "props": cells}])
