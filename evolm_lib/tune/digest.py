"""A study's tables (``report.study_tables``) as the Markdown a findings section quotes (``summary.md``):
each method's trials, winner and setting, the held-out scores over the final seeds with their
intervals, the comparisons, the control, the base model's line and the winners' geometry; and
``write_study_tables``, which writes the tables and the digest of a study folder or an export."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from .export import read_study
from .report import lacking, study_tables


def left_lines(left) -> list[str]:
    """The digest's line on what is left, in worker-hours at each method's own pace (``left_table``)."""
    if left is None or left.empty:
        return []
    known = left[~left["seconds_left"].isna()]
    unpaced = [name for name in left.index if name not in known.index]
    parts = [f"{name} {seconds / 3600:.1f}" for name, seconds in known["seconds_left"].items() if seconds > 0]
    return [f"Left, in one worker's hours at the pace of each method's own finished runs (`left.csv`; a floor, the "
            f"engines a card as they ran): about {known['seconds_left'].sum() / 3600:.1f} in all"
            + (f" ({', '.join(parts)})" if parts else "")
            + (f"; not paced yet: {_and(unpaced)}" if unpaced else "") + ".", ""]


def interim_lines(completeness) -> list[str]:
    """The digest's warning, naming what each row lacks, where a row of ``completeness_table`` is short."""
    if completeness is None or completeness["complete"].all():
        return []
    short = [f"{name} ({', '.join(lacking(row))})" for name, row in completeness[~completeness["complete"]].iterrows()]
    return ["**Interim: the study is not finished.** Read nothing here as its result: " + _and(short) + ".", ""]


def _missing(value) -> bool:
    """None or NaN: a figure the tables have no value for."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _one_seed_side(row) -> bool:
    """Whether a comparison has a side of a single seed (no interval, permutation p or Welch's t)."""
    return min(row["seeds_a"], row["seeds_b"]) < 2


def _value(value: float, measure: str) -> str:
    """A held-out score as the README gives it: a success rate in percent, a reward as it is."""
    if _missing(value):
        return "n/a"
    return f"{100 * value:.1f} %" if measure == "success" else f"{value:.3g}"


def _interval(low: float, high: float, measure: str) -> str:
    """An interval's bounds, "43.8-45.3 %"; "-2.46 to -1.74" where a bound is negative, since a
    hyphen before a minus would read as one."""
    if any(isinstance(bound, (int, float)) and bound < 0 for bound in (low, high)):
        return f"{_value(low, measure)} to {_value(high, measure)}"
    return f"{_value(low, measure).removesuffix(' %')}-{_value(high, measure)}"


def _setting(text: str) -> str:
    """A winner's setting (JSON) in a line: numbers to 3 digits."""
    if not text:
        return ""
    return ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in json.loads(text).items())


def _mean_and_interval(row, measure: str) -> str:
    """A method's held-out mean over its seeds with its interval (BCa, or Student's t below
    ``stats.MIN_BOOTSTRAP_VALUES`` seeds: ``study_table``'s ``interval``), "-2.34 (-2.47 to -1.83)"; over
    one seed there is no spread to draw an interval from (the bootstrap gives the value three times),
    and the cell says so."""
    if row["seeds"] < 2:
        return f"{_value(row['mean'], measure)} (one seed)"
    return f"{_value(row['mean'], measure)} ({_interval(row['ci_low'], row['ci_high'], measure)})"


def _difference(row, scale: float, unit: str) -> str:
    """A comparison's difference with its interval (BCa, or Welch's t where a side has fewer than
    ``stats.MIN_BOOTSTRAP_VALUES`` seeds), "+0.133 (+0.0333 to +0.233)"; where there is
    none to draw (a side with a single seed), the cell says so rather than "+nan to +nan"."""
    difference = f"{scale * row['difference']:+.3g}{unit}"
    if _missing(row["ci_low"]) or _missing(row["ci_high"]):
        return f"{difference} (no interval: one seed on a side)" if _one_seed_side(row) else f"{difference} (no interval)"
    return f"{difference} ({scale * row['ci_low']:+.3g} to {scale * row['ci_high']:+.3g})"


def _p(value, row=None) -> str:
    """A p-value to two digits; a permutation p drawn by Monte Carlo (``row``'s ``exact`` False) is an
    estimate that cannot fall below its floor (``smallest_p``), and the cell says so."""
    if _missing(value):
        return ""
    if row is not None and not bool(row.get("exact", True)):
        return f"{value:.2g} (sampled; floor {row['smallest_p']:.1g})"
    return f"{value:.2g}"


def study_digest(tables: Mapping[str, Any], title: str) -> str:
    """The tables a findings section quotes, as Markdown: each method's trials, winner and setting,
    its held-out score over the final seeds with its interval (BCa, or t below five seeds), the t
    interval and the seed spread, at twice
    the budget where continued, the tokens it generated and its training seconds (the means over the
    seeds) with the engines per card they ran at and the compute processes seen on the card; where
    and with what code the final seeds ran; then the comparisons (the declared family Holm-corrected,
    the rest exploratory) and the shuffled-fitness control. A plain sweep's runs go in the same table;
    where their budgets differ, the digest says so and reads each method at the common budget too.
    Pairs whose seed counts cannot reach the comparisons' alpha are named (``too_few_seeds``)."""
    import pandas as pd

    measure = next(iter(tables.values())).attrs.get("measure", "") if tables else ""
    winners, long, sweep = tables.get("winners"), tables.get("long"), tables.get("sweep")
    intervals = ("95 % interval across seeds: BCa bootstrap from 5 seeds, Student's t below, where a bootstrap "
                 "has too few distinct resamples")
    lines = [f"# {title}", "", f"Held-out {measure} over the final seeds: mean ({intervals}), t interval, "
             "seed standard deviation; the winner's validation score in brackets." if winners is not None else
             f"Held-out {measure} over each method's seeds: mean ({intervals}), t interval, seed standard deviation.", ""]
    lines += interim_lines(tables.get("completeness"))
    lines += left_lines(tables.get("left"))
    parts = [table for table in (tables.get("heldout"), tables.get("control")) if table is not None]
    tuned = pd.concat(parts) if parts else None  # the control's rows under their own names
    finals = [table for table in (tuned, sweep) if table is not None]
    heldout = pd.concat(finals) if finals else None
    methods = list(dict.fromkeys([*(winners.index if winners is not None else []),
                                  *(heldout.index if heldout is not None else [])]))
    lines += ["| method | trials | winner | setting | seeds | held out | t interval | seed std | at 2x "
              "| generated tokens | training s (engines a card; processes on it) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for method in methods:
        row = winners.loc[method] if winners is not None and method in winners.index else None
        final = heldout.loc[method] if heldout is not None and method in heldout.index else None
        later = long.loc[method] if long is not None and method in long.index else None
        cells = [method,
                 "" if row is None else f"{int(row['trials'])}",
                 "" if row is None or row["winner_trial"] is None or math.isnan(row["winner_trial"])
                 else f"trial {int(row['winner_trial'])} ({row['validation_score']:.3g})",
                 "" if row is None else _setting(row["setting"]),
                 "" if final is None else f"{int(final['seeds'])}",
                 "" if final is None else _mean_and_interval(final, measure),
                 "" if final is None or final["seeds"] < 2 else _interval(final["t_low"], final["t_high"], measure),
                 "" if final is None or final["seeds"] < 2 else (f"{100 * final['seed_std']:.1f} points"
                                                                 if measure == "success" else f"{final['seed_std']:.3g}"),
                 "" if later is None else _mean_and_interval(later, measure),
                 "" if final is None or math.isnan(final["generated_tokens"]) else f"{final['generated_tokens']:,.0f}",
                 "" if final is None or math.isnan(final["training_seconds"])
                 else f"{final['training_seconds']:.0f} ({final['engines_per_card'] or 'n/a'}"
                      + (f", {final['mps']}" if final.get("mps") else "")
                      + (f"; {final['processes_on_card']})" if final.get("processes_on_card") else ")")]
        lines.append("| " + " | ".join(cells) + " |")
    if tuned is not None:
        lines += ["", _where("The final seeds", tuned)]
    if long is not None:
        lines += ["", _where("The runs at twice the budget", long)]
    if sweep is not None:
        lines += ["", _where("The runs", sweep)]
        if "sweep_equal_budget" in tables:  # study_tables reads the methods there where their budgets differ
            lines += ["", "Not an equal-budget comparison: the methods trained on different numbers of completions, " + _and(
                [f"{method} on {completions:,.0f}" for method, completions in sweep["training_completions"].items()])
                + " (means over the seeds)."]
    lines += equal_budget_digest(tables.get("sweep_equal_budget"))
    lines += answers_digest(heldout, long)
    if tables.get("base") is not None:
        lines += ["", base_line(tables["base"].iloc[0], measure)]
    in_measure = measure == "success"  # differences in percentage points; the evaluation reward's as they are
    for name, heading, points in (
            ("comparisons", "Comparisons at the budget", in_measure),
            ("long_comparisons", "Comparisons at twice the budget", in_measure),
            ("control_comparisons", "The shuffled-fitness control", in_measure),
            ("sweep_comparisons", "Comparisons of the runs, each at its own budget", in_measure),
            ("sweep_equal_budget_tests", "Comparisons at the common budget, of the evaluation reward there", False)):
        table = tables.get(name)
        if table is None or table.empty:
            continue
        lines += ["", f"{heading} (difference a - b with its interval: BCa, or Welch's t where a side has fewer than "
                      "5 seeds; permutation p over seeds, every split enumerated unless marked sampled; "
                      "Holm over the declared family):", "",
                  "| a | b | family | difference | permutation p | Holm p | beyond seed noise |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        scale, unit = (100, " points") if points else (1, "")
        for _, row in table.sort_values(["family", "method_a", "method_b"], ascending=[False, True, True]).iterrows():
            lines.append(f"| {row['method_a']} | {row['method_b']} | {row['family']} | {_difference(row, scale, unit)} | "
                         f"{_p(row['permutation_p'], row)} | {_p(row.get('holm_p'))} | {row['larger_than_seed_noise']} |")
        lines += too_few_seeds(table)
    reach = tables.get("reach")
    if reach is not None and not reach.empty:
        lines += ["", "How soon each method of a declared pair reaches the score the weaker of the two ends with "
                      "(the evaluation reward in the rows, the mean over the seeds; medians over the seeds that reach it):", "",
                  "| a | b | target | method | seeds reaching it | training s | training completions |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for _, row in reach.iterrows():
            lines.append(f"| {row['a']} | {row['b']} | {_value(row['target'], measure)} | {row['method']} | "
                         f"{int(row['reached'])} of {int(row['seeds'])} | "
                         f"{'' if math.isnan(row['training_seconds']) else format(row['training_seconds'], '.0f')} | "
                         f"{'' if math.isnan(row['completions']) else format(row['completions'], ',.0f')} |")
    lines += geometry_digest(tables, measure)
    return "\n".join(lines) + "\n"


def _where(runs: str, table) -> str:
    """Where a stage's runs ran, as a sentence starting with ``runs``: the devices, engines a card and
    code, one clause per group of methods that share them when the methods differ (a seconds column
    compares only within one such group)."""
    def listed(rows, column: str) -> str:
        return ", ".join(sorted({part for cell in rows[column].fillna("") for part in str(cell).split(", ") if part}))

    def place(rows) -> tuple[str, str]:
        code, mps = listed(rows, "code"), listed(rows, "mps") if "mps" in rows else ""
        return (f"{listed(rows, 'device') or 'unrecorded devices'}, "
                f"{listed(rows, 'engines_per_card') or 'an unrecorded number of'} engines a card"
                + (f" ({mps})" if mps else ""),
                f"code {code if code else 'not recorded (runs from before placement.jsonl recorded it)'}")

    places: dict[tuple[str, str], list[str]] = {}
    for method in table.index:
        places.setdefault(place(table.loc[[method]]), []).append(str(method))
    if len(places) == 1:
        where, code = next(iter(places))
        return f"{runs} ran on {where}; {code}."
    return f"{runs} ran in {len(places)} places: " + "; ".join(
        f"{_and(methods)} on {where}, {code}" for (where, code), methods in places.items()) + "."


def equal_budget_digest(table) -> list[str]:
    """``analysis.equal_budget_table`` as digest lines: each method's evaluation reward at the largest
    budget every run reached (each run's interpolated linearly between its logged points), beside
    what it ended with at its own budget."""
    if table is None:
        return []
    lines = ["", f"At the common budget of {table.attrs['budget']:,.0f} training completions (the evaluation reward "
                 "in the rows, each run's interpolated linearly between its logged points there; mean and seed "
                 "standard deviation):", "",
             "| method | seeds | at the common budget | at its own budget (training completions) |",
             "| --- | --- | --- | --- |"]
    for method, row in table.iterrows():
        lines.append(f"| {method} | {int(row['seeds'])} | {row['reward_mean']:.3g} (std {row['reward_std']:.2g}) | "
                     f"{row['final_reward_mean']:.3g} ({row['final_budget_mean']:,.0f}) |")
    return lines


def too_few_seeds(table) -> list[str]:
    """A line for the pairs whose seed counts cannot reach the comparisons' alpha: the smallest p an
    exact permutation test over seeds can give (``smallest_p``; 0.1 for 3 against 3) is above it, so
    such a pair is never called beyond seed noise, however large its difference; Welch's t p beside it,
    for reference, as the table keeps it."""
    alpha = table.attrs.get("alpha", 0.05)
    short = table[table["smallest_p"] >= alpha]
    if short.empty:
        return []
    pairs = [f"{row['method_a']} - {row['method_b']} ({int(row['seeds_a'])} and {int(row['seeds_b'])} seeds: "
             f"smallest p {row['smallest_p']:.2g}; {_welch(row)})" for _, row in short.iterrows()]
    return ["", f"Too few seeds to call beyond seed noise at {alpha:g}, whatever the difference: " + _and(pairs) + "."]


def _welch(row) -> str:
    """Welch's t p for the too-few-seeds line, or why there is none: it needs two seeds a side (a
    variance each), and some spread within them."""
    if not _missing(row["welch_p"]):
        return f"Welch's t p {_p(row['welch_p'])}"
    return "no Welch's t with one seed on a side" if _one_seed_side(row) else "no Welch's t: no spread within either side"


ANSWER_LINES = {
    "empty_answers": "Empty held-out answers (nothing but whitespace; where the reward is minus the length gap, "
                     "an empty one scores minus the target's length)",
    "target_answers": "Held-out answers that hold their target as a word, in any case (whether they are right, "
                      "which a length reward does not check)",
}
"""The digest's line for each of the held-out table's answer shares (``analysis.ANSWER_SHARES``)."""


def answers_digest(heldout, long) -> list[str]:
    """A line for each share of held-out answers the tables have (``ANSWER_LINES``: empty ones, ones
    that hold their target), naming each method's at the budget and at twice it."""
    lines = []
    for column, opening in ANSWER_LINES.items():
        shares = []
        for table, where in ((heldout, ""), (long, " at twice the budget")):
            if table is None or column not in table:
                continue
            shares += [f"{method}{where} {100 * share:.0f} %" for method, share in table[column].items()
                       if not math.isnan(share)]
        if shares:
            lines += ["", f"{opening}, the mean share over the seeds: " + _and(shares) + "."]
    return lines


def base_line(base: Mapping[str, Any], measure: str) -> str:
    """The digest's line for the base model's held-out summary (``analysis.heldout_summary``, from
    ``tune.base_answers``): its mean in ``measure`` and its answers' shares, where judged."""
    from ..analysis import HELDOUT_MEASURES

    key = HELDOUT_MEASURES.get(measure, ("success",))[0]
    shares = [f"{100 * base[flag]:.0f} % {words}" for flag, words in (("empty", "of its answers empty"),
                                                                       ("has_target", "holding their target"))
              if flag in base and not math.isnan(base[flag])]
    return (f"The base model, untrained, on the same {int(base['problems'])} held-out problems (`python -m "
            f"evolm_lib.tune.base_answers`): {_value(base[key], measure)}" + (f", {_and(shares)}" if shares else "") + ".")


def _and(words: Sequence[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def geometry_digest(tables: Mapping[str, Any], measure: str) -> list[str]:
    """The geometry tables as Markdown lines (none without them)."""
    updates, cosines, paths = (tables.get(f"geometry_{name}") for name in ("updates", "cosines", "paths"))
    lines = []
    if updates is not None:
        task = next((t for t in updates["drift_task"] if isinstance(t, str)), None)
        lines += ["", f"The winners' geometry over {int(updates['seeds'].max())} final seeds (mean, seed standard "
                      "deviation): the update's norm, relative to the norm of the weights it moved, and the share "
                      "of those weights it changed in the engine's dtype"
                      + (f"; the drift, mean KL to the base model on {task}'s held-out prompts:" if task else ":"), "",
                  "| method | form | update norm | relative | weights changed |" + (" drift KL |" if task else ""),
                  "| --- | --- | --- | --- | --- |" + (" --- |" if task else "")]
        for method, row in updates.iterrows():
            cells = [method, row["form"], f"{row['update_norm']:.3g} ({row['update_norm_sd']:.2g})",
                     f"{row['relative_norm']:.3g}", f"{100 * row['changed_share']:.1f} %"]
            if task:
                cells.append("" if math.isnan(row["drift_kl"]) else f"{row['drift_kl']:.3g} ({row['drift_kl_sd']:.2g})")
            lines.append("| " + " | ".join(cells) + " |")
    if cosines is not None:
        lines += ["", "The cosine between two methods' updates at the same seed (mean over the seeds; lowest to highest), "
                      "beside its chance level 1/sqrt(d), the spread of the cosine between two unrelated directions "
                      "in the d dimensions compared:",
                  "", "| a | b | cosine | range | chance level |", "| --- | --- | --- | --- | --- |"]
        for _, row in cosines.iterrows():
            lines.append(f"| {row['a']} | {row['b']} | {row['cosine']:.2g} | {row['lowest']:.2g} to {row['highest']:.2g} "
                         f"| {row['chance']:.2g} |")
    if paths is not None:
        points = [c for c in paths.columns if c.startswith("t=")]
        lines += ["", "Held-out mean reward (a task scored right or wrong: its success) along the straight path from a "
                      "to b, the weights written in place, and its barrier, the largest drop below the line between "
                      "the ends:", "",
                  "| a | b | seed | " + " | ".join(points) + " | barrier |",
                  "| --- | --- | --- | " + " | ".join("---" for _ in points) + " | --- |"]
        for _, row in paths.iterrows():
            lines.append(f"| {row['a']} | {row['b']} | {int(row['seed'])} | "
                         + " | ".join(_value(row[c], measure) for c in points) + f" | {_value(row['barrier'], measure)} |")
    return lines


DIGEST = "summary.md"
"""The Markdown digest ``write_study_tables`` writes beside the CSV tables."""


def write_study_tables(study_dir: str | Path, out_dir: str | Path, measure: str | None = None,
                       storage: str | None = None, title: str | None = None) -> list[Path]:
    """Every table of ``study_tables`` of a study folder or an export as OUT/<name>.csv, and their
    digest as OUT/summary.md (``digest.study_digest``, headed ``title``, else the folder's name);
    returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    tables = study_tables(read_study(study_dir, storage), measure)
    for name, table in tables.items():
        path = out / f"{name}.csv"
        table.to_csv(path, float_format="%.6g")
        paths.append(path)
    if tables:
        digest = out / DIGEST
        digest.write_text(study_digest(tables, title=title or Path(study_dir).resolve().name))
        paths.append(digest)
    return paths

