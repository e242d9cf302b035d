"""A study's tables, from its folder or its export (``export.read_study``): ``evolm tune report STUDY``.

Tables (CSV): each method's tuning (trials, their states, the winner's setting and validation score,
seconds spent, engines per card), the winners' held-out score over the final seeds (mean, BCa and t
intervals, interquartile mean, training completions, generated tokens and wall seconds with the
engines per card they ran at), the comparisons (the declared family Holm-corrected, the rest
exploratory), and where present the continued reruns, the shuffled-fitness control and a plain
sweep's runs (Qiu et al.'s protocol; where its methods trained on different budgets, also each one's
evaluation reward at the common budget, and the comparisons there); the winners' geometry where
geometry.json lies beside the files; the base model's held-out summary where the study has it
(``tune.base_answers``). ``digest.study_digest`` writes them as Markdown (``summary.md``), the numbers a
findings section quotes.
"""
from __future__ import annotations

import json
import math
import statistics
from typing import Any, Mapping, Sequence

from .export import export_groups


def placements(runs: Sequence[dict]) -> dict[str, str]:
    """The devices, engines per card, compute processes on the card (their range), CUDA MPS and code
    exported runs ran at, as text ("5", "4, 5", "6-10"; "" when unrecorded): MPS as "MPS" or "MPS
    in part" where any attempt's processes shared their card through it, else ""; the code as its
    commit where known, else as its source digest (``env.code_identity``)."""
    lines = [line for run in runs for line in run.get("placement") or []]
    engines = sorted({line["engines_per_card"] for line in lines if line.get("engines_per_card") is not None})
    devices = sorted({line["device"] for line in lines if line.get("device")})
    code = sorted({line["code_commit"][:7] if line.get("code_commit") else f"digest {line['code_digest']}"
                   for line in lines if line.get("code_digest")})
    # compute processes nvidia-smi saw on the card as each run opened (engines, and GRPO policies in
    # their own processes): engines a card alone understate what a card was shared with
    seen = sorted({line["processes_on_card"] for line in lines if line.get("processes_on_card") is not None})
    processes = "" if not seen else str(seen[0]) if len(seen) == 1 else f"{seen[0]}-{seen[-1]}"
    through = {bool(line.get("cuda_mps_pipe_directory")) for line in lines}
    mps = "" if True not in through else "MPS" if through == {True} else "MPS in part"
    return {"engines_per_card": ", ".join(map(str, engines)), "device": ", ".join(devices), "code": ", ".join(code),
            "processes_on_card": processes, "mps": mps}


def first_attempt(trial: Mapping[str, Any], by_number: Mapping[int, Mapping[str, Any]]) -> int:
    """The number of the trial's first attempt, followed back through Optuna's retries of killed
    trials: the number its folder (trials/<method>/trial_NNNN) and its runs' exported lines carry."""
    number, seen = trial["number"], set()
    while by_number.get(number, {}).get("retries") is not None and number not in seen:
        seen.add(number)
        number = by_number[number]["retries"]
    return number


def counted_trials(trials: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """A method's trials as they count against its trial budget, in order: complete, pruned, and failed
    with an error. A killed trial that Optuna retried (the retry is asked later, with the same
    setting) is not counted; its retry takes its place in the order."""
    by_number = {t["number"]: t for t in trials}
    retried = {t["retries"] for t in trials if t.get("retries") is not None}
    counted = [t for t in trials if t["number"] not in retried and (
        t["state"] in ("complete", "pruned") or (t["state"] == "fail" and t.get("error") is not None))]
    return sorted(counted, key=lambda t: (first_attempt(t, by_number), t["number"]))


def trial_seconds(trial: Mapping[str, Any], by_number: Mapping[int, Mapping[str, Any]], trial_runs: Sequence[dict]) -> float:
    """What a trial took: its last attempt's seconds, or, where more, its runs' own wall clocks at
    their last rows (``time/wall_s``, which goes on across a resume from a checkpoint, where the
    attempt's seconds count only the attempt that finished it), ``trial_runs`` being its method's
    tuning runs. Work begun again from the start is in neither."""
    from ..metrics import final_value

    number = first_attempt(trial, by_number)
    walls = [final_value(run.get("rows") or [], "time/wall_s") for run in trial_runs if run["trial"] == number]
    return max(trial.get("seconds") or 0.0, sum(w for w in walls if w is not None))


def rerun_step_seconds(reruns: Sequence[dict]) -> float | None:
    """Seconds a generation or step of a method's reruns on the final seeds (``reruns``: their exported
    runs): the median over those with timed rows, finished or under way, of each one's wall clock at its
    last row over the generations or steps it reached; None where none has."""
    from ..metrics import final_value
    from ..runs import row_generation

    walls = []
    for run in reruns:
        rows = run.get("rows") or []
        wall, reached = final_value(rows, "time/wall_s"), max((row_generation(row) for row in rows), default=-1)
        if wall is not None and reached > 0:  # a timed row past generation 0
            walls.append(wall / reached)
    return statistics.median(walls) if walls else None


def method_trials(method: str, trials: Sequence[Mapping[str, Any]], runs: Sequence[dict]):
    """A method's view of the exported study: (its trials, them by number, its tuning runs, the
    trials that count against its budget (``counted_trials``), the complete ones among those)."""
    own = [t for t in trials if t["method"] == method]
    counted = counted_trials(own)
    return (own, {t["number"]: t for t in own}, [r for r in runs if r["stage"] == "trial" and r["method"] == method],
            counted, [t for t in counted if t["state"] == "complete" and t["value"] is not None])


def winners_table(trials: Sequence[dict], runs: Sequence[dict]):
    """One row per method: its trials by state, the winner (the complete trial of the highest score),
    its setting and what that setting derived (generations, split), the seconds the trials took and
    the engines per card they ran at."""
    import pandas as pd

    lines = []
    for method in dict.fromkeys(t["method"] for t in trials):
        own, by_number, trial_runs, counted, complete = method_trials(method, trials, runs)
        failed = [t for t in counted if t["state"] == "fail"]
        pruned = [t for t in counted if t["state"] == "pruned"]
        best = max(complete, key=lambda t: t["value"]) if complete else None
        lines.append({
            "method": method, "trials": len(counted), "complete": len(complete),
            "pruned": len(pruned), "failed": len(failed), "retries_of_killed": sum(t.get("retries") is not None for t in own),
            "winner_trial": best["number"] if best else None, "validation_score": best["value"] if best else math.nan,
            "setting": json.dumps(best["params"], sort_keys=True) if best else "",
            "derived": json.dumps({k: v for k, v in (best.get("config") or {}).items() if k not in best["params"]},
                                  sort_keys=True) if best else "",
            "tuning_seconds": sum(trial_seconds(t, by_number, trial_runs) for t in counted),
            **placements(trial_runs),
        })
    return pd.DataFrame(lines).set_index("method") if lines else pd.DataFrame()


def _final(groups: Mapping[str, Sequence], runs: Sequence[dict], stage: str, measure: str, label: str = "{method}"):
    """``analysis.study_table`` of a stage with the generated tokens, wall and training seconds
    (``metrics.with_training_seconds``) and placement of its runs."""
    from ..analysis import study_table
    from ..metrics import TRAINING_SECONDS, final_value, with_training_seconds

    table = study_table(groups, measure=measure)
    extra = {}
    for name in table.index:
        records = groups[name]
        own = [r for r in runs if r["stage"] == stage and label.format(method=r["method"]) == name]
        tokens = [v for v in (final_value(r.rows, "samples/tokens") for r in records) if v is not None]
        seconds = [v for v in (final_value(r.rows, "time/wall_s") for r in records) if v is not None]
        training = [with_training_seconds(r.rows)[-1][TRAINING_SECONDS] for r in records if r.rows]
        extra[name] = {"generated_tokens": statistics.fmean(tokens) if tokens else math.nan,
                       "wall_seconds": statistics.fmean(seconds) if seconds else math.nan,
                       "training_seconds": statistics.fmean(training) if training else math.nan, **placements(own)}
    for column in ("generated_tokens", "wall_seconds", "training_seconds", "engines_per_card", "processes_on_card",
                   "mps", "device", "code"):
        table[column] = [extra[name][column] for name in table.index]
    return table


def _primary(summary: dict | None, groups: Mapping[str, Sequence]) -> list[tuple[str, str]]:
    """The summary's resolved family, limited to methods with reruns."""
    family = ((summary or {}).get("primary") or {}).get("family") or []
    return [(a, b) for a, b in family if a in groups and b in groups]


def reach_table(groups: Mapping[str, Sequence], pairs: Sequence[tuple[str, str]], key: str = "eval/reward"):
    """For each pair (a, b): the target, the lower of the two methods' mean final ``key`` over their
    seeds; and for each of the two, how many seeds reach the target in their rows, and the median
    training seconds (``metrics.with_training_seconds``) and training completions at which they first
    do (over the seeds that reach it). It reads a comparison on the budget axes: how soon the
    stronger method matches what the weaker one ends with (a DataFrame: a, b, target, method, seeds,
    reached, training_seconds, completions)."""
    import pandas as pd

    from ..metrics import TRAINING_SECONDS, final_value, finite, with_training_seconds

    lines = []
    for a, b in pairs:
        finals = {m: [v for v in (final_value(r.rows, key) for r in groups[m]) if v is not None] for m in (a, b)}
        if not all(finals.values()):
            continue
        target = min(statistics.fmean(values) for values in finals.values())
        for method in (a, b):
            firsts = []
            for record in groups[method]:
                first = next((row for row in with_training_seconds(record.rows)
                              if finite(row.get(key)) and row[key] >= target), None)
                if first is not None:
                    firsts.append(first)
            seconds = [row[TRAINING_SECONDS] for row in firsts]
            completions = [row["samples/completions"] for row in firsts if row.get("samples/completions") is not None]
            lines.append({"a": a, "b": b, "target": target, "method": method, "seeds": len(groups[method]),
                          "reached": len(firsts),
                          "training_seconds": statistics.median(seconds) if seconds else math.nan,
                          "completions": statistics.median(completions) if completions else math.nan})
    return pd.DataFrame(lines, columns=["a", "b", "target", "method", "seeds", "reached", "training_seconds",
                                        "completions"])


def study_tables(compact: dict, measure: str | None = None) -> dict[str, Any]:
    """{name: DataFrame} of a exported study (see the module docstring); ``measure``: success or
    reward (default: the summary's, else the task's)."""
    import pandas as pd

    from ..analysis import default_measure, equal_budget_comparisons, equal_budget_table, method_comparisons

    runs, summary = compact["runs"], compact["summary"]
    tables: dict[str, Any] = {}
    if compact["trials"]:
        tables["winners"] = winners_table(compact["trials"], runs)
    final = export_groups(runs, "final")
    measure = measure or (summary or {}).get("measure") or default_measure(final or export_groups(runs, "sweep"))
    if final:
        tables["heldout"] = _final(final, runs, "final", measure)
        primary = _primary(summary, final)
        if len(final) > 1:
            tables["comparisons"] = method_comparisons(final, measure=measure, primary=primary)
        if primary:
            tables["reach"] = reach_table(final, primary)
    long = export_groups(runs, "long")
    if long:
        tables["long"] = _final(long, runs, "long", measure)
        if len(long) > 1:
            tables["long_comparisons"] = method_comparisons(long, measure=measure)
    control = export_groups(runs, "control", label="{method} shuffled")
    if control:
        tables["control"] = _final(control, runs, "control", measure, label="{method} shuffled")
        pairs = {name: group for name, group in control.items()}
        for name in control:
            method = name.removesuffix(" shuffled")
            if method in final:
                pairs[method] = final[method]
        if len(pairs) > 1:
            tables["control_comparisons"] = method_comparisons(pairs, measure=measure)
    sweep = export_groups(runs, "sweep")
    if sweep:
        tables["sweep"] = _final(sweep, runs, "sweep", measure)
        if len(sweep) > 1:
            tables["sweep_comparisons"] = method_comparisons(sweep, measure=measure)
            if tables["sweep"]["training_completions"].nunique() > 1:  # a protocol's own budgets: read both at the smaller
                tables["sweep_equal_budget"] = equal_budget_table(sweep)
                tables["sweep_equal_budget_tests"] = equal_budget_comparisons(sweep)
    if compact.get("geometry"):
        tables.update(geometry_tables(compact["geometry"]))
    if compact.get("base"):  # the untrained model on the same problems (tune.base_answers), one row
        tables["base"] = pd.DataFrame([{"method": "base model", **compact["base"]}]).set_index("method")
    if "winners" in tables:
        tables["completeness"] = completeness_table(summary, tables["winners"], tables.get("heldout"), tables.get("long"),
                                                    tables.get("control"))
        if not tables["completeness"]["complete"].all():
            tables["left"] = left_table(compact["trials"], runs, summary, tables["winners"], tables["completeness"])
    for table in tables.values():
        table.attrs["measure"] = measure
    return tables


COUNTS = (("trials", "trials"), ("final_seeds", "final seeds"), ("long_seeds", "continued reruns"))
"""What ``completeness_table`` counts against its plan (``<name>_planned``), with the digest's words."""


def lacking(line: Mapping[str, Any]) -> list[str]:
    """What a completeness line lacks, as "k of N <words>"; a count the summary does not plan (an
    older one's tune.trials: NaN) is not counted against it."""
    return [f"{int(line[key])} of {int(line[f'{key}_planned'])} {words}" for key, words in COUNTS
            if key in line and not math.isnan(line[f"{key}_planned"]) and line[key] < line[f"{key}_planned"]]


def completeness_table(summary: Mapping[str, Any] | None, winners, heldout=None, long=None, control=None):
    """One row per tuned method: its trials against the spec's ``tune.trials`` (``trials_per_method``
    in the summary; NaN, and not checked, in a summary written before it was recorded), its reruns
    and continued reruns with held-out scores against the final seeds; then, where the spec declares
    one, the shuffled-fitness control's runs against the final seeds (none while it is undecided).
    ``complete`` says whether a row has all it plans: a study under way reads as such from this table,
    not from its counts alone."""
    import pandas as pd

    summary = summary or {}
    planned_seeds = len(summary.get("final_seeds") or ()) or math.nan
    long_info, control_info = summary.get("long"), summary.get("control")
    continued = isinstance(long_info, dict) and long_info.get("factor", 1) > 1

    def seeds(table, name: str) -> int:
        return int(table.loc[name, "seeds"]) if table is not None and name in table.index else 0

    lines = []
    for method, row in winners.iterrows():
        line = {"method": method, "trials": int(row["trials"]), "trials_planned": summary.get("trials_per_method", math.nan),
                "final_seeds": seeds(heldout, method), "final_seeds_planned": planned_seeds}
        if continued:
            line.update({"long_seeds": seeds(long, method), "long_seeds_planned": planned_seeds})
        lines.append(line)
    if isinstance(control_info, dict) and control_info.get("declared") not in (None, "none"):
        method = control_info.get("method")
        lines.append({"method": f"control ({control_info['declared']}: {method or 'undecided'})",
                      "final_seeds": seeds(control, f"{method} shuffled") if method else 0,
                      "final_seeds_planned": planned_seeds})
    for line in lines:
        line["complete"] = not lacking(line)
    return pd.DataFrame(lines).set_index("method")


def _share_done(run: Mapping[str, Any]) -> float:
    """How much of an exported run under way an imported study keeps: its last row's generation over its
    length where it goes on from a checkpoint (``resume``), else none (it begins again)."""
    from ..runs import row_generation

    length = run["config"].get("num_generations", run["config"].get("num_steps"))
    if not run.get("resume") or not run.get("rows") or not length:
        return 0.0
    return min(max(row_generation(run["rows"][-1]), 0) / length, 1.0)


def left_table(trials: Sequence[Mapping[str, Any]], runs: Sequence[dict], summary: Mapping[str, Any] | None, winners,
               completeness):
    """What a study under way has left, per method, in runs (``completeness_table``'s counts against
    their plan) and in one worker's seconds at the pace of its own finished work: a trial at the
    median seconds its method's complete trials took (``trial_seconds``: their wall clocks, at the
    engines a card they ran at), a rerun on a final seed at its reruns' own pace where any has timed
    rows (``rerun_step_seconds`` times its length), else at its
    winner's trial seconds once the trials are done (the same setting and length; the median before), a continuation at
    ``tune.long - 1`` times that, and the control's runs at its method's rerun (the ES form of the
    best validation score so far while it is undecided). A run under way that goes on from a
    checkpoint counts what it has done; one that begins again counts nothing. A continuation whose
    rerun's last checkpoint is lost runs from the start instead, which this does not know: a floor,
    not a promise. NaN where a method has no complete trial to pace it."""
    import pandas as pd

    summary = summary or {}
    long_info, control_info = summary.get("long"), summary.get("control")
    factor = long_info.get("factor", 1) if isinstance(long_info, dict) else 1

    def missing(line, key: str) -> float:  # what a completeness line lacks of a count (0 where it plans none)
        if key not in line or math.isnan(line[key]):
            return 0
        planned = line[f"{key}_planned"]
        return math.nan if math.isnan(planned) else max(planned - line[key], 0)

    lines, rerun_pace = [], {}
    for method, row in winners.iterrows():
        own, by_number, trial_runs, counted, complete = method_trials(method, trials, runs)
        line = completeness.loc[method]
        pace = statistics.median(trial_seconds(t, by_number, trial_runs) for t in complete) if complete else math.nan
        trials_left = missing(line, "trials")

        def kept(trial) -> float:  # a trial under way: the mean share its runs keep (a retry's are its first attempt's)
            shares = [_share_done(r) for r in trial_runs if r["trial"] == first_attempt(trial, by_number)]
            return statistics.fmean(shares) if shares else 0.0

        open_shares = sorted((kept(t) for t in own if t["state"] in ("running", "waiting")), reverse=True)
        trial_units = math.nan if math.isnan(trials_left) else trials_left - sum(open_shares[:int(trials_left)])
        winner = by_number.get(row["winner_trial"]) if trials_left == 0 else None
        reruns = [r for r in runs if r["stage"] == "final" and r["method"] == method]
        step = rerun_step_seconds(reruns)
        length = next((r["config"].get("num_generations", r["config"].get("num_steps")) for r in reruns), None)
        rerun = (step * length if step is not None and length else
                 trial_seconds(winner, by_number, trial_runs) if winner else pace)
        rerun_pace[method] = rerun
        reruns_left, continuations_left = missing(line, "final_seeds"), missing(line, "long_seeds")
        units = reruns_left + continuations_left * (factor - 1)
        # what the runs under way keep: a rerun is one budget long; a continuation (factor - 1) budgets
        # of its own, past its rerun's
        for stage, before, own_units in (("final", 0, 1), ("long", 1, factor - 1)):
            units -= sum(max(_share_done(r) * (before + own_units) - before, 0.0) for r in runs
                         if r["stage"] == stage and r["method"] == method and not r.get("heldout"))
        lines.append({"method": method, "trials_left": trials_left, "reruns_left": reruns_left,
                      "continuations_left": continuations_left, "trial_pace_seconds": pace,
                      "paced_by_trials": len(complete), "rerun_seconds": rerun,
                      "seconds_left": trial_units * pace + units * rerun,
                      **{k: v for k, v in placements(trial_runs).items() if k in ("engines_per_card", "device")}})
    controls = [name for name in completeness.index if name.startswith("control (")]
    if controls:
        declared, method = control_info["declared"], control_info.get("method")
        if method is None:  # undecided: of its kind (best_es: the ES forms), the one ahead so far
            kinds = {r["method"]: r["rows"][0].get("method") for r in runs if r["stage"] == "trial" and r.get("rows")}
            scores = {m: winners.loc[m, "validation_score"] for m in winners.index
                      if kinds.get(m) == declared.removeprefix("best_") and not math.isnan(winners.loc[m, "validation_score"])}
            method = max(scores, key=lambda m: scores[m]) if scores else declared
        runs_left = missing(completeness.loc[controls[0]], "final_seeds")
        lines.append({"method": f"control ({declared}: {control_info.get('method') or f'{method} so far'})",
                      "reruns_left": runs_left, "rerun_seconds": rerun_pace.get(method, math.nan),
                      "seconds_left": runs_left * rerun_pace.get(method, math.nan)})
    return pd.DataFrame(lines).set_index("method")


def geometry_tables(geometry: Mapping[str, Any]) -> dict[str, Any]:
    """{name: DataFrame} of geometry.json (``tune.geometry``): per method its update over the seeds
    (mean and standard deviation of the norm, the norm relative to the weights it moved, the share of
    them changed) with its drift (mean KL to the base on the other study's prompts); per pair of
    methods the cosine of their updates (mean, lowest and highest over the seeds) beside its chance
    level 1/sqrt(d) (``geometry.update_cosine``; where geometry.json predates it, d is the larger
    update's count of values, the space both updates live in when one moves a subset of the other's
    weights); per path its
    held-out score at each point and its barrier."""
    import pandas as pd

    def spread(values: Sequence[float | None]) -> tuple[float, float]:
        values = [v for v in values if v is not None and math.isfinite(v)]
        return (statistics.fmean(values) if values else math.nan,
                statistics.stdev(values) if len(values) > 1 else math.nan)

    updates, drift = geometry.get("updates", []), geometry.get("drift", [])
    lines = []
    for method in dict.fromkeys(u["method"] for u in updates):
        own = [u for u in updates if u["method"] == method]
        norm, norm_sd = spread([u["norm"] for u in own])
        kl, kl_sd = spread([d["kl"] for d in drift if d["method"] == method])
        lines.append({"method": method, "form": own[0]["form"], "seeds": len(own), "values": own[0]["values"],
                      "update_norm": norm, "update_norm_sd": norm_sd,
                      "relative_norm": statistics.fmean(u["norm"] / u["base_norm"] for u in own),
                      "changed_share": statistics.fmean(u["changed_share"] for u in own),
                      "drift_task": next((d["task"] for d in drift if d["method"] == method), None),
                      "drift_kl": kl, "drift_kl_sd": kl_sd})
    tables = {"geometry_updates": pd.DataFrame(lines).set_index("method")} if lines else {}
    pairs: dict[tuple[str, str], list] = {}
    chance: dict[tuple[str, str], float] = {}
    values = {u["method"]: u["values"] for u in updates}
    for cosine in geometry.get("cosines", []):
        if cosine["overall"] is not None:  # an update of no length has no direction
            pair = (cosine["a"], cosine["b"])
            pairs.setdefault(pair, []).append(cosine["overall"])
            dimensions = max(values.get(cosine["a"], 0), values.get(cosine["b"], 0))
            chance[pair] = cosine.get("chance") or (1 / math.sqrt(dimensions) if dimensions else math.nan)
    if pairs:
        tables["geometry_cosines"] = pd.DataFrame(
            [{"a": a, "b": b, "seeds": len(found), "cosine": statistics.fmean(found), "lowest": min(found),
              "highest": max(found), "chance": chance[(a, b)]} for (a, b), found in pairs.items()])
    paths = geometry.get("paths", [])
    if paths:
        tables["geometry_paths"] = pd.DataFrame(
            [{"a": path["a"], "b": path["b"], "seed": path["seed"],
              **{f"t={row['t']:g}": row["eval/reward"] for row in path["rows"]}, "barrier": path["barrier"]}
             for path in paths])
    return tables
