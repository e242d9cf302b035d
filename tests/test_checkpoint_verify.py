"""Verified checkpoints (issue 24): a manifest with the size and SHA-256 of every file, written last; a
damaged latest checkpoint is set aside and the run resumes from the previous one to the same end as an
uninterrupted run; with none intact the error names the folder; leftovers of a write are removed."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from evolm_lib.config import ESConfig, GRPOConfig
from evolm_lib.engines.synthetic import SyntheticEngine
from evolm_lib.runs import (
    MANIFEST,
    CheckpointDamaged,
    CheckpointFallback,
    list_checkpoints,
    load_run_config,
    read_metrics,
    verify_checkpoint,
)
from evolm_lib.train.es import ESRun
from evolm_lib.train.grpo import GRPORun
from evolm_lib.metrics import without_times

OLD_LAYOUT = Path(__file__).with_name("data") / "old_layout"
ADAPTER = "adapter/adapter_model.safetensors"


def es_config(**changes) -> ESConfig:
    """A synthetic ES run with momentum (optimizer tensors in every checkpoint), a checkpoint per generation."""
    return ESConfig(**{**dict(model="tiny-random", target_modules=("q_proj", "v_proj"), sigma=0.02,
                              learning_rate=0.05, optimizer="sgd", momentum=0.5, population_size=4,
                              num_generations=6, seed=5), **changes})


def grpo_config() -> GRPOConfig:
    return GRPOConfig.from_dict(dict(model="tiny-random", target_modules=["q_proj", "v_proj"], lora_rank=2,
                                     lora_alpha=2.0, max_new_tokens=4, loss_type="no_baseline",
                                     normalize_by_std=False, group_size=2, learning_rate=1e-2, num_steps=5))


def stopped_run(cls, config, run_dir: Path, generations: int):
    run = cls.create(config, run_dir, engine=SyntheticEngine())
    run.run(generations)
    run.close()
    return run


def damage(path: Path, how: str) -> None:
    """Truncate a file to half, flip one byte of its tensor data (past the header), or delete it."""
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "corrupt":
        position = len(data) - 7  # in the last tensor's bytes: the file still loads, with a wrong value
        path.write_bytes(data[:position] + bytes([data[position] ^ 0x01]) + data[position + 1:])
    else:
        path.unlink()


def test_a_checkpoint_records_size_and_sha256_of_every_file(tmp_path):
    stopped_run(ESRun, es_config(), tmp_path / "run", 1)
    checkpoint = list_checkpoints(tmp_path / "run")[-1]
    manifest = json.loads((checkpoint / MANIFEST).read_text())["files"]
    files = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file() and p.name != MANIFEST)
    assert sorted(manifest) == files == ["adapter/adapter_config.json", ADAPTER, "optimizer.safetensors", "state.json"]
    for name, entry in manifest.items():
        data = (checkpoint / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify_checkpoint(checkpoint) is None


@pytest.mark.parametrize("how, name, problem", [
    ("truncate", ADAPTER, rf"{ADAPTER} has \d+ bytes, its manifest says \d+"),
    ("corrupt", "optimizer.safetensors", "optimizer.safetensors differs from its manifest's SHA-256"),
    ("delete", ADAPTER, f"{ADAPTER} is missing"),
    ("delete", "state.json", "state.json is missing"),
    ("delete", MANIFEST, f"{MANIFEST} is missing"),
])
def test_a_damaged_latest_checkpoint_falls_back_and_ends_like_an_uninterrupted_run(tmp_path, how, name, problem):
    config = es_config()
    reference = stopped_run(ESRun, config, tmp_path / "reference", config.num_generations)
    run_dir = tmp_path / "run"
    stopped_run(ESRun, config, run_dir, 4)
    rows_before = read_metrics(run_dir)
    damaged_file = run_dir / "checkpoints" / "000004" / name
    damage(damaged_file, how)
    left = damaged_file.read_bytes() if damaged_file.exists() else None

    with pytest.warns(CheckpointFallback) as caught:
        resumed = ESRun.open(config, run_dir, engine=SyntheticEngine())
    message = str(caught[0].message)
    for part in (str(run_dir), "000004", "000004.damaged", "resuming from checkpoint 000003 (generation 3)",
                 "metrics.after-000003.jsonl"):
        assert part in message, message
    assert re.search(problem, message), message
    assert resumed.generation == 3
    # the damaged checkpoint is kept aside as it was; the row past the fallback moves to a side file
    aside = run_dir / "checkpoints" / "000004.damaged"
    assert (aside / name).read_bytes() == left if left is not None else not (aside / name).exists()
    assert [r["generation"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]
    assert [json.loads(line) for line in (run_dir / "metrics.after-000003.jsonl").read_text().splitlines()] == \
        rows_before[4:]

    resumed.run()
    resumed.close()
    assert without_times(read_metrics(run_dir)) == without_times(read_metrics(tmp_path / "reference"))
    for key, value in reference.mean.tensors.items():
        assert torch.equal(value, resumed.mean.tensors[key]), key
    assert [p.name for p in list_checkpoints(run_dir)] == ["000005", "000006"]
    assert aside.is_dir()  # pruning leaves a damaged checkpoint alone


def test_a_damaged_grpo_checkpoint_falls_back_too(tmp_path):
    config = grpo_config()
    reference = stopped_run(GRPORun, config, tmp_path / "reference", config.num_steps)
    run_dir = tmp_path / "run"
    stopped_run(GRPORun, config, run_dir, 3)
    damage(run_dir / "checkpoints" / "000003" / "optimizer.safetensors", "corrupt")
    with pytest.warns(CheckpointFallback, match="resuming from checkpoint 000002"):
        resumed = GRPORun.open(config, run_dir, engine=SyntheticEngine())
    assert resumed.generation == 2
    resumed.run()
    resumed.close()
    assert without_times(read_metrics(run_dir)) == without_times(read_metrics(tmp_path / "reference"))
    for key, value in reference.policy.tensors.items():
        assert torch.equal(value, resumed.policy.tensors[key]), key


def test_a_damaged_checkpoint_written_before_manifests_is_found_by_loading(tmp_path):
    run_dir = tmp_path / "old"
    shutil.copytree(OLD_LAYOUT / "es", run_dir)  # checkpoints 0 and 2, no manifests
    damage(run_dir / "checkpoints" / "000002" / ADAPTER, "truncate")
    settings = load_run_config(run_dir)
    with pytest.warns(CheckpointFallback, match=r"000002: it does not load \(SafetensorError.*resuming from "
                                                r"checkpoint 000000 \(generation 0\)"):
        resumed = ESRun.open(settings, run_dir, engine=SyntheticEngine())
    assert resumed.generation == 0
    resumed.close()


def test_with_every_checkpoint_damaged_the_error_names_the_folder_and_moves_nothing(tmp_path):
    run_dir = tmp_path / "run"
    stopped_run(ESRun, es_config(), run_dir, 4)
    damage(run_dir / "checkpoints" / "000004" / ADAPTER, "truncate")
    damage(run_dir / "checkpoints" / "000003" / "state.json", "delete")
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    with pytest.raises(CheckpointDamaged) as caught:
        ESRun.open(es_config(), run_dir, engine=SyntheticEngine())
    message = str(caught.value)
    for part in (str(run_dir), "no intact checkpoint", f"000004: {ADAPTER} has", "000003: state.json is missing"):
        assert part in message, message
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    assert [r["generation"] for r in read_metrics(run_dir)] == [0, 1, 2, 3, 4]


def test_leftovers_of_an_interrupted_write_are_gone_after_the_next_open(tmp_path):
    run_dir = tmp_path / "run"
    stopped_run(ESRun, es_config(), run_dir, 2)
    leftover = run_dir / "checkpoints" / ".000003-mn0n58on"  # as a write stopped by a full disk leaves it
    (leftover / "adapter").mkdir(parents=True)
    (leftover / "adapter" / "adapter_model.safetensors").write_bytes(b"\0" * 100)
    (run_dir / ".metrics.jsonl.tmp").write_text('{"generation": 0')
    resumed = ESRun.open(es_config(), run_dir, engine=SyntheticEngine())
    assert resumed.generation == 2
    assert not leftover.exists() and not (run_dir / ".metrics.jsonl.tmp").exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["000001", "000002"]
    resumed.close()
