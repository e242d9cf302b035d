"""`evolm tune` on tiny-random: equal trials per method to a finished study, a SIGKILLed worker's trial
retried and resumed, two workers sharing one study, the winners rerun on final seeds only, and every
bad spec refused before an engine starts."""
from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import yaml

from evolm_lib import tune
from evolm_lib.cli import main
from evolm_lib.runs import read_jsonl, read_metrics

REPO = Path(__file__).resolve().parents[1]

SPEC = {
    "notebook": "notebooks/07_tuning.py",
    "parameters": {},
    "sweep": {
        "common": {"model": "tiny-random", "task": "conciseness", "task_options": {"num_validation": 4},
                   "target_modules": ["q_proj", "v_proj"], "lora_rank": 1, "max_new_tokens": 8,
                   "max_model_len": 256, "kv_cache_gb": 0.1, "eval_every": 1},
        "es": {"population_size": 4, "temperature": 0.0},
        "grpo": {"group_size": 4, "temperature": 1.0},
        "generations": 2,
        "seeds": [0],
    },
    "tune": {
        "trials": 4, "seeds": [100], "select": "validation/reward", "startup_trials": 2, "heartbeat_s": 1,
        "space": {"es": {"sigma": {"log": [0.005, 0.2]}, "optimizer": ["sgd", "adam"]},
                  "grpo": {"learning_rate": {"log": [1.0e-5, 3.0e-3]}, "beta": [0.0, 0.1]}},
        "primary": [["es", "grpo"]],
    },
    "final_seeds": [0, 1],
}


def write_spec(tmp_path: Path, changes=None, **sweep_changes) -> Path:
    spec = copy.deepcopy(SPEC)
    spec["sweep"]["out"] = str(tmp_path / "out")
    spec["sweep"].update(sweep_changes)
    if changes:
        changes(spec)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_two_methods_four_trials_each_then_the_winners_on_final_seeds_only(tmp_path, tiny_vllm):
    spec = tune.load_tune_spec(write_spec(tmp_path))
    assert tune.tune(spec, tiny_vllm, log=lambda line: None) == {"es": 4, "grpo": 4}
    for method, names in (("es", {"sigma", "optimizer"}), ("grpo", {"learning_rate", "beta"})):
        trials = tune.study_trials(spec, method)
        assert [t["number"] for t in trials] == [0, 1, 2, 3] and {t["state"] for t in trials} == {"complete"}
        for t in trials:  # every trial's setting, config and score recorded
            assert set(t["params"]) == names and t["value"] is not None
            assert {k: t["config"][k] for k in names} == t["params"]
            run_dir = Path(t["run_dir"]) / "seed100"
            rows = read_metrics(run_dir)
            assert t["value"] == rows[-1]["validation/reward"]  # the final mean's validation score
            config = yaml.safe_load((run_dir / "config.yaml").read_text())
            assert config["seed"] == 100 and all(config[k] == v for k, v in t["params"].items())
    # running again continues the finished study: no new trial
    assert tune.tune(spec, tiny_vllm, log=lambda line: None) == {"es": 0, "grpo": 0}
    assert tune.outstanding(spec) == ["final/es/seed0", "final/es/seed1", "final/grpo/seed0", "final/grpo/seed1"]
    assert tune.outstanding(spec, finals=False) == []
    done = tune.run_finals(spec, tiny_vllm, log=lambda line: None)
    assert tune.outstanding(spec) == []
    assert {m: [Path(f).name for f in folders] for m, folders in done.items()} == {"es": ["seed0", "seed1"],
                                                                                   "grpo": ["seed0", "seed1"]}
    # a finished rerun as a pack brings it to another machine (its weights left behind) is left be
    unpacked = spec.out / "final" / "es" / "seed0"
    for weights in ("checkpoints", "final_adapter", "final_model"):
        shutil.rmtree(unpacked / weights, ignore_errors=True)
    scored = (unpacked / "heldout.jsonl").read_text()
    assert tune.run_finals(spec, tiny_vllm, log=lambda line: None) == done
    assert (unpacked / "heldout.jsonl").read_text() == scored and not (unpacked / "checkpoints").exists()
    for method in ("es", "grpo"):
        best = tune.best_trial(spec, method)
        for folder in (spec.out / "final" / method).iterdir():
            config = yaml.safe_load((folder / "config.yaml").read_text())
            assert config["seed"] in (0, 1) and all(config[k] == v for k, v in best.params.items())
            assert (folder / "heldout.jsonl").exists()
    seeds = {yaml.safe_load(p.read_text())["seed"] for p in (spec.out / "trials").rglob("config.yaml")}
    assert seeds == {100}  # tuning touched no final seed
    # a rerun another worker has just started (its config, no rows yet) and one a kill cut short (rows,
    # no held-out score) are not in the tables, and the summary is written beside them
    started, cut = spec.out / "final" / "es" / "seed7", spec.out / "final" / "es" / "seed8"
    started.mkdir()
    shutil.copy(spec.out / "final" / "es" / "seed1" / "config.yaml", started)
    shutil.copytree(spec.out / "final" / "es" / "seed1", cut, ignore=shutil.ignore_patterns("heldout.jsonl"))
    assert {m: len(runs) for m, runs in tune.final_groups(spec).items()} == {"es": 2, "grpo": 2}
    summary = tune.summarize(spec)
    assert json.loads((spec.out / tune.SUMMARY).read_text())["methods"]["es"]["trials"] == 4
    assert {m: summary["methods"][m]["complete"] for m in ("es", "grpo")} == {"es": 4, "grpo": 4}
    assert [row["seeds"] for row in summary["final"]] == [2, 2]
    (comparison,) = summary["comparisons"]  # one primary pair: Holm leaves a family of one as it is
    assert comparison["family"] == "primary" and comparison["holm_p"] == comparison["permutation_p"]
    # a worker of one method writes the study's one summary all the same: both methods, the declared pair
    worker = tune.summarize(tune.load_tune_spec(tmp_path / "spec.yaml", methods=["grpo"]))
    assert list(worker["methods"]) == ["es", "grpo"] and [row["seeds"] for row in worker["final"]] == [2, 2]
    assert worker["primary"]["family"] == [["es", "grpo"]] and worker["comparisons"] == summary["comparisons"]


def test_a_worker_that_may_claim_no_more_finishes_its_run_and_leaves_the_rest(tmp_path, tiny_vllm, capsys):
    """``may_claim`` (``--claim-for`` on the command line) is asked before each trial or rerun starts:
    once it says no, the worker ends with the rest unclaimed, and a later worker finishes it."""
    spec = tune.load_tune_spec(write_spec(tmp_path, _set(["tune", "trials"], 2)), methods=["es"])
    lines = []
    one_claim = iter([True])
    assert tune.work(spec, tiny_vllm, log=lines.append, may_claim=lambda seconds=0.0: next(one_claim, False)) == {"es": 1}
    assert [t["state"] for t in tune.study_trials(spec, "es")] == ["complete"]
    assert tune.outstanding(spec) == ["trials of es"]
    assert lines[-1] == "claiming no more: 1 unfinished left to other workers or a later start (trials of es)"
    one_claim = iter([True])  # the second trial, then no rerun begun
    assert tune.work(spec, tiny_vllm, log=lines.append, may_claim=lambda seconds=0.0: next(one_claim, False)) == {"es": 1}
    assert tune.outstanding(spec) == ["final/es/seed0", "final/es/seed1"]
    assert not (spec.out / "final").exists()
    assert tune.work(spec, tiny_vllm, log=lines.append) == {"es": 0}  # no limit: the reruns
    assert tune.outstanding(spec) == []
    assert [row["generation"] for row in read_metrics(spec.out / "final" / "es" / "seed1")] == [0, 1, 2]
    assert main(["tune", str(tmp_path / "spec.yaml"), "--claim-for", "-5"]) == 2
    assert "--claim-for: a number of seconds >= 0, not -5.0" in capsys.readouterr().err
    assert main(["tune", str(tmp_path / "spec.yaml"), "--claim-until", "0"]) == 2
    assert "--claim-until: seconds since the epoch (date +%s), not 0.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one deadline or the other
        main(["tune", str(tmp_path / "spec.yaml"), "--claim-for", "5", "--claim-until", "1"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_deadline_for_claiming_is_a_span_from_now_or_a_time_on_the_clock(monkeypatch):
    """``--claim-for`` counts from the worker's own start; ``--claim-until`` is the clock's time, the
    same for every worker given it however long each took to start; neither: no deadline."""
    from evolm_lib.cli.tune import claim_rule

    now = {"time": 1_800_000_000.0}
    monkeypatch.setattr(time, "time", lambda: now["time"])
    within, until, always = claim_rule(claim_for=30), claim_rule(claim_until=1_800_000_020), claim_rule()
    assert within() and until() and always()
    now["time"] = 1_800_000_019.9
    assert within() and until()
    now["time"] = 1_800_000_020.0
    assert within() and not until() and always()
    now["time"] = 1_800_000_030.0
    assert not within() and always(1e9)


def test_a_deadline_with_an_end_claims_work_by_its_expected_length_and_counts_what_it_turns_down():
    """``pace.Deadline``: with ``finish_by`` a claim of ``seconds`` holds while now + 1.2 x seconds is
    not past it; a claim turned down for its length alone is counted (the worker then ends); the
    length is read only where an end makes it matter; past ``claim_until`` nothing is claimed."""
    from evolm_lib.tune.pace import FINISH_MARGIN, Deadline

    assert FINISH_MARGIN == 1.2
    now = [1000.0]
    deadline = Deadline(finish_by=1100.0, clock=lambda: now[0])
    assert deadline(50.0) and deadline(83.33) and deadline.refused == 0  # 1000 + 99.996
    assert not deadline(83.34) and deadline.refused == 1  # 1000 + 100.008
    assert deadline(lambda: 10.0) and not deadline(lambda: 90.0) and deadline.refused == 2
    asked = []
    open_ended = Deadline(claim_until=1050.0, clock=lambda: now[0])
    assert open_ended(lambda: asked.append("read") or 1e9) and asked == []
    now[0] = 1050.0
    assert not open_ended(0.0) and open_ended.refused == 0
    now[0] = 1100.0  # the end itself: nothing more, and not counted as too long
    assert not deadline(0.0) and deadline.refused == 2
    both = Deadline(claim_until=1200.0, finish_by=2000.0, clock=lambda: now[0])
    assert both(100.0) and not both(800.0) and both.refused == 1
    now[0] = 1200.0
    assert not both(1.0) and both.refused == 1


def test_a_deadline_asked_as_of_an_engine_s_start_weighs_work_from_then():
    """``pace.starting_later``: a ``Deadline`` asked as of ``seconds`` from now (lease 17: six LoRA GRPO
    workers each started a 3.5-minute engine, then turned their rerun down), counting its refusals apart
    from the rule it copies; ``tune.always``, or no start to wait for, is the rule itself."""
    from evolm_lib.tune.pace import Deadline, starting_later

    now = [1000.0]
    deadline = Deadline(finish_by=1100.0, clock=lambda: now[0])
    later = starting_later(deadline, 50.0)
    assert later(41.66) and not later(41.67) and later.refused == 1 and deadline.refused == 0  # 1050 + 1.2 x s
    assert deadline(41.67) and deadline.refused == 0  # asked now, it fits
    now[0] = 1040.0  # the copy follows the rule's clock
    assert not later(10.0) and later(8.33)
    shut = starting_later(Deadline(claim_until=1060.0, clock=lambda: now[0]), 20.0)
    assert not shut(0.0) and shut.refused == 0  # the claim window shuts before the engine is up
    assert starting_later(tune.always, 50.0) is tune.always and starting_later(deadline, 0.0) is deadline


def test_a_run_goes_on_from_its_newest_checkpoint_also_one_renamed_aside_mid_write(tmp_path):
    """``pace.resumes_at``: the newest written checkpoint's generation (a copy renamed aside while its
    replacement is written stands in for it); 0 for a folder without one."""
    from evolm_lib.tune.pace import resumes_at

    assert resumes_at(tmp_path) == 0
    for name in ("000002", "000004.old", "000006"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    for name in ("000002", "000004.old"):  # 000006 holds nothing written yet
        (tmp_path / "checkpoints" / name / "state.json").write_text("{}")
    assert resumes_at(tmp_path) == 4


def test_a_worker_given_its_end_starts_only_what_the_study_s_own_pace_says_ends_by_then(tmp_path, tiny_vllm):
    """A trial is paced by its method's complete trials (the median of their runs' ``time/wall_s``), a
    rerun and its continuation (``tune.long``) by the winner's seconds a generation times what each has
    left past its checkpoint; a worker whose end is too near for the rerun starts nothing and ends
    saying so, and one whose end leaves room runs it, then its continuation."""
    from evolm_lib.tune.final import long_run
    from evolm_lib.tune.pace import Deadline, resumes_at, run_seconds, step_seconds
    from evolm_lib.tune.study import trial_seconds

    def changes(spec):
        spec["tune"].update(trials=2, long=2)
        spec["final_seeds"] = [0]

    spec = tune.load_tune_spec(write_spec(tmp_path, changes), methods=["es"])
    assert trial_seconds(spec, "es") == 0.0 and step_seconds(spec, "es") == 0.0  # nothing to pace by yet
    assert tune.tune(spec, tiny_vllm, log=lambda line: None) == {"es": 2}
    walls = {}
    for trial in tune.study_trials(spec, "es"):
        row = read_metrics(Path(trial["run_dir"]) / "seed100")[-1]
        walls[trial["number"]] = (row["time/wall_s"], row["generation"])
    assert trial_seconds(spec, "es") == pytest.approx((walls[0][0] + walls[1][0]) / 2)
    wall, generations = walls[tune.best_trial(spec, "es").number]
    step = wall / generations
    assert generations == 2 and step_seconds(spec, "es") == pytest.approx(step)
    (rerun,) = tune.final_plan(spec, "es")
    folder, continued = spec.out / "final" / rerun.name, spec.out / "long" / rerun.name
    assert run_seconds(spec, rerun, folder) == pytest.approx(2 * step)
    assert run_seconds(spec, long_run(spec, rerun), continued, start=2) == pytest.approx(2 * step)  # 2 to 4

    lines = []
    near = Deadline(finish_by=1000.0 + 0.99 * 1.2 * 2 * step, clock=lambda: 1000.0)
    assert tune.work(spec, tiny_vllm, log=lines.append, may_claim=near) == {"es": 0}
    assert near.refused == 1 and not folder.exists()
    assert lines[-1] == ("claiming no more: what is left would not end by the deadline (2 unfinished left to other "
                         "workers or a later start: final/es/seed0, long/es/seed0)")
    # room for the rerun and for its continuation, which is weighed at the rerun's own pace once it has
    # run; both at the 1.01 boundary: the test after next
    room = Deadline(finish_by=1000.0 + 3600.0, clock=lambda: 1000.0)
    assert tune.work(spec, tiny_vllm, log=lines.append, may_claim=room) == {"es": 0}
    assert room.refused == 0 and tune.outstanding(spec) == []
    assert resumes_at(folder) == 2 and run_seconds(spec, rerun, folder) == 0.0  # done: nothing left to pace
    # once a rerun has timed rows, the method's reruns and control are paced by them, not by the trial
    timed = [row for row in read_metrics(folder) if "time/wall_s" in row]
    assert timed[-1]["generation"] == 2 and step_seconds(spec, "es") == pytest.approx(timed[-1]["time/wall_s"] / 2)
    assert [row["generation"] for row in read_metrics(continued)][-1] == 4


def test_a_worker_whose_end_leaves_no_trial_room_starts_no_engine(tmp_path, tiny_vllm, monkeypatch, capsys):
    """Lease 13: LoRA GRPO's worker started its engine (2.7 minutes on an H200) before turning its one
    trial left down. Where all that is left is trials not started and the next one would not end by
    the deadline, `evolm tune --finish-by` says so and starts no engine; with room, or with nothing to
    pace by yet, it goes on to claim as before."""
    from evolm_lib.tune.pace import Deadline
    from evolm_lib.tune.study import trial_seconds

    path = write_spec(tmp_path, lambda spec: spec["tune"].update(trials=2))
    spec = tune.load_tune_spec(path, methods=["es"])
    assert tune.nothing_fits(spec, Deadline(finish_by=1.0, clock=lambda: 0.5)) is None  # no trial to pace by
    claims = []
    assert tune.tune(spec, tiny_vllm, log=lambda line: None,
                     may_claim=lambda seconds=0.0: claims.append(1) or len(claims) == 1) == {"es": 1}
    assert trial_seconds(spec, "es") > 0 and tune.outstanding(spec) == ["trials of es"]
    # the trial as if it had taken 1,000 s (its rows' wall clocks stretched): the command-line checks
    # below then hold on any machine, however long `evolm tune` takes to get to its first claim
    (trial,) = tune.study_trials(spec, "es")
    rows = read_metrics(Path(trial["run_dir"]) / "seed100")
    stretch = 1000.0 / rows[-1]["time/wall_s"]
    for row in rows:
        row["time/wall_s"] = row["time/wall_s"] * stretch if "time/wall_s" in row else None
    (Path(trial["run_dir"]) / "seed100" / "metrics.jsonl").write_text(
        "".join(json.dumps({k: v for k, v in row.items() if v is not None}) + "\n" for row in rows))
    took = trial_seconds(spec, "es")
    assert took == pytest.approx(1000.0)
    near = Deadline(finish_by=1000.0 + 0.99 * 1.2 * took, clock=lambda: 1000.0)
    assert tune.nothing_fits(spec, near) == ("claiming no more: what is left would not end by the deadline "
                                            "(trials of es): no engine started")
    assert tune.nothing_fits(spec, Deadline(finish_by=1000.0 + 1.01 * 1.2 * took, clock=lambda: 1000.0)) is None
    shut = Deadline(claim_until=999.0, clock=lambda: 1000.0)  # `--claim-until` passed: no length weighed
    assert tune.nothing_fits(spec, shut) == ("claiming no more: what is left may not be started now (trials of es): "
                                             "no engine started")

    def no_engine(spec):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(tune, "make_tuning_evaluator", no_engine)
    capsys.readouterr()
    end = time.time() + 0.5 * 1.2 * took
    assert main(["tune", str(path), "--methods", "es", "--no-figures", "--finish-by", str(end)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "claiming no more: what is left would not end by the deadline (trials of es): no engine started" in printed
    assert printed[-1].startswith("summary: ")  # a clean end: the stage script's refill hands the slot on
    assert tune.outstanding(spec) == ["trials of es"]  # nothing claimed
    # the trial fits from now (2,400 s for its 1,200 with the margin), not once an engine that takes
    # 1,800 s to start is up (`--engine-start-s`)
    end = str(time.time() + 2 * 1.2 * took)
    assert main(["tune", str(path), "--methods", "es", "--no-figures", "--finish-by", end,
                 "--engine-start-s", str(1.5 * 1.2 * took)]) == 0
    assert "claiming no more: what is left would not end by the deadline (trials of es): no engine started" in (
        capsys.readouterr().out.splitlines())
    assert main(["tune", str(path), "--methods", "es", "--finish-by", end, "--engine-start-s", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "error: --engine-start-s: a number of seconds >= 0, not -1.0"


def test_a_worker_whose_end_leaves_no_room_for_any_rerun_or_continuation_starts_no_engine(tmp_path, tiny_vllm):
    """The plan after lease 14 fills slots late in a lease with GRPO workers whose work left is reruns and
    continuations. Each is weighed at the length the worker would weigh it at (a continuation from its
    rerun's last checkpoint, at that rerun's own pace; one whose rerun is not done, through that
    rerun): where none fits and none is held by another worker, the worker starts no engine; a run
    another worker writes is left to it, and with every run held elsewhere the worker waits as before."""
    from evolm_lib.runs.lock import WriterLock
    from evolm_lib.tune.final import continuation_seconds, long_run, run_unfinished
    from evolm_lib.tune.pace import Deadline, run_seconds
    from evolm_lib.tune.study import run_wall

    spec = tune.load_tune_spec(write_spec(tmp_path, lambda spec: spec["tune"].update(trials=1, long=2)), methods=["es"])
    assert tune.tune(spec, tiny_vllm, log=lambda line: None) == {"es": 1}
    seed0, seed1 = tune.final_plan(spec, "es")
    assert run_unfinished(seed0, spec.out / "final", tiny_vllm)  # its continuation's checkpoint is here
    assert tune.outstanding(spec) == ["final/es/seed1", "long/es/seed0", "long/es/seed1"]
    rerun_s = run_seconds(spec, seed1, spec.out / "final" / seed1.name)  # 2 generations at seed0's rerun's pace
    rerun0 = spec.out / "final" / seed0.name
    wall, generations = run_wall(rerun0)
    assert rerun_s > 0 and generations == 2
    assert continuation_seconds(spec, long_run(spec, seed0), seed0) == pytest.approx(wall)  # 2 more at its own pace

    def ran_in(seconds):  # seed0's rerun as if its 2 generations had taken `seconds`
        rows = read_metrics(rerun0)
        rows[-1]["time/wall_s"] = seconds
        (rerun0 / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    ran_in(rerun_s)  # every run left weighs rerun_s, seed1's rerun too (paced by seed0's)
    continued_s = continuation_seconds(spec, long_run(spec, seed0), seed0)
    assert continued_s == pytest.approx(rerun_s)

    def at(fraction):  # a deadline that leaves `fraction` of a run's stretched seconds
        return Deadline(finish_by=1000.0 + fraction * 1.2 * rerun_s, clock=lambda: 1000.0)

    assert tune.nothing_fits(spec, at(0.99)) == ("claiming no more: what is left would not end by the deadline "
                                                 "(final/es/seed1, long/es/seed0, long/es/seed1): no engine started")
    assert tune.nothing_fits(spec, at(1.01)) is None
    held = [WriterLock.acquire(spec.out / "final" / seed1.name)]  # another worker writes seed1's rerun
    try:
        # seed0's continuation turned down, the rest another's: the worker would claim nothing and end
        assert tune.nothing_fits(spec, at(0.99)).startswith("claiming no more: what is left would not end")
        assert tune.nothing_fits(spec, at(1.01)) is None  # seed0's continuation fits
        # seed0's rerun ran three times as slow as its trial (a busier card): so is its continuation weighed
        ran_in(3 * rerun_s)
        assert continuation_seconds(spec, long_run(spec, seed0), seed0) == pytest.approx(3 * rerun_s)
        assert tune.nothing_fits(spec, at(1.01)).startswith("claiming no more: what is left would not end")
        assert tune.nothing_fits(spec, at(3.03)) is None
        held.append(WriterLock.acquire(spec.out / "long" / seed0.name))
        assert tune.nothing_fits(spec, at(0.99)) is None  # all held elsewhere: it waits for them
    finally:
        for lock in held:
            lock.release()


def test_a_continuation_whose_rerun_checkpoint_is_here_goes_before_a_rerun_not_started(tmp_path, tiny_vllm):
    """Lease 15 packed four LoRA GRPO reruns' checkpoints for their continuations, which a later session
    has only where it finds the checkout kept; a worker there would have claimed the reruns not yet
    started first and left the checkpoints unused. Now a finished rerun whose checkpoint is here is
    continued before any rerun is started (which any machine can run)."""
    from evolm_lib.tune.final import run_unfinished

    spec = tune.load_tune_spec(write_spec(tmp_path, lambda spec: spec["tune"].update(trials=1, long=2)), methods=["es"])
    assert tune.tune(spec, tiny_vllm, log=lambda line: None) == {"es": 1}
    seed0, seed1 = tune.final_plan(spec, "es")
    assert run_unfinished(seed0, spec.out / "final", tiny_vllm)  # as unpacked from a kept pack: its checkpoint here
    continued0, rerun1 = spec.out / "long" / seed0.name, spec.out / "final" / seed1.name
    seen = []  # which of the two exists at each claim the worker asks

    def may_claim(seconds=0.0):
        seen.append((continued0.exists(), rerun1.exists()))
        return True

    tune.run_finals(spec, tiny_vllm, log=lambda line: None, may_claim=may_claim)
    assert tune.outstanding(spec) == []
    assert next(state for state in seen if any(state)) == (True, False)  # seed0's continuation begun first


# the engine in the worker's process, whatever the caller's environment asks (the checkout is on the
# PYTHONPATH the root conftest.py sets)
WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _worker(spec: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "evolm_lib.cli", "tune", str(spec), "--methods", "es", "--no-finals",
                             "--no-figures", *extra], cwd=REPO, env={**os.environ, **WORKER_ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _hf_spec(tmp_path: Path, trials: int, generations: int) -> Path:
    def change(spec):
        spec["sweep"]["common"]["engine"] = "hf"  # starts in seconds: these tests start several workers
        spec["tune"]["trials"] = trials
    return write_spec(tmp_path, change, generations=generations)


def test_a_worker_killed_mid_trial_leaves_a_study_the_next_run_continues(tmp_path):
    path = _hf_spec(tmp_path, trials=3, generations=12)
    spec = tune.load_tune_spec(path, methods=["es"])
    worker = _worker(path)
    deadline, killed_folder = time.time() + 600, None
    while time.time() < deadline and worker.poll() is None:
        if (spec.out / "optuna.db").exists():
            running = [t for t in tune.study_trials(spec, "es") if t["state"] == "running" and t["number"] == 1]
            folder = spec.out / "trials" / "es" / "trial_0001" / "seed100"
            if running and (folder / "metrics.jsonl").exists() and len(read_metrics(folder)) >= 3:
                os.kill(worker.pid, signal.SIGKILL)
                worker.wait()
                killed_folder = folder
                break
        time.sleep(0.2)
    assert killed_folder is not None, "the worker ended before its second trial was half done"
    done_before = len(read_metrics(killed_folder))
    assert done_before < 13
    time.sleep(3 * spec.settings.heartbeat_s + 1)  # the killed trial's heartbeat goes stale
    rerun = _worker(path)
    output, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, output
    trials = {t["number"]: t for t in tune.study_trials(spec, "es")}
    killed = trials[1]
    assert killed["state"] == "fail" and killed["error"] is None  # failed by the next worker, not by its setting
    retry = next(t for t in trials.values() if t["retries"] == 1)
    assert retry["state"] == "complete" and retry["params"] == killed["params"]
    assert Path(retry["run_dir"]) == killed_folder.parent  # the same folder, resumed from its checkpoint
    generations = [row["generation"] for row in read_metrics(killed_folder)]
    assert generations == list(range(13))  # nothing counted twice
    # each attempt's placement line says where its rows begin: the retry's at the checkpoint it resumed.
    # A checkpoint is written before its generation's metrics line (it holds the row), so a kill between
    # the two leaves a checkpoint at done_before, whose row the resume writes back
    starts = [line["from_generation"] for line in read_jsonl(killed_folder / "placement.jsonl")]
    assert len(starts) == 2 and starts[0] == 0 and 0 < starts[1] <= done_before
    complete = [t for t in trials.values() if t["state"] == "complete"]
    assert len(complete) == 3 and len(trials) == 4  # 3 trials: two first attempts and one retry


def test_two_workers_share_one_study_and_never_run_the_same_trial(tmp_path):
    path = _hf_spec(tmp_path, trials=4, generations=3)
    spec = tune.load_tune_spec(path, methods=["es"])
    tune.load_study(spec, "es")  # created once, before both workers open it
    workers = [_worker(path) for _ in range(2)]
    outputs = [w.communicate(timeout=600)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    ran = [eval(line.split(": ", 1)[1].split(" (")[0])["es"] for out in outputs for line in out.splitlines()
           if line.startswith("trials run by this worker")]
    trials = tune.study_trials(spec, "es")
    assert sum(ran) == 4 and len(trials) == 4 and {t["state"] for t in trials} == {"complete"}
    assert sorted(Path(t["run_dir"]).name for t in trials) == [f"trial_{n:04d}" for n in range(4)]
    assert len({t["worker"] for t in trials}) <= 2
    for t in trials:  # each trial's run written once, by one worker
        assert [row["generation"] for row in read_metrics(Path(t["run_dir"]) / "seed100")] == [0, 1, 2, 3]


def test_two_workers_one_trial_at_a_time_then_each_ends_with_every_rerun(tmp_path, monkeypatch, capsys):
    """tune.parallel 1: the second worker waits while the first runs a trial. A worker with nothing to
    claim waits for the others instead of ending, so each ends with the whole summary; a worker
    started once all is done starts no engine."""
    def change(spec):
        spec["sweep"]["common"]["engine"] = "hf"  # starts in seconds
        spec["tune"].update(trials=2, parallel=1)
    path = write_spec(tmp_path, change, generations=3)
    spec = tune.load_tune_spec(path, methods=["es"])
    tune.load_study(spec, "es")
    workers = [subprocess.Popen([sys.executable, "-m", "evolm_lib.cli", "tune", str(path), "--methods", "es",
                                 "--no-figures"], cwd=REPO, env={**os.environ, **WORKER_ENV}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [w.communicate(timeout=600)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    trials = sorted(tune.load_study(spec, "es").get_trials(deepcopy=False), key=lambda t: t.datetime_start)
    assert [t.state.name for t in trials] == ["COMPLETE"] * 2
    assert trials[1].datetime_start >= trials[0].datetime_complete  # the second drawn knowing the first
    for output in outputs:  # each worker's summary holds both trials and both reruns, whichever worker ran them
        assert "es: 2 trials (2 complete" in output, output
        assert "held-out reward on 2 final seeds" in output, output
    for seed in (0, 1):  # each rerun written by one worker, where it ran recorded once
        folder = spec.out / "final" / "es" / f"seed{seed}"
        assert [row["generation"] for row in read_metrics(folder)] == [0, 1, 2, 3]
        assert len((folder / "placement.jsonl").read_text().splitlines()) == 1
        assert len((folder / "heldout.jsonl").read_text().splitlines()) == 8  # every held-out problem, once

    def no_engine(spec):
        raise AssertionError("an engine started for a finished study")

    monkeypatch.setattr(tune, "make_tuning_evaluator", no_engine)
    assert main(["tune", str(path), "--methods", "es", "--no-figures"]) == 0
    output = capsys.readouterr().out
    assert "nothing left to run for these methods: no engine started" in output
    assert "held-out reward on 2 final seeds" in output  # the summary all the same


def _set(path: list, value):
    def change(spec):
        node = spec
        for key in path[:-1]:
            node = node[key]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return change


_DELETE = object()


@pytest.mark.parametrize("change, message", [
    (_set(["tune", "space", "gpro"], {"beta": [0.1]}), r"tune.space.gpro: not a method of this sweep \(did you mean grpo\?\)"),
    (_set(["tune", "space", "es", "sigmaa"], {"log": [0.1, 0.2]}), r"tune.space.es.sigmaa: not one of the ESConfig settings \(did you mean sigma\?\)"),
    (_set(["tune", "space", "es", "sigma"], {"log": [0.2, 0.2]}), r"tune.space.es.sigma: an empty range \[0.2, 0.2\]"),
    (_set(["tune", "space", "es", "sigma"], {"log": [0.0, 0.2]}), r"tune.space.es.sigma: a log range must lie above 0"),
    (_set(["tune", "space", "es", "sigma"], {"lgo": [0.1, 0.2]}), r"tune.space.es.sigma: unknown range 'lgo' \(did you mean log\?\)"),
    (_set(["tune", "space", "es", "sigma"], []), r"tune.space.es.sigma: an empty list of choices"),
    (_set(["tune", "space", "es", "sigma"], {"uniform": [-1.0, 0.2]}), r"tune.space.es.sigma: .*greater than 0"),
    (_set(["tune", "space", "es", "seed"], [1, 2]), r"tune.space.es.seed: not searched"),
    (_set(["final_seeds"], [0, 100]), r"final_seeds: \[100\] also tuning seeds"),
    (_set(["tune", "select"], "validation/rewrd"), r"tune.select: no run writes 'validation/rewrd' \(did you mean validation/reward\?\)"),
    (_set(["tune", "select"], "eval/reward"), r"tune.select: eval/reward is the held-out score"),
    (_set(["sweep", "common", "task_options"], {}), r"tune.select: validation/reward, but es's task 'conciseness' has no validation"),
    (_set(["tune", "space", "grpo"], _DELETE), r"tune.space: no space for \['grpo'\]"),
    (_set(["tune", "trials"], 0), r"tune.trials: a whole number >= 1"),
    (_set(["tune", "parallel"], -1), r"tune.parallel: a whole number >= 0"),
    (_set(["tune", "primary"], [["es", "grpoo"]]), r"tune.primary: \['grpoo'\] not a method of this sweep"),
])
def test_bad_specs_fail_naming_the_setting_before_any_engine(tmp_path, change, message, capsys):
    path = write_spec(tmp_path, change)
    with pytest.raises(ValueError, match=message):
        tune.load_tune_spec(path)
    assert main(["tune", str(path)]) == 2  # the command stops before an engine, with the same line
    assert "error: " in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_searched_population_size_keeps_the_budget(tmp_path):
    path = write_spec(tmp_path, _set(["tune", "space", "es", "population_size"], [2, 8]))
    spec = tune.load_tune_spec(path)
    planned = spec.tuning_runs["es"][0]
    assert tune.trial_config(spec, planned, {"population_size": 8}).num_generations == 1  # 16 completions: 1 x 8 x 2
    assert tune.trial_config(spec, planned, {"population_size": 2}).num_generations == 4
    with pytest.raises(ValueError, match="tune.space.es.population_size: 6 makes 12 completions"):
        tune.trial_config(spec, planned, {"population_size": 6})


def test_a_study_packed_mid_run_keeps_finished_trials_rows_and_leaves_weights_and_running_trials_out(tmp_path):
    """python -m evolm_lib.tune.pack: a consistent copy of the storage, the finished trial's text
    files without its weights, nothing of the trial still running (its retry starts afresh)."""
    import subprocess
    import tarfile

    import optuna

    out = tmp_path / "study"
    out.mkdir()
    study = optuna.create_study(storage=f"sqlite:///{out / 'optuna.db'}", study_name="es_full", direction="maximize")
    done = study.ask()
    done.set_user_attr("run_dir", str(out / "trials" / "es_full" / "trial_0000"))
    study.tell(done, 0.5)
    study.ask()  # trial 1: still running
    finished = out / "trials" / "es_full" / "trial_0000" / "seed100"
    running = out / "trials" / "es_full" / "trial_0001" / "seed100"
    rerun_done, rerun_going = out / "final" / "es_full" / "seed0", out / "final" / "es_full" / "seed1"
    for folder in (finished, running, rerun_done, rerun_going):
        (folder / "checkpoints" / "000010").mkdir(parents=True)
        (folder / "checkpoints" / "000010" / "state.json").write_text("{}")
        (folder / "snapshots").mkdir()
        (folder / "snapshots" / "000010.safetensors").write_bytes(b"\0" * 64)
        (folder / "metrics.jsonl").write_text('{"generation": 1}\n')
        (folder / "config.yaml").write_text("seed: 100\n")
    (rerun_done / "heldout.jsonl").write_text('{"index": 0, "generation": 10}\n')  # scored: finished
    (out / "final" / "es_full" / ".seed0.copying").mkdir()  # a continuation's copy being made: not a run
    (out / "final" / "es_full" / ".seed0.copying" / "config.yaml").write_text("seed: 0\n")
    (out / "tune_summary.json").write_text("{}")
    archive = tmp_path / "pack" / "study.tar.gz"
    result = subprocess.run([sys.executable, "-m", "evolm_lib.tune.pack", str(out), str(archive)],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert ("left out 2 unfinished runs, to run from their start: "
            "final/es_full/seed1, trials/es_full/trial_0001/seed100") in result.stdout  # no intact checkpoint
    with tarfile.open(archive) as tar:
        names = sorted(tar.getnames())
        tar.extractall(tmp_path / "unpacked", filter="data")
    assert names == ["study/final/es_full/seed0/config.yaml", "study/final/es_full/seed0/heldout.jsonl",
                     "study/final/es_full/seed0/metrics.jsonl", "study/optuna.db", "study/pack_index.json",
                     "study/trials/es_full/trial_0000/seed100/config.yaml",
                     "study/trials/es_full/trial_0000/seed100/metrics.jsonl", "study/tune_summary.json"]
    copy = optuna.load_study(study_name="es_full", storage=f"sqlite:///{tmp_path / 'unpacked' / 'study' / 'optuna.db'}")
    assert [t.state.name for t in copy.trials] == ["COMPLETE", "RUNNING"] and copy.best_value == 0.5

    missing = subprocess.run([sys.executable, "-m", "evolm_lib.tune.pack", str(tmp_path), str(archive)],
                             capture_output=True, text=True, cwd=REPO)
    assert missing.returncode == 1 and "no optuna.db here" in missing.stderr


def test_a_pack_carries_the_geometry_s_solutions_in_what_the_budget_leaves_so_they_need_no_rebuild(tmp_path):
    """After the checkpoints a run goes on from (an unfinished control run's), a pack carries the last
    checkpoint of each finished rerun the geometry reads (the first three final seeds) where it holds
    the weights, smallest first within the budget: GRPO's seeds 0 and 1 fit, seed 2 and full GRPO's
    large one are named over it, seed 3 is no geometry seed, and full ES's checkpoint (no tensors: its
    weights are in snapshots, which stay behind) is not a solution. Unpacked, only the ones left
    behind are to rebuild; a full ES folder holds its solution only beside its snapshot."""
    import tarfile

    import optuna
    import torch

    from evolm_lib.runs.checkpoints import write_checkpoint
    from evolm_lib.tune.pack import pack_study
    from evolm_lib.tune.rebuild import has_weights, to_rebuild

    out = tmp_path / "study"
    out.mkdir()
    optuna.create_study(storage=f"sqlite:///{out / 'optuna.db'}", study_name="es_lora")

    def run(stage, method, seed, values, finished=True):
        folder = out / stage / method / f"seed{seed}"
        folder.mkdir(parents=True)
        kind = "grpo" if method.startswith("grpo") else "es"
        (folder / "config.yaml").write_text(f"kind: {kind}\nseed: {seed}\n")
        (folder / "metrics.jsonl").write_text(json.dumps({"generation": 0}) + "\n")
        if finished:
            (folder / "heldout.jsonl").write_text(json.dumps({"index": 0, "reward": -1.0, "success": False}) + "\n")
        if values is not None:
            tensors = {"m": torch.arange(values, dtype=torch.float32)} if values else {}
            write_checkpoint(folder, 8, None, tensors, {}, "tiny-random", rows=[])
        return folder

    def size(folder):
        (checkpoint,) = list((folder / "checkpoints").iterdir())
        return sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())

    control = run("control", "es_lora", 0, 3000, finished=False)
    solutions = [run("final", "grpo_lora", seed, 1000 + seed) for seed in range(4)]
    large = run("final", "grpo_full", 0, 200_000)
    es_full = run("final", "es_full", 0, 0)  # a checkpoint without tensors
    for method, seed in [("grpo_lora", s) for s in range(4)] + [("grpo_full", 0), ("es_full", 0)]:
        run("long", method, seed, None)  # continued: no checkpoint is wanted for a continuation
    budget = size(control) + size(solutions[0]) + size(solutions[1])
    report = pack_study(out, tmp_path / "pack.tar.gz", checkpoint_bytes=budget)
    assert report["resumed"] == ["control/es_lora/seed0 at 8"] and report["continued"] == []
    assert report["solutions"] == ["final/grpo_lora/seed0 at 8", "final/grpo_lora/seed1 at 8"]
    assert report["checkpoint_bytes"] == budget
    assert sorted(report["over_budget"]) == [("final/grpo_full/seed0", size(large)),
                                             ("final/grpo_lora/seed2", size(solutions[2]))]
    unpacked = tmp_path / "unpacked"
    with tarfile.open(tmp_path / "pack.tar.gz") as tar:
        tar.extractall(unpacked, filter="data")
    left = to_rebuild(unpacked / "study", None)
    assert [(source.parent.name, source.name) for source, _, _ in left] == [
        ("es_full", "seed0"), ("grpo_full", "seed0"), ("grpo_lora", "seed2")]
    assert not has_weights(es_full)  # its checkpoint alone: no weights to read
    (es_full / "snapshots").mkdir()
    (es_full / "snapshots" / "000008.safetensors").write_bytes(b"")
    assert has_weights(es_full) and has_weights(solutions[3]) and not has_weights(out / "long" / "es_full" / "seed0")


def test_a_pack_spends_its_budget_on_checkpoints_that_save_work_before_the_geometry_s(tmp_path):
    """A run whose newest checkpoint is at its start (generation 0) is left out to start again, its
    checkpoint spending none of the budget though it is the smallest; a finished rerun whose
    continuation goes on from a checkpoint of its own is no continuation's start, so its checkpoint
    waits with the geometry's solutions, after a rerun's whose continuation has none."""
    import optuna
    import torch

    from evolm_lib.runs.checkpoints import write_checkpoint
    from evolm_lib.tune.pack import pack_study

    out = tmp_path / "study"
    out.mkdir()
    optuna.create_study(storage=f"sqlite:///{out / 'optuna.db'}", study_name="grpo_lora")

    def run(stage, seed, generation, values, finished):
        folder = out / stage / "grpo_lora" / f"seed{seed}"
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(f"kind: grpo\nseed: {seed}\n")
        (folder / "metrics.jsonl").write_text(json.dumps({"generation": generation}) + "\n")
        if finished:
            (folder / "heldout.jsonl").write_text(json.dumps({"index": 0, "reward": -1.0, "success": False}) + "\n")
        write_checkpoint(folder, generation, None, {"m": torch.arange(values, dtype=torch.float32)}, {},
                         "tiny-random", rows=[])
        return folder

    def size(folder):
        (checkpoint,) = list((folder / "checkpoints").iterdir())
        return sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())

    going_on = run("long", 0, 16, 3000, finished=False)  # seed 0's continuation, under way
    run("final", 0, 8, 3000, finished=True)
    seed1 = run("final", 1, 8, 3000, finished=True)  # its continuation not begun
    seed2 = run("final", 2, 8, 3000, finished=False)
    run("final", 3, 0, 10, finished=False)  # just begun: the smallest checkpoint of all
    budget = size(going_on) + size(seed1) + size(seed2)
    report = pack_study(out, tmp_path / "pack.tar.gz", checkpoint_bytes=budget)
    assert report["resumed"] == ["final/grpo_lora/seed2 at 8", "long/grpo_lora/seed0 at 16"]
    assert report["continued"] == ["final/grpo_lora/seed1 at 8"] and report["solutions"] == []
    assert report["left_out"] == ["final/grpo_lora/seed3"] and report["checkpoint_bytes"] == budget
    assert report["over_budget"] == [("final/grpo_lora/seed0", size(out / "final" / "grpo_lora" / "seed0"))]
    # with room for it, seed 0's last checkpoint goes in as a solution the geometry reads
    report = pack_study(out, tmp_path / "pack.tar.gz", checkpoint_bytes=2 * budget)
    assert report["solutions"] == ["final/grpo_lora/seed0 at 8"] and report["left_out"] == ["final/grpo_lora/seed3"]


def test_a_retry_packs_into_its_first_attempts_folder_and_a_failed_trial_s_folder_is_its_retry_s(tmp_path):
    """tune.pack.trial_folders: finished trials by their run_dir, trials still to run (running, or a
    retry waiting) by their first attempt's folder, which a retry resumes; a failed trial with a
    retry under its retry's name, one without among the failed."""
    import optuna

    from evolm_lib.tune.pack import trial_folders

    storage = tmp_path / "optuna.db"
    study = optuna.create_study(storage=f"sqlite:///{storage}", study_name="es_full", direction="maximize")
    done = study.ask()  # 0: complete
    done.set_user_attr("run_dir", "runs/x/trials/es_full/trial_0000")
    study.tell(done, 0.5)
    study.tell(study.ask(), state=optuna.trial.TrialState.FAIL)  # 1: killed, its retry waits as 3
    study.tell(study.ask(), state=optuna.trial.TrialState.FAIL)  # 2: refused by its config, no retry
    params = {"sigma": 0.1}
    distributions = {"sigma": optuna.distributions.FloatDistribution(0.01, 1.0)}
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.WAITING, params=params,
                                              distributions=distributions,
                                              system_attrs={"failed_trial": 1, "retry_history": [1]}))
    study.ask()  # 4: running (takes the waiting retry 3 first, so ask twice)
    study.ask()
    assert trial_folders(storage) == (["trials/es_full/trial_0000"],
                                      ["trials/es_full/trial_0001", "trials/es_full/trial_0004"],
                                      ["trials/es_full/trial_0002"])


def test_an_unfinished_run_packed_with_its_checkpoint_resumes_elsewhere_to_the_uninterrupted_rows(tiny_vllm, tmp_path, capsys):
    """A full-parameter ES run's checkpoint holds no tensors (its mean is replayed from the seed log),
    a LoRA run's (ES or GRPO) holds the adapter and the optimizer's moments: under a budget below the
    ES LoRA checkpoint only the first goes in and the LoRA runs are left out and named; under the
    default all go in, without snapshots, and each, unpacked in another folder, resumes to the rows
    of a run never stopped."""
    import tarfile

    import optuna

    from evolm_lib.config import ESConfig, GRPOConfig
    from evolm_lib.runs import list_checkpoints
    from evolm_lib.train.es import ESRun
    from evolm_lib.train.grpo import GRPORun
    from evolm_lib.tune.pack import pack_study

    common = dict(model="tiny-random", task="conciseness", population_size=4, sigma=0.1, learning_rate=0.05,
                  lora_rank=1, target_modules=["q_proj", "v_proj"], max_new_tokens=6, max_model_len=256,
                  kv_cache_gb=0.0625, eval_every=1, num_generations=3, checkpoint_every=1, optimizer="adam")
    configs = {"es_full": ESConfig(**common, es_mode="full"), "es_lora": ESConfig(**common),
               "grpo_lora": GRPOConfig(model="tiny-random", task="conciseness", target_modules=["q_proj", "v_proj"],
                                       lora_rank=1, max_new_tokens=6, max_model_len=256, kv_cache_gb=0.0625,
                                       group_size=2, num_steps=3, checkpoint_every=1, eval_every=1, temperature=1.0)}
    opened = {"es_full": ESRun, "es_lora": ESRun, "grpo_lora": GRPORun}
    out = tmp_path / "study"
    out.mkdir()
    optuna.create_study(storage=f"sqlite:///{out / 'optuna.db'}", study_name="es_full")
    uninterrupted = {}
    for method, config in configs.items():
        whole = opened[method].open(config, tmp_path / "whole" / method, evaluator=tiny_vllm)
        whole.run()
        whole.close()
        uninterrupted[method] = [{k: v for k, v in r.items() if not k.startswith("time/")}
                                 for r in read_metrics(tmp_path / "whole" / method)]
        cut = opened[method].open(config, out / "final" / method / "seed0", evaluator=tiny_vllm)
        cut.run(2)  # the machine goes back after generation 2: no held-out scores, unfinished
        cut.close()
    lora = list_checkpoints(out / "final" / "es_lora" / "seed0")[-1]
    lora_bytes = sum(p.stat().st_size for p in lora.rglob("*") if p.is_file())

    report = pack_study(out, tmp_path / "small.tar.gz", checkpoint_bytes=lora_bytes - 1)
    assert report["resumed"] == ["final/es_full/seed0 at 2"]
    assert report["left_out"] == ["final/es_lora/seed0", "final/grpo_lora/seed0"]
    assert sorted(run for run, _ in report["over_budget"]) == report["left_out"]  # named, with their sizes
    assert dict(report["over_budget"])["final/es_lora/seed0"] == lora_bytes
    from evolm_lib.tune.pack import main as pack_main

    budget = str((lora_bytes - 1) / 2**20)
    assert pack_main([str(out), str(tmp_path / "small_again.tar.gz"), "--checkpoint-mib", budget]) == 0
    said = capsys.readouterr().out.splitlines()[-1]
    assert said.startswith(f"2 checkpoints over --checkpoint-mib {float(budget):g} stayed behind (")
    assert said.endswith("final/es_lora/seed0, final/grpo_lora/seed0")
    with tarfile.open(tmp_path / "small.tar.gz") as tar:
        names = tar.getnames()
    assert "study/final/es_full/seed0/checkpoints/000002/state.json" in names
    assert "study/final/es_full/seed0/seed_log.jsonl" in names
    assert not [n for n in names if "snapshots" in n or "_lora" in n]

    report = pack_study(out, tmp_path / "pack.tar.gz")
    assert report["resumed"] == ["final/es_full/seed0 at 2", "final/es_lora/seed0 at 2", "final/grpo_lora/seed0 at 2"]
    assert report["left_out"] == [] and report["over_budget"] == []
    with tarfile.open(tmp_path / "pack.tar.gz") as tar:
        assert "study/final/es_lora/seed0/checkpoints/000002/adapter/adapter_model.safetensors" in tar.getnames()
        tar.extractall(tmp_path / "elsewhere", filter="data")
    for method, config in configs.items():
        folder = tmp_path / "elsewhere" / "study" / "final" / method / "seed0"
        run = opened[method].open(config, folder, evaluator=tiny_vllm)
        assert run.generation == 2
        run.run()
        run.close()
        assert [{k: v for k, v in r.items() if not k.startswith("time/")} for r in read_metrics(folder)] == \
            uninterrupted[method], method


def test_the_progress_table_counts_each_stage_and_places_each_run_under_way(tmp_path, capsys):
    """python -m evolm_lib.tune.progress: trials finished of the spec's and those running with their
    runs' positions and checkpoints, reruns, continued reruns and the control, from the folder and
    storage alone (no engine)."""
    from evolm_lib.runs import write_checkpoint
    from evolm_lib.tune.progress import main as progress

    def change(spec):
        spec["tune"].update(trials=2, long=2, control="best_es")
    path = write_spec(tmp_path, change)
    assert progress([str(path)]) == 2
    assert "holds no study (no optuna.db)" in capsys.readouterr().err
    spec = tune.load_tune_spec(path)

    def trial(method: str, value: float | None):
        study = tune.load_study(spec, method)
        with warnings.catch_warnings():  # Optuna's note that its heartbeat is meant for optimize()
            warnings.simplefilter("ignore", UserWarning)
            asked = study.ask()
        for parameter in spec.settings.space[method]:
            parameter.suggest(asked)
        if value is not None:
            study.tell(asked, value)
        return study, asked

    def rows(folder: Path, generations: int, length: int, kind: str = "es", seconds: Sequence[float] = ()) -> None:
        folder.mkdir(parents=True)
        key = "num_generations" if kind == "es" else "num_steps"
        (folder / "config.yaml").write_text(f"{key}: {length}\n")
        timed = dict(enumerate(seconds, start=1))  # generation 0 scores the start: not a step's pace
        (folder / "metrics.jsonl").write_text("".join(
            json.dumps({"generation": g, **({"time/generation_s": timed[g]} if g in timed else {})}) + "\n"
            for g in range(generations)))

    for value in (0.7, 0.7):  # es tuned (two trials level at the best): its reruns and continuations are planned
        trial("es", value)
    trial("grpo", 0.1)
    study, running = trial("grpo", None)  # a trial under way, checkpointed at step 1
    folder = tune.study.trial_folder(spec, "grpo", study, running) / "seed100"
    rows(folder, 3, 2, kind="grpo")
    write_checkpoint(folder, 1, None, {}, {}, base_model="tiny-random")
    far = trial("grpo", None)[1]  # a second trial under way, far from its end
    rows(tune.study.trial_folder(spec, "grpo", study, far) / "seed100", 11, 900, kind="grpo", seconds=[0.5] * 10)
    study.enqueue_trial(running.params)  # queued, as a restored trial's retry waits: no folder yet
    final = spec.out / "final" / "es"
    rows(final / "seed0", 3, 2)
    (final / "seed0" / "heldout.jsonl").write_text(json.dumps({"generation": 2, "reward": 1.0}) + "\n")
    rows(final / "seed1", 1, 2)  # begun, no checkpoint
    rows(spec.out / "long" / "es" / "seed0", 3, 4, seconds=(3.0, 1.0))  # at 2 of 4, a median 2 s a generation
    assert progress([str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "| method | trials | reruns on the final seeds | continued to 2x | best validation score |",
        "| --- | --- | --- | --- | --- |",
        "| es | 2 of 2 | 1 of 2; under way: seed1 at 0/2 (no checkpoint) | 0 of 2; under way: seed0 at 2/4 (no checkpoint), "
        "about 4 s left at 2 s a generation | 0.7 (trial 0 and 1 other) |",
        "| grpo | 1 of 2; under way: trial_0001 at 2/2 (checkpoint 1); trial_0002 at 10/900 (no checkpoint), about 7 min left "
        "at 0.5 s a step; queued: trial_0003 from its start "
        "| 0 of 2: waits for the trials "
        "| 0 of 2: waits for the trials | 0.1 (trial 0) |",
        "",
        "Control (best_es): es, 0 of 2",
    ]
