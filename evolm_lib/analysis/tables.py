"""Statistics and comparison tables of loaded runs: final points and KL, seed spread, the reward at
an equal sample budget (the fair comparison), and the study's held-out tables with bootstrap
intervals and seed-noise tests (`study_table`, `method_comparisons`; the maths in `evolm_lib.stats`)."""
from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from ..metrics import by_mean, final_value, finite, interp, series
from ..stats import MAX_EXACT_SPLITS, bootstrap_interval, compare_seeds, holm, interquartile_mean, seed_interval, t_interval
from .completions import ANSWER_SHARES, answer_share
from .load import HELDOUT_MEASURES, Groups, RunRecord, heldout_rows


def runs_for_plots(groups: Groups) -> dict[str, list[list[dict]]]:
    """{label: [rows of seed 0, rows of seed 1, ...]}: the input of the plots' ES-vs-GRPO figures."""
    return {label: [record.rows for record in runs] for label, runs in groups.items()}


def describe_runs(groups: Groups):
    """One line per run: label, seed, folder, steps, samples, wall time and final rewards (a DataFrame)."""
    import pandas as pd

    lines = []
    for label, runs in groups.items():
        for r in runs:
            last = r.rows[-1]
            lines.append({
                "method": label, "seed": r.seed, "run": r.name, "kind": r.kind,
                "steps": last.get("generation", last.get("step")),
                "samples/completions": final_value(r.rows, "samples/completions"),
                "time/wall_s": final_value(r.rows, "time/wall_s"),
                "policy/train_reward": final_value(r.rows, "policy/train_reward"),
                "eval/reward": final_value(r.rows, "eval/reward"),
            })
    return pd.DataFrame(lines)


# --------------------------------------------------------------------------- final values


def final_points(groups: Groups, reward_key: str = "eval/reward", kl_key: str = "policy/kl") -> list[dict]:
    """One {method, seed, kl, reward} per run: the last logged reward, and KL from the last row that
    has it (None when no row does)."""
    return [{"method": label, "seed": r.seed, "kl": final_value(r.rows, kl_key), "reward": final_value(r.rows, reward_key)}
            for label, runs in groups.items() for r in runs]


def checkpoint_points(groups: Groups, reward_key: str = "eval/reward") -> list[dict]:
    """One {method, seed, generation, kl, reward} per measured checkpoint (kl.jsonl of ``evolm sweep``):
    each run's path through reward and KL, to compare the methods at equal reward. [] when none has any."""
    from ..runs import read_checkpoint_kls

    points = []
    for label, runs in groups.items():
        for record in runs:
            by_generation = {row.get("generation", row.get("step")): row.get(reward_key) for row in by_mean(record.rows)}
            for entry in read_checkpoint_kls(record.path):
                reward = by_generation.get(entry["generation"])
                if reward is not None:
                    points.append({"method": label, "seed": record.seed, "generation": entry["generation"],
                                   "kl": entry["policy/kl"], "reward": reward})
    return points


def split_points_by_kl(points: Sequence[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], str]:
    """(points with a KL, a note naming the runs without one: they are left out of the scatter)."""
    kept = [p for p in points if p.get("kl") is not None and p.get("reward") is not None]
    left_out = [f"{p.get('method')} seed {p.get('seed')}" for p in points if p not in kept]
    note = ""
    if left_out:
        note = (f"{len(left_out)} run(s) without a KL or reward left out of the scatter: {', '.join(left_out)} "
                "(`evolm sweep` records policy/kl at the end of each run)")
    return kept, note


def _std(values: Sequence[float]) -> float:
    """Sample std (n - 1); NaN for fewer than two values."""
    if len(values) < 2:
        return math.nan
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def seed_spread_table(groups: Groups, key: str = "eval/reward"):
    """Per method: seeds, mean, std (n - 1), min, max of the final `key` across seeds, and, when ES
    runs are among them, `std(es)/std`: ES's std over this method's (1 on the ES row itself)."""
    import pandas as pd

    lines = []
    for label, runs in groups.items():
        finals = [v for v in (final_value(r.rows, key) for r in runs) if v is not None]
        lines.append({"method": label, "seeds": len(finals),
                      "mean": sum(finals) / len(finals) if finals else math.nan, "std": _std(finals),
                      "min": min(finals, default=math.nan), "max": max(finals, default=math.nan)})
    # the LoRA ES runs when there are several ES modes; else the first ES label
    es_labels = [label for label, runs in groups.items() if runs and runs[0].kind == "es"]
    es_label = next((label for label in es_labels if groups[label][0].es_mode == "lora"), next(iter(es_labels), None))
    if es_label is not None:
        es_std = next(line["std"] for line in lines if line["method"] == es_label)
        for line in lines:
            # a zero std has no ratio: NaN rather than inf
            line["std(es)/std"] = es_std / line["std"] if line["std"] else math.nan
    table = pd.DataFrame(lines).set_index("method")
    table.attrs["key"] = key
    return table


def reward_label(groups: Groups) -> str | None:
    """The compared runs' reward in words (their task's ``reward_label``), for axis titles."""
    from ..tasks import get_task

    first = next((r for runs in groups.values() for r in runs), None)
    if first is None:
        return None
    try:
        return get_task(first.config.get("task", "conciseness"), **(first.config.get("task_options") or {})).reward_label
    except Exception:  # noqa: BLE001 - a task file moved since: the axes say "reward" without its definition
        return None


# --------------------------------------------------------------------------- the fair comparison


def _curve(record: RunRecord, budget_key: str, reward_key: str) -> tuple[list[float], list[float]]:
    """(budgets, rewards) of a run's rows that have both, in budget order."""
    pairs = sorted(zip(*series(record.rows, reward_key, x=budget_key)))
    if not pairs:
        raise ValueError(f"{record.path} has no row with both {budget_key!r} and {reward_key!r}")
    return [p[0] for p in pairs], [p[1] for p in pairs]


def equal_budget_table(groups: Groups, budget_key: str = "samples/completions", reward_key: str = "eval/reward"):
    """Reward of each method at the largest `budget_key` every run reached, interpolated linearly
    between the logged points of each run, then mean/std/min/max across seeds (a DataFrame; the
    common budget is also in `.attrs["budget"]`)."""
    import pandas as pd

    curves = {label: [_curve(r, budget_key, reward_key) for r in runs] for label, runs in groups.items()}
    if not curves:
        raise ValueError("no runs to compare")
    budget = min(xs[-1] for runs in curves.values() for xs, _ in runs)
    lines = []
    for label, runs in curves.items():
        values = [interp(budget, xs, ys) for xs, ys in runs]
        lines.append({"method": label, "seeds": len(values), budget_key: budget,
                      "reward_mean": sum(values) / len(values), "reward_std": _std(values),
                      "reward_min": min(values), "reward_max": max(values),
                      "final_budget_mean": sum(xs[-1] for xs, _ in runs) / len(runs),
                      "final_reward_mean": sum(ys[-1] for _, ys in runs) / len(runs)})
    table = pd.DataFrame(lines).set_index("method")
    table.attrs.update(budget=budget, budget_key=budget_key, reward_key=reward_key)
    return table


def equal_budget_comparisons(groups: Groups, budget_key: str = "samples/completions", reward_key: str = "eval/reward",
                             alpha: float = 0.05, level: float = 0.95, num_resamples: int = 10_000, seed: int = 0):
    """``method_comparisons`` at the common budget of ``equal_budget_table``: each run's `reward_key`
    interpolated at the largest `budget_key` every run reached, compared pair by pair across seeds
    (runs stopped before their budget included: the fair comparison when some did not finish).
    ``.attrs["budget"]`` holds that budget."""
    budget = equal_budget_table(groups, budget_key, reward_key).attrs["budget"]
    per_seed = {label: [interp(budget, *_curve(r, budget_key, reward_key)) for r in runs] for label, runs in groups.items()}
    table = _pairwise(per_seed, alpha=alpha, level=level, num_resamples=num_resamples, seed=seed)
    table.attrs.update(budget=budget, budget_key=budget_key, reward_key=reward_key, alpha=alpha, level=level)
    return table


# --------------------------------------------------------------------------- the study: held-out scores


def _measure(measure: str) -> tuple[str, str]:
    """(heldout.jsonl field, label key) of a measure; fails naming the setting."""
    if measure not in HELDOUT_MEASURES:
        raise ValueError(f"measure: one of {', '.join(map(repr, HELDOUT_MEASURES))} (share of problems solved, "
                         f"or the task's mean reward where accuracy does not apply), got {measure!r}")
    return HELDOUT_MEASURES[measure]


def default_measure(groups: Groups) -> str:
    """The held-out measure of the compared runs' task (its ``heldout_measure``: "reward" for
    conciseness, "success" for arithmetic and countdown); "success" when the task no longer loads."""
    from ..tasks import get_task

    first = next((r for runs in groups.values() for r in runs), None)
    if first is None:
        return "success"
    try:
        task = get_task(first.config.get("task", "conciseness"), **(first.config.get("task_options") or {}))
    except Exception:  # noqa: BLE001 - a task file moved since: the share of problems solved
        return "success"
    return task.heldout_measure


def heldout_scores(record: RunRecord, measure: str = "success") -> list[float] | None:
    """One number per held-out problem of a run: 1.0 or 0.0 for ``measure="success"``, the task's
    reward for ``"reward"``; None when the run has no heldout.jsonl."""
    field_name, _ = _measure(measure)
    rows = heldout_rows(record)
    if rows is None:
        return None
    return [float(bool(row[field_name])) if field_name == "success" else float(row[field_name]) for row in rows]


def _runs_with_scores(groups: Groups, measure: str) -> tuple[dict[str, list[tuple[RunRecord, list[float]]]], list[str]]:
    """{label: [(run, its held-out scores), ...]} of the runs that have any, and the names of those left out.
    Each run comes back carrying its held-out rows, so what reads them next reads no file again."""
    kept: dict[str, list[tuple[RunRecord, list[float]]]] = {}
    left_out = []
    for label, runs in groups.items():
        for record in runs:
            record = dataclasses.replace(record, heldout=heldout_rows(record))
            scores = heldout_scores(record, measure)
            if scores:
                kept.setdefault(label, []).append((record, scores))
            else:
                left_out.append(f"{label} seed {record.seed} ({record.name})")
    return kept, left_out


def _left_out_note(left_out: Sequence[str]) -> str:
    return (f"{len(left_out)} run(s) without held-out scores left out: {', '.join(left_out)} "
            "(`evolm sweep` writes heldout.jsonl after each run)") if left_out else ""


def _seconds_per_step(rows: Sequence[Mapping[str, Any]]) -> list[float]:
    return [float(row["time/generation_s"]) for row in rows if finite(row.get("time/generation_s"))]


def heldout_table(groups: Groups, measure: str = "success", level: float = 0.95, num_resamples: int = 10_000,
                  seed: int = 0):
    """One row per run: its held-out score (mean over problems of ``measure``) with a percentile
    bootstrap interval over problems (`stats.bootstrap_interval`, ``seed``), the problem count, and the
    final KL to the base model (a DataFrame: method, seed, run, problems, value, ci_low, ci_high, kl).
    Runs without heldout.jsonl get 0 problems and NaN scores."""
    import pandas as pd

    _measure(measure)
    lines = []
    for label, runs in groups.items():
        for record in runs:
            scores = heldout_scores(record, measure)
            value, low, high = (bootstrap_interval(scores, level=level, num_resamples=num_resamples, seed=seed)
                                if scores else (math.nan, math.nan, math.nan))
            kl = final_value(record.rows, "policy/kl")
            lines.append({"method": label, "seed": record.seed, "run": record.name, "problems": len(scores or ()),
                          "value": value, "ci_low": low, "ci_high": high, "kl": math.nan if kl is None else kl})
    table = pd.DataFrame(lines, columns=["method", "seed", "run", "problems", "value", "ci_low", "ci_high", "kl"])
    table.attrs.update(measure=measure, key=HELDOUT_MEASURES[measure][1], level=level)
    return table


def study_table(groups: Groups, measure: str = "success", level: float = 0.95, num_resamples: int = 10_000,
                seed: int = 0):
    """One row per method, from each run's heldout.jsonl (a DataFrame indexed by method).

    Columns: ``seeds`` (runs with held-out scores), ``problems`` (the fewest any of them scored);
    ``mean``, ``ci_low``, ``ci_high``: the mean across seeds of each run's held-out score (share of
    problems solved for ``measure="success"``, mean task reward for ``"reward"``, e.g. minus the
    length gap for conciseness) with a BCa bootstrap interval across seeds at ``level``
    (`stats.seed_interval`; NaN where BCa is undefined; Student's t below ``stats.MIN_BOOTSTRAP_VALUES``
    seeds), ``interval`` naming which; ``t_low``, ``t_high``: Student's t
    interval across seeds (`stats.t_interval`); for ``measure="success"`` both are cut to [0, 1]; ``iqm``: the interquartile mean across seeds;
    ``seed_std`` (n - 1), ``min``, ``max``; ``per_seed``: each seed's score and its bootstrap interval
    over problems, as text; ``kl_mean``, ``kl_std``: final KL to the base model across seeds;
    ``seconds_per_step``: median `time/generation_s` over every generation or step of every seed;
    ``training_completions``: mean final `samples/completions`; ``empty_answers`` and
    ``target_answers``: the mean across seeds of the share of held-out answers that were empty and that
    held their target (``answer_share``), each a column only where some run's rows say. Runs without
    heldout.jsonl are left out, named in ``.attrs["note"]``; ``.attrs`` also holds measure, key (the
    axis label key) and level.
    """
    import pandas as pd

    _measure(measure)
    kept, left_out = _runs_with_scores(groups, measure)
    lines = []
    for label, pairs in kept.items():
        values, texts = [], []
        for record, scores in pairs:
            value, low, high = bootstrap_interval(scores, level=level, num_resamples=num_resamples, seed=seed)
            values.append(value)
            texts.append(f"{record.seed}: {value:.3g} [{low:.3g}, {high:.3g}]")
        mean, low, high, interval = seed_interval(values, level=level, num_resamples=num_resamples, seed=seed)
        _, t_low, t_high = t_interval(values, level=level)
        if measure == "success":  # a share lies in [0, 1]: an interval cut to it covers the true share as often
            low, high, t_low, t_high = (min(max(bound, 0.0), 1.0) for bound in (low, high, t_low, t_high))
        kls = [kl for kl in (final_value(record.rows, "policy/kl") for record, _ in pairs) if kl is not None]
        seconds = [s for record, _ in pairs for s in _seconds_per_step(record.rows)]
        completions = [c for c in (final_value(record.rows, "samples/completions") for record, _ in pairs) if c is not None]
        shares = {column: [share for share in (answer_share(record, flag) for record, _ in pairs) if share is not None]
                  for column, flag in ANSWER_SHARES.items()}
        lines.append({
            "method": label, "seeds": len(values), "problems": min(len(scores) for _, scores in pairs),
            "mean": mean, "ci_low": low, "ci_high": high, "interval": interval, "t_low": t_low, "t_high": t_high,
            "iqm": interquartile_mean(values), "seed_std": _std(values),
            "min": min(values), "max": max(values), "per_seed": "; ".join(texts),
            "kl_mean": sum(kls) / len(kls) if kls else math.nan, "kl_std": _std(kls),
            "seconds_per_step": statistics.median(seconds) if seconds else math.nan,
            "training_completions": sum(completions) / len(completions) if completions else math.nan,
            **{column: statistics.fmean(found) if found else math.nan for column, found in shares.items()},
        })
    columns = ["method", "seeds", "problems", "mean", "ci_low", "ci_high", "interval", "t_low", "t_high", "iqm", "seed_std",
               "min", "max", "per_seed",
               "kl_mean", "kl_std", "seconds_per_step", "training_completions"]
    # runs that kept no answers, or no flags for them: no such column
    columns += [column for column in ANSWER_SHARES if any(not math.isnan(line[column]) for line in lines)]
    table = pd.DataFrame(lines, columns=columns).set_index("method")
    table.attrs.update(measure=measure, key=HELDOUT_MEASURES[measure][1], level=level, note=_left_out_note(left_out))
    return table


def _pairwise(per_seed: Mapping[str, Sequence[float]], primary: Sequence[tuple[str, str]] = (), **settings):
    """The comparisons table of ``method_comparisons`` from {method: per-seed values}: the pairs named
    in ``primary`` form the family Holm's correction covers, every other pair is exploratory."""
    import pandas as pd

    declared = {frozenset(pair) for pair in primary}
    unknown = [pair for pair in primary if not set(pair) <= set(per_seed)]
    if unknown:
        raise ValueError(f"primary: {unknown} name methods without held-out scores; methods: {list(per_seed)}")
    lines = []
    for first, second in itertools.combinations(per_seed, 2):
        result = compare_seeds(per_seed[first], per_seed[second], **settings)
        family = "primary" if frozenset((first, second)) in declared else "exploratory"
        lines.append({"family": family, 
            "method_a": first, "method_b": second, "seeds_a": len(per_seed[first]), "seeds_b": len(per_seed[second]),
            "difference": result.difference, "ci_low": result.low, "ci_high": result.high, "interval": result.interval,
            "permutation_p": result.permutation.p, "exact": result.permutation.exact,
            "smallest_p": result.permutation.smallest_p, "welch_t": result.welch.t, "welch_dof": result.welch.dof,
            "welch_p": result.welch.p, "larger_than_seed_noise": "yes" if result.larger_than_seed_noise else "no",
        })
    family = [i for i, line in enumerate(lines) if line["family"] == "primary"]
    alpha = settings.get("alpha", 0.05)
    _, adjusted = holm([lines[i]["permutation_p"] for i in family], alpha=alpha)
    for line in lines:
        line["holm_p"] = math.nan
    for i, p in zip(family, adjusted):
        lines[i]["holm_p"] = p
        lines[i]["larger_than_seed_noise"] = "yes" if p < alpha else "no"
    columns = ["family", "method_a", "method_b", "seeds_a", "seeds_b", "difference", "ci_low", "ci_high", "interval",
               "permutation_p", "holm_p", "exact", "smallest_p", "welch_t", "welch_dof", "welch_p",
               "larger_than_seed_noise"]
    return pd.DataFrame(lines, columns=columns)


def method_comparisons(groups: Groups, measure: str = "success", alpha: float = 0.05, level: float = 0.95,
                       num_resamples: int = 10_000, seed: int = 0, max_exact: int = MAX_EXACT_SPLITS,
                       num_permutations: int = 100_000, primary: Sequence[tuple[str, str]] = ()):
    """Every pair of methods (in label order): is their difference in held-out score larger than seed
    noise? One row per pair (a DataFrame): ``method_a``, ``method_b``, ``seeds_a``, ``seeds_b``,
    ``difference`` (mean of a's per-seed scores minus b's), ``ci_low``, ``ci_high`` (its bootstrap
    interval at ``level``; Welch's t where a side has fewer than ``stats.MIN_BOOTSTRAP_VALUES`` seeds),
    ``interval`` naming which, ``permutation_p`` (two-sided, over seed labels; ``exact``: every split
    enumerated, else a Monte Carlo estimate whose floor is ``smallest_p``), ``smallest_p`` (the least p the seed counts allow: 1/3 for 2 vs 2, 2/252 for 5 vs 5),
    ``welch_t``, ``welch_dof``, ``welch_p`` (for reference), and ``larger_than_seed_noise``: "yes"
    when permutation_p < alpha, else "no" (`stats.compare_seeds`). ``primary``: the pairs of method
    labels declared before the study; they form the family (``family`` "primary") whose p-values
    Holm's correction adjusts (``holm_p``, which then decides ``larger_than_seed_noise``); every
    other pair is "exploratory", uncorrected. Runs without heldout.jsonl are left out (``.attrs["note"]``)."""
    _measure(measure)
    kept, left_out = _runs_with_scores(groups, measure)
    per_seed = {label: [sum(scores) / len(scores) for _, scores in pairs] for label, pairs in kept.items()}
    table = _pairwise(per_seed, primary, alpha=alpha, level=level, num_resamples=num_resamples, seed=seed,
                      max_exact=max_exact, num_permutations=num_permutations)
    table.attrs.update(measure=measure, alpha=alpha, level=level, note=_left_out_note(left_out))
    return table
