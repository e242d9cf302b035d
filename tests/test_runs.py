"""Run folders: a kill between the steps of a checkpoint rewrite still leaves a loadable checkpoint;
folders written by earlier code still open."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from evolm_lib.config import ESConfig, GRPOConfig
from evolm_lib.engines.synthetic import SyntheticEngine
from evolm_lib.lora import AdapterWeights, LoraSpec
from evolm_lib.runs import list_checkpoints, load_checkpoint, read_metrics, write_checkpoint
from evolm_lib.train.es import ESRun
from evolm_lib.train.grpo import GRPORun
from helpers_data import data_script

SPEC = LoraSpec(("q_proj",), 1, 1.0, None)
NAME = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def adapter(value: float) -> AdapterWeights:
    return AdapterWeights(SPEC, {NAME: torch.full((1, 4), value)})


# A child writes checkpoint 3 twice; on the second write it dies (SIGKILL) at the given os.rename call.
CHILD = textwrap.dedent("""
    import os, signal, sys, torch
    from evolm_lib.lora import AdapterWeights, LoraSpec
    from evolm_lib.runs import write_checkpoint
    run_dir, kill_at = sys.argv[1], int(sys.argv[2])
    spec = LoraSpec(("q_proj",), 1, 1.0, None)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    write_checkpoint(run_dir, 3, AdapterWeights(spec, {name: torch.full((1, 4), 1.0)}), {}, {"generation": 3, "v": 1}, "m")
    real, calls = os.rename, []
    def rename(src, dst):
        calls.append((src, dst))
        if len(calls) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        real(src, dst)
    os.rename = rename
    write_checkpoint(run_dir, 3, AdapterWeights(spec, {name: torch.full((1, 4), 2.0)}), {}, {"generation": 3, "v": 2}, "m")
""")


@pytest.mark.parametrize("kill_at, expected", [(1, 1.0), (2, 1.0)], ids=["before-rename-aside", "between-aside-and-in"])
def test_kill_during_checkpoint_rewrite_leaves_a_loadable_checkpoint(tmp_path, kill_at, expected):
    result = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), str(kill_at)], capture_output=True, text=True)
    assert result.returncode == -signal.SIGKILL, result.stderr
    (found,) = list_checkpoints(tmp_path)
    loaded, _, state = load_checkpoint(found)
    assert loaded.tensors[NAME].eq(expected).all() and state["v"] == 1
    # the run goes on: the next rewrite replaces whichever copy survived and leaves exactly one
    write_checkpoint(tmp_path, 3, adapter(3.0), {}, {"generation": 3, "v": 3}, "m")
    (found,) = list_checkpoints(tmp_path)
    assert found.name == "000003" and load_checkpoint(found)[2]["v"] == 3
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.endswith(".old")]


def test_rewrite_completed_replaces_the_old_copy(tmp_path):
    write_checkpoint(tmp_path, 3, adapter(1.0), {}, {"generation": 3, "v": 1}, "m")
    write_checkpoint(tmp_path, 3, adapter(2.0), {}, {"generation": 3, "v": 2}, "m")
    (found,) = list_checkpoints(tmp_path)
    assert load_checkpoint(found)[0].tensors[NAME].eq(2.0).all()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["000003"]


def test_aside_copy_is_ignored_once_its_replacement_is_in(tmp_path):
    write_checkpoint(tmp_path, 3, adapter(1.0), {}, {"generation": 3, "v": 1}, "m")
    os.rename(tmp_path / "checkpoints" / "000003", tmp_path / "checkpoints" / "000003.old")
    write_checkpoint(tmp_path, 3, adapter(2.0), {}, {"generation": 3, "v": 2}, "m")
    (found,) = list_checkpoints(tmp_path)
    assert found.name == "000003" and load_checkpoint(found)[2]["v"] == 2


# ------------------------------------------------------------------ folders written by earlier code

OLD_LAYOUT = Path(__file__).with_name("data") / "old_layout"


def _old_layout_settings():
    """The settings tests/data/make_old_layout_runs.py wrote the old folders with (one source)."""
    return data_script("make_old_layout_runs")


def _science(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


def _rounded_alike(value, expected) -> bool:
    """Equal, floats to float32 rounding (relative 1e-5), through lists and mappings."""
    if isinstance(value, float) or isinstance(expected, float):
        return value == pytest.approx(expected, rel=1e-5, abs=1e-6)
    if isinstance(value, (list, tuple)):
        return len(value) == len(expected) and all(map(_rounded_alike, value, expected))
    if isinstance(value, dict):
        return value.keys() == expected.keys() and all(_rounded_alike(value[k], expected[k]) for k in value)
    return value == expected


@pytest.mark.parametrize("kind", ["es", "grpo"])
def test_a_run_folder_written_before_the_runs_moved_resumes_like_an_uninterrupted_run(tmp_path, kind):
    """tests/data/old_layout: folders written by evolm_lib/es/run.py and grpo/run.py (commit 3456869),
    stopped part-way; today's code opens them and ends where an uninterrupted run of today ends.
    They were written on another CPU, and torch's float sums round differently between vector
    instruction sets (AVX-512 there, AVX2 on some machines CI runs on): a GRPO step's loss there and
    here can differ in the last bits, so the ends and the old rows are compared to float32 rounding.
    A resume on one machine is bit for bit (tests/test_grpo_run.py, tests/test_es_run.py)."""
    old = _old_layout_settings()
    if kind == "es":
        cls, config, stopped_at = ESRun, ESConfig.from_dict({**old.OLD_ES, "optimizer_step": "formulas"}), 2  # checkpoint 2; row 3 reruns
    else:
        cls, config, stopped_at = GRPORun, GRPOConfig.from_dict(old.OLD_GRPO), old.OLD_GRPO_STOP
    run_dir = tmp_path / "old"
    shutil.copytree(OLD_LAYOUT / kind, run_dir)
    resumed = cls.open(config, run_dir, engine=SyntheticEngine())
    assert resumed.generation == stopped_at
    resumed.run()
    resumed.close()
    reference = cls.create(config, tmp_path / "reference", engine=SyntheticEngine())
    reference.run()
    reference.close()
    for name, value in reference.adapter.tensors.items():
        torch.testing.assert_close(resumed.adapter.tensors[name], value, rtol=1e-5, atol=1e-6, msg=name)
    rows, expected = read_metrics(run_dir), read_metrics(tmp_path / "reference")
    generations = list(range(reference.generation + 1))
    assert [r["generation"] for r in rows] == [r["generation"] for r in expected] == generations
    # rows written by the old code carry the keys they had then; each equals today's value
    assert all(r.keys() <= e.keys() for r, e in zip(_science(rows), _science(expected)))
    assert _rounded_alike(_science(rows), [{k: e[k] for k in r} for r, e in zip(_science(rows), _science(expected))])


def _pre_protocol():
    """The settings tests/data/make_pre_protocol_runs.py wrote the folders with (one source)."""
    return data_script("make_pre_protocol_runs")


class _Batching(SyntheticEngine):
    batches_grids = True  # the mean's scoring rides in the population's call


TRAINED = ("generation", "es/rewards", "es/weights", "es/update_norm", "train/reward_mean", "best_completions",
           "samples/completions", "samples/tokens")


@pytest.mark.parametrize("name", ["full", "eggroll", "riding"])
def test_a_run_folder_of_the_earlier_step_resumes_like_an_uninterrupted_run(tmp_path, name):
    """tests/data/pre_protocol: folders written before a generation became one explicit step and
    what ES moves one protocol (commit ed0985a), stopped part-way: full and EGGROLL folders whose
    checkpoints hold an unused LoRA mean, and a riding LoRA folder whose last row waited for its
    scores. Their settings name no optimizer_step: they load with the formulas term by term they
    stepped with, and end bit for bit where an uninterrupted run of today with those settings ends."""
    from evolm_lib.metrics import by_mean

    old = _pre_protocol()
    config = ESConfig.from_dict({**old.SETTINGS[name], "optimizer_step": "formulas"})
    engine = _Batching if name == "riding" else (lambda: None)
    run_dir = tmp_path / "old"
    shutil.copytree(Path(__file__).with_name("data") / "pre_protocol" / name, run_dir)
    resumed = ESRun.open(config, run_dir, engine=engine())
    assert resumed.generation == old.STOP
    if name == "riding":  # the row that waited for its scores is scored on opening
        assert [r["generation"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]
        assert "eval/reward" in read_metrics(run_dir)[3]
    resumed.run()
    reference = ESRun.create(config, tmp_path / "reference", engine=engine())
    reference.run()
    rows, expected = read_metrics(run_dir), read_metrics(tmp_path / "reference")
    assert [{k: r.get(k) for k in TRAINED} for r in rows] == [{k: r.get(k) for k in TRAINED} for r in expected]
    scored = [{r["generation"]: r["eval/reward"] for r in by_mean(found) if "eval/reward" in r} for found in (rows, expected)]
    assert scored[1] and all(scored[0][g] == value for g, value in scored[1].items())  # every mean today scores
    if name == "riding":
        for got, want in zip(resumed.adapter.tensors.values(), reference.adapter.tensors.values()):
            assert torch.equal(got, want)
    else:
        assert resumed.parameters.weights.checksum() == reference.parameters.weights.checksum()
        assert not (run_dir / "checkpoints" / f"{reference.generation:06d}" / "adapter").exists()  # none moves
    resumed.close()
    reference.close()
