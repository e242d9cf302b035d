"""ES vs GRPO from run folders: load runs grouped by method, final points, seed spread, side-by-side
completions, the reward at an equal sample budget (the fair comparison), and the study's held-out
tables: accuracy per method with bootstrap intervals and whether two methods differ by more than seed
noise (`study_table`, `method_comparisons`; the maths in `evolm_lib.stats`). Reads files, starts no engine.

A run folder is what `ESRun` and `GRPORun` write (see `evolm_lib.runs`): config.yaml (with `kind`,
and `es_mode` for ES runs: lora, full or eggroll; older folders have none: lora) and metrics.jsonl.
Rows of both methods share the keys used here: `generation`/`step`, `seed`, `policy/train_reward`,
`eval/reward`, `samples/completions`, `samples/tokens`, `time/wall_s`, `time/generation_s`,
`policy/train_completions`, `policy/eval_completions`; `policy/kl` where a script recorded it
(`evolm_lib.runs.record_final_metrics`). `evolm sweep` adds kl.jsonl (the KL of each checkpoint) and
heldout.jsonl (the final mean adapter or policy scored greedily on the held-out problems, one line
per problem: `index`, `prompt`, `target`, `completion`, `reward`, `success`). This package only reads:
it writes no file; the summaries that hold its results are written by `evolm_lib.batch.summary`.

The pieces: ``load`` (run folders read and grouped by method, the fairness checks), ``tables``
(statistics and comparison tables), ``completions`` (held-out answers judged, completions side by side).
"""
from __future__ import annotations

from .load import (
    COMPARED_FIELDS,
    ES_MODE_ORDER,
    Groups,
    HELDOUT_FIELDS,
    HELDOUT_MEASURES,
    MixedRuns,
    NOT_METHOD_SETTINGS,
    NotARunFolder,
    RUN_RESULT_COLUMNS,
    RepeatedSeeds,
    RunRecord,
    SETTING_NAMES,
    check_comparable,
    check_distinct_seeds,
    final_accuracy,
    folder_settings,
    heldout_rows,
    load_runs,
    method_globs,
    method_label,
    method_labels,
    method_settings,
    read_heldout,
    read_run,
    run_length,
    run_results,
    varying_settings,
)
from .tables import (
    checkpoint_points,
    default_measure,
    describe_runs,
    equal_budget_comparisons,
    equal_budget_table,
    final_points,
    heldout_scores,
    heldout_table,
    method_comparisons,
    reward_label,
    runs_for_plots,
    seed_spread_table,
    split_points_by_kl,
    study_table,
)
from .completions import (
    ANSWER_FLAGS,
    ANSWER_SHARES,
    answer_share,
    empty_answer,
    heldout_summary,
    side_by_side_completions,
    target_in_answer,
)
