"""Fair comparisons by search: every method of a sweep spec gets the same number of Optuna trials over
a declared space, at the same completion budget, selected on a validation split; each method's best
setting is then rerun on fresh seeds and scored on the held-out problems (`evolm tune`).

spec.py: the `tune:` section, checked before any engine starts, and each trial's config;
space.py: a searched setting (log, uniform or int range, or a choice); study.py: the studies in
OUT/optuna.db and the worker that runs trials on one engine (heartbeats, retries of killed trials);
final.py: the winners' reruns on `final_seeds`, continued (`long`) and controlled (`control`), and the
summary with its statistics; compact.py: a finished study's rows and scores in a few gzipped files
to commit; restore.py: a study folder written again from them, to continue (full ES's and EGGROLL's
runs under way from their checkpoints, the others from their start); geometry.py: the winners' solutions compared (run where their weights are); rebuild.py:
reruns whose weights a pack left behind run again, their rows checked against the rerun's;
progress.py: where a study stands, as a Markdown table (runs under way with their positions);
pace.py: how long a trial or run should take, from the study's own finished work, and the rule a
worker given a lent machine's end claims by (`Deadline`).
"""
from .final import (STAGES, SUMMARY, control_plan, final_groups, final_plan, long_plan, nothing_fits, outstanding,
                    resolve_best, resolved_primary, run_extras, run_finals, summarize, summary_lines, work)
from .space import Parameter, parse_parameter, parse_space
from .spec import TuneSettings, TuneSpec, check_space, describe, load_tune_spec, trial_config, with_trials
from .study import (STORAGE, always, best_trial, finished, load_study, make_tuning_evaluator, open_storage,
                    storage_url, study_trials, tune, tune_method, with_methods)

__all__ = [
    "Parameter", "STAGES", "STORAGE", "SUMMARY", "always", "control_plan", "long_plan", "resolve_best",
    "resolved_primary", "run_extras", "TuneSettings", "TuneSpec", "best_trial", "check_space", "describe",
    "final_groups", "final_plan", "finished", "load_study", "load_tune_spec", "make_tuning_evaluator",
    "nothing_fits", "open_storage", "outstanding", "parse_parameter", "parse_space", "run_finals", "storage_url",
    "study_trials", "summarize", "summary_lines", "trial_config", "tune", "tune_method", "with_methods", "with_trials",
    "work",
]
