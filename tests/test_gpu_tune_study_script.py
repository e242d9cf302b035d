"""``scripts/gpu_tune_study.sh``'s refill, run by bash on stand-in workers: a worker that ended cleanly
gives its card to a method still at work, the one with the fewest workers alive; a worker that died,
or one of a method whose work is all claimed, is not replaced."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_tune_study.sh"


def _functions() -> str:
    """The script's own functions that refill uses (the rest of it starts real workers)."""
    text, taken, keep = SCRIPT.read_text().splitlines(), [], False
    for line in text:
        keep = keep or line.startswith(("alive() {", "launch() {", "ended_cleanly() {", "refill() {"))
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
