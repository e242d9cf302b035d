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
from pathlib import Path

import pytest
import yaml

from evolm_lib import tune
from evolm_lib.cli import main
from evolm_lib.runs import read_jsonl, read_metrics

from helpers_terminal import ctrl_c_as_in_a_terminal

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
    assert tune.unfinished_parts(spec) == ["final/es/seed0", "final/es/seed1", "final/grpo/seed0", "final/grpo/seed1"]
    assert tune.unfinished_parts(spec, finals=False) == []
    done = tune.run_finals(spec, tiny_vllm, log=lambda line: None)
    assert tune.unfinished_parts(spec) == []
    assert {m: [Path(f).name for f in folders] for m, folders in done.items()} == {"es": ["seed0", "seed1"],
                                                                                   "grpo": ["seed0", "seed1"]}
    # a finished rerun without its weights (as `evolm tune import` writes it) is left be
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
           if line.startswith("trials finished by this worker")]
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
    # a trial both workers asked for at once is given back unrun (``surplus``) and never counted
    trials = sorted((t for t in tune.load_study(spec, "es").get_trials(deepcopy=False) if not t.user_attrs.get("surplus")),
                    key=lambda t: t.datetime_start)
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

    monkeypatch.setattr(tune, "make_tuning_engine", no_engine)
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


def _hf_change(**tune_settings):
    def change(spec):
        spec["sweep"]["common"]["engine"] = "hf"  # starts in seconds: these tests start several workers
        spec["tune"].update(tune_settings)
    return change


def _start(path: Path, *extra: str, methods: str = "es") -> subprocess.Popen:
    """An `evolm tune` worker in its own process (the reruns included unless ``extra`` says otherwise)."""
    return subprocess.Popen([sys.executable, "-m", "evolm_lib.cli", "tune", str(path), "--methods", methods,
                             "--no-figures", *extra], cwd=REPO, env={**os.environ, **WORKER_ENV},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=ctrl_c_as_in_a_terminal)


def _running_trial(spec, number: int | None = None, rows: int = 2, timeout: float = 600, workers=()):
    """(trial number, its seed folder) once a trial of ``es`` is running with ``rows`` rows written.
    ``workers`` (their processes) are then stopped (SIGSTOP) and the folder read again: they stay
    stopped only where the trial's run still has rows to write, so that a signal the test sends next
    lands mid-trial however late this poll saw the rows (a loaded machine); the test continues them
    (``_continue``). Nothing reads the study's storage while they are stopped (one may hold its lock)."""
    last = spec.tuning_runs["es"][0].config.num_generations  # a run's rows are generations 0..last
    end = time.time() + timeout
    while time.time() < end:
        if spec.storage or (spec.out / "optuna.db").exists():
            for trial in tune.study_trials(spec, "es"):
                folder = spec.out / "trials" / "es" / f"trial_{trial['number']:04d}" / "seed100"
                if (trial["state"] == "running" and (number is None or trial["number"] == number)
                        and (folder / "metrics.jsonl").exists() and len(read_metrics(folder)) >= rows):
                    if not workers:
                        return trial["number"], folder
                    for worker in workers:
                        os.kill(worker.pid, signal.SIGSTOP)
                    if len(read_metrics(folder)) <= last:  # its run is not done: the trial is under way
                        return trial["number"], folder
                    _continue(*workers)
        time.sleep(0.2)
    raise AssertionError("no trial got under way")


def _continue(*workers: subprocess.Popen) -> None:
    """SIGCONT to the workers still running (``_running_trial`` stopped them)."""
    for worker in workers:
        if worker.poll() is None:
            os.kill(worker.pid, signal.SIGCONT)


def _kill_the_holder(folder: Path, workers: tuple[subprocess.Popen, subprocess.Popen]) -> subprocess.Popen:
    """SIGKILL the worker that writes ``folder`` (stopped or not); returns the other one, continued."""
    holder = json.loads((folder / ".writer.lock").read_text())["pid"]
    victim, survivor = workers if holder == workers[0].pid else workers[::-1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    _continue(survivor)
    return survivor


def _states(spec) -> list[str]:
    return [t["state"] for t in tune.study_trials(spec, "es")]


def test_two_workers_one_killed_mid_trial_end_with_the_spec_s_trials_and_one_rerun_per_final_seed(tmp_path):
    """SIGKILL of one of two workers in the middle of a trial: the other fails it once its heartbeats are
    stale, runs its retry from the trial's checkpoints, and the study ends with exactly tune.trials
    finished trials and one rerun per final seed; `evolm tune` leaves summary.md in the study folder."""
    path = write_spec(tmp_path, _hf_change(trials=3), generations=8)
    spec = tune.load_tune_spec(path, methods=["es"])
    tune.load_study(spec, "es")  # created once, before both workers open it
    workers = _start(path), _start(path)
    number, folder = _running_trial(spec, rows=3, workers=workers)
    survivor = _kill_the_holder(folder, workers)
    output, _ = survivor.communicate(timeout=900)
    assert survivor.returncode == 0, output
    assert "Warning" not in output  # no Optuna warning reaches the console
    trials = {t["number"]: t for t in tune.study_trials(spec, "es")}
    assert sum(t["state"] == "complete" for t in trials.values()) == 3
    assert f"es trial {number} (attempt " in output  # the retry logged under the trial's own number
    assert trials[number]["state"] == "fail" and trials[number]["error"] is None  # killed, not counted
    (retry,) = [t for t in trials.values() if t["retries"] == number]
    assert retry["state"] == "complete" and retry["params"] == trials[number]["params"]
    assert [row["generation"] for row in read_metrics(folder)] == list(range(9))  # resumed, nothing twice
    for seed in (0, 1):  # one rerun per final seed, written once
        rerun = spec.out / "final" / "es" / f"seed{seed}"
        assert len((rerun / "placement.jsonl").read_text().splitlines()) == 1
        assert [row["generation"] for row in read_metrics(rerun)] == list(range(9))
    assert sorted(p.name for p in (spec.out / "final" / "es").iterdir()) == ["seed0", "seed1"]
    assert f"{spec.out / 'summary.md'}" in output.splitlines() and (spec.out / "summary.md").is_file()
    assert "| es | 3 |" in (spec.out / "summary.md").read_text()
    assert "plumbing check" in (spec.out / "summary.md").read_text()  # the tiny model's scores mean nothing
    again = _start(path)  # the study is done: nothing more is run
    output, _ = again.communicate(timeout=300)
    assert again.returncode == 0 and "nothing left to run" in output, output
    assert len(tune.study_trials(spec, "es")) == len(trials)
    assert "Warning" not in output  # no Optuna warning reaches the console


def test_a_worker_paused_past_its_heartbeats_loses_no_trial_and_gives_it_up_when_continued(tmp_path):
    """SIGSTOP on a worker mid-trial past three heartbeats: a second worker fails the trial and retries
    it, waits while the paused worker still holds the run folder (a lock conflict is never a finished
    trial), and once the first worker is continued (SIGCONT) it gives the trial up at its next row and
    ends cleanly; the study ends with exactly tune.trials finished trials."""
    path = write_spec(tmp_path, _hf_change(trials=2), generations=8)
    spec = tune.load_tune_spec(path, methods=["es"])
    paused = _start(path, "--no-finals")
    number, folder = _running_trial(spec, rows=2, workers=(paused,))  # the worker is stopped mid-trial
    try:
        time.sleep(3 * spec.settings.heartbeat_s + 2)
        taker = _start(path, "--no-finals")
        end = time.time() + 300
        while time.time() < end and not any(t["retries"] == number and t["state"] == "running"
                                            for t in tune.study_trials(spec, "es")):
            time.sleep(0.5)
        time.sleep(3)  # the retry meets the paused worker's folder and waits for it
        assert taker.poll() is None
        assert _states(spec).count("complete") <= 1 and "fail" in _states(spec)
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    paused_output, _ = paused.communicate(timeout=600)
    taker_output, _ = taker.communicate(timeout=600)
    assert paused.returncode == 0, paused_output
    assert taker.returncode == 0, taker_output
    assert "taken over by another worker" in paused_output
    assert "waiting until it gives the folder up" in taker_output
    trials = {t["number"]: t for t in tune.study_trials(spec, "es")}
    assert sum(t["state"] == "complete" for t in trials.values()) == 2
    assert not any(t["error"] for t in trials.values())  # no lock conflict recorded as a trial's failure
    (retry,) = [t for t in trials.values() if t["retries"] == number]
    assert retry["state"] == "complete"
    assert [row["generation"] for row in read_metrics(folder)] == list(range(9))
    assert "Traceback" not in paused_output + taker_output


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # the trial is asked outside Study.optimize
def test_a_trial_failed_between_the_workers_check_and_its_report_is_given_up(tmp_path):
    """The race a continued worker can meet: its check finds the trial still running, another worker's
    heartbeat check fails the trial, then the report reaches Optuna. Optuna refuses the report
    (UpdateFinishedTrialError); the worker gives the trial up as taken over, its run folder kept."""
    from optuna.trial import TrialState

    from evolm_lib.tune import study as studies

    spec = tune.load_tune_spec(write_spec(tmp_path, _hf_change(trials=1)), methods=["es"])
    storage = studies.open_storage(spec)
    trial = studies.load_study(spec, "es", storage).ask()
    checks = []

    def still_mine() -> bool:  # running at the check; failed right after it, by the first check only
        mine = storage.get_trial(trial._trial_id).state == TrialState.RUNNING
        if not checks:
            storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        checks.append(mine)
        return mine

    folder = studies.trial_folder(spec, "es", storage.get_trial(trial._trial_id))
    with pytest.raises(studies._GivenUp, match="taken over"):
        studies._run_trial(spec, "es", trial, folder, None, lambda line: None, still_mine)
    assert checks == [True]  # given up at the refused report, without asking again
    assert read_metrics(folder / "seed100")[0]["generation"] == 0  # the rows written are kept


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_worker_hands_its_trial_to_the_next_worker_at_once(tmp_path, stop):
    """SIGTERM or Ctrl-C mid-trial: the worker says what is kept, fails the cut trial and queues its
    retry, so the next worker takes it at once, long before heartbeats of 60 s would go stale."""
    path = write_spec(tmp_path, _hf_change(trials=2, heartbeat_s=60), generations=6)
    spec = tune.load_tune_spec(path, methods=["es"])
    worker = _start(path, "--no-finals")
    number, folder = _running_trial(spec, rows=2)
    os.kill(worker.pid, stop)  # while it runs, as Ctrl-C comes: not held pending while it is frozen mid-write
    output, _ = worker.communicate(timeout=120)
    assert worker.returncode == 130, output
    assert "interrupted: finished trials and reruns are kept" in output and "Traceback" not in output
    cut = {t["number"]: t for t in tune.study_trials(spec, "es")}
    assert cut[number]["state"] == "fail"
    assert any(t["retries"] == number and t["state"] == "waiting" for t in cut.values())
    started = time.time()
    nxt = _start(path, "--no-finals")
    output, _ = nxt.communicate(timeout=170)  # under the 180 s a stale heartbeat would take
    assert nxt.returncode == 0, output
    assert time.time() - started < 170
    trials = {t["number"]: t for t in tune.study_trials(spec, "es")}
    assert sum(t["state"] == "complete" for t in trials.values()) == 2
    assert next(t for t in trials.values() if t["retries"] == number)["state"] == "complete"
    assert [row["generation"] for row in read_metrics(folder)] == list(range(7))


def _study_with_trials(tmp_path: Path, count: int = 40):
    """A spec and its study's storage holding ``count`` complete trials (no engine: added as Optuna
    trials), enough pages for a damage in the middle to land in them."""
    import optuna

    path = write_spec(tmp_path)
    spec = tune.load_tune_spec(path, methods=["es"])
    study = tune.load_study(spec, "es")
    distributions = {p.name: p.distribution() for p in spec.settings.space["es"]}
    for number in range(count):
        study.add_trial(optuna.trial.create_trial(
            params={"sigma": 0.01 + number / 1000, "optimizer": "sgd"}, distributions=distributions,
            value=float(number), user_attrs={"config": {"note": "x" * 200}}))
    study._storage._backend.engine.dispose()
    return path, spec


@pytest.mark.parametrize("damage", ["truncated to half", "garbage in the middle"])
def test_a_damaged_storage_is_named_with_the_way_back_and_left_untouched(tmp_path, damage, monkeypatch, capsys):
    path, spec = _study_with_trials(tmp_path)
    db = spec.out / "optuna.db"
    data = db.read_bytes()
    if damage == "truncated to half":
        db.write_bytes(data[:len(data) // 2])
    else:
        middle = len(data) // 2
        db.write_bytes(data[:middle] + os.urandom(8192) + data[middle + 8192:])
    os.utime(db, (1_000_000_000, 1_000_000_000))
    before = (db.read_bytes(), db.stat().st_mtime)

    def no_engine(spec):
        raise AssertionError("an engine started on a damaged storage")

    monkeypatch.setattr(tune, "make_tuning_engine", no_engine)
    capsys.readouterr()
    assert main(["tune", str(path), "--methods", "es", "--no-figures"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert str(db) in err[0] and "damaged" in err[0] and "evolm tune import" in err[0] and ".recover" in err[0]
    assert (db.read_bytes(), db.stat().st_mtime) == before  # the same bytes, the same time
    assert not (spec.out / "trials").exists()  # no trial spent
    assert main(["tune", "export", str(spec.out), str(tmp_path / "export")]) == 2  # export names it the same way
    assert str(db) in capsys.readouterr().err


def test_a_storage_another_process_holds_locked_is_waited_for_not_called_damaged(tmp_path):
    """A worker stopped (or slow) in the middle of writing the study holds SQLite's lock: a worker
    opening the storage then waits for it, and never calls the file damaged."""
    _, spec = _study_with_trials(tmp_path, count=3)
    holder = subprocess.Popen([sys.executable, "-c", "import sqlite3, sys, time\n"
                               "connection = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
                               "connection.execute('BEGIN EXCLUSIVE')\nprint('held', flush=True)\n"
                               "time.sleep(7)\nconnection.execute('COMMIT')", str(spec.out / "optuna.db")],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    started = time.time()
    assert len(tune.study_trials(spec, "es")) == 3  # read once the lock is given back
    assert time.time() - started > 1 and holder.wait(timeout=60) == 0


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_inside_a_storage_call_acts_once_the_call_has_returned(tmp_path, stop):
    """Ctrl-C or SIGTERM landing inside a call to the study's storage (here: sent as the call's SQL
    statement runs) acts once the call has returned, its write done: cut in its middle, the call
    left its connection holding the database's lock (or SQLAlchemy one of its own), and the worker's
    next write, the one that fails the cut trial, waited for it until SQLite's timeout, or for ever."""
    from optuna.trial import TrialState
    from sqlalchemy import event

    spec = tune.load_tune_spec(write_spec(tmp_path), methods=["es"])
    storage = tune.open_storage(spec)
    trial_id = tune.load_study(spec, "es", storage).ask()._trial_id
    sent: list[int] = []

    def stop_once(*_):
        if not sent:
            sent.append(stop)
            os.kill(os.getpid(), stop)

    def interrupt(signum, frame):  # the tune command's handler, for either signal
        raise KeyboardInterrupt

    event.listen(storage.engine, "before_cursor_execute", stop_once)
    harness = {number: signal.signal(number, interrupt) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(KeyboardInterrupt):
            storage.set_trial_user_attr(trial_id, "cut", True)
    finally:
        for number, handler in harness.items():
            signal.signal(number, handler)
        event.remove(storage.engine, "before_cursor_execute", stop_once)
    assert sent and storage.get_trial(trial_id).user_attrs["cut"] is True  # the call finished first
    started = time.time()
    storage.set_trial_state_values(trial_id, state=TrialState.FAIL)  # the cut trial failed at once
    assert time.time() - started < 5
    assert tune.load_study(spec, "es").trials[0].state == TrialState.FAIL  # as another worker reads it


def test_a_tune_stopped_in_process_gives_its_caller_back_its_ctrl_c(tmp_path, monkeypatch, capsys):
    """`evolm tune` run from Python (a notebook, a script) and stopped by Ctrl-C ignores further stop
    signals while it cleans up; once it returns, the caller's handlers are back (a process it starts
    later would otherwise inherit an ignored Ctrl-C)."""
    path = write_spec(tmp_path)

    def interrupted(spec):
        raise KeyboardInterrupt  # Ctrl-C as the engine starts

    monkeypatch.setattr(tune, "make_tuning_engine", interrupted)
    harness = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in an interactive Python
    try:
        before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
        assert main(["tune", str(path), "--methods", "es", "--no-figures"]) == 130
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    finally:
        signal.signal(signal.SIGINT, harness)
    assert "interrupted: finished trials and reruns are kept" in capsys.readouterr().err


def test_an_emptied_storage_beside_trial_folders_is_refused_before_any_trial(tmp_path, monkeypatch, capsys):
    """A storage that holds none of the study's trials while its trial folders exist (emptied, or
    another study's) would spend the budget failing trials against the old folders: refused, naming both."""
    path = write_spec(tmp_path)
    spec = tune.load_tune_spec(path, methods=["es"])
    (spec.out / "trials" / "es" / "trial_0000" / "seed100").mkdir(parents=True)
    (spec.out / "optuna.db").write_bytes(b"")
    monkeypatch.setattr(tune, "make_tuning_engine", lambda spec: type("E", (), {"close": lambda self: None})())
    assert main(["tune", str(path), "--methods", "es", "--no-figures"]) == 2
    err = capsys.readouterr().err
    assert f"{spec.out / 'trials' / 'es'} holds 1 trial folders" in err and "not this study's storage" in err
    assert tune.study_trials(spec, "es") == []


def test_a_timeout_starts_no_new_trial_after_it_and_a_later_start_continues(tmp_path, tiny_vllm):
    """--timeout (Optuna's timeout): no trial starts after it; the same command later runs the rest."""
    spec = tune.load_tune_spec(write_spec(tmp_path, _set(["tune", "trials"], 2)), methods=["es"])
    assert tune.run_worker(spec, tiny_vllm, log=lambda line: None, timeout=1e-6) == {"es": 0}
    assert tune.study_trials(spec, "es") == [] and not (spec.out / "final").exists()
    assert tune.run_worker(spec, tiny_vllm, log=lambda line: None, timeout=3600) == {"es": 2}
    assert [t["state"] for t in tune.study_trials(spec, "es")] == ["complete", "complete"]
    assert tune.unfinished_parts(spec) == []


def test_the_removed_options_are_gone_and_a_bad_timeout_is_named(tmp_path, capsys):
    path = write_spec(tmp_path)
    for option in ("--claim-for", "--claim-until", "--finish-by", "--engine-start-s"):
        with pytest.raises(SystemExit):
            main(["tune", str(path), option, "5"])
        assert "unrecognized arguments" in capsys.readouterr().err
    assert main(["tune", str(path), "--timeout", "-5"]) == 2
    assert "--timeout: a number of seconds above 0, not -5.0" in capsys.readouterr().err


def _postgres_binaries() -> Path | None:
    """The folder of a PostgreSQL server's programs (Debian's postgresql package), or None."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return found[-1].parent if found else None


@pytest.fixture
def postgres_url():
    """A throwaway PostgreSQL server on a free local port (as the postgres user where the tests run as
    root, which the server refuses), its URL; stopped and deleted afterwards."""
    import socket
    import tempfile

    binaries = _postgres_binaries()
    if binaries is None:
        pytest.skip("no PostgreSQL server here (scripts/setup_env.sh installs Debian's postgresql)")
    pytest.importorskip("psycopg")
    as_user: list[str] = []
    folder = Path(tempfile.mkdtemp(prefix="evolm_pg_", dir="/tmp"))
    if os.geteuid() == 0:
        import pwd

        owner = pwd.getpwnam("postgres")
        os.chown(folder, owner.pw_uid, owner.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    data = folder / "data"
    subprocess.run([*as_user, str(binaries / "initdb"), "-D", str(data), "-U", "evolm", "--auth=trust"],
                   check=True, capture_output=True)
    subprocess.run([*as_user, str(binaries / "pg_ctl"), "-D", str(data), "-l", str(folder / "log"), "-w", "start",
                    "-o", f"-p {port} -k {folder} -c listen_addresses=127.0.0.1"], check=True, capture_output=True)
    try:
        yield f"postgresql://evolm@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, str(binaries / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                       capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def test_workers_share_a_study_in_a_postgresql_database_and_a_killed_one_s_trial_is_retried(tmp_path, postgres_url):
    """--storage postgresql://...: the study lives in the database, not in OUT/optuna.db; two workers share
    it, one is killed mid-trial, the other retries its trial (heartbeats work there as in SQLite) and
    the study ends with exactly tune.trials finished trials, which `evolm tune export --storage` reads."""
    path = write_spec(tmp_path, _hf_change(trials=2), generations=6)
    spec = tune.with_storage(tune.load_tune_spec(path, methods=["es"]), postgres_url)
    workers = tuple(_start(path, "--no-finals", "--storage", postgres_url) for _ in range(2))
    number, folder = _running_trial(spec, rows=2, workers=workers)
    survivor = _kill_the_holder(folder, workers)
    output, _ = survivor.communicate(timeout=600)
    assert survivor.returncode == 0, output
    assert not (spec.out / "optuna.db").exists()
    trials = tune.study_trials(spec, "es")
    assert sum(t["state"] == "complete" for t in trials) == 2
    assert any(t["retries"] == number and t["state"] == "complete" for t in trials)
    assert main(["tune", "export", str(spec.out), str(tmp_path / "export"), "--storage", postgres_url]) == 0
    assert json.loads((tmp_path / "export" / "manifest.json").read_text())["trials"] == len(trials)


def test_a_journal_storage_holds_the_study_in_one_file_on_a_shared_filesystem(tmp_path):
    """--storage journal:PATH: Optuna's journal file instead of OUT/optuna.db (no heartbeats there)."""
    import optuna

    journal = tmp_path / "shared" / "study.log"
    journal.parent.mkdir()
    spec = tune.with_storage(tune.load_tune_spec(write_spec(tmp_path), methods=["es"]), f"journal:{journal}")
    study = tune.load_study(spec, "es")
    distributions = {p.name: p.distribution() for p in spec.settings.space["es"]}
    study.add_trial(optuna.trial.create_trial(params={"sigma": 0.01, "optimizer": "adam"},
                                              distributions=distributions, value=0.5))
    assert journal.is_file() and not (spec.out / "optuna.db").exists()
    assert [(t["value"], t["params"]) for t in tune.study_trials(spec, "es")] == [(0.5, {"sigma": 0.01, "optimizer": "adam"})]
    assert tune.best_trial(spec, "es").value == 0.5


def test_a_worker_waiting_for_a_held_study_lock_says_so(tmp_path, capfd):
    """A lock of the study folder held by another live process (one stopped with Ctrl-Z, say): the
    worker says what it waits for and how to free it, then goes on once the holder lets go."""
    from evolm_lib.tune.storage import held

    lock = tmp_path / "optuna.db.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from filelock import FileLock; "
                               f"kept = FileLock({str(lock)!r}); kept.acquire(); print('held', flush=True); time.sleep(12)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    started = time.time()
    with held(lock, "creates the storage's tables"):
        waited = time.time() - started
    assert waited >= 10 and holder.wait() == 0
    err = capfd.readouterr().err
    assert f"waiting for {lock}: another process holds it while it creates the storage's tables" in err
    assert "kill -CONT" in err


@pytest.mark.parametrize("where, absurd", [("sweep", {"es": {"population_size": 10**9, "temperature": 0.0}}),
                                            ("space", {"population_size": [4, 10**9]})])
def test_a_size_of_ten_to_the_ninth_in_a_tune_spec_is_refused_before_any_work(tmp_path, capsys, where, absurd):
    """A population of 10^9, whether fixed or one of the searched choices, is refused by the dry run and
    the run alike, naming the field, before any engine starts or the study folder exists."""
    def change(spec):
        if where == "sweep":
            spec["sweep"].update(absurd)
        else:
            spec["tune"]["space"]["es"].update(absurd)

    path = write_spec(tmp_path, change)
    for extra in (["--dry-run"], []):
        assert main(["tune", str(path), *extra]) == 2
        error = capsys.readouterr().err
        # the size check, or for a searched choice first the budget it cannot divide: named either way
        assert "population_size" in error and ("1,000,000,000" in error or "1000000000" in error), error
    assert not (tmp_path / "out").exists()
