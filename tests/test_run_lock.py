"""One writer per run folder (issue 23): a second writer fails at open naming the holder and writes
nothing; a SIGKILLed holder leaves no stale lock; readers never block; two `evolm batch` commands over
one output run a point once (the other reports it busy); a sweep reports a held run busy."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from evolm_lib import batch, sweep
from evolm_lib.analysis import run_results
from evolm_lib.config import ESConfig
from evolm_lib.engines.synthetic import SyntheticEngine
from evolm_lib.paths import project_root
from evolm_lib.runs import (
    LOCK_FILE,
    NOTEBOOK_RUNS_ENV,
    RunFolderBusy,
    WriterLock,
    lock_holder,
    notebook_run_dir,
    read_metrics,
)
from evolm_lib.train import es as es_train
from evolm_lib.train.es import ESRun

from helpers_kill_run import kill_config

REPO = Path(__file__).resolve().parents[1]
HELPER = Path(__file__).with_name("helpers_kill_run.py")
LOCK_NB = REPO / "tests" / "data" / "batch_lock_nb.py"


def small_config(**changes) -> ESConfig:
    """A synthetic ES run of 448 adapter parameters (tiny-random), population 4."""
    return ESConfig(**{**dict(model="tiny-random", target_modules=("q_proj", "v_proj"), sigma=0.02,
                              learning_rate=0.05, population_size=4, num_generations=4, seed=5), **changes})


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under a folder with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def wait_for(condition, what: str, process: subprocess.Popen | None = None, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the process ended (code {process.returncode}) before {what}: "
                                 f"{process.stderr.read() if process.stderr else ''}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


# A writer in a process of its own: opens the run, says so, waits for a file, then runs to the budget.
WRITER = textwrap.dedent("""
    import json, pathlib, sys, time
    from evolm_lib.config import ESConfig
    from evolm_lib.engines.synthetic import SyntheticEngine
    from evolm_lib.train.es import ESRun
    run_dir, ready, go = map(pathlib.Path, sys.argv[1:4])
    run = ESRun.open(ESConfig.from_dict(json.loads(sys.argv[4])), run_dir, engine=SyntheticEngine())
    ready.write_text("open")
    while not go.exists():
        time.sleep(0.05)
    run.run()
    run.close()
""")


@pytest.fixture
def engine_tripwire(monkeypatch):
    """Any engine start fails the test: a refused writer must be refused before its engine."""
    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was started for a writer that should have been refused")

    monkeypatch.setattr(es_train, "make_engine", no_engine)


# ------------------------------------------------------------------------------ two processes


def test_a_second_process_fails_at_open_naming_the_holder_and_writes_nothing(tmp_path, engine_tripwire):
    config, run_dir = small_config(), tmp_path / "run"
    ready, go = tmp_path / "ready", tmp_path / "go"
    first = subprocess.Popen([sys.executable, "-c", WRITER, str(run_dir), str(ready), str(go),
                              json.dumps(config.to_dict())], stderr=subprocess.PIPE, text=True)
    try:
        wait_for(ready.exists, "the first writer opened the run", first)
        before = snapshot(run_dir)
        attempts = [lambda: ESRun.open(config, run_dir), lambda: ESRun.resume(run_dir),
                    lambda: ESRun.create(config, run_dir, overwrite=True),
                    lambda: ESRun.open(config, run_dir, overwrite=True)]
        for attempt in attempts:  # no engine given: a late check would start the engine first
            with pytest.raises(RunFolderBusy) as caught:
                attempt()
            message = str(caught.value)
            for part in (str(run_dir), f"process {first.pid}", socket.gethostname(), "since"):
                assert part in message, message
        assert snapshot(run_dir) == before  # the refused writers wrote nothing, deleted nothing

        # readers neither need the lock nor wait for it
        assert [r["generation"] for r in read_metrics(run_dir)] == [0]
        assert run_results(run_dir)["generation"] == 0
        assert lock_holder(run_dir)["pid"] == first.pid
        go.write_text("go")
        assert first.wait(120) == 0, first.stderr.read()
    finally:
        first.kill()
    assert [r["generation"] for r in read_metrics(run_dir)] == [0, 1, 2, 3, 4]  # in order, none repeated
    assert lock_holder(run_dir) is None
    assert (run_dir / LOCK_FILE).read_text() == ""  # released: no holder named


def test_after_sigkill_a_new_open_succeeds_at_once(tmp_path):
    run_dir = tmp_path / "killed"
    process = subprocess.run([sys.executable, str(HELPER), str(run_dir), "4"], capture_output=True, text=True,
                             timeout=120)
    assert process.returncode == -signal.SIGKILL, process.stderr[-2000:]
    # the lock file still names the dead writer, but the operating system dropped its lock
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] > 0
    assert lock_holder(run_dir) is None
    started = time.perf_counter()
    with WriterLock.acquire(run_dir):
        assert time.perf_counter() - started < 0.1  # no waiting for a stale lock to time out
    resumed = ESRun.open(kill_config(), run_dir, engine=SyntheticEngine())
    assert resumed.generation == 2
    resumed.run()
    resumed.close()
    assert [r["generation"] for r in read_metrics(run_dir)] == list(range(7))


# A writer forks a child (as an engine may) and then dies by SIGKILL; the child lives on.
FORKER = textwrap.dedent("""
    import os, signal, sys, time
    from evolm_lib.runs import WriterLock
    lock = WriterLock.acquire(sys.argv[1])
    child = os.fork()
    if child == 0:
        # the child runs this only after the fork's hooks ran in it: its pid file says it is past them
        with open(sys.argv[2] + ".part", "w") as handle:
            handle.write(str(os.getpid()))
        os.replace(sys.argv[2] + ".part", sys.argv[2])
        time.sleep(120)
        os._exit(0)
    while not os.path.exists(sys.argv[2]):  # on a busy machine the child may not have run yet
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_child_forked_by_the_writer_does_not_keep_the_folder_after_the_writer_dies(tmp_path):
    pid_file, log = tmp_path / "child.pid", tmp_path / "stderr.txt"
    with open(log, "w") as stderr:  # a file, not a pipe: the child would hold a pipe open
        process = subprocess.run([sys.executable, "-c", FORKER, str(tmp_path / "run"), str(pid_file)],
                                 stdout=subprocess.DEVNULL, stderr=stderr, timeout=120)
    assert process.returncode == -signal.SIGKILL, log.read_text()[-2000:]
    child = int(pid_file.read_text())
    try:
        os.kill(child, 0)  # the child still lives, with a copy of the writer's descriptors
        assert lock_holder(tmp_path / "run") is None
        WriterLock.acquire(tmp_path / "run").release()
    finally:
        os.kill(child, signal.SIGKILL)


# ------------------------------------------------------------------------------ one process


def test_a_run_still_open_in_this_process_is_named_and_a_closed_run_writes_nothing(tmp_path):
    config, run_dir = small_config(), tmp_path / "run"
    run = ESRun.create(config, run_dir, engine=SyntheticEngine())
    with pytest.raises(RunFolderBusy, match=r"already open for writing in this process .*run\.close\(\)"):
        ESRun.open(config, run_dir, engine=SyntheticEngine())
    run.close()
    with pytest.raises(RuntimeError, match="closed"):
        run.step()
    with pytest.raises(RuntimeError, match="closed"):
        run.save_final()
    assert [r["generation"] for r in read_metrics(run_dir)] == [0]

    again = ESRun.open(config, run_dir, engine=SyntheticEngine())
    again.itself = again  # a reference cycle: dropped, it is collected only by the garbage collector
    del again
    third = ESRun.open(config, run_dir, engine=SyntheticEngine())  # the dropped run let go of the folder
    third.run()
    third.close()
    assert [r["generation"] for r in read_metrics(run_dir)] == [0, 1, 2, 3, 4]


# A reader in a process of its own probes the lock in a tight loop until told to stop; it counts what it saw.
PROBER = textwrap.dedent("""
    import json, pathlib, sys
    from evolm_lib.runs import lock_holder
    folder, stop = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    (folder / "probing").write_text("")
    seen = {"free": 0, "held": 0}
    while not stop.exists():
        for _ in range(50):
            seen["held" if lock_holder(folder) is not None else "free"] += 1
    print(json.dumps(seen))
""")


def test_a_reader_probing_in_a_loop_never_makes_a_free_folder_busy(tmp_path):
    """A probe holds a shared lock for microseconds; a writer meeting one (about 2 % of tries in a tight
    loop here) tries again instead of reporting a free folder busy."""
    WriterLock.acquire(tmp_path).release()  # the lock file exists: the reader probes from its first loop
    stop = tmp_path / "stop"
    reader = subprocess.Popen([sys.executable, "-c", PROBER, str(tmp_path), str(stop)], stdout=subprocess.PIPE,
                              text=True)
    try:
        wait_for((tmp_path / "probing").exists, "the reader probing", reader)
        end, taken = time.monotonic() + 2, 0
        while time.monotonic() < end:
            with WriterLock.acquire(tmp_path):  # never RunFolderBusy
                taken += 1
                if taken % 100 == 0:
                    time.sleep(0.005)  # held a while now and then: the reader sees a writer
    finally:
        stop.write_text("stop")
        seen = json.loads(reader.communicate(timeout=60)[0])
    assert taken > 500 and seen["held"] > 0 and seen["free"] > 0, (taken, seen)


def test_the_notebooks_default_run_folder_is_the_projects_unless_the_tests_move_it(monkeypatch):
    # pytest (the repository's conftest.py) moved it for this session, nbval kernels included
    assert os.environ.get(NOTEBOOK_RUNS_ENV)
    assert notebook_run_dir("03_es_stepper") == Path(os.environ[NOTEBOOK_RUNS_ENV]) / "03_es_stepper"
    monkeypatch.delenv(NOTEBOOK_RUNS_ENV)
    assert notebook_run_dir("03_es_stepper") == project_root() / "runs" / "notebooks" / "03_es_stepper"
    declared = batch.notebook_parameters(REPO / "notebooks" / "03_es_stepper.py")
    assert declared["run_dir"]["default"] in ('""', "''")  # empty: the notebook takes notebook_run_dir's


# ------------------------------------------------------------------------------ batch and sweep


def test_a_point_whose_run_folder_is_open_is_busy_and_untouched(tmp_path):
    spec_path = tmp_path / "p.yaml"
    spec_path.write_text(f"notebook: {LOCK_NB}\nname: fx\nparameters: {{num_generations: 2}}\n")
    out = tmp_path / "out"
    run = ESRun.create(small_config(num_generations=2), out / "fx" / "run", engine=SyntheticEngine())
    try:
        before = snapshot(out)
        [planned] = batch.run_batch(spec_path, out, dry_run=True)
        assert (planned.action, planned.status) == ("skip", batch.PLANNED) and "held by process" in planned.reason
        [result] = batch.run_batch(spec_path, out)
        assert result.status == batch.BUSY and f"process {os.getpid()}" in result.reason
        assert {k: v for k, v in snapshot(out).items() if not k.startswith("summary.")} == before
        summary = json.loads((out / "summary.json").read_text())
        assert summary["runs"][0]["status"] == "busy"
    finally:
        run.close()


def test_two_concurrent_batches_run_a_point_once(tmp_path):
    """The issue's measurement: two `evolm batch` over one output. One runs the point; the other,
    started while the first has its run open, reports it busy, and metrics.jsonl has each generation once."""
    hold = tmp_path / "go"
    spec_path = tmp_path / "p.yaml"
    spec_path.write_text(f"notebook: {LOCK_NB}\nname: fx\nparameters: {{num_generations: 3, hold: {hold}}}\n")
    out = tmp_path / "out"
    run_dir = out / "fx" / "run"
    command = [sys.executable, "-m", "evolm_lib.cli", "batch", str(spec_path), "--out", str(out)]
    first = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(Path(f"{hold}.open").exists, "the first batch's kernel opened the run", first, 300)
        assert lock_holder(run_dir)["pid"] != first.pid  # the kernel holds the run, its batch the point
        status_before = (out / "fx" / "status.json").read_text()
        run_before = snapshot(run_dir)
        second = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stdout + second.stderr
        assert "busy, left as it is: fx, held by process" in second.stdout, second.stdout
        assert json.loads((out / "summary.json").read_text())["runs"][0]["status"] == "busy"
        assert (out / "fx" / "status.json").read_text() == status_before  # the first batch's record, untouched
        assert snapshot(run_dir) == run_before
        hold.write_text("go")
        stdout, stderr = first.communicate(timeout=300)
        assert first.returncode == 0, stdout + stderr
    finally:
        first.kill()
    assert [r["generation"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]
    assert batch.read_status(out / "fx")["status"] == "ok"


def test_a_sweep_reports_a_run_held_elsewhere_busy_and_runs_the_others(tmp_path):
    _, spec = sweep.load_sweep_spec(REPO / "papermill_runs" / "es_vs_grpo_conciseness_cpu.yaml")
    plan = [r for r in sweep.plan_sweep(spec, 1, [0, 1], {"model": "tiny-random"})
            if r.kind == "es"]
    out = tmp_path / "sweep"
    held = ESRun.create(plan[0].config, out / plan[0].name, engine=SyntheticEngine())
    try:
        before = snapshot(out / plan[0].name)
        seconds = sweep.run_sweep(plan, out, engine=SyntheticEngine())
        assert list(seconds) == [plan[1].name]
        assert snapshot(out / plan[0].name) == before
        rows = {row["run"]: row for row in sweep.summarize(out)}
        assert rows[plan[0].name]["status"] == "busy" and rows[plan[1].name]["status"] == "ok"
        assert "status" in (out / "summary.csv").read_text().splitlines()[0].split(",")
    finally:
        held.close()
