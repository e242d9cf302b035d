"""Batch runs of a notebook with papermill: one YAML file, a parameter grid, one folder per grid point,
and batches that continue where they stopped.

    evolm batch PARAMS.yaml [--out DIR] [--notebook PATH] [--dry-run] [--retry-failed] [--overwrite [POINT]]

PARAMS.yaml:

    notebook: notebooks/03_es_stepper.py   # relative to the YAML file or to the repository root
    name: sigma-sweep                      # optional run-name prefix (default: the notebook's name)
    kernel: python3                        # optional
    parameters: {num_generations: 20, settings: {optimizer: adam}}   # base parameters
    grid: {seed: [0, 1, 2], sigma: [0.01, 0.05]}   # optional; cartesian product

Each grid point gets OUT/<name>__seed-0__sigma-0.05/ with notebook.ipynb, status.json and, when the
notebook declares them in its `parameters` cell, `run_dir` (= that folder/run) and `figures_dir`
(= that folder/figures). A mapping or list given for a `str` parameter (e.g. `task_options`) is
passed as JSON text; a `dict` parameter (the stepper's `settings`, which reaches every ESConfig
setting) gets the mapping itself.

Rerunning a batch continues it. Each point's status.json says what happened to it; a point is (the
states and actions of the planner and executor that batch, sweep and tune share, `evolm_lib.grid`)
- new (no folder): it runs;
- finished (its notebook completed with these settings, its run reached its budget): skipped;
- unfinished (killed mid-run, or its run short of its budget, e.g. num_generations raised): it runs
  again in its folder, and a notebook that resumes runs (03_es_stepper) continues from the last checkpoint;
- failed (its notebook raised): skipped, and rerun with --retry-failed;
- changed (its folder holds a finished point, or a run, made with other settings): left as it is
  (action "conflict"); the batch lists what changed, old and new values as the run folder has them,
  and the fix: --out another folder to run the new settings there, or --overwrite POINT to replace
  that point alone (--overwrite alone replaces every point);
- changed-failed (a failed or unfinished point whose settings changed, its folder holding no run made
  with other settings): it runs again in its folder;
- running (another batch process is running it now): skipped;
- busy (another process holds it: a batch running the point, or a notebook or sweep with its run
  folder open, see `evolm_lib.runs.WriterLock`): skipped and reported busy, its files untouched;
- damaged (its run folder holds checkpoints but lost its config.yaml): left as it is (action
  "damaged"), with the command that restores the file (`evolm_lib.runs.missing_config`), or
  --overwrite POINT;
- stopped (its batch got Ctrl-C or SIGTERM while the point ran): it runs again in its folder, as unfinished.
An output folder that holds another batch's points (another name, or runs of another kind: a GRPO
batch's folder for an ES batch) or a sweep's runs is refused before anything is written, naming
what it holds (`plan.check_out_folder`); its files and summary stay as they are.
Settings are compared as the run has them: for a notebook whose parameters cell is tagged
`settings:es` (or `settings:grpo`), the run folder's config.yaml against the point's resolved settings
(a change of budget or cadence, `evolm_lib.runs.EXTENDABLE`, extends the run instead); otherwise the
parameters in status.json, the notebook's declared defaults filling what a spec left out. The dry run
and the real run use this one comparison, so they say the same thing.

A failed attempt never replaces a finished point: a point that is extended or overwritten keeps its
notebook.ipynb, run folder, status and summary row until the attempt succeeds; a failed extension
leaves its notebook beside it as notebook.failed-<time>.ipynb, a failed overwrite its whole folder
as OUT/<point>.failed-<time>/ (both listed in status.json under `failed_attempts`). While an overwrite
runs, the point it replaces waits in OUT/.<point>.kept-<time>/ (left there if the batch is killed).

Before any kernel starts, each point is checked without running notebook code: its parameters against
the notebook's declared names and types (papermill's own inspection of the `parameters` cell), then,
for a notebook tagged `settings:<kind>`, its settings through the config class exactly as the
notebook's config cell builds them (`evolm_lib.parameters.notebook_config`), then the sizes this
machine can hold (`evolm_lib.preflight.check_run_sizes`) and the engine limits of
`evolm_lib.preflight`. A bad point fails at once and creates nothing (no folder, no summary row),
and --dry-run lists every point with what would happen to it.

OUT/summary.csv (and summary.json, with every parameter and result) holds one row per grid point,
rewritten after every point; a point the batch left as it was keeps its row. Columns (a result
column that no point has is left out):
- run: the point's folder name under OUT;
- status: ok, failed (its notebook raised, or its settings failed the checks) or running;
- wall_s: seconds its notebook ran (kernel and engine start included), for the attempt that made this
  row (a point resumed after a kill: its last attempt), to 0.1 s;
- error: the notebook's exception, for a failed point;
- one column per parameter the spec sets (grid and parameters; a mapping such as `settings` gives
  one column per key, e.g. settings.optimizer), with the value the point's run has (a spec that left
  one out: the notebook's default);
- kind (es or grpo), budget (generations or steps asked), generation (the last one logged);
- train_reward_start, train_reward_final, train_reward_best: the greedy reward of the current adapter
  on the train prompts at generation 0, at the end and at its best, in the task's reward unit (e.g.
  conciseness: -|length difference| in characters); eval_reward_*: the same on the held-out prompts;
- eval_accuracy_final: share (0 to 1) of the final greedy eval completions at or above the task's
  success threshold (tasks with one, e.g. countdown);
- kl_final: KL(adapter || base) in nats per token, where the run measured it (`evolm sweep` does);
- completions, tokens: training completions and generated tokens used;
- notebook: the executed notebook.
`evolm sweep` writes its own summary.csv and summary.json through the same writer
(`summary.write_summary_files`).

The pieces: `spec` (the batch file and its grid), `notebooks` (papermill's view of a notebook, and
running it), `checks` (a point checked without a kernel), `state` (status.json and a point's state),
`plan` (the action per point, `grid.decide`), `execute` (each point's notebook run, the points one
after another through `grid.execute`), `summary` (summary.csv/json and the console tables).
"""
from __future__ import annotations

from ..grid import format_plan
from .checks import TYPES, check_point, check_types
from .execute import run_batch, run_point
from .notebooks import (
    KERNEL_DIED_AT_START,
    KERNEL_START_ATTEMPTS,
    NOTEBOOK_FILE,
    NotebookInfo,
    check_parameters,
    execute_notebook,
    notebook_info,
    notebook_parameters,
    read_notebook,
)
from .plan import plan_batch, plan_points, stale_folders
from .spec import (INJECTED, SPEC_KEYS, BatchSpec, RunSpec, expand_runs, load_batch_spec, read_yaml_file,
                   resolve_notebook, spec_from_dict)
from .state import (
    ACTIONS,
    BUSY,
    FAILED,
    NOT_RUN,
    OK,
    PLANNED,
    RUNNING,
    STOPPED,
    STATUS_FILE,
    Change,
    PointPlan,
    RunResult,
    conflict_fix,
    point_state,
    read_status,
    settings_changes,
    write_status,
)
from .plan import check_out_folder
from .summary import (RESULT_CELLS, format_summary, plumbing_check_note, summary_rows, write_summary,
                      write_summary_files)

__all__ = [
    "TYPES", "check_point", "check_types", "run_batch", "run_point", "KERNEL_DIED_AT_START", "KERNEL_START_ATTEMPTS",
    "NOTEBOOK_FILE", "NotebookInfo", "check_parameters", "execute_notebook", "notebook_info", "notebook_parameters",
    "read_notebook", "plan_batch", "plan_points", "stale_folders", "INJECTED", "SPEC_KEYS", "BatchSpec", "RunSpec",
    "expand_runs", "load_batch_spec", "read_yaml_file", "resolve_notebook", "spec_from_dict", "ACTIONS", "BUSY",
    "FAILED", "NOT_RUN", "OK", "PLANNED", "RUNNING", "STOPPED", "STATUS_FILE", "Change", "PointPlan", "RunResult",
    "conflict_fix", "point_state", "read_status", "settings_changes", "write_status", "RESULT_CELLS", "format_plan",
    "format_summary", "summary_rows", "write_summary", "write_summary_files", "plumbing_check_note", "check_out_folder",
]
