"""``scripts/gpu_tune_study.sh`` run by bash on stand-in workers: refill (a worker that ended cleanly
gives its card to a method still at work, the one with the fewest workers alive; a worker that died,
or one of a method whose work is all claimed, is not replaced), rebuild (one process per method and
seed over the cards), finish (rebuild, geometry, compact, only for a finished study), and a pack
split into parts a device call can return, which start joins again; and ``scripts/gpu_study.sh``'s
job set for Qiu et al.'s protocol."""
from __future__ import annotations

import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_tune_study.sh"


def _functions(*names: str) -> str:
    """The script's own functions of these names, by default those refill uses (the rest of it starts
    real workers)."""
    names = names or ("alive", "claim_until", "mps_env", "launch", "ended_cleanly", "waiting", "fewest_alive",
                      "refill")
    text, taken, keep = SCRIPT.read_text().splitlines(), [], False
    for line in text:
        keep = keep or line.startswith(tuple(f"{name}() {{" for name in names))
        if keep:
            taken.append(line)
        if keep and line == "}":
            keep = False
    return "\n".join(taken)


@pytest.fixture
def sleeper():
    """A stand-in worker that stays alive; killed at the end."""
    processes = []

    def start() -> int:
        processes.append(subprocess.Popen(["sleep", "60"]))
        return processes[-1].pid

    yield start
    for process in processes:
        process.kill()


def _ended() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_clean_end_hands_its_card_to_the_method_at_work_with_the_fewest_workers(tmp_path, sleeper):
    logs = tmp_path / "logs"
    logs.mkdir()
    rows = []

    def worker(method: str, card: int, pid: int, summary: bool) -> None:
        log = logs / f"{method}.{len(rows)}.log"
        # an earlier worker's clean end in the same (appended) log says nothing about this one
        earlier = "summary: out/tune_summary.json (1.0 min in all)\n"
        log.write_text(earlier + ("trials run by this worker: 4\nsummary: out/tune_summary.json (3.0 min in all)\n"
                                  if summary else "Traceback (most recent call last):\nRuntimeError: out of memory\n"))
        rows.append(f"{pid}\t{card}\t5\t{method}\t{log}\t{len(earlier)}")

    worker("es_lora", 0, _ended(), summary=True)       # done, nothing left to claim: its card goes on
    worker("es_full", 1, _ended(), summary=False)      # died: not replaced
    worker("grpo_full", 1, _ended(), summary=True)     # done, though another of its workers is still at work
    worker("grpo_full", 2, sleeper(), summary=False)   # so grpo_full takes no new worker
    worker("grpo_lora", 3, sleeper(), summary=False)   # at work, two workers alive
    worker("grpo_lora", 0, sleeper(), summary=False)
    worker("es_eggroll", 2, sleeper(), summary=False)  # at work, one worker alive
    (logs / "workers.tsv").write_text("\n".join(rows) + "\n")
    (logs / "replaced.txt").write_text("")
    script = f"""set -u
LOGS={logs}; METHODS="es_full grpo_full grpo_lora es_lora es_eggroll"
{_functions()}
launch() {{ printf '%s\\t%s\\t%s\\t%s\\t%s\\t0\\n' $$ "$2" "$3" "$1" "$4" >> "$LOGS/workers.tsv"; }}  # stands in, alive
refill
refill  # a second pass replaces nothing twice
"""
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "card 0: a worker of es_lora ended; a worker of es_eggroll took its place",  # 1 alive against grpo_lora's 2
        "card 1: a worker of grpo_full ended; a worker of grpo_lora took its place",  # 2 and 2: the first listed
    ]
    added = [line.split("\t")[1:4] for line in (logs / "workers.tsv").read_text().splitlines()[len(rows):]]
    assert added == [["0", "5", "es_eggroll"], ["1", "5", "grpo_lora"]]  # the ended worker's card and engine count
    ended = [row.split("\t")[0] for row in rows[:3]]
    assert sorted((logs / "replaced.txt").read_text().split()) == sorted(ended)


def test_fill_methods_take_only_the_slots_no_method_at_work_may_take_the_emptiest_first(tmp_path, sleeper):
    """FILL (ES, whose runs survive a lost machine): a slot that no method at work may take (its
    CLAIM_UNTIL passed) goes to the FILL method with the fewest workers alive, never to one that ended
    cleanly or whose own deadline passed; while a method at work may take a slot, no FILL method gets
    it, even one with no worker alive."""
    logs = tmp_path / "logs"
    logs.mkdir()
    rows = []
    for method, pid, summary in (("grpo_full", _ended(), True),     # a slot: nothing left it may start
                                 ("grpo_lora", sleeper(), False),   # at work, unless its deadline passed
                                 ("es_eggroll", _ended(), True),    # a slot, and a FILL method done
                                 ("es_lora", sleeper(), False)):    # a FILL method with a worker alive
        log = logs / f"{method}.{len(rows)}.log"
        log.write_text("summary: out/tune_summary.json (3.0 min in all)\n" if summary else "step 10\n")
        rows.append(f"{pid}\t0\t6\t{method}\t{log}\t0")
    script = f"""set -u
LOGS={logs}; METHODS="es_full grpo_full grpo_lora es_lora es_eggroll"
{_functions()}
launch() {{ printf '%s\\t%s\\t%s\\t%s\\t%s\\t0\\n' $$ "$2" "$3" "$1" "$4" >> "$LOGS/workers.tsv"; }}  # stands in, alive
refill
"""

    def refill(passed: str, fill: str) -> list[str]:
        (logs / "workers.tsv").write_text("\n".join(rows) + "\n")
        (logs / "replaced.txt").write_text("")
        (logs / "claim_until.txt").write_text("".join(f"{m}={int(time.time()) - 1}\n" for m in passed.split()))
        (logs / "fill.txt").write_text("".join(f"{m}\n" for m in fill.split()))
        result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return [line.split("; ")[1] for line in result.stdout.splitlines()]

    fill = "es_eggroll es_lora es_full"
    # es_full has none alive, es_lora one; then one each, the first listed
    assert refill("grpo_full grpo_lora", fill) == ["a worker of es_full took its place", "a worker of es_lora took its place"]
    assert refill("grpo_full grpo_lora es_full", fill) == ["a worker of es_lora took its place"] * 2
    # grpo_lora may still start work: both slots are its, es_full's empty hands notwithstanding
    assert refill("grpo_full", fill) == ["a worker of grpo_lora took its place"] * 2
    # without FILL, as before: es_lora is a method at work like any other, and with its deadline
    # passed too the slots stay empty
    assert refill("grpo_full grpo_lora", "") == ["a worker of es_lora took its place"] * 2
    assert refill("grpo_full grpo_lora es_lora", "") == []


def test_a_method_whose_worker_waits_for_the_others_takes_no_slot(tmp_path, sleeper):
    """Lease 13: LoRA GRPO's worker ended, and its slot went to a fourth full GRPO worker while one of
    full GRPO's three already waited for the other two's trials. A method one of whose workers waits
    (its last line) has more hands than work: the slot goes to FILL instead. A worker that waited and
    then took a run (a line after the wait) is at work again."""
    logs = tmp_path / "logs"
    logs.mkdir()
    rows = []

    def worker(method: str, pid: int, text: str) -> None:
        log = logs / f"{method}.{len(rows)}.log"
        earlier = "waiting for other workers: 1 unfinished (an earlier worker's line)\n"  # before this worker's offset
        log.write_text(earlier + text)
        rows.append(f"{pid}\t0\t6\t{method}\t{log}\t{len(earlier)}")

    worker("grpo_lora", _ended(), "claiming no more: what is left would not end by the deadline\n"
                                  "summary: out/tune_summary.json (3.6 min in all)\n")
    worker("grpo_full", sleeper(), "  grpo_full/trial_0019  450/900\n")
    worker("grpo_full", sleeper(), "  grpo_full/trial_0020  440/900\n")
    worker("grpo_full", sleeper(), "grpo_full: tuning not finished; its reruns wait\n"
                                   "waiting for other workers: 1 unfinished (trials of grpo_full)\n\n")
    worker("es_full", sleeper(), "  es_full/seed8  170/240\n")
    worker("es_lora", sleeper(), "  es_lora/seed3  250/600\n")
    waiting_row = rows[3]
    script = f"""set -u
LOGS={logs}; METHODS="es_full grpo_full grpo_lora es_lora"
{_functions()}
launch() {{ printf '%s\\t%s\\t%s\\t%s\\t%s\\t0\\n' $$ "$2" "$3" "$1" "$4" >> "$LOGS/workers.tsv"; }}  # stands in, alive
refill
"""

    def refill() -> list[str]:
        (logs / "workers.tsv").write_text("\n".join(rows) + "\n")
        (logs / "replaced.txt").write_text("")
        (logs / "fill.txt").write_text("es_full\nes_lora\n")
        result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return [line.split("; ")[1] for line in result.stdout.splitlines()]

    assert refill() == ["a worker of es_full took its place"]
    Path(waiting_row.split("\t")[4]).open("a").write("  grpo_full/final/seed0  1/900\n")  # its trials ended: a rerun
    assert refill() == ["a worker of grpo_full took its place"]


def _stand_ins(tmp_path: Path, study: Path, gpus: int, python: str) -> dict:
    """The environment for running the script on stand-ins: an nvidia-smi listing ``gpus`` cards and a
    ``python`` of the given shell body, first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cards = "".join(f"echo 'GPU {i}: H100'\n" for i in range(gpus))
    for tool, body in (("nvidia-smi", cards), ("python", python)):
        (bin_dir / tool).write_text("#!/bin/sh\n" + body)
        (bin_dir / tool).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "STUDY": str(study), "LOGS": str(tmp_path / "logs"),
            "REBUILD_WAVE_S": "0", "WAVE_S": "0", "POLL_S": "0.2",
            "CACHE_ARCHIVE": str(tmp_path / "no_compile_cache" / "compile_cache.tar.gz")}


def _detached(command: str) -> int:
    """A stand-in worker as `launch` starts one: its own process group (setsid), its parent gone."""
    started = subprocess.run(["bash", "-c", f"setsid bash -c {shlex.quote(command)} > /dev/null 2>&1 < /dev/null & echo $!"],
                             capture_output=True, text=True, check=True)
    return int(started.stdout)


def _group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_stop_ends_every_worker_s_process_group_and_kills_one_that_ignores_term(tmp_path):
    """`stop` sends TERM to each recorded worker's process group (its children too), waits, and kills
    a group still there after its SECONDS; a worker already ended is left alone."""
    logs = tmp_path / "logs"
    logs.mkdir()
    child, trapped = tmp_path / "child.pid", tmp_path / "trapped"
    polite = _detached(f"sleep 120 & echo $! > {child}; wait")
    stubborn = _detached(f"trap '' TERM; echo yes > {trapped}; while :; do sleep 0.2; done")
    try:
        deadline = time.monotonic() + 10
        # the polite worker's child has started, and the stubborn one ignores TERM (a TERM sent before its
        # trap, on a busy machine, would end it like the polite one)
        while not all(f.exists() and f.read_text().strip() for f in (child, trapped)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (logs / "workers.pids").write_text(f"{polite}\n{_ended()}\n{stubborn}\n")
        script = f"set -u\nLOGS={logs}\n{_functions('stop')}\nstop 2\n"
        result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == [f"process group {stubborn}: killed after 2 s", f"stopped: {polite} {stubborn}"]
        deadline = time.monotonic() + 10
        while (_group_alive(polite) or _group_alive(stubborn)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _group_alive(polite) and not _group_alive(stubborn), "both groups, the worker's child too, ended"
    finally:
        for pid in (polite, stubborn):
            if _group_alive(pid):
                os.killpg(pid, signal.SIGKILL)


def test_stop_with_methods_ends_only_their_workers_and_refuses_a_method_never_started(tmp_path):
    """`stop SECONDS METHOD...` ends the process groups of those methods' workers (workers.tsv) and
    leaves the others and the rebuilds running; a method with no worker recorded is refused, naming
    the methods there are, before any worker is stopped."""
    logs = tmp_path / "logs"
    logs.mkdir()
    lora, eggroll, grpo, rebuild = (_detached("while :; do sleep 0.2; done") for _ in range(4))
    try:
        (logs / "workers.tsv").write_text("".join(f"{pid}\t0\t4\t{method}\t{logs}/{method}.log\t0\n" for pid, method in (
            (lora, "es_lora"), (eggroll, "es_eggroll"), (grpo, "grpo_lora"))))
        (logs / "workers.pids").write_text(f"{lora}\n{eggroll}\n{grpo}\n")
        (logs / "rebuild.pid").write_text(f"{rebuild}\n")
        script = f"set -u\nLOGS={logs}\n{_functions('stop')}\nstop 5 \"$@\"\n"
        refused = subprocess.run(["bash", "-c", script, "stop", "es_lora", "es_ful"], capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2
        assert refused.stderr.strip() == "stop: no worker of es_ful was started (workers: es_eggroll es_lora grpo_lora)"
        assert all(_group_alive(pid) for pid in (lora, eggroll, grpo, rebuild))
        result = subprocess.run(["bash", "-c", script, "stop", "es_lora", "es_eggroll"], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == [f"stopped: {lora} {eggroll}"]
        deadline = time.monotonic() + 10
        while (_group_alive(lora) or _group_alive(eggroll)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _group_alive(lora) and not _group_alive(eggroll)
        assert _group_alive(grpo) and _group_alive(rebuild), "the other method's worker and the rebuilds run on"
    finally:
        for pid in (lora, eggroll, grpo, rebuild):
            if _group_alive(pid):
                os.killpg(pid, signal.SIGKILL)


def test_rebuild_runs_the_first_three_final_seeds_of_each_method_one_process_each_round_robin(tmp_path):
    """`rebuild` starts `python -m evolm_lib.tune.rebuild` per method and seed (the geometry's first
    three seeds, numerically: seed10 after seed2) over the cards, waits for all, and counts failures."""
    study = tmp_path / "study"
    for method, seeds in (("es_full", (0, 1, 2, 10)), ("grpo_lora", (2, 0, 1))):
        for seed in seeds:
            (study / "final" / method / f"seed{seed}").mkdir(parents=True)
    (study / "final" / "es_full" / "notes.txt").write_text("not a seed folder")
    calls = tmp_path / "calls.txt"
    # a stand-in for the rebuild: records its card, the engines declared on it and its arguments;
    # grpo_lora seed 1's rows differ (exit 3)
    env = _stand_ins(tmp_path, study, gpus=2, python=(
        f'echo "$CUDA_VISIBLE_DEVICES $*" >> {calls}\necho "$CUDA_VISIBLE_DEVICES $EVOLM_ENGINES_PER_CARD" >> {calls}.engines\n'
        'echo "rebuilt $5 $7"\n'
        'if [ "$5" = grpo_lora ] && [ "$7" = 1 ]; then exit 3; fi\n'))
    result = subprocess.run(["bash", str(SCRIPT), "rebuild"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    started = sorted(calls.read_text().splitlines(), key=lambda line: (line.split()[5], int(line.split()[7])))
    assert started == [
        f"0 -m evolm_lib.tune.rebuild {study} --methods es_full --seeds 0",
        f"1 -m evolm_lib.tune.rebuild {study} --methods es_full --seeds 1",
        f"0 -m evolm_lib.tune.rebuild {study} --methods es_full --seeds 2",
        f"1 -m evolm_lib.tune.rebuild {study} --methods grpo_lora --seeds 0",
        f"0 -m evolm_lib.tune.rebuild {study} --methods grpo_lora --seeds 1",
        f"1 -m evolm_lib.tune.rebuild {study} --methods grpo_lora --seeds 2",
    ]
    assert result.stdout.splitlines()[-1] == "6 rebuilds on 2 GPUs, 1 failed or with rows that differ"
    assert sorted(Path(f"{calls}.engines").read_text().splitlines()) == ["0 3"] * 3 + ["1 3"] * 3  # 6 over 2 cards
    assert "rebuilt grpo_lora 2" in result.stdout


@pytest.mark.parametrize("done, geometry", [(True, "1"), (False, "1"), (True, "0")])
def test_finish_rebuilds_measures_and_compacts_only_a_finished_study(tmp_path, done, geometry):
    """`finish` asks tune.outstanding whether the study is done; only then it runs the rebuilds, the
    geometry and the compaction, in that order, into DIR/compact, and packs that as one file; with
    GEOMETRY=0 (measured before, by geometry-stage) no rebuild and no geometry."""
    study = tmp_path / "study"
    (study / "final" / "es_lora" / "seed0").mkdir(parents=True)
    calls = tmp_path / "calls.txt"
    # a stand-in python: the status check (-c) says done or not; every module call is recorded
    env = _stand_ins(tmp_path, study, gpus=1, python=(
        f'if [ "$1" = -c ]; then echo "status $3 $4" >> {calls}; exit {0 if done else 1}; fi\n'
        f'echo "$2 $3 $4" >> {calls}\n'))
    env.update(SPEC="spec.yaml", GEOMETRY=geometry)
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(SCRIPT), "finish", str(out), "120"], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    expected = [f"status spec.yaml {study}"]
    if done:
        expected += ([f"evolm_lib.tune.rebuild {study} --methods"] if geometry == "1" else []) + [
            "evolm_lib.cli tune spec.yaml"] + ([f"evolm_lib.tune.geometry {study} {out}/compact"] if geometry == "1" else []) + [
            "evolm_lib.tune.base spec.yaml --out", f"evolm_lib.tune.compact {study} {out}/compact"]
    assert calls.read_text().splitlines() == expected
    assert (out / "compact.tar.gz").is_file() == done and not (out / "compact").exists()
    if done:
        with tarfile.open(out / "compact.tar.gz") as tar:
            assert tar.getnames() == ["compact"]


def test_rebuilds_started_beside_the_workers_end_before_finish_goes_on(tmp_path):
    """With REBUILD_AT_START=1, `start` also starts `rebuild` detached beside its workers and returns
    at once; `finish` waits for those rebuilds before its own rebuild, the geometry and compact."""
    study = tmp_path / "study"
    (study / "final" / "es_lora" / "seed0").mkdir(parents=True)
    calls = tmp_path / "calls.txt"
    # stand-ins: the status check says done, workers end at once, a rebuild takes a second
    env = _stand_ins(tmp_path, study, gpus=2, python=(
        '[ "$1" = -c ] && exit 0\n'
        f'case "$2" in evolm_lib.tune.rebuild) echo "rebuild starts $5" >> {calls}; sleep 1; '
        f'echo "rebuild ends $5" >> {calls} ;;\n'
        f'evolm_lib.cli) case "$5 $7" in *--dry-run*) ;; *--no-finals*) echo summary >> {calls} ;; '
        f'*) echo "worker $6" >> {calls} ;; esac ;;\n'
        f'*) echo "$2" >> {calls} ;; esac\n'))
    env.update(SPEC="spec.yaml", METHODS="es_lora", WORKERS_PER_METHOD="1", REBUILD_AT_START="1", REBUILD_DELAY_S="0")
    result = subprocess.run(["bash", str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "the geometry's rebuilds start beside them in 0 s" in result.stdout
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(SCRIPT), "finish", str(out), "120"], env={**env, "REBUILD_AT_START": "0"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = calls.read_text().splitlines()
    assert lines[0] == "worker es_lora" and lines[1:3] == ["rebuild starts es_lora", "rebuild ends es_lora"]
    # finish's own rebuild (here a stand-in, which runs again; the real one finds the work done), then on
    assert lines[3:] == ["rebuild starts es_lora", "rebuild ends es_lora", "summary", "evolm_lib.tune.geometry",
                         "evolm_lib.tune.base", "evolm_lib.tune.compact"]


def test_the_geometry_stage_runs_finish_steps_detached_across_calls_without_asking_whether_the_study_is_done(
        tmp_path):
    """`geometry-stage` unpacks the archive once, starts the rebuilds, geometry and compact detached
    (no status check, no workers), and each call waits for them only until its own seconds are up: a
    call that ends first says so and returns no compact, the next waits on the same steps (it starts
    nothing again) and returns DIR/compact.tar.gz with a status file."""
    study = tmp_path / "runs" / "study"
    source = tmp_path / "source" / "study" / "final" / "es_lora" / "seed0"
    source.mkdir(parents=True)
    (source / "config.yaml").write_text("seed: 0\n")
    archive = tmp_path / "pack.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "source" / "study", arcname="study")
    calls = tmp_path / "calls.txt"
    # stand-ins: a status check (python -c) would be recorded; the rebuild takes 12 s, the rest is at once
    env = _stand_ins(tmp_path, study, gpus=1, python=(
        f'if [ "$1" = -c ]; then case "$2" in *resolve_model*) echo resolve_model ;; *) echo status ;; esac >> {calls}; '
        'exit 0; fi\n'
        f'case "$2" in evolm_lib.tune.rebuild) echo "rebuild $5" >> {calls}; sleep 12 ;;\n'
        f'*) echo "$2" >> {calls}; [ "$2" = evolm_lib.tune.compact ] && mkdir -p "$4" && echo x > "$4/rows.csv" ;; esac\n'))
    env["SPEC"] = "spec.yaml"
    out1, out2 = tmp_path / "out1", tmp_path / "out2"
    first = subprocess.run(["bash", str(SCRIPT), "geometry-stage", "20", str(out1), str(archive)], env=env,
                           capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert f"unpacked {archive}" in first.stdout and "still running" in first.stdout
    assert (study / "final" / "es_lora" / "seed0" / "config.yaml").is_file()
    assert not (out1 / "compact.tar.gz").exists() and (out1 / "geometry_stage_status.txt").is_file()
    second = subprocess.run(["bash", str(SCRIPT), "geometry-stage", "60", str(out2), str(archive)], env=env,
                            capture_output=True, text=True, timeout=90)
    assert second.returncode == 0, second.stderr
    assert "unpacked" not in second.stdout and f"done: {out2}/compact.tar.gz" in second.stdout
    work = tmp_path / "logs" / "geometry_stage"
    assert calls.read_text().splitlines() == [
        "resolve_model", "rebuild es_lora", "evolm_lib.cli", "evolm_lib.tune.geometry", "evolm_lib.tune.base",
        "evolm_lib.tune.compact"]
    with tarfile.open(out2 / "compact.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["compact", "compact/rows.csv"]
    assert (out2 / "geometry_stage_status.txt").is_file() and not (work / "compact").exists()
    # a start that ends without its compact (here the model's conversion fails once) is started again
    # by the next call, without unpacking over the study
    (tmp_path / "failing").mkdir()
    marker = tmp_path / "failed_once"
    env_failing = _stand_ins(tmp_path / "failing", study, gpus=1, python=(
        f'if [ "$1" = -c ]; then [ -f {marker} ] && exit 0; touch {marker}; echo "conversion fails" >> {calls}; exit 1; fi\n'
        f'echo "$2" >> {calls}; [ "$2" = evolm_lib.tune.compact ] && mkdir -p "$4" && echo x > "$4/rows.csv"; exit 0\n'))
    env_failing.update(SPEC="spec.yaml", LOGS=str(tmp_path / "logs2"))
    (study / "rebuilt").mkdir()
    runs = [subprocess.run(["bash", str(SCRIPT), "geometry-stage", "60", str(tmp_path / f"out{i}"), str(archive)],
                           env=env_failing, capture_output=True, text=True, timeout=90) for i in (3, 4)]
    assert all(run.returncode == 0 for run in runs), [run.stderr for run in runs]
    assert "ended without compact.tar.gz" in runs[0].stdout and "unpacked" not in runs[0].stdout
    assert "the last start ended without compact.tar.gz" in runs[1].stdout and "done:" in runs[1].stdout
    assert calls.read_text().splitlines()[-6:] == ["conversion fails", "evolm_lib.tune.rebuild", "evolm_lib.cli",
                                                  "evolm_lib.tune.geometry", "evolm_lib.tune.base", "evolm_lib.tune.compact"]
    assert (study / "rebuilt").is_dir()  # the study was not unpacked over


def test_the_compile_caches_go_back_in_parts_and_a_new_machine_restores_them_before_its_engines(tmp_path):
    """`compile-cache DIR [N]` packs the caches once (absolute paths) in parts of PART_BYTES kept on
    the machine, parts N to N+3 into DIR; staged as CACHE_ARCHIVE's parts, `restore_compile_cache`
    (what start runs before the engines) puts every file back where it was; damaged parts are said
    and leave the engines cold, not the start stopped; no caches at all is an error naming where it looked."""
    caches = [tmp_path / "machine" / "vllm", tmp_path / "machine" / "triton"]
    files = {caches[0] / "torch_compile_cache" / "abc" / "model.bin": os.urandom(300_000),
             caches[1] / "k1" / "kernel.cubin": os.urandom(200_000), caches[1] / "k1" / "kernel.json": b"{}"}
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    env = {**os.environ, "COMPILE_CACHES": f"{caches[0]} {caches[1]} {tmp_path / 'absent'}",
           "PACKS": str(tmp_path / "packs"), "PART_BYTES": "100000", "RETURN_BYTES": "400000",
           "CACHE_ARCHIVE": str(tmp_path / "stage" / "compile_cache.tar.gz")}
    first, second = tmp_path / "out1", tmp_path / "out2"
    result = subprocess.run(["bash", str(SCRIPT), "compile-cache", str(first)], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    count = len(list((tmp_path / "packs").glob("compile_cache.tar.gz.part-*")))
    assert count >= 6  # random bytes do not compress: 500 kB in parts of 100 kB
    assert sorted(p.name for p in first.iterdir()) == [f"compile_cache.tar.gz.part-{i:02d}" for i in range(4)]
    assert f"compile cache parts 00 01 02 03 of {count} in {first}" in result.stdout
    result = subprocess.run(["bash", str(SCRIPT), "compile-cache", str(second), "4"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in second.iterdir()) == [f"compile_cache.tar.gz.part-{i:02d}" for i in range(4, count)]

    shutil.rmtree(tmp_path / "machine")  # the next machine: nothing compiled yet
    (tmp_path / "stage").mkdir()
    for part in [*first.iterdir(), *second.iterdir()]:
        shutil.copy(part, tmp_path / "stage" / part.name)
    script = f"""set -u
CACHE_ARCHIVE={env['CACHE_ARCHIVE']}
{_functions('restore_compile_cache')}
restore_compile_cache
"""
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "compile caches restored from" in result.stdout, result.stderr
    assert {path: path.read_bytes() for path in files} == files

    (tmp_path / "stage" / "compile_cache.tar.gz.part-01").write_bytes(b"damaged")
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "the engines start from a cold compile cache" in result.stderr
    shutil.rmtree(tmp_path / "packs")
    shutil.rmtree(tmp_path / "machine")
    result = subprocess.run(["bash", str(SCRIPT), "compile-cache", str(first)], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1 and f"no compile cache here (COMPILE_CACHES: {caches[0]}" in result.stderr


def test_a_pack_goes_back_in_parts_over_several_calls_and_start_joins_them_again(tmp_path):
    """`pack` with the real packer: the archive in parts of at most PART_BYTES kept on the machine,
    the first in DIR, as many as fit in what a call returns beside what DIR holds (an earlier pack's
    parts there removed), `parts N DIR2 [COUNT]` the rest;
    `unpack` (what start runs) puts the study back from the parts gathered, file for file."""
    import optuna

    study = tmp_path / "run" / "study"
    trial_folder = study / "trials" / "es_lora" / "trial_0000"
    (trial_folder / "seed100").mkdir(parents=True)
    storage = optuna.create_study(storage=f"sqlite:///{study / 'optuna.db'}", study_name="es_lora",
                                  direction="maximize")
    trial = storage.ask()
    trial.set_user_attr("run_dir", str(trial_folder))
    storage.tell(trial, 0.5)
    rows = os.urandom(250_000).hex()  # gzip cannot shrink it below three parts
    (trial_folder / "seed100" / "metrics.jsonl").write_text(rows + "\n")
    (study / "tune_summary.json").write_text("{}")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "STUDY": str(study),
           "LOGS": str(tmp_path / "logs"), "PACKS": str(tmp_path / "packs"), "PART_BYTES": "100000",
           # room for two parts (and some slack for the folder's own size) beside compact.tar.gz and a
           # MiB kept for the status
           "RETURN_BYTES": str(2**20 + 150_000 + 250_000 + 50_000)}
    out = tmp_path / "out"
    out.mkdir()
    (out / "tune_study.tar.gz.part-07").write_text("an earlier pack's part")  # not mistaken for this pack's
    finished = os.urandom(150_000)  # finish's compacted study, with the geometry: kept, not written over
    (out / "compact.tar.gz").write_bytes(finished)
    result = subprocess.run(["bash", str(SCRIPT), "pack", str(out)], env=env, capture_output=True, text=True,
                            timeout=120, cwd=SCRIPT.parents[1])
    assert result.returncode == 0, result.stderr
    assert (out / "compact.tar.gz").read_bytes() == finished
    kept = sorted((tmp_path / "packs").iterdir())
    count = -(-sum(p.stat().st_size for p in kept) // 100_000)
    assert count >= 3 and [p.name for p in kept] == [f"tune_study.tar.gz.part-{i:02d}" for i in range(count)]
    assert all(p.stat().st_size <= 100_000 for p in kept)
    assert sorted(p.name for p in out.iterdir()) == ["compact.tar.gz", "tune_study.tar.gz.part-00",
                                                     "tune_study.tar.gz.part-01", "tune_study_status.txt"]
    assert f"this call returns 2 of the pack's {count} parts" in result.stdout
    assert "| es_lora | 1 of 16 | 0 of 10: waits for the trials |" in result.stdout  # the progress, also in the status
    status = (out / "tune_study_status.txt").read_text()
    assert "| es_lora | 1 of 16 |" in status
    # the attempts' speeds, by placement (this run folder records none: the tables' headers alone)
    assert "| method | size | engines a card | MPS | attempts |" in status

    one = tmp_path / "one"
    result = subprocess.run(["bash", str(SCRIPT), "parts", "2", str(one), "1"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and [p.name for p in one.iterdir()] == ["tune_study.tar.gz.part-02"]

    later = tmp_path / "later"
    result = subprocess.run(["bash", str(SCRIPT), "parts", "2", str(later)], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in later.iterdir()) == [f"tune_study.tar.gz.part-{i:02d}" for i in range(2, count)]
    for part in later.iterdir():
        shutil.copy(part, out / part.name)

    again = tmp_path / "again" / "study"
    script = f"set -u\nSTUDY={again}\n{_functions('unpack')}\nunpack {out}/tune_study.tar.gz\n"
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (again / "trials" / "es_lora" / "trial_0000" / "seed100" / "metrics.jsonl").read_text() == rows + "\n"
    assert optuna.load_study(study_name="es_lora", storage=f"sqlite:///{again / 'optuna.db'}").best_value == 0.5

    script = f"set -u\nSTUDY={again}\n{_functions('unpack')}\nunpack {tmp_path}/none.tar.gz\n"
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and f"no pack at {tmp_path}/none.tar.gz" in result.stderr


def test_every_pack_brings_the_compacted_study_back_beside_its_first_parts(tmp_path):
    """`pack` writes DIR/compact.tar.gz, the form a session commits, beside the first parts: a machine
    lost before the pack's later parts are fetched then loses no finished run's rows. The archive holds
    the study's runs with their rows (load_compact reads it back). One already in DIR (finish's, with
    the geometry) is kept: the test above."""
    import optuna

    from evolm_lib.tune.compact import load_compact

    study = tmp_path / "run" / "study"
    run = study / "trials" / "es_lora" / "trial_0000" / "seed100"
    run.mkdir(parents=True)
    storage = optuna.create_study(storage=f"sqlite:///{study / 'optuna.db'}", study_name="es_lora",
                                  direction="maximize")
    trial = storage.ask()
    trial.set_user_attr("run_dir", str(run.parent))
    storage.tell(trial, 0.5)
    (run / "config.yaml").write_text("seed: 100\n")
    (run / "metrics.jsonl").write_text("".join(f'{{"generation": {g}, "train_reward": {g / 4}}}\n' for g in range(3)))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "STUDY": str(study),
           "LOGS": str(tmp_path / "logs"), "PACKS": str(tmp_path / "packs")}
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(SCRIPT), "pack", str(out)], env=env, capture_output=True, text=True,
                            timeout=120, cwd=SCRIPT.parents[1])
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["compact.tar.gz", "tune_study.tar.gz.part-00",
                                                     "tune_study_status.txt"]
    with tarfile.open(out / "compact.tar.gz") as tar:
        tar.extractall(tmp_path / "back", filter="data")
    runs = load_compact(tmp_path / "back" / "compact")["runs"]
    assert [(r["path"], [row["train_reward"] for row in r["rows"]]) for r in runs] == [
        ("trials/es_lora/trial_0000/seed100", [0.0, 0.25, 0.5])]
    assert not (tmp_path / "packs" / "compact_work").exists()  # its working copy gone


def test_the_qiu_protocol_runs_a_process_per_run_round_robin_over_the_cards(tmp_path):
    """scripts/gpu_study.sh LIMIT qiu on stand-ins: six `evolm sweep` processes of the protocol's spec
    (full ES and full GRPO on seeds 0-2), card by card, each under the limit and told how many share its
    card; then the end marked."""
    calls = tmp_path / "calls.txt"
    env = _stand_ins(tmp_path, tmp_path / "unused", gpus=4, python=(
        f'[ "$1" = -c ] && exit 0\necho "$CUDA_VISIBLE_DEVICES $EVOLM_ENGINES_PER_CARD $*" >> {calls}\n'))
    logs = tmp_path / "logs"
    result = subprocess.run(["bash", str(SCRIPT.with_name("gpu_study.sh")), "30", "qiu", str(logs)], env=env,
                            capture_output=True, text=True, timeout=60, cwd=SCRIPT.parents[1])
    assert result.returncode == 0, result.stderr
    spec = "papermill_runs/qiu_protocol_addition_gpu.yaml"
    # six processes on four cards: cards 0 and 1 hold two each, and every run is told its card's count
    assert sorted(calls.read_text().splitlines()) == sorted(
        f"{card} {2 if card < 2 else 1} -m evolm_lib.cli sweep {spec} --methods {method} --seeds {seed} --no-notebook"
        for card, (method, seed) in zip([0, 1, 2, 3, 0, 1], [(m, s) for m in ("es_full", "grpo_full") for s in (0, 1, 2)]))
    assert "6 processes on 4 GPUs, at most 30 s each" in result.stdout and (logs / "study.done").exists()
    assert (SCRIPT.parents[1] / spec).is_file()

    unknown = subprocess.run(["bash", str(SCRIPT.with_name("gpu_study.sh")), "30", "qui", str(logs)], env=env,
                             capture_output=True, text=True, timeout=60, cwd=SCRIPT.parents[1])
    assert unknown.returncode == 2 and "unknown job set qui: all, grpo, finish or qiu" in unknown.stderr


def _launch_past(logs: Path, deadlines: str, method: str, card: int) -> str:
    """What `launch` says for a worker of ``method`` (a later call's refill) once the deadline the
    file ``deadlines`` records for it has passed."""
    (logs / deadlines).write_text(f"{method}={int(time.time()) - 1}\n")
    script = f"""set -u
LOGS={logs}
{_functions('claim_until', 'mps_env', 'launch')}
launch {method} {card} 2 {logs / 'late.log'}
"""
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60).stdout


def test_start_places_workers_as_told_and_passes_each_its_deadline_for_starting_runs(tmp_path):
    """PLACE puts each worker on its card, wave by wave (the first worker of every card, then the
    second, ...), each told its card's count; CLAIM_UNTIL gives a method's workers its deadline
    (--claim-until, the time itself) and no worker once it has passed; refills read the deadlines again."""
    import time

    calls = tmp_path / "calls.txt"
    env = _stand_ins(tmp_path, tmp_path / "study", gpus=3, python=(
        f'[ "$1" = -c ] && exit 0\necho "$CUDA_VISIBLE_DEVICES $EVOLM_ENGINES_PER_CARD $*" >> {calls}\n'))
    soon = int(time.time()) + 600
    env.update(PLACE="grpo_full@0 grpo_full@0 es_lora@1 es_full@0 grpo_lora@2", CLAIM_UNTIL=f"grpo_full={soon}",
               FILL="es_full es_eggroll")
    result = subprocess.run(["bash", str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=120,
                            cwd=SCRIPT.parents[1])
    assert result.returncode == 0, result.stderr
    assert "5 workers on 3 GPUs: grpo_full,es_lora,es_full,grpo_lora" in result.stdout
    # each step before the launch timed, in the output and in the file the packs' status reads
    steps = (tmp_path / "logs" / "start_steps.txt").read_text()
    assert re.fullmatch(r"before the launch: unpack \d+ s, model \d+ s, dry run \d+ s, parallel check \d+ s, "
                        r"compile caches \d+ s, MPS \d+ s; \d+ s in all\n", steps) and steps in result.stdout
    for _ in range(100):  # the stand-in workers run detached: wait for the last to write its line
        lines = calls.read_text().splitlines()
        if len(lines) == 6:
            break
        time.sleep(0.1)
    lines.sort(key=lambda line: "--dry-run" not in line)
    spec = "papermill_runs/tune_study_addition_gpu.yaml"
    # the dry run checks FILL's methods beside the placed ones; later calls' refills read FILL back
    assert lines[0].strip() == (f"-m evolm_lib.cli tune {spec} --dry-run --no-figures --methods "
                                "grpo_full,es_lora,es_full,grpo_lora,es_eggroll")
    assert (tmp_path / "logs" / "fill.txt").read_text().split() == ["es_full", "es_eggroll"]
    placed = [row.split("\t")[1:4] for row in (tmp_path / "logs" / "workers.tsv").read_text().splitlines()]
    assert placed == [["0", "3", "grpo_full"], ["1", "1", "es_lora"], ["2", "1", "grpo_lora"],  # wave 1: cards 0-2
                      ["0", "3", "grpo_full"],  # wave 2: card 0
                      ["0", "3", "es_full"]]  # wave 3
    launched = sorted(line.split(" --claim-until ") for line in lines[1:])
    assert [head for head, *_ in launched] == sorted(
        f"{card} {engines} -m evolm_lib.cli tune {spec} --methods {method} --no-figures"
        for card, engines, method in placed)
    # a worker given a deadline weighs its work as of its engine's start: ENGINE_START_S, 210 s by default
    assert all(rest == [] or rest[0].split()[1:] == ["--engine-start-s", "210"] for _, *rest in launched)
    claims = [(head.split()[-2], float(rest[0].split()[0]) if rest else None) for head, *rest in launched]
    assert sorted(method for method, claim in claims if claim is None) == ["es_full", "es_lora", "grpo_lora"]
    deadlines = [claim for method, claim in claims if claim is not None]
    assert deadlines == [soon, soon]  # both grpo_full's
    logs = sorted(p.name for p in (tmp_path / "logs").glob("*.log"))
    assert logs == ["es_full.1.log", "es_lora.1.log", "grpo_full.1.log", "grpo_full.2.log", "grpo_lora.1.log"]

    # a refill in a later call: the deadline passed, grpo_full takes no card back
    late = _launch_past(tmp_path / "logs", "claim_until.txt", "grpo_full", 1)
    assert late == "card 1: no worker of grpo_full, whose deadline for starting runs has passed\n"
    assert len(calls.read_text().splitlines()) == len(lines)

    for place, message in (("grpo_full@3", "PLACE: grpo_full@3: this machine has cards 0 to 2"),
                           ("grpo_full", "PLACE: grpo_full is not METHOD@CARD"),
                           ("grpo_full@x", "PLACE: grpo_full@x: the card is not a number")):
        bad = subprocess.run(["bash", str(SCRIPT), "start"], env={**env, "PLACE": place, "LOGS": str(tmp_path / "l2")},
                             capture_output=True, text=True, timeout=60, cwd=SCRIPT.parents[1])
        assert bad.returncode == 2 and message in bad.stderr and not (tmp_path / "l2").exists()
    bad = subprocess.run(["bash", str(SCRIPT), "start"], env={**env, "CLAIM_UNTIL": "grpo_full=soon",
                                                                  "LOGS": str(tmp_path / "l2")},
                         capture_output=True, text=True, timeout=60, cwd=SCRIPT.parents[1])
    assert bad.returncode == 2 and "CLAIM_UNTIL: grpo_full=soon is not METHOD=EPOCH_SECONDS" in bad.stderr


def test_finish_by_gives_a_method_s_workers_the_lease_s_end_and_no_worker_once_it_has_passed(tmp_path):
    """FINISH_BY hands a method's workers the time their runs must end by (--finish-by, the time
    itself), beside CLAIM_UNTIL's deadline where both are given, and with either ENGINE_START_S
    (--engine-start-s: they weigh their work as of their engine's start); a refill after it launches none of
    that method, and a FINISH_BY that is no time is refused before any worker starts."""
    calls = tmp_path / "calls.txt"
    env = _stand_ins(tmp_path, tmp_path / "study", gpus=1, python=(
        f'[ "$1" = -c ] && exit 0\necho "$*" >> {calls}\n'))
    end, soon = int(time.time()) + 1500, int(time.time()) + 700
    env.update(PLACE="grpo_lora@0 grpo_full@0 es_full@0", FINISH_BY=f"grpo_lora={end} grpo_full={end}",
               CLAIM_UNTIL=f"grpo_full={soon}", ENGINE_START_S="150")
    result = subprocess.run(["bash", str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=120,
                            cwd=SCRIPT.parents[1])
    assert result.returncode == 0, result.stderr
    for _ in range(100):  # the stand-in workers run detached: wait for the last to write its line
        lines = [line for line in calls.read_text().splitlines() if "--dry-run" not in line]
        if len(lines) == 3:
            break
        time.sleep(0.1)
    options = {line.split("--methods ")[1].split()[0]: line.split("--no-figures")[1].split() for line in lines}
    assert options == {"grpo_lora": ["--finish-by", str(end), "--engine-start-s", "150"],
                       "grpo_full": ["--claim-until", str(soon), "--finish-by", str(end), "--engine-start-s", "150"],
                       "es_full": []}
    assert (tmp_path / "logs" / "finish_by.txt").read_text().split() == [f"grpo_lora={end}", f"grpo_full={end}"]

    late = _launch_past(tmp_path / "logs", "finish_by.txt", "grpo_lora", 0)
    assert late == "card 0: no worker of grpo_lora, whose deadline for ending runs has passed\n"
    bad = subprocess.run(["bash", str(SCRIPT), "start"], env={**env, "FINISH_BY": "grpo_lora=later",
                                                                  "LOGS": str(tmp_path / "l2")},
                         capture_output=True, text=True, timeout=60, cwd=SCRIPT.parents[1])
    assert bad.returncode == 2 and "FINISH_BY: grpo_lora=later is not METHOD=EPOCH_SECONDS" in bad.stderr
    assert not (tmp_path / "l2").exists()


def test_start_says_which_workers_wait_because_tune_parallel_caps_their_trials(tmp_path):
    """A method given more workers than tune.parallel lets run trials at once is named at the start,
    with how many of its workers wait; a spec without the cap, or a method within it, says nothing.
    The spec is read by the real evolm_lib (the stand-in python hands that one call on)."""
    env = _stand_ins(tmp_path, tmp_path / "study", gpus=2, python=(
        f'case "$2" in *tune.parallel*) exec {sys.executable} "$@" ;; esac\nexit 0\n'))
    place = "grpo_full@0 grpo_full@0 grpo_full@0 grpo_full@1 grpo_full@1 grpo_full@1 es_lora@0 es_lora@1"
    said = {}
    for spec in ("tune_study_conciseness_gpu.yaml", "tune_study_addition_gpu.yaml"):
        result = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=120,
                                env={**env, "PLACE": place, "SPEC": f"papermill_runs/{spec}",
                                     "LOGS": str(tmp_path / spec)}, cwd=SCRIPT.parents[1])
        assert result.returncode == 0, result.stderr
        said[spec] = [line for line in result.stdout.splitlines() if "tune.parallel" in line]
    assert said == {"tune_study_conciseness_gpu.yaml": [
        "grpo_full: 6 workers, but tune.parallel runs 4 of its trials at once: 2 wait (an engine each) until its"
        " trials are done, then take its reruns"], "tune_study_addition_gpu.yaml": []}


def test_mps_cards_start_one_daemon_check_it_and_send_only_their_workers_through_it(tmp_path):
    """MPS_CARDS starts the MPS control daemon once (not again while it answers), checks each of its
    cards with a CUDA process through it before any worker starts, and points only the workers of those
    cards at its pipe; bad cards, a machine without the daemon and a failing check stop the start."""
    import time

    calls = tmp_path / "calls.txt"
    env = _stand_ins(tmp_path, tmp_path / "study", gpus=2, python=(
        f'echo "python $CUDA_VISIBLE_DEVICES ${{CUDA_MPS_PIPE_DIRECTORY:-none}} $*" >> {calls}\n'
        f'case "$*" in *torch*) [ -f {tmp_path}/cuda_fails ] && exit 1 ;; esac\nexit 0\n'))
    mps = tmp_path / "mps"
    # a stand-in daemon: -d records its start and answers queries from then on
    (tmp_path / "bin" / "nvidia-cuda-mps-control").write_text(
        f'#!/bin/sh\nif [ "$1" = -d ]; then echo "daemon $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> {calls}; '
        f'touch {tmp_path}/answers; exit 0; fi\n[ -f {tmp_path}/answers ]\n')
    (tmp_path / "bin" / "nvidia-cuda-mps-control").chmod(0o755)
    env.update(PLACE="es_full@0 grpo_full@1 es_lora@1", MPS_CARDS="1", MPS_DIR=str(mps))
    (tmp_path / "nobin").mkdir()  # the same stand-ins without the daemon
    for tool in ("nvidia-smi", "python"):
        shutil.copy(tmp_path / "bin" / tool, tmp_path / "nobin" / tool)

    def start(**changes):
        return subprocess.run(["bash", str(SCRIPT), "start"], env={**env, **changes}, capture_output=True,
                              text=True, timeout=120, cwd=SCRIPT.parents[1])

    def workers():
        for _ in range(100):  # the stand-in workers run detached: wait for all three lines
            lines = [line for line in calls.read_text().splitlines() if "--methods" in line and "--dry-run" not in line]
            if len(lines) == 3:
                return sorted(line.split(" -m ")[0] for line in lines)
            time.sleep(0.1)
        raise AssertionError(calls.read_text())

    result = start()
    assert result.returncode == 0, result.stderr
    assert "MPS on cards 1 (daemon: " in result.stdout
    lines = calls.read_text().splitlines()
    pipe = f"{mps}/pipe"
    assert lines.count(f"daemon {pipe} {mps}/log") == 1
    check = [line for line in lines if "torch" in line]
    assert len(check) == 1 and check[0].startswith(f"python 1 {pipe} -c ")
    assert workers() == ["python 0 none", f"python 1 {pipe}", f"python 1 {pipe}"]

    for _ in range(100):  # the stand-in workers end: a second start finds the daemon answering
        if not any(os.path.exists(f"/proc/{pid}") for pid in (tmp_path / "logs" / "workers.pids").read_text().split()):
            break
        time.sleep(0.1)
    calls.write_text("")
    again = start()
    assert again.returncode == 0 and "MPS on cards 1" in again.stdout, again.stdout + again.stderr
    assert not [line for line in calls.read_text().splitlines() if line.startswith("daemon")]
    assert workers() == ["python 0 none", f"python 1 {pipe}", f"python 1 {pipe}"]

    calls.write_text("")
    every = start(MPS_CARDS="all", LOGS=str(tmp_path / "l4"))  # every card of the machine
    assert every.returncode == 0 and "MPS on cards 0,1 (daemon: " in every.stdout, every.stderr
    assert sorted(line.split(" -c ")[0] for line in calls.read_text().splitlines() if "torch" in line) == [
        f"python 0 {pipe}", f"python 1 {pipe}"]
    # every worker through the pipe; waited for, so that none of them writes its line after the next clear
    assert workers() == [f"python 0 {pipe}", f"python 1 {pipe}", f"python 1 {pipe}"]
    for changes, code, message in (
            ({"MPS_CARDS": "2"}, 2, "MPS_CARDS: card 2: this machine has cards 0 to 1"),
            ({"MPS_CARDS": "x"}, 2, "MPS_CARDS: x is not a card number"),
            ({"MPS_CARDS": "0", "PATH": env["PATH"].replace(str(tmp_path / "bin"), str(tmp_path / "nobin"))},
             2, "MPS_CARDS: this machine has no nvidia-cuda-mps-control")):
        bad = start(LOGS=str(tmp_path / "l2"), **changes)
        assert bad.returncode == code and message in bad.stderr and not (tmp_path / "l2").exists()
    (tmp_path / "cuda_fails").touch()
    calls.write_text("")
    bad = start(LOGS=str(tmp_path / "l3"), MPS_CARDS="0 1")
    assert bad.returncode == 1 and "MPS_CARDS: card 0: a CUDA process through MPS failed" in bad.stderr
    assert not (tmp_path / "l3" / "workers.pids").read_text()
    assert not [line for line in calls.read_text().splitlines() if "--methods" in line and "--dry-run" not in line]


def test_a_bundle_fills_each_call_and_unbundles_to_the_same_files(tmp_path):
    """`gpu_stage_study.sh bundle` puts vLLM's staged parts, the wheels' parts and a pack's parts (renamed
    to the archive they join into) in pieces of at most what a call carries beside the tree; `unbundle`
    on the other side gives back every file byte for byte, vLLM's parts where unstage.sh reads them."""
    import random

    script = SCRIPT.parent / "gpu_stage_study.sh"
    repo = tmp_path / "repo"
    (repo / ".gpu_stage" / "study").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("/.gpu_stage/\n")
    (repo / "tree.txt").write_bytes(b"t" * 50_000)  # the working tree a call carries beside a piece
    rng = random.Random(0)
    files = {".gpu_stage/part.00": 300_000, ".gpu_stage/part.01": 120_000, ".gpu_stage/study/part.00": 90_000}
    for name, size in files.items():
        (repo / name).write_bytes(rng.randbytes(size))
    (repo / ".gpu_stage" / "unstage.sh").write_text("echo unstaged\n")
    old = tmp_path / "old_pack"
    old.mkdir()
    for i, size in enumerate((70_000, 30_000)):
        (old / f"tune_study.tar.gz.part-0{i}").write_bytes(rng.randbytes(size))
    wanted = {name: (repo / name).read_bytes() for name in files}
    wanted |= {f".gpu_stage/tune_study_conciseness.tar.gz.part-0{i}": (old / f"tune_study.tar.gz.part-0{i}").read_bytes()
               for i in range(2)}
    env = {**os.environ, "CARRY_BYTES": str(50_000 + 2_000_000 + 150_000), "STAGE_ROOT": str(tmp_path / "root")}
    made = subprocess.run(["bash", str(script), "bundle", "tune_study_conciseness.tar.gz",
                           *sorted(str(p) for p in old.iterdir())], cwd=repo, env=env, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    pieces = sorted((repo / ".gpu_stage" / "bundle").iterdir())
    assert len(pieces) >= 4 and all(p.stat().st_size <= 150_000 for p in pieces)  # 610 kB of files in 150 kB pieces
    assert "6 files in" in made.stdout

    # the GPU machine's side: the pieces arrive one a call, in a copy of the tree without .gpu_stage
    there = tmp_path / "there"
    there.mkdir()
    (tmp_path / "root" / "bundle").mkdir(parents=True)
    for p in pieces:
        shutil.copy(p, tmp_path / "root" / "bundle" / p.name)
    back = subprocess.run(["bash", str(script), "unbundle"], cwd=there, env=env, capture_output=True, text=True)
    assert back.returncode == 0, back.stderr
    for name, data in wanted.items():
        where = tmp_path / "root" / "stage" / Path(name).name if Path(name).name.startswith("part.") and "study" not in name \
            else there / name
        assert where.read_bytes() == data, name
    assert (tmp_path / "root" / "unstage.sh").exists() and not (tmp_path / "root" / "bundle").exists()

    # a later call's copy of the tree has no .gpu_stage/: `unbundle` again copies the wheels and packs back,
    # but a part that call carried (a newer one) is kept
    shutil.rmtree(there / ".gpu_stage")
    carried = there / ".gpu_stage" / "tune_study_conciseness.tar.gz.part-01"
    carried.parent.mkdir()
    carried.write_bytes(b"newer")
    again = subprocess.run(["bash", str(script), "unbundle"], cwd=there, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    for name, data in wanted.items():
        if ("study" in name or ".part-" in name) and not name.endswith("part-01"):
            assert (there / name).read_bytes() == data, name
    assert carried.read_bytes() == b"newer"
    shutil.rmtree(tmp_path / "root" / "unbundled")
    nothing = subprocess.run(["bash", str(script), "unbundle"], cwd=there, env=env, capture_output=True, text=True)
    assert nothing.returncode == 1 and "nothing to unbundle" in nothing.stderr

    no_room = subprocess.run(["bash", str(script), "bundle"], cwd=repo, env={**env, "CARRY_BYTES": "100000"},
                             capture_output=True, text=True)
    assert no_room.returncode == 1 and "leaves no room for a piece" in no_room.stderr

    # a study's first lease: no pack and no compile caches to carry, only vLLM's parts and the wheels
    for part in (repo / ".gpu_stage").glob("*.part-*"):
        part.unlink()
    first = subprocess.run(["bash", str(script), "bundle"], cwd=repo, env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert "4 files in" in first.stdout


def test_ready_sets_a_machine_up_once_and_gives_a_later_calls_tree_its_files_back(tmp_path):
    """`gpu_stage_study.sh ready` on the GPU machine's side: the pieces unbundled, vLLM's wheels unstaged
    and the study's wheels installed into SITE the first time; in a later call, whose copy of the tree
    has no .gpu_stage/ and whose pieces are gone, the wheels' and packs' parts come back and nothing
    is installed again."""
    import io
    import tarfile
    import zipfile

    script = SCRIPT.parent / "gpu_stage_study.sh"
    repo, root, site = tmp_path / "repo", tmp_path / "root", tmp_path / "site"
    (repo / ".gpu_stage" / "study").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("/.gpu_stage/\n")
    (repo / ".gpu_stage" / "part.00").write_bytes(b"vllm" * 1000)
    (repo / ".gpu_stage" / "unstage.sh").write_text('mkdir -p "$SITE/vllm" && echo "staged: vLLM"\n')
    wheel = io.BytesIO()
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("optuna/__init__.py", "VERSION = 'test'\n")
    wheels = io.BytesIO()
    with tarfile.open(fileobj=wheels, mode="w") as tar:
        info = tarfile.TarInfo("optuna-0-py3-none-any.whl")
        info.size = len(wheel.getvalue())
        tar.addfile(info, io.BytesIO(wheel.getvalue()))
    (repo / ".gpu_stage" / "study" / "part.00").write_bytes(wheels.getvalue())
    (repo / ".gpu_stage" / "tune_study_conciseness.tar.gz.part-00").write_bytes(b"pack")
    env = {**os.environ, "CARRY_BYTES": str(4_000_000), "STAGE_ROOT": str(root), "SITE": str(site)}
    made = subprocess.run(["bash", str(script), "bundle"], cwd=repo, env=env, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr

    there = tmp_path / "there"
    there.mkdir()
    (root / "bundle").mkdir(parents=True)
    for piece in (repo / ".gpu_stage" / "bundle").iterdir():
        shutil.copy(piece, root / "bundle" / piece.name)
    first = subprocess.run(["bash", str(script), "ready"], cwd=there, env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert "staged: vLLM" in first.stdout and "installed 1 wheels" in first.stdout
    assert (site / "vllm").is_dir() and (site / "optuna" / "__init__.py").read_text() == "VERSION = 'test'\n"

    shutil.rmtree(there / ".gpu_stage")
    (site / "optuna" / "__init__.py").write_text("kept\n")  # installed again would overwrite it
    later = subprocess.run(["bash", str(script), "ready"], cwd=there, env=env, capture_output=True, text=True)
    assert later.returncode == 0, later.stderr
    assert "vLLM already in" in later.stdout and "the study's wheels already in" in later.stdout
    assert (site / "optuna" / "__init__.py").read_text() == "kept\n"
    assert (there / ".gpu_stage" / "tune_study_conciseness.tar.gz.part-00").read_bytes() == b"pack"
    assert (there / ".gpu_stage" / "study" / "part.00").read_bytes() == wheels.getvalue()


def test_a_study_whose_pack_is_lost_is_restored_from_its_committed_files_and_packed_for_the_bundle(tmp_path):
    """`gpu_stage_study.sh restore` on the conciseness study's committed compacted files: its pack again,
    in parts under .gpu_stage/ named for the bundle, the study's name its top folder (what `start`
    unpacks beside STUDY), with the full ES runs under way and their checkpoints."""
    script = SCRIPT.parent / "gpu_stage_study.sh"
    repo = tmp_path / "repo"
    repo.mkdir()
    root = SCRIPT.parents[1]
    env = {**os.environ, "STUDY": "runs/tune_study_conciseness", "PYTHON": sys.executable}
    made = subprocess.run(["bash", str(script), "restore", str(root / "papermill_runs" / "tune_study_conciseness_gpu.yaml"),
                           str(root / "figures" / "study" / "summaries" / "tune_study_conciseness"), "tune_study_conciseness.tar.gz"],
                          cwd=repo, env=env, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    parts = sorted((repo / ".gpu_stage").glob("tune_study_conciseness.tar.gz.part-*"))
    assert parts and parts[0].name == "tune_study_conciseness.tar.gz.part-00"
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
        names = tar.getnames()
    assert "tune_study_conciseness/optuna.db" in names
    # every run the compacted files carry under way goes on from its checkpoint, its seed log beside it
    from evolm_lib.tune.compact import load_compact

    under_way = [run for run in load_compact(root / "figures" / "study" / "summaries" / "tune_study_conciseness")["runs"]
                 if run.get("resume")]
    for run in under_way:
        folder = f"tune_study_conciseness/{run['path']}"
        assert f"{folder}/checkpoints/{run['resume']['checkpoint']}/state.json" in names, folder
        assert all(f"{folder}/{name}" in names for name in run["resume"]["text"]), folder
    assert ("runs under way go on from their checkpoints" in made.stdout) == bool(under_way)


def _reply(folder: Path, compact: Path, study: str, parts: int) -> Path:
    """A lease's last reply as the device tool leaves it: compact.tar.gz (COMPACT's files under compact/),
    a pack of STUDY's files split into PARTS parts, and the status."""
    folder.mkdir(parents=True)
    with tarfile.open(folder / "compact.tar.gz", "w:gz") as tar:
        tar.add(compact, arcname="compact")
    payload = io.BytesIO()
    with tarfile.open(fileobj=payload, mode="w:gz") as tar:
        for name, data in ((f"{study}/optuna.db", b"storage"),
                           (f"{study}/trials/grpo_lora/trial_0012/seed100/checkpoints/000900/adapter.safetensors", os.urandom(4096))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    data = payload.getvalue()
    size = -(-len(data) // parts)
    for i in range(parts):
        (folder / f"tune_study.tar.gz.part-{i:02d}").write_bytes(data[i * size:(i + 1) * size])
    (folder / "tune_study_status.txt").write_text("5 workers alive\n")
    return folder


def test_a_kept_lease_reply_is_restored_from_where_it_is_the_committed_state_and_a_damaged_one_never(tmp_path):
    """`gpu_stage_study.sh keep` stores a lease's reply under .gpu_stage/packs/NAME/ and never over one
    kept before; a pack whose parts do not join is kept all the same, named DAMAGED. `restore` then takes
    the kept pack whose compact.tar.gz is the committed files, byte for byte, its parts as they came
    back (so a LoRA GRPO run's checkpoint goes on), passing over a newer damaged one; with the committed
    files changed, no kept pack is taken."""
    script = SCRIPT.parent / "gpu_stage_study.sh"
    repo, compact = tmp_path / "repo", tmp_path / "committed"
    repo.mkdir()
    compact.mkdir()
    (compact / "manifest.json").write_text('{"trials": 57}')
    (compact / "runs.jsonl.gz").write_bytes(os.urandom(256))
    study = "tune_study_conciseness"
    whole = _reply(tmp_path / "device" / "15", compact, study, parts=3)
    env = {**os.environ, "STUDY": f"runs/{study}", "PYTHON": sys.executable}

    def run(*args):
        return subprocess.run(["bash", str(script), *args], cwd=repo, env=env, capture_output=True, text=True)

    kept = run("keep", "lease8", str(whole))
    assert kept.returncode == 0, kept.stderr
    assert sorted(p.name for p in (repo / ".gpu_stage" / "packs" / "lease8").iterdir()) == [
        "compact.tar.gz", "tune_study.tar.gz.part-00", "tune_study.tar.gz.part-01", "tune_study.tar.gz.part-02",
        "tune_study_status.txt"]
    again = run("keep", "lease8", str(whole))
    assert again.returncode == 1 and "never overwritten" in again.stderr
    assert run("keep", "lease 8", str(whole)).returncode == 2

    # a reply whose second part never came back, kept later than the whole one
    time.sleep(1.1)
    cut = _reply(tmp_path / "device" / "16", compact, study, parts=3)
    (cut / "tune_study.tar.gz.part-01").unlink()
    damaged = run("keep", "lease8b", str(cut))
    assert damaged.returncode == 1 and "DAMAGED" in damaged.stderr
    assert "part 01 of 2 missing" in (repo / ".gpu_stage" / "packs" / "lease8b" / "DAMAGED").read_text()
    assert (repo / ".gpu_stage" / "packs" / "lease8b" / "tune_study.tar.gz.part-02").exists()  # kept, not dropped

    restored = run("restore", "unused.yaml", str(compact), f"{study}.tar.gz")
    assert restored.returncode == 0, restored.stderr
    assert "lease8" in restored.stdout and "going on from its checkpoints" in restored.stdout
    parts = sorted((repo / ".gpu_stage").glob(f"{study}.tar.gz.part-*"))
    assert [p.read_bytes() for p in parts] == [(whole / f"tune_study.tar.gz.part-{i:02d}").read_bytes() for i in range(3)]

    # the committed files moved on (a later lease's compact committed): the kept pack is stale; the
    # compacted files are then restored as ever (here a spec that does not exist says so)
    (compact / "manifest.json").write_text('{"trials": 60}')
    stale = run("restore", str(tmp_path / "missing.yaml"), str(compact), f"{study}.tar.gz")
    assert stale.returncode != 0
    assert "do not hold" in stale.stdout and stale.stdout.split(":")[-1].split() == ["lease8b", "(DAMAGED)", "lease8"]
    assert not list((repo / ".gpu_stage").glob(f"{study}.tar.gz.part-*"))  # nothing stale left for the bundle


def test_the_speed_script_refuses_an_unknown_part_before_any_work_and_knows_each_part_it_runs(tmp_path):
    """`gpu_speed.sh` spends device time: a mistyped part is refused at once, before the model's
    conversion or any engine, and the parts it accepts are the parts its case runs and its header
    documents."""
    import re

    script = SCRIPT.parent / "gpu_speed.sh"
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0  # the whole script parses
    refused = subprocess.run(["bash", str(script), "mps2", str(tmp_path / "out")], cwd=tmp_path,
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode == 2 and "unknown part mps2: one of cards ray" in refused.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()  # nothing made before the check
    accepted = set(re.search(r'^PARTS="([^"]+)"', text, re.M).group(1).split())
    run = text[text.index('case "$PART" in\ncards)'):]
    assert set(re.findall(r"^([a-z0-9]+)\)(?:\s|$)", run, re.M)) == accepted
    assert set(re.findall(r"^#   bash scripts/gpu_speed.sh (\w+) OUT", text, re.M)) == accepted
