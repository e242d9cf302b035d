"""Fair comparisons by search: every method of a sweep spec gets the same number of Optuna trials over
a declared space, at the same completion budget, selected on a validation split; each method's best
setting is then rerun on fresh seeds and scored on the held-out problems (`evolm tune`).

spec.py: the `tune:` section, checked before any engine starts, and each trial's config;
space.py: a searched setting (log, uniform or int range, or a choice); storage.py: Optuna's storage
(OUT/optuna.db, a database URL, or a journal file), its calls never cut by Ctrl-C; study.py: the
studies and the worker that runs trials on one engine through ``Study.optimize`` (heartbeats, retries
of killed or stopped trials);
final.py: the winners' reruns on `final_seeds`, continued (`long`) and controlled (`control`);
summary.py: OUT/tune_summary.json with its statistics; export.py: a study's runs and trials in a few
gzipped files to commit (`evolm tune export`), read back, or read from a live study folder the same
way; importer.py: a study folder written again from an export, to continue (`evolm tune import`);
report.py and digest.py: the tables and summary.md (`evolm tune report`); geometry.py: the winners'
solutions compared (run where their weights are); base_answers.py: the base model on the held-out problems.
"""
from .final import (STAGES, SUMMARY, control_plan, final_plan, long_plan, resolve_best, resolved_primary, run_extras,
                    run_finals, run_worker, unfinished_parts)
from .space import Parameter, parse_parameter, parse_space
from .spec import TuneSettings, TuneSpec, check_space, describe, load_tune_spec, trial_config, with_trials
from .storage import STORAGE, StudyStorageError, open_storage, storage_url
from .study import (best_trial, finished, load_study, make_tuning_engine, study_trials, tune, tune_method,
                    with_methods, with_storage)
from .summary import final_groups, summarize, summary_lines

__all__ = [
    "Parameter", "STAGES", "STORAGE", "SUMMARY", "StudyStorageError", "control_plan", "long_plan", "resolve_best",
    "resolved_primary", "run_extras", "TuneSettings", "TuneSpec", "best_trial", "check_space", "describe",
    "final_groups", "final_plan", "finished", "load_study", "load_tune_spec", "make_tuning_engine",
    "open_storage", "parse_parameter", "parse_space", "run_finals", "storage_url",
    "study_trials", "summarize", "summary_lines", "trial_config", "tune", "tune_method", "with_methods",
    "with_storage", "with_trials", "run_worker", "unfinished_parts",
]
