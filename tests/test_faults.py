"""Fault injection on run folders, as one table (issue 33): each fault is injected into a real run
(the synthetic engine, or two Ray engines on the CPU) and what the user then sees is checked: nothing
finished is lost, damaged input is kept and named, and the run ends with the rows of a run never
interrupted where that can be had. A new fault is one more row of ``FAULTS`` and one more line of
docs/reliability.md (a test checks the page lists every row).

The Ray faults need two engines (minutes to start): they run in tests/test_ray_modes.py beside the
engines' other tests, and the table names them there.
"""
from __future__ import annotations

import errno
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

import evolm_lib.runs.checkpoints as checkpoints_module
from evolm_lib import analysis
from evolm_lib.config import ESConfig
from evolm_lib.engines.synthetic import SyntheticEngine
from evolm_lib.metrics import series
from evolm_lib.runs import (
    DAMAGED_CONFIG,
    DAMAGED_METRICS,
    MISSING,
    CheckpointFallback,
    DamagedLines,
    RunFolderBusy,
    RunFolderDamaged,
    list_checkpoints,
    read_metrics,
    restore_run_config,
)
from evolm_lib.train.es import ESRun
from evolm_lib.metrics import without_times

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"


def config(**changes) -> ESConfig:
    """A synthetic ES run with momentum (optimizer state to restore), a checkpoint per generation."""
    return ESConfig(**{**dict(model="tiny-random", target_modules=("q_proj", "v_proj"), sigma=0.02,
                              learning_rate=0.05, optimizer="sgd", momentum=0.5, population_size=4,
                              num_generations=3, seed=5), **changes})


def run_to(run_dir: Path, generations: int, **changes) -> None:
    run = ESRun.open(config(**changes), run_dir, engine=SyntheticEngine())
    run.run(generations)
    run.close()


def uninterrupted(tmp_path: Path, **changes) -> list[dict]:
    run_to(tmp_path / "reference", 3, **changes)
    return without_times(read_metrics(tmp_path / "reference"))


def overwrite_line(path: Path, line: int, offset: int, length: int) -> bytes:
    """Overwrite ``length`` bytes of a line (from 1) with 'X' from ``offset`` on; returns the line as it then is."""
    lines = path.read_bytes().split(b"\n")
    lines[line - 1] = lines[line - 1][:offset] + b"X" * length + lines[line - 1][offset + length:]
    path.write_bytes(b"\n".join(lines))
    return lines[line - 1]


# ----------------------------------------------------------------------------- the faults


def torn_last_metrics_line(tmp_path: Path) -> None:
    run_to(tmp_path / "run", 2)
    with open(tmp_path / "run" / "metrics.jsonl", "a") as handle:
        handle.write('{"generation": 3, "train/rew')  # a kill in the middle of a write
    assert [r["generation"] for r in read_metrics(tmp_path / "run")] == [0, 1, 2]  # skipped without a warning
    run_to(tmp_path / "run", 3)
    assert without_times(read_metrics(tmp_path / "run")) == uninterrupted(tmp_path)
    assert not (tmp_path / "run" / DAMAGED_METRICS).exists()  # a torn write is no damage


def damaged_middle_metrics_line(tmp_path: Path) -> None:
    """The issue's probe: 2 generations, 40 bytes of generation 1's line overwritten, continued to 3."""
    run_dir = tmp_path / "run"
    run_to(run_dir, 2)
    damaged = overwrite_line(run_dir / "metrics.jsonl", 2, 10, 40)
    with pytest.warns(DamagedLines, match=r"metrics.jsonl: line 2 does not parse \(generation 1\); restored from "
                                          r"the checkpoints: generation 1"):
        assert [r["generation"] for r in read_metrics(run_dir)] == [0, 1, 2]  # a reader: nothing is written
    assert not (run_dir / DAMAGED_METRICS).exists()
    with pytest.warns(DamagedLines, match="generation 1"):
        run_to(run_dir, 3)
    assert without_times(read_metrics(run_dir)) == uninterrupted(tmp_path)  # generation 1's row is back
    (kept,) = [json.loads(line) for line in (run_dir / DAMAGED_METRICS).read_text().splitlines()]
    assert kept["line"] == 2 and kept["generation"] == 1 and kept["raw"].encode("latin-1") == damaged


def damaged_metrics_line_no_checkpoint_keeps(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_to(run_dir, 2, keep_checkpoints=1)  # checkpoint 2 keeps rows 2 only: generation 1's row is nowhere else
    damaged = overwrite_line(run_dir / "metrics.jsonl", 2, 0, 30)
    with pytest.warns(DamagedLines, match=r"no checkpoint keeps generation 1: marked missing"):
        run_to(run_dir, 3, keep_checkpoints=1)
    rows = read_metrics(run_dir)
    assert [r["generation"] for r in rows] == [0, 1, 2, 3]
    assert rows[1] == {"generation": 1, MISSING: True, "damaged_line": 2}  # the gap, visible
    reference = uninterrupted(tmp_path, keep_checkpoints=1)
    assert without_times([rows[0], *rows[2:]]) == [reference[0], *reference[2:]]
    kept = json.loads((run_dir / DAMAGED_METRICS).read_text())
    assert kept["raw"].encode("latin-1") == damaged
    # tables and plots skip its values and still know the generation is missing
    xs, _ = series(rows, "train/reward_mean")
    assert xs == [2.0, 3.0]  # generation 0 has no population; generation 1's values are gone
    record = analysis.read_run(run_dir)
    assert [r.get(MISSING, False) for r in record.rows] == [False, True, False, False]


def unparsable_config_yaml(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_to(run_dir, 2)
    text = (run_dir / "config.yaml").read_text().splitlines()
    line = next(n for n, t in enumerate(text) if t.startswith("target_modules"))
    text[line + 1] = "- [q_proj"  # an unclosed flow sequence, as the probe left
    (run_dir / "config.yaml").write_text("\n".join(text) + "\n")
    damaged = (run_dir / "config.yaml").read_bytes()
    with pytest.raises(RunFolderDamaged, match=rf"{re.escape(str(run_dir / 'config.yaml'))}, line {line + 2}, column 3: "
                                               r"the run folder's settings do not parse .*restore_run_config.*"
                                               r"overwrite=True"):
        ESRun.open(config(), run_dir)  # no engine: an engine started before the check would show here
    assert (run_dir / "config.yaml").read_bytes() == damaged  # refused: nothing written
    assert restore_run_config(run_dir).name == "000002"
    assert (run_dir / DAMAGED_CONFIG).read_bytes() == damaged  # kept, never deleted
    run_to(run_dir, 3)
    assert without_times(read_metrics(run_dir)) == uninterrupted(tmp_path)


def invalid_config_yaml(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_to(run_dir, 1)
    text = (run_dir / "config.yaml").read_text()
    (run_dir / "config.yaml").write_text(text.replace("population_size: 4", "population_size: -4"))
    line = next(n for n, t in enumerate(text.splitlines(), start=1) if t.startswith("population_size:"))
    with pytest.raises(RunFolderDamaged, match=rf"config.yaml, line {line}: the run folder's settings do not validate "
                                               r"\(.*population_size"):
        ESRun.resume(run_dir)


def disk_full_mid_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    run = ESRun.create(config(), run_dir, engine=SyntheticEngine())
    run.step()
    real = checkpoints_module.fsync_tree

    def full(path):  # the checkpoint's files are written; making them durable runs out of space
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoints_module, "fsync_tree", full)
    with pytest.raises(OSError, match="No space left on device"):
        run.step()
    monkeypatch.setattr(checkpoints_module, "fsync_tree", real)
    run.close()
    assert [r["generation"] for r in read_metrics(run_dir)] == [0, 1]  # generation 2 never counted
    assert list_checkpoints(run_dir)[-1].name == "000001"
    run_to(run_dir, 3)  # the half-written checkpoint is cleared on open, generation 2 reruns
    assert without_times(read_metrics(run_dir)) == uninterrupted(tmp_path)
    assert not list((run_dir / "checkpoints").glob(".*"))


def disk_full_on_a_small_filesystem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run folder on a 2 MiB tmpfs (mounted where the test may, else every fsync raising ENOSPC), filled up
    after one generation: the next step's error names the file it was writing; with room again the run
    continues to the rows of an uninterrupted run."""
    import os
    import shutil
    import subprocess

    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)],
                             capture_output=True).returncode == 0
    run_dir = small / "run"
    try:
        run = ESRun.create(config(), run_dir, engine=SyntheticEngine())
        run.step()
        filler = small / "filler"
        if mounted:
            filler.write_bytes(b"x" * (shutil.disk_usage(small).free - 8192))
        else:
            def full(descriptor):  # no file name, as the kernel reports it
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            monkeypatch.setattr(os, "fsync", full)
        with pytest.raises(OSError) as caught:
            run.step()
        monkeypatch.undo()
        error = caught.value
        assert error.errno == errno.ENOSPC and error.filename is not None, repr(error)
        assert Path(error.filename).is_relative_to(run_dir) and error.filename in str(error), str(error)
        filler.unlink(missing_ok=True)
        run.close()
        run_to(run_dir, 3)
        assert without_times(read_metrics(run_dir)) == uninterrupted(tmp_path)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(small)], check=True)


def extra_garbage_metrics_line(tmp_path: Path) -> None:
    """A line of garbage after the last row (and one between two rows): named by file and line, kept, and
    neither reported as a missing generation nor left as a phantom row."""
    run_dir = tmp_path / "run"
    run_to(run_dir, 2)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines.insert(2, "garbage between rows\n")
    (run_dir / "metrics.jsonl").write_text("".join(lines) + "garbage at the end\n")
    with pytest.warns(DamagedLines, match=rf"{re.escape(str(run_dir / 'metrics.jsonl'))}: lines 3, 5 do not parse and "
                                          r"name no generation: an extra line, not a row \(no generation is missing"):
        rows = read_metrics(run_dir)
    assert [r["generation"] for r in rows] == [0, 1, 2] and not any(r.get(MISSING) for r in rows)
    with pytest.warns(DamagedLines, match="an extra line"):
        run_to(run_dir, 3)
    assert without_times(read_metrics(run_dir)) == uninterrupted(tmp_path)
    kept = [json.loads(line) for line in (run_dir / DAMAGED_METRICS).read_text().splitlines()]
    assert [(k["line"], k["generation"], k["raw"]) for k in kept] == [
        (3, None, "garbage between rows"), (5, None, "garbage at the end")]


def truncated_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_to(run_dir, 2)
    adapter = run_dir / "checkpoints" / "000002" / "adapter" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:100])
    with pytest.warns(CheckpointFallback, match="000002: adapter/adapter_model.safetensors has 100 bytes"):
        run_to(run_dir, 3)
    assert (run_dir / "checkpoints" / "000002.damaged").is_dir()
    assert without_times(read_metrics(run_dir)) == uninterrupted(tmp_path)


def two_writers(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = ESRun.create(config(), run_dir, engine=SyntheticEngine())
    first.step()
    with pytest.raises(RunFolderBusy, match=f"{re.escape(str(run_dir))}.*process"):
        ESRun.open(config(), run_dir, engine=SyntheticEngine())
    first.run()
    first.close()
    assert without_times(read_metrics(run_dir)) == uninterrupted(tmp_path)


@dataclass(frozen=True)
class Fault:
    """One injected fault: its name (as docs/reliability.md lists it) and the check of what the user sees."""

    name: str
    check: Callable[..., None] | str
    "a function of (tmp_path[, monkeypatch]), or the node id of the test elsewhere that injects it"


FAULTS = [
    Fault("torn last line of metrics.jsonl", torn_last_metrics_line),
    Fault("damaged line in the middle of metrics.jsonl", damaged_middle_metrics_line),
    Fault("damaged metrics line no checkpoint keeps", damaged_metrics_line_no_checkpoint_keeps),
    Fault("config.yaml that does not parse", unparsable_config_yaml),
    Fault("config.yaml that does not validate", invalid_config_yaml),
    Fault("disk full mid-checkpoint", disk_full_mid_checkpoint),
    Fault("truncated checkpoint file", truncated_checkpoint),
    Fault("disk full while a run writes its files", disk_full_on_a_small_filesystem),
    Fault("extra garbage line in metrics.jsonl", extra_garbage_metrics_line),
    Fault("deleted config.yaml in a sweep's run folder",
          "tests/test_sweep.py::test_a_run_folder_that_lost_its_config_yaml_is_refused_with_the_command_that_restores_it"),
    Fault("population, group size, tokens or generations of 10^9",
          "tests/test_preflight.py::test_a_size_of_ten_to_the_ninth_is_refused_naming_the_field_and_the_largest_value_that_fits"),
    Fault("population of 10^9 in `evolm batch`",
          "tests/test_batch.py::test_a_population_of_ten_to_the_ninth_is_refused_by_the_dry_run_and_the_run_creates_nothing"),
    Fault("population or group size of 10^9 in `evolm sweep`",
          "tests/test_sweep.py::test_sizes_of_ten_to_the_ninth_are_refused_before_any_run_folder_exists"),
    Fault("task of 10^9 examples",
          "tests/test_preflight.py::test_a_task_of_ten_to_the_ninth_examples_is_refused_before_one_is_made"),
    Fault("a batch pointed at another batch's folder",
          "tests/test_batch.py::test_an_es_batch_pointed_at_a_grpo_batchs_folder_names_it_and_leaves_it_unchanged"),
    Fault("a sweep pointed at a batch's folder",
          "tests/test_sweep.py::test_a_sweep_pointed_at_a_batchs_folder_names_it_and_leaves_it_unchanged"),
    Fault("an invalid grid point", "tests/test_batch.py::test_a_bad_point_fails_before_its_kernel_and_a_rerun_after_the_fix_runs_only_it"),
    Fault("a point whose folder holds other settings",
          "tests/test_batch.py::test_changed_settings_keep_a_finished_point_and_say_so_the_same_way_in_dry_and_real_runs"),
    Fault("empty grids and method lists in a sweep",
          "tests/test_sweep.py::test_empty_grids_and_method_lists_are_refused_naming_the_field"),
    Fault("JSONL task file with a byte that is not UTF-8",
          "tests/test_tasks.py::test_a_jsonl_file_with_a_byte_that_is_not_utf8_is_named_with_its_line"),
    Fault("JSONL target that is null",
          "tests/test_tasks.py::test_a_jsonl_target_that_is_not_text_or_a_number_is_refused_not_turned_into_text"),
    Fault("SIGTERM on `evolm batch`",
          "tests/test_batch.py::test_sigterm_on_a_batch_prints_what_ctrl_c_prints_and_leaves_no_running_status"),
    Fault("two writers", two_writers),
    Fault("SIGKILL mid-generation", "tests/test_es_run.py::test_kill_mid_generation_then_resume"),
    Fault("Ctrl-C while the engine generates", "tests/test_engines.py::test_a_call_cut_by_ctrl_c_leaves_no_request_behind"),
    Fault("Ctrl-C after a generation's update, before its commit has returned",
          "tests/test_es_run.py::test_a_generation_cut_after_its_update_stops_the_run_and_opening_it_again_continues"),
    Fault("SIGTERM or Ctrl-C on a tuning worker in the middle of a call to the study's storage",
          "tests/test_tune.py::test_ctrl_c_inside_a_storage_call_acts_once_the_call_has_returned"),
    Fault("killed between the steps of a checkpoint rewrite",
          "tests/test_runs.py::test_kill_during_checkpoint_rewrite_leaves_a_loadable_checkpoint"),
    Fault("Ray engine lost in LoRA mode",
          "tests/test_ray_engine.py::test_an_engine_killed_mid_generation_loses_nothing"),
    Fault("Ray engine lost with the mean (full, eggroll)",
          "tests/test_ray_modes.py::test_an_engine_lost_with_the_mean_is_given_it_back_and_the_run_ends_as_uninterrupted"),
    Fault("Ray engine lost past its attempts",
          "tests/test_ray_modes.py::test_an_engine_that_stays_lost_past_its_attempts_ends_the_run_and_it_resumes_to_the_same_rows"),
]
HERE = [fault for fault in FAULTS if callable(fault.check)]


@pytest.mark.parametrize("fault", HERE, ids=[fault.name for fault in HERE])
def test_fault(fault, tmp_path, monkeypatch):
    if "monkeypatch" in fault.check.__code__.co_varnames[:fault.check.__code__.co_argcount]:
        fault.check(tmp_path, monkeypatch)
    else:
        fault.check(tmp_path)


@pytest.mark.parametrize("fault", [f for f in FAULTS if not callable(f.check)], ids=lambda f: f.name)
def test_a_fault_injected_elsewhere_names_a_test_that_exists(fault):
    path, name = fault.check.split("::")
    assert re.search(rf"^def {name}\(", (Path(__file__).parents[1] / path).read_text(), re.M), fault.check


def test_the_reliability_page_lists_every_fault():
    page = DOCS.read_text()
    missing = [fault.name for fault in FAULTS if f"| {fault.name} |" not in page]
    assert not missing, f"docs/reliability.md lists no row for {missing}"
