"""Run folders: a kill between the steps of a checkpoint rewrite still leaves a loadable checkpoint."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from evolm_lib.lora import AdapterWeights, LoraSpec
from evolm_lib.runs import list_checkpoints, load_checkpoint, write_checkpoint

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
