"""The planner and executor that batch, sweep and tune share (`evolm_lib.grid`), on real run folders:
finished, unfinished, changed, damaged, held by a live process (busy) and left by a killed one (a
stale lock); the actions it decides, and an executor that records a failure and a busy folder and goes on."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from evolm_lib import grid
from evolm_lib.config import ESConfig
from evolm_lib.engines.synthetic import SyntheticEngine
from evolm_lib.runs import RunFolderBusy, lock_holder, read_metrics
from evolm_lib.train.es import ESRun

# A process that takes a folder's writer lock and says so; with "kill" it then dies by SIGKILL,
# leaving its lock file behind naming it (a stale lock), else it holds the lock until it is ended.
HOLDER = textwrap.dedent("""
    import os, pathlib, signal, sys, time
    from evolm_lib.runs import WriterLock
    lock = WriterLock.acquire(sys.argv[1])
    pathlib.Path(sys.argv[2]).write_text("held")
    if sys.argv[3] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(300)
""")


def config(**changes) -> ESConfig:
    """A synthetic ES run of two generations (tiny-random, population 4)."""
    return ESConfig(**{**dict(model="tiny-random", target_modules=("q_proj", "v_proj"), sigma=0.02,
                              learning_rate=0.05, population_size=4, num_generations=2, seed=3), **changes})


def make_run(folder: Path, generations: int | None = None, **changes) -> None:
    """A real run folder, run to ``generations`` (all of its budget where None)."""
    run = ESRun.open(config(**changes), folder, engine=SyntheticEngine())
    run.run(generations)
    run.close()


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def hold(folder: Path, tmp_path: Path, then: str) -> subprocess.Popen:
    """A child process holding ``folder``'s writer lock (``then`` "kill": it dies holding it)."""
    ready = tmp_path / f"{folder.name}.ready"
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), str(ready), then], stderr=subprocess.PIPE,
                             text=True)
    deadline = time.monotonic() + 180
    while not ready.exists():
        assert child.poll() is None or then == "kill", child.stderr.read()
        assert time.monotonic() < deadline, "the holder never took the lock"
        time.sleep(0.1)
    if then == "kill":
        child.wait(60)
    return child


@pytest.fixture
def folders(tmp_path):
    """OUT with one run folder per state, and the live child that holds the busy one."""
    out = tmp_path / "out"
    make_run(out / "finished")
    make_run(out / "unfinished", 1)
    make_run(out / "changed", sigma=0.05)
    make_run(out / "damaged", 1)
    (out / "damaged" / "config.yaml").unlink()
    make_run(out / "busy", 1)
    make_run(out / "stale")
    hold(out / "stale", tmp_path, "kill")
    child = hold(out / "busy", tmp_path, "hold")
    yield out, child
    child.kill()
    child.wait(60)


def test_the_planner_decides_each_folder_by_its_state(folders):
    out, child = folders
    found = {name: grid.run_folder_state(out / name, config(), 2)
             for name in ("new", "finished", "unfinished", "changed", "damaged", "busy", "stale")}
    assert {name: state.state for name, state in found.items()} == {
        "new": "new", "finished": "finished", "unfinished": "unfinished", "changed": "changed",
        "damaged": "damaged", "busy": "busy", "stale": "finished"}  # a dead writer's lock holds nothing
    assert found["unfinished"].reason == "resumes at generation 1 of 2"
    assert found["changed"].reason == "its folder holds a run with other settings: sigma 0.05 -> 0.02"
    assert f"process {child.pid}" in found["busy"].reason
    assert "config.yaml is missing" in found["damaged"].reason
    # a raised budget extends the finished run instead of changing it
    longer = grid.run_folder_state(out / "finished", config(num_generations=4), 4)
    assert (longer.state, longer.reason) == ("unfinished", "settings changed that its run can follow: "
                                                           "num_generations 2 -> 4")

    actions = {name: grid.decide(state.state) for name, state in found.items()}
    assert actions == {"new": "run", "finished": "skip", "unfinished": "resume", "changed": "conflict",
                       "damaged": "damaged", "busy": "skip", "stale": "skip"}
    replaced = {name: grid.decide(state.state, replace=True) for name, state in found.items()}
    assert replaced == {"new": "run", "finished": "overwrite", "unfinished": "overwrite", "changed": "overwrite",
                        "damaged": "overwrite", "busy": "skip", "stale": "overwrite"}  # never another's folder
    assert grid.decide("finished", finished="finish") == "finish"
    assert (grid.decide("failed"), grid.decide("failed", retry_failed=True)) == ("skip", "retry")
    assert grid.decide("changed-failed") == "rerun" and grid.decide("running", replace=True) == "skip"


def test_the_executor_records_a_failure_and_a_busy_folder_and_runs_the_others(folders):
    out, child = folders
    busy_before = snapshot(out / "busy")
    seen = []

    def attempt(name: str) -> int:
        run = ESRun.open(config(), out / name, engine=SyntheticEngine())
        try:
            if name == "unfinished":
                raise RuntimeError("the engine died")  # the folder opened, then the attempt failed
            run.run()
            return run.generation
        finally:
            run.close()

    outcomes = grid.execute(["busy", "unfinished", "stale", "new"], attempt,
                            after=lambda item, outcome: seen.append((item, outcome.status)), name=str)
    assert [(o.name, o.status) for o in outcomes] == [("busy", "busy"), ("unfinished", "failed"),
                                                      ("stale", "ok"), ("new", "ok")]
    assert seen == [(o.name, o.status) for o in outcomes]  # ``after`` saw each as it ended
    assert outcomes[0].holder["pid"] == child.pid and snapshot(out / "busy") == busy_before  # untouched
    assert outcomes[1].error == "RuntimeError: the engine died" and outcomes[1].seconds > 0
    assert [r["generation"] for r in read_metrics(out / "unfinished")] == [0, 1]  # what it wrote is kept
    assert grid.run_folder_state(out / "unfinished", config(), 2).state == "unfinished"  # and resumes next time
    assert outcomes[2].value == 2 and outcomes[3].value == 2 and lock_holder(out / "new") is None

    # a runner that stops at its first failure: the error goes up, the items before it kept
    seen.clear()
    with pytest.raises(RuntimeError, match="the engine died"):
        grid.execute(["finished", "unfinished", "new"], attempt,
                     after=lambda item, outcome: seen.append(item), keep_going=False, name=str)
    assert seen == ["finished"]
    with pytest.raises(RunFolderBusy):  # what the executor turns into a busy outcome
        ESRun.open(config(), out / "busy", engine=SyntheticEngine())


def test_a_replacement_keeps_the_old_folder_until_its_attempt_succeeds(tmp_path):
    folder = tmp_path / "out" / "finished"
    make_run(folder)
    before = snapshot(folder)

    replaced = grid.Replacement.begin(folder)
    assert not folder.exists() and snapshot(replaced.aside) == before and replaced.aside.name.startswith(".finished.kept-")
    make_run(folder, sigma=0.05)  # the attempt writes a new run, then fails
    attempt = replaced.failed()
    assert snapshot(folder) == before and attempt.name.startswith("finished.failed-") and (attempt / "config.yaml").exists()
    assert not list(folder.parent.glob(".finished.kept-*"))

    replaced = grid.Replacement.begin(folder)
    replaced.abandoned()  # another process held the folder: nothing began, all as it was
    assert snapshot(folder) == before

    replaced = grid.Replacement.begin(folder)
    make_run(folder, sigma=0.05)
    replaced.succeeded()
    assert grid.run_folder_state(folder, config(sigma=0.05), 2).state == "finished"
    assert not list(folder.parent.glob(".finished.kept-*"))
    assert grid.Replacement.begin(tmp_path / "out" / "absent") is None  # nothing to replace
