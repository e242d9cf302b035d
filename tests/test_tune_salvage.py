"""tune.pack's order and tune.salvage: a pack cut short (a machine taken back before its later parts
were fetched) still hands its first runs on, whole, to the study restored at the next lease."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _study(root: Path, runs: dict[str, tuple[int | None, bool]], values: int = 40_000, settings: str = "lr: 0.001") -> Path:
    """A study folder (an empty storage) with GRPO run folders: path -> (checkpoint step or None,
    finished). Each checkpoint holds random float32 values (they do not compress), so each run takes
    about 4 x ``values`` bytes of a pack."""
    import optuna
    import torch

    from evolm_lib.runs.checkpoints import write_checkpoint

    out = root / "study"
    out.mkdir(parents=True)
    optuna.create_study(storage=f"sqlite:///{out / 'optuna.db'}", study_name="grpo_lora")
    for index, (path, (step, finished)) in enumerate(sorted(runs.items())):
        folder = out / path
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(f"kind: grpo\n{settings}\n")
        last = step or 0
        (folder / "metrics.jsonl").write_text("".join(json.dumps({"generation": g}) + "\n" for g in range(1, last + 1)))
        if finished:
            (folder / "heldout.jsonl").write_text(json.dumps({"index": 0, "generation": last, "reward": -1.0}) + "\n")
        if step is not None:
            generator = torch.Generator().manual_seed(index)
            write_checkpoint(folder, step, None, {"m": torch.rand(values, generator=generator)}, {}, "tiny-random", rows=[])
    return out


def _kept(archive: Path, folder: Path, cut: int | None = None, part: int = 60_000) -> Path:
    """A kept reply: the archive's parts (of ``part`` bytes) up to byte ``cut`` (all: None)."""
    data = archive.read_bytes()[:cut]
    folder.mkdir(parents=True)
    for number, start in enumerate(range(0, len(data), part)):
        (folder / f"tune_study.tar.gz.part-{number:02d}").write_bytes(data[start:start + part])
    return folder


def test_a_pack_begins_with_its_index_then_the_runs_under_way_furthest_first_each_whole(tmp_path):
    """The index, then each unfinished run with its checkpoint (the furthest first), its checkpoint
    and then its rows, then the storage and the finished runs; the index names every file of each
    run of final/, long/ and control/ in the order they follow."""
    from evolm_lib.tune.pack import PACK_INDEX, pack_study

    out = _study(tmp_path, {"final/grpo_lora/seed0": (8, True), "final/grpo_lora/seed1": (4, False),
                            "final/grpo_lora/seed2": (8, True), "long/grpo_lora/seed0": (12, False)}, values=100)
    report = pack_study(out, tmp_path / "pack.tar.gz", checkpoint_bytes=10**7)
    assert report["resumed"] == ["final/grpo_lora/seed1 at 4", "long/grpo_lora/seed0 at 12"]
    assert report["continued"] == ["final/grpo_lora/seed2 at 8"]
    with tarfile.open(tmp_path / "pack.tar.gz") as tar:
        names = [name.removeprefix("study/") for name in tar.getnames()]
        index = json.loads(tar.extractfile(f"study/{PACK_INDEX}").read())
    runs = [name.rsplit("/", 1)[0] if "checkpoints" not in name else name.split("/checkpoints/")[0] for name in names]
    order = [run for i, run in enumerate(runs) if run.count("/") == 2 and (i == 0 or runs[i - 1] != run)]
    assert names[0] == PACK_INDEX and names.index("optuna.db") == 1 + len(index["runs"]["long/grpo_lora/seed0"]) \
        + len(index["runs"]["final/grpo_lora/seed1"])
    # each run in one stretch, the finished reruns after the storage
    assert order == ["long/grpo_lora/seed0", "final/grpo_lora/seed1", "final/grpo_lora/seed0", "final/grpo_lora/seed2"]
    assert index["runs"]["final/grpo_lora/seed2"][0].startswith("final/grpo_lora/seed2/checkpoints/000008/")
    for run, files in index["runs"].items():
        assert [name for name in names if name.startswith(run + "/")] == files
    assert index["runs"]["long/grpo_lora/seed0"][-1] == "long/grpo_lora/seed0/metrics.jsonl"
    assert index["runs"]["long/grpo_lora/seed0"][0].startswith("long/grpo_lora/seed0/checkpoints/000012/")


def test_a_pack_cut_short_hands_on_the_runs_it_holds_whole_and_nothing_torn(tmp_path):
    """Lease 16 (2026-12-03) lost six LoRA GRPO runs two minutes from their end: the machine went back
    between two calls. Here a pack of two runs under way, cut after the furthest one: restore lays
    that one (absent from the study it restores) over the study, checkpoint and rows as packed, and
    leaves the one cut through as the study had it, as well as a pack of another study."""
    from evolm_lib.runs import list_checkpoints
    from evolm_lib.tune.pack import pack_study
    from evolm_lib.tune.salvage import read_pack, salvage, whole_runs

    lease = _study(tmp_path / "lease", {"final/grpo_lora/seed0": (8, True), "final/grpo_lora/seed4": (15, False),
                                        "long/grpo_lora/seed0": (33, False)})
    archive = tmp_path / "pack.tar.gz"
    pack_study(lease, archive, checkpoint_bytes=10**7)
    size = archive.stat().st_size
    assert 300_000 < size < 600_000  # three checkpoints of about 160 kB
    kept = _kept(archive, tmp_path / "kept" / "restart_lease16", cut=size // 2)  # the first run and a bit
    read = read_pack(sorted(kept.iterdir()))
    assert read.study == "study" and not read.whole and "final/grpo_lora/seed4" in read.runs  # begun, not whole
    assert list(whole_runs(read)) == ["long/grpo_lora/seed0"]

    # the study as the lease began: seed 0's rerun finished (its checkpoint kept), seed 4 early on
    start = _study(tmp_path / "start", {"final/grpo_lora/seed0": (8, True), "final/grpo_lora/seed4": (3, False)})
    lines = []
    assert salvage(start, kept, log=lines.append) == ["long/grpo_lora/seed0"]
    assert lines == ["restart_lease16: long/grpo_lora/seed0 taken (under way, checkpoint 33)",
                     f"restart_lease16: {len(list(kept.iterdir()))} parts, cut short; runs whole: 1, taken: 1"]
    taken = start / "long" / "grpo_lora" / "seed0"
    assert (taken / "metrics.jsonl").read_bytes() == (lease / "long" / "grpo_lora" / "seed0" / "metrics.jsonl").read_bytes()
    assert [p.name for p in list_checkpoints(taken)] == ["000033"]
    assert [p.name for p in list_checkpoints(start / "final" / "grpo_lora" / "seed4")] == ["000003"]
    assert not list(start.glob(".salvaging-*")) and not list(start.rglob(".*.replaced"))

    # a part missing in the middle: nothing after the gap is read, so the run that spans it is not whole
    (kept / "tune_study.tar.gz.part-01").rename(tmp_path / "part-01")
    again = _study(tmp_path / "again", {"final/grpo_lora/seed4": (3, False)})
    lines = []
    assert salvage(again, kept, log=lines.append) == []
    assert lines[0] == f"{kept}: part 01 missing: read up to it"
    assert lines[-1] == "restart_lease16: 1 parts, cut short; runs whole: 0, taken: 0"
    (tmp_path / "part-01").rename(kept / "tune_study.tar.gz.part-01")

    other = tmp_path / "other"
    other.mkdir()
    (other / "elsewhere").mkdir()
    lines = []
    assert salvage(other / "elsewhere", kept, log=lines.append) == []
    assert lines == [f"{kept}: a pack of the study 'study', not 'elsewhere': nothing taken"]


def test_salvage_takes_a_run_only_where_it_is_further_on_with_the_same_settings(tmp_path):
    """A whole pack over a study: an unfinished run with a newer checkpoint is taken, one with an
    older is not; a finished run is taken over an unfinished one, and over a finished one only where
    it brings the checkpoint the study's lacks (a study restored from its compacted files); a run
    with other settings is never taken. On the command line, the kept folders apply in turn."""
    from evolm_lib.runs import list_checkpoints
    from evolm_lib.tune.pack import pack_study
    from evolm_lib.tune.salvage import salvage

    pack = {"final/grpo_lora/seed0": (8, True), "final/grpo_lora/seed1": (8, True), "final/grpo_lora/seed2": (6, False),
            "final/grpo_lora/seed3": (6, False), "long/grpo_lora/seed0": (10, False)}
    lease = _study(tmp_path / "lease", pack, values=1000)
    archive = tmp_path / "pack.tar.gz"
    pack_study(lease, archive, checkpoint_bytes=10**7)
    kept = _kept(archive, tmp_path / "kept" / "restart_lease15")

    here = _study(tmp_path / "here", {"final/grpo_lora/seed0": (None, True),   # compacted: no checkpoint
                                      "final/grpo_lora/seed1": (8, True),       # has its own
                                      "final/grpo_lora/seed2": (7, False),      # further than the pack's 6
                                      "final/grpo_lora/seed3": (2, False),
                                      "long/grpo_lora/seed0": (4, False)}, values=1000)
    (here / "final" / "grpo_lora" / "seed1" / "metrics.jsonl").write_text("mine\n")
    (here / "long" / "grpo_lora" / "seed0" / "config.yaml").write_text("kind: grpo\nlr: 0.01\n")  # other settings
    result = subprocess.run([sys.executable, "-m", "evolm_lib.tune.salvage", str(here), str(kept), str(tmp_path / "none")],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "restart_lease15: final/grpo_lora/seed0 taken (finished, checkpoint 8)",
        "restart_lease15: final/grpo_lora/seed1 left: finished here already",
        "restart_lease15: final/grpo_lora/seed2 left: its checkpoint (6) is not newer than the study's (7)",
        "restart_lease15: final/grpo_lora/seed3 taken (under way, checkpoint 6)",
        "restart_lease15: long/grpo_lora/seed0 left: its settings differ from the study's run",
        "restart_lease15: 1 parts, whole; runs whole: 5, taken: 2",
        f"{tmp_path / 'none'}: no tune_study.tar.gz.part-*",
        "salvaged 2 runs into " + str(here)]
    assert [p.name for p in list_checkpoints(here / "final" / "grpo_lora" / "seed0")] == ["000008"]
    assert (here / "final" / "grpo_lora" / "seed1" / "metrics.jsonl").read_text() == "mine\n"

    # a checkpoint that does not match its manifest (bytes changed in the pack itself) is never taken
    torn = tmp_path / "torn.tar.gz"
    with tarfile.open(archive) as source, tarfile.open(torn, "w:gz") as target:
        for member in source:
            data = source.extractfile(member).read() if member.isfile() else None
            if member.name.startswith("study/final/grpo_lora/seed3/checkpoints/") and member.name.endswith("optimizer.safetensors"):
                data = bytes(len(data))  # the size its manifest says, other bytes
            target.addfile(member, io.BytesIO(data) if data is not None else None)
    here = _study(tmp_path / "here2", {"final/grpo_lora/seed3": (2, False)}, values=1000)
    lines = []
    salvage(here, _kept(torn, tmp_path / "kept" / "torn"), log=lines.append)
    assert "torn: final/grpo_lora/seed3 left: its checkpoint does not match its manifest" in lines
    assert [p.name for p in list_checkpoints(here / "final" / "grpo_lora" / "seed3")] == ["000002"]


def test_a_pack_cut_short_without_an_index_hands_nothing_on(tmp_path):
    """A pack from before the index (lease 15's and earlier) tells no run whole unless it reads to
    its end: cut short, nothing is taken, and the log says why."""
    from evolm_lib.tune.salvage import salvage

    lease = _study(tmp_path / "lease", {"long/grpo_lora/seed0": (33, False), "final/grpo_lora/seed4": (15, False)})
    archive = tmp_path / "old.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(lease, arcname="study")
    kept = _kept(archive, tmp_path / "kept" / "old", cut=archive.stat().st_size * 3 // 4)
    start = _study(tmp_path / "start", {"final/grpo_lora/seed4": (3, False)})
    lines = []
    assert salvage(start, kept, log=lines.append) == []
    assert lines[0] == f"{kept}: {len(list(kept.iterdir()))} parts, cut short, and packed without an index: nothing can be told whole"
    whole = _kept(archive, tmp_path / "kept" / "old_whole")
    assert salvage(start, whole, log=lambda line: None) == ["final/grpo_lora/seed4", "long/grpo_lora/seed0"]


def test_restore_lays_a_cut_short_reply_s_whole_runs_over_the_kept_pack_of_the_committed_state(tmp_path):
    """`gpu_stage_study.sh restore`: the pack kept from the committed state (lease 15's) is the base,
    and a later lease's reply kept DAMAGED (its machine went back before the rest came) hands on the
    run under way it holds whole; the study is packed again for the bundle, that run at its newer
    checkpoint, the cut one as the base had it."""
    import os

    from evolm_lib.tune.pack import pack_study

    script = REPO / "scripts" / "gpu_stage_study.sh"
    repo, compact = tmp_path / "repo", tmp_path / "committed"
    repo.mkdir()
    compact.mkdir()
    (compact / "manifest.json").write_text('{"trials": 80}')
    env = {**os.environ, "STUDY": "runs/study", "PYTHON": sys.executable}

    def run(*args):
        return subprocess.run(["bash", str(script), *args], cwd=repo, env=env, capture_output=True, text=True)

    def reply(name: str, study: Path, cut: int | None = None) -> Path:
        archive = tmp_path / f"{name}.tar.gz"
        pack_study(study, archive, checkpoint_bytes=10**7)
        folder = _kept(archive, tmp_path / "device" / name, cut=None if cut is None else archive.stat().st_size * cut // 100)
        with tarfile.open(folder / "compact.tar.gz", "w:gz") as tar:
            tar.add(compact, arcname="compact")
        return folder

    lease15 = _study(tmp_path / "lease15", {"final/grpo_lora/seed0": (8, True), "final/grpo_lora/seed4": (3, False)})
    assert run("keep", "restart_lease15", str(reply("15", lease15))).returncode == 0
    lease16 = _study(tmp_path / "lease16", {"final/grpo_lora/seed0": (8, True), "final/grpo_lora/seed4": (15, False),
                                            "long/grpo_lora/seed0": (33, False)})
    damaged = run("keep", "restart_lease16", str(reply("16", lease16, cut=50)))
    assert damaged.returncode == 1 and "DAMAGED" in damaged.stderr

    restored = run("restore", "unused.yaml", str(compact), "study.tar.gz")
    assert restored.returncode == 0, restored.stderr
    assert "restart_lease15 holds" in restored.stdout
    assert "restart_lease16: long/grpo_lora/seed0 taken (under way, checkpoint 33)" in restored.stdout
    assert "with the runs salvaged above" in restored.stdout
    parts = sorted((repo / ".gpu_stage").glob("study.tar.gz.part-*"))
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts))) as tar:
        names = tar.getnames()
    assert any(name.startswith("study/long/grpo_lora/seed0/checkpoints/000033/") for name in names)
    assert any(name.startswith("study/final/grpo_lora/seed4/checkpoints/000003/") for name in names)
    assert not any("000015" in name for name in names)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
