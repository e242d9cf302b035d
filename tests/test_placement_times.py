"""``python -m evolm_lib.tune.placement_times``: each attempt of a run gets the rows after the generation
it started from, with where it ran, on hand-made run folders whose medians are known."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from evolm_lib.tune import placement_times


def _run(folder: Path, config: dict, lines: list[dict], seconds: list[tuple[float, float, float]],
         checkpoints: tuple[int, ...] = (), tokens: list[int] | None = None) -> None:
    """A run folder: config, placement lines, a row per generation 1.. of (generation, engine, update)
    seconds after a row 0 without times, and empty checkpoint folders of these generations; ``tokens``:
    the cumulative ``samples/tokens`` of rows 0, 1, ..."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "placement.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = [{"generation": 0}] + [{"generation": g, "time/generation_s": total, "time/generate_s": engine,
                                   "time/update_s": update} for g, (total, engine, update) in enumerate(seconds, 1)]
    for row, count in zip(rows, tokens or []):
        row["samples/tokens"] = count
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for generation in checkpoints:
        (folder / "checkpoints" / f"{generation:06d}").mkdir(parents=True)
        (folder / "checkpoints" / f"{generation:06d}" / "state.json").write_text("{}")


def test_each_attempt_gets_the_rows_after_its_start_and_legacy_lines_their_earlier_checkpoint(tmp_path, capsys):
    study, before = tmp_path / "study", tmp_path / "before"
    line = {"code_commit": "abc123", "device": "NVIDIA H200", "engines_per_card": 5}
    # two attempts: generations 1-3 on card 2 without MPS (an earlier commit), 4-6 on card 0 through MPS
    _run(study / "trials" / "es_full" / "trial_0000" / "seed100", {"population_size": 30},
         [{**line, "code_commit": "old", "cuda_visible_devices": "2", "from_generation": 0, "pid": 1, "time": 1.0},
          {**line, "cuda_visible_devices": "0", "cuda_mps_pipe_directory": "/tmp/mps/pipe", "from_generation": 3,
           "pid": 2, "time": 2.0}],
         [(9.0, 8.0, 0.1), (10.0, 9.0, 0.1), (11.0, 10.0, 0.1), (5.0, 4.0, 0.2), (7.0, 6.0, 0.2), (6.0, 5.0, 0.3)])
    # lines from before attempts recorded their start: the second began at the earlier pack's checkpoint 2
    _run(study / "final" / "grpo_lora" / "seed0", {"group_size": 4},
         [{**line, "cuda_visible_devices": "1", "pid": 3, "time": 3.0},
          {**line, "cuda_visible_devices": "3", "pid": 4, "time": 4.0}],
         [(1.0, 0.5, 0.5), (1.0, 0.5, 0.5), (2.0, 1.5, 0.5), (4.0, 3.5, 0.5)])
    _run(before / "final" / "grpo_lora" / "seed0", {"group_size": 4}, [], [], checkpoints=(1, 2))
    # a continuation copied from its rerun carries the rerun's line: counted once, under the rerun
    _run(study / "long" / "grpo_lora" / "seed0", {"group_size": 4},
         [{**line, "cuda_visible_devices": "1", "pid": 3, "time": 3.0}], [(1.0, 0.5, 0.5)] * 2)

    found, unknown = placement_times.attempts(study, commit="abc", before=before)
    by_run = {(a["run"], a["from"]): a for a in found}
    assert set(by_run) == {("trials/es_full/trial_0000/seed100", 3), ("final/grpo_lora/seed0", 0),
                           ("final/grpo_lora/seed0", 2)} and unknown == []
    es = by_run["trials/es_full/trial_0000/seed100", 3]
    assert (es["method"], es["card"], es["mps"], es["size"], es["rows"]) == ("es_full", "0", True, 30, 3)
    assert (es["generation_s"], es["engine_s"], es["update_s"]) == (6.0, 5.0, 0.2)
    first, second = by_run["final/grpo_lora/seed0", 0], by_run["final/grpo_lora/seed0", 2]
    assert (first["rows"], first["generation_s"], first["card"], first["mps"]) == (2, 1.0, "1", False)
    assert (second["rows"], second["generation_s"], second["engine_s"]) == (2, 3.0, 2.5)

    # without the earlier pack the legacy second attempt's start is unknown: left out and named
    found, unknown = placement_times.attempts(study, commit="abc")
    assert unknown == ["final/grpo_lora/seed0"] and len(found) == 2

    assert placement_times.main([str(study), "--commit", "abc", "--before", str(before)]) == 0
    out = capsys.readouterr().out
    assert "| trials/es_full/trial_0000/seed100 (from 3) | 0 | yes | 5 | 30 | 3 | 6 | 5 | 0.2 |  |  |" in out
    assert "| grpo_lora | 4 | 5 | no | 2 | 2 | 1.5 | 0.5 |  |  |" in out  # the medians of the two attempts' medians


def test_tokens_a_generation_come_from_the_cumulative_counter_and_the_engine_time_is_per_1k_of_them(tmp_path, capsys):
    """A conciseness run whose answers shrink: generations 1-4 decode 4,000, 4,000, 1,000 and 500 tokens
    (the counter's steps) in 8, 8, 2 and 1.5 s of engine, so 2,000, 2,000, 2,000 and 3,000 ms per 1,000;
    an attempt resumed from generation 2 gets the steps of 3 and 4 only, the first of them against
    the row of generation 2 it did not write."""
    study = tmp_path / "study"
    line = {"code_commit": "abc", "engines_per_card": 8, "cuda_visible_devices": "0"}
    _run(study / "trials" / "es_full" / "trial_0000" / "seed100", {"population_size": 60},
         [{**line, "from_generation": 0, "pid": 1, "time": 1.0}, {**line, "from_generation": 2, "pid": 2, "time": 2.0}],
         [(9.0, 8.0, 0.1), (9.0, 8.0, 0.1), (3.0, 2.0, 0.1), (2.5, 1.5, 0.1)], tokens=[0, 4000, 8000, 9000, 9500])
    found, _ = placement_times.attempts(study)
    by_start = {a["from"]: a for a in found}
    assert (by_start[0]["tokens"], by_start[0]["engine_ms_per_1k_tokens"]) == (4000, 2000)
    assert (by_start[2]["tokens"], by_start[2]["engine_ms_per_1k_tokens"]) == (750, 2500)
    assert placement_times.main([str(study)]) == 0
    out = capsys.readouterr().out
    assert "| trials/es_full/trial_0000/seed100 (from 2) | 0 | no | 8 | 60 | 2 | 2.75 | 1.75 | 0.1 | 750 | 2500 |" in out
    assert "| es_full | 60 | 8 | no | 2 | 5.88 | 4.88 | 0.1 | 2375 | 2250 |" in out


def test_each_workers_first_run_is_timed_from_the_launch(tmp_path, capsys):
    """``--launched-at``: per process id, its first placement line at or after the launch, minus the
    launch; lines from before it (an earlier machine's) are not counted."""
    study = tmp_path / "study"
    _run(study / "trials" / "es_full" / "trial_0000" / "seed100", {"population_size": 30},
         [{"pid": 7, "time": 50.0}, {"pid": 11, "time": 1290.0}], [(1.0, 0.5, 0.1)])
    _run(study / "final" / "es_full" / "seed0", {"population_size": 30},
         [{"pid": 11, "time": 1500.0}, {"pid": 12, "time": 1310.5}], [(1.0, 0.5, 0.1)])
    _run(study / "long" / "es_full" / "seed0", {"population_size": 30}, [{"pid": 12, "time": 1400.0}],
         [(1.0, 0.5, 0.1)])
    assert placement_times.first_run_delays(study, 1000.0) == [290.0, 310.5]
    assert placement_times.first_run_delays(study, 2000.0) == []
    assert placement_times.main([str(study), "--launched-at", "1000"]) == 0
    assert ("Each worker's first run began, in seconds after the workers were launched (2 workers; one that "
            "waited for work, or was refilled, began later): 290, 310") in capsys.readouterr().out
