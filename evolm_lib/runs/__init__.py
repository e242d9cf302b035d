"""Run folders shared by ES and GRPO runs: resolved config, metrics.jsonl, atomic checkpoints, one writer.

The pieces: ``lock`` (the one writer), ``folder`` (where a run folder is, and a new one),
``metrics_file`` (metrics.jsonl and the other logs), ``checkpoints`` (write, verify, fall back),
``config_io`` (config.yaml and the state a run resumes from), ``durable`` (fsync and JSON-safe values).

Layout::

    run_dir/
      config.yaml            resolved settings (kind: es | grpo)
      metrics.jsonl          one row per generation/step, appended as each finishes
      checkpoints/000012/    adapter (PEFT format), optimizer.safetensors, state.json (with that row),
                             manifest.json (size and SHA-256 of each of those files, written last)
      final_adapter/         PEFT format, loadable by vLLM and peft
      tensorboard/           with report_to: [tensorboard], the rows as event files (evolm_lib.reporting)
      .writer.lock           the writer's lock: who writes the folder now (pid, host, since when)

One process writes a run folder at a time: the run that opens it holds an exclusive OS lock
(``flock``) on .writer.lock until it is closed, and the operating system drops the lock when the
process ends, a crash or SIGKILL included, so no stale lock survives its holder. A second writer
fails at open with ``RunFolderBusy``, naming the holder. Readers (analysis, summaries, notebook 04)
take no lock and are never blocked.

A checkpoint is written to a temporary folder, fsynced, and renamed into place, so a kill at any
moment leaves either the previous checkpoint or the new one, never half of one. Rewriting an existing
checkpoint (after a resume from an older one) renames the old folder aside first, renames the new one
in, then deletes the old: a kill between the steps still leaves one loadable copy.

A resume verifies the latest checkpoint against its manifest (one written before manifests existed
must load instead). A damaged one (a truncated, changed or missing file, as a partial copy between
machines or a failing disk leaves) is renamed aside to checkpoints/NNNNNN.damaged, never deleted;
the run falls back to the newest intact checkpoint with a warning that says what was wrong, and the
metrics rows past it move to metrics.after-NNNNNN.jsonl. Leftover temporary folders of an
interrupted write are removed on that resume.

Damaged input is kept and named, never rewritten away: a metrics line that does not parse (not the
torn last one) is kept byte for byte in metrics.damaged.jsonl, its row comes back from the
checkpoints (each keeps its row, the rows since the checkpoint before it, and a copy of config.yaml)
or is marked missing; a config.yaml that does not parse or validate fails with ``RunFolderDamaged``
naming the file and the line, before any engine starts (``restore_run_config`` puts back a
checkpoint's copy). docs/reliability.md lists every fault and what the user sees.
"""
from __future__ import annotations

from ..clock import timed
from .checkpoints import (
    CHECKPOINT_FORMAT,
    CHECKPOINTS,
    CONFIG_COPY,
    DAMAGED,
    MANIFEST,
    CheckpointDamaged,
    CheckpointFallback,
    latest_intact_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint_files,
    verify_checkpoint,
    write_checkpoint,
)
from .config_io import (
    DAMAGED_CONFIG,
    EXTENDABLE,
    RunFolderDamaged,
    RunState,
    extended_settings,
    load_latest,
    load_run_config,
    read_config_file,
    read_config_kind,
    missing_config,
    restore_command,
    restore_run_config,
    write_config_data,
    write_run_config,
)
from .folder import NOTEBOOK_RUNS_ENV, RunFolderExists, notebook_run_dir, prepare_run_dir
from .lock import LOCK_FILE, RunFolderBusy, WriterLock, describe_holder, lock_holder
from .metrics_file import (
    DAMAGED_METRICS,
    MISSING,
    DamagedLines,
    NotARunFolder,
    append_metrics,
    checkpoint_rows,
    keep_damaged_lines,
    place_damaged,
    read_checkpoint_kls,
    read_jsonl,
    write_jsonl,
    read_metrics,
    record_final_metrics,
    rewrite_metrics,
    row_generation,
    scan_jsonl,
)

__all__ = [
    "CHECKPOINT_FORMAT", "CHECKPOINTS", "CONFIG_COPY", "DAMAGED", "MANIFEST", "CheckpointDamaged", "CheckpointFallback",
    "latest_intact_checkpoint", "list_checkpoints", "load_checkpoint", "read_checkpoint_files", "verify_checkpoint", "write_checkpoint",
    "DAMAGED_CONFIG", "EXTENDABLE", "RunFolderDamaged", "RunState", "extended_settings", "load_latest",
    "load_run_config", "read_config_file", "read_config_kind", "missing_config", "restore_command", "restore_run_config", "write_config_data", "write_run_config", "NOTEBOOK_RUNS_ENV", "NotARunFolder", "RunFolderExists", "notebook_run_dir",
    "prepare_run_dir", "LOCK_FILE", "RunFolderBusy", "WriterLock", "describe_holder", "lock_holder",
    "DAMAGED_METRICS", "MISSING", "DamagedLines", "checkpoint_rows", "keep_damaged_lines", "place_damaged", "row_generation", "scan_jsonl",
    "append_metrics", "read_checkpoint_kls", "read_jsonl", "write_jsonl", "read_metrics", "record_final_metrics",
    "rewrite_metrics", "timed",
]
