"""Tensor-parallel vLLM engines (``tensor_parallel_size``) on the CPU: the machine checks before an
engine starts, and resident LoRA slots written into each rank's shard (``vllm.worker_shards``).

One tiny-random engine at tensor_parallel_size 2 (two processes, one core each) and one at 1 are
shared by the module; both have the sizes of the vLLM kill test (``helpers_kill_run.vllm_engine``),
so the ES runs here and the killed run's resumption run on engines alike. tiny-random has 2 query
heads and 1 KV head: at 2 ranks q_proj's lora_B is split, k/v's are replicated on both ranks,
o_proj and down_proj split lora_A, gate/up split lora_B.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from evolm_lib import es
from evolm_lib.config import ConfigError
from evolm_lib.engines import EngineSizing, SamplingSettings
from evolm_lib.engines.vllm import startup
from evolm_lib.engines.vllm.rpc import gather_shards, stored_form
from evolm_lib.engines.vllm.slots import ResidentSlots, SlotsUnsupported, describe
from evolm_lib.lora import AdapterWeights, LoraSpec, adapter_shapes, init_adapter
from evolm_lib.metrics import without_times
from evolm_lib.runs import list_checkpoints, read_metrics
from evolm_lib.train.es import ESRun
from evolm_lib.types import Prompt

from helpers_kill_run import vllm_engine, vllm_kill_config

HELPER = Path(__file__).with_name("helpers_kill_run.py")
SPEC = LoraSpec(rank=1, alpha=2.0)  # the engines' max_lora_rank is 1 (the kill test's sizes); alpha / r = 2 folded into B
SIGMA = 0.05
POPULATION = 4
GREEDY = SamplingSettings(max_new_tokens=16)
PROMPTS = [Prompt.user("What is 2+3?"), Prompt.user("Name a colour."), "Once upon a time", "The quick brown fox"]
FIRST_ID = 1_500_000_000  # beside the engine's own population slots


def _unbound_environment() -> dict:
    """The environment without a core binding (the suite's conftest gives each xdist worker one
    core): the engine then binds each rank to one of this process's cores."""
    return {k: v for k, v in os.environ.items() if k != startup.CPU_BIND_ENV}


@pytest.fixture(scope="module")
def tp1():
    engine = vllm_engine()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tp2(tp1):  # after tp1: vLLM has cached its environment by then, which the start must read afresh
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(startup.CPU_BIND_ENV, raising=False)
        engine = vllm_engine(tensor_parallel_size=2)
    yield engine
    engine.close()


def make_mean(model_dir, spec: LoraSpec = SPEC) -> AdapterWeights:
    init = init_adapter(spec, adapter_shapes(model_dir, spec), "peft_default", seed=0)
    return AdapterWeights(spec, es.perturb(dict(init.tensors), es.Member(99), 0.02))


def token_ids(rows) -> list[list[tuple[int, ...]]]:
    return [[c.token_ids for c in row] for row in rows]


# ----------------------------------------------------------------------------- before an engine starts


def test_sizing_and_llm_arguments_carry_tensor_parallel_size(tmp_path):
    config = vllm_kill_config(tensor_parallel_size=2)
    sizing = EngineSizing.from_config(config)
    assert sizing.tensor_parallel_size == 2
    assert startup.llm_arguments(tmp_path, sizing, on_gpu=False)["tensor_parallel_size"] == 2
    assert "tensor_parallel_size" not in startup.llm_arguments(tmp_path, sizing.replace(tensor_parallel_size=1), on_gpu=False)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineSizing(tensor_parallel_size=0)


def test_cpu_ranks_get_cores_of_their_own(monkeypatch):
    assert startup.cpu_binding(2, [0, 1]) == "0|1"
    assert startup.cpu_binding(2, [4, 5, 6, 7, 8]) == "4,5|6,7"  # equal blocks, the odd core left out
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 .* 2 core"):
        startup.cpu_binding(3, [0, 1])
    monkeypatch.delenv(startup.CPU_BIND_ENV, raising=False)
    startup.tensor_parallel_setup(2, on_gpu=False, cpus=[2, 3])
    assert os.environ[startup.CPU_BIND_ENV] == "2|3"
    startup.tensor_parallel_setup(1, on_gpu=False)  # one rank: nothing to bind, nothing changed
    assert os.environ[startup.CPU_BIND_ENV] == "2|3"
    startup.tensor_parallel_setup(2, on_gpu=False, cpus=[0, 1])  # its own binding is not the user's: set again
    assert os.environ[startup.CPU_BIND_ENV] == "0|1"
    with pytest.raises(ConfigError, match="tensor_parallel_size=4"):
        startup.tensor_parallel_setup(4, on_gpu=False, cpus=[0, 1])
    # a binding the user set is kept, but must name one core list per rank
    monkeypatch.setenv(startup.CPU_BIND_ENV, "1|0")
    startup.tensor_parallel_setup(2, on_gpu=False, cpus=[0, 1])
    assert os.environ[startup.CPU_BIND_ENV] == "1|0"
    monkeypatch.setenv(startup.CPU_BIND_ENV, "0")
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 needs one core list per rank in VLLM_CPU_OMP_THREADS_BIND"):
        startup.tensor_parallel_setup(2, on_gpu=False, cpus=[0, 1])


def test_more_ranks_than_visible_cards_are_refused(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 .* 1 are visible \(CUDA_VISIBLE_DEVICES=0\)"):
        startup.tensor_parallel_setup(2, on_gpu=True, cards=1)
    startup.tensor_parallel_setup(2, on_gpu=True, cards=2)


def test_ray_engines_ask_for_a_slice_of_cards_per_rank_and_hf_refuses():
    from evolm_lib.engines.ray.cluster import check_cluster_resources

    # an engine split over T ranks: its actor holds T cards (or T CPU slices) of one node
    assert check_cluster_resources(2, {"CPU": 64.0, "GPU": 4.0}, tensor_parallel_size=2) == {"num_gpus": 2}
    assert check_cluster_resources(1, {"CPU": 2.0}, tensor_parallel_size=2) == {"num_cpus": 2.0}
    with pytest.raises(ValueError, match=r"num_engines: 3 engines need 6 GPUs \(tensor_parallel_size=2 cards each\)"):
        check_cluster_resources(3, {"CPU": 64.0, "GPU": 4.0}, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="engines_per_gpu: 2 engines on one card cannot each be split"):
        check_cluster_resources(2, {"CPU": 64.0, "GPU": 4.0}, engines_per_gpu=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="num_engines: 2 CPU engines need 4 CPUs"):
        check_cluster_resources(2, {"CPU": 2.0}, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="tensor_parallel_size: 2 splits a vLLM engine; engine must be 'vllm'"):
        vllm_kill_config().replace(engine="hf", tensor_parallel_size=2)


# ----------------------------------------------------------------------------- resident slots in shards


def test_every_rank_hosts_the_slots(tp2):
    info = describe(tp2.llm)
    assert info["ok"], info
    assert info["tp_size"] == 2
    # rank 0's shards: q's B rows halved (64 -> 32), o_proj's and down_proj's A columns halved
    shapes = {module.rsplit(".", 1)[-1]: (a, b) for module, a, b in info["modules"]}
    assert shapes["qkv_proj"][1] == [[32, 1], [32, 1], [32, 1]]
    assert shapes["o_proj"][0] == [[1, 32]] and shapes["down_proj"][0] == [[1, 64]]
    assert shapes["gate_up_proj"][1] == [[64, 1], [64, 1]]


@pytest.mark.parametrize("spec, scheme", [
    (SPEC, "flat"),
    (LoraSpec(("k_proj", "o_proj", "up_proj"), rank=1, alpha=1.0, layers_to_transform=(1,)), "per_tensor"),
], ids=["all-projections", "k-o-up-layer1-per-tensor-noise"])
def test_the_served_weights_at_two_ranks_equal_one_ranks_bit_for_bit(tp1, tp2, spec, scheme):
    """Each rank draws the members' full noise and writes its shard: gathered from the ranks, the
    slots hold what one rank's slots hold and what the trainer's es.perturb gives, bit for bit."""
    mean = make_mean(tp1.model_dir, spec)
    members = es.population(base_seed=3, generation=5, population_size=POPULATION)
    with ResidentSlots(tp1.llm, spec, POPULATION, tp1.model_dir, tp1.dtype, first_id=FIRST_ID) as one, \
            ResidentSlots(tp2.llm, spec, POPULATION, tp2.model_dir, tp2.dtype, first_id=FIRST_ID) as two:
        one.write(mean, members, SIGMA, noise_scheme=scheme)
        timing = two.write(mean, members, SIGMA, noise_scheme=scheme)
        assert timing["slots_call_s"] >= timing["slots_write_s"] > 0
        host = [es.perturb(dict(mean.tensors), member, SIGMA, scheme=scheme) for member in members]
        assert two.checksums() == [two.expected_checksum(tensors) for tensors in host]
        assert len(set(two.checksums())) == POPULATION  # the checksums tell the members apart
        for index, tensors in enumerate(host):
            served_one, served_two = one.read(index), two.read(index)
            assert set(served_two) == set(tensors)
            for name, tensor in tensors.items():
                assert torch.equal(served_two[name], served_one[name]), name
                expected = stored_form(tensor, ".lora_A." in name, torch.float32, torch.float32, spec.alpha / spec.rank)
                assert torch.equal(served_two[name], expected), name


def test_greedy_completions_at_two_ranks_equal_one_ranks(tp1, tp2):
    """On this CPU in float32 the two ranks' all-reduce gives tiny-random's greedy tokens of one rank
    (measured: 0 of 180 completions differed over 5 generations of 8 members and the base)."""
    mean = make_mean(tp1.model_dir)
    with ResidentSlots(tp1.llm, SPEC, POPULATION, tp1.model_dir, tp1.dtype, first_id=FIRST_ID) as one, \
            ResidentSlots(tp2.llm, SPEC, POPULATION, tp2.model_dir, tp2.dtype, first_id=FIRST_ID) as two:
        for generation in (1, 2):
            members = es.population(base_seed=7, generation=generation, population_size=POPULATION)
            one.write(mean, members, SIGMA)
            two.write(mean, members, SIGMA)
            from_one = token_ids(one.generate(PROMPTS, GREEDY, with_base=True))
            from_two = token_ids(two.generate(PROMPTS, GREEDY, with_base=True))
            assert from_two == from_one
            assert len({tuple(row) for row in from_one[:POPULATION]}) > 1  # members differ: the test can fail
        # adapter files at two ranks: vLLM's own loader splits them, into the same completions
        adapters = [AdapterWeights(SPEC, es.perturb(dict(mean.tensors), member, SIGMA)) for member in members]
        assert token_ids(tp2.generate(PROMPTS, adapters, GREEDY)) == from_one[:POPULATION]


def _write_full_members(worker, key: int, full: dict) -> None:
    """Inside each rank: EGGROLL's way into the slots, full tensors through ``worker_shards.write_full``."""
    from evolm_lib.engines.vllm.worker_shards import write_full

    state = worker._evolm_slot_set(key)
    slots = torch.tensor(state.slots[: len(next(iter(full.values())))], device=state.entries[0].stacked.device)
    with torch.inference_mode():
        for entry in state.entries:
            write_full(entry, slots, full[entry.name])


def test_write_full_puts_each_rank_its_part(tp2):
    """``worker_shards.write_full`` (the call EGGROLL's slot writes use): full per-member tensors
    in, each rank's shard written, the gathered slots equal to what went in."""
    spec = LoraSpec(rank=1, alpha=1.0)
    shapes = adapter_shapes(tp2.model_dir, spec)
    generator = torch.Generator().manual_seed(0)
    full = {name: torch.randn((2, *shape), generator=generator) for name, shape in shapes.items()}  # 2 members
    with ResidentSlots(tp2.llm, spec, 2, tp2.model_dir, tp2.dtype, first_id=FIRST_ID) as slots:
        tp2.llm.collective_rpc(_write_full_members, args=(slots.key, full))
        for member in range(2):
            served = slots.read(member)
            for name in shapes:
                assert torch.equal(served[name], full[name][member]), name


def _loader_unscaled(worker, broken: bool) -> None:
    """Inside each rank: pretend vLLM's loader stopped folding alpha / r into B (or undo that)."""
    from evolm_lib.engines.vllm import rpc, worker_slots

    def unscaled(tensor, is_a, file_dtype, slot_dtype, scaling):
        return tensor.to(file_dtype).to(slot_dtype)

    worker_slots.stored_form = unscaled if broken else rpc.stored_form


def test_a_loader_mismatch_on_the_ranks_is_refused_and_the_slots_released(tp2):
    """The fingerprint check fails on every rank: the refusal reaches the host as SlotsUnsupported
    (which falls back to files), not as vLLM's RPC error, and no rank keeps a slot pinned."""
    pinned = describe(tp2.llm)["pinned"]
    tp2.llm.collective_rpc(_loader_unscaled, args=(True,))
    try:
        with pytest.raises(SlotsUnsupported, match="rank 0: .*differently from the in-place write.*; rank 1: "):
            ResidentSlots(tp2.llm, SPEC, POPULATION, tp2.model_dir, tp2.dtype, first_id=FIRST_ID)
    finally:
        tp2.llm.collective_rpc(_loader_unscaled, args=(False,))
    assert describe(tp2.llm)["pinned"] == pinned
    with ResidentSlots(tp2.llm, SPEC, POPULATION, tp2.model_dir, tp2.dtype, first_id=FIRST_ID) as population:
        population.write(make_mean(tp2.model_dir), es.population(1, 1, 2), SIGMA)


def test_gather_refuses_missing_or_disagreeing_shards():
    rows = torch.arange(8.0).view(4, 2)  # a lora_B (out 4, rank 2)
    halves = [(rows[:2], [0, 1]), (rows[2:], [2, 3])]
    assert torch.equal(gather_shards("b", (4, 2), False, halves), rows)
    assert torch.equal(gather_shards("b", (4, 2), False, [(rows, None), (rows, None)]), rows)  # replicated
    with pytest.raises(ValueError, match="held by no rank"):
        gather_shards("b", (4, 2), False, halves[:1])
    with pytest.raises(ValueError, match="other values"):
        gather_shards("b", (4, 2), False, [(rows, None), (rows + 1, None)])


# ----------------------------------------------------------------------------- ES runs


def test_an_es_run_at_two_ranks_logs_one_ranks_rows(tp1, tp2, tmp_path):
    one = ESRun.create(vllm_kill_config(), tmp_path / "one", engine=tp1)
    one.run()
    two = ESRun.create(vllm_kill_config(tensor_parallel_size=2), tmp_path / "two", engine=tp2)
    two.run()
    assert tp2.adapter_transfer == "in_place" and tp2.slots.resident is not None  # no silent fall-back to files
    rows = without_times(read_metrics(tmp_path / "two"))
    assert [row["generation"] for row in rows] == list(range(6))
    assert rows == without_times(read_metrics(tmp_path / "one"))
    for name, tensor in one.mean.tensors.items():
        assert torch.equal(two.mean.tensors[name], tensor), name
    # the test can fail: members were scored apart and the mean moved
    assert any(len(set(row["es/rewards"])) > 1 and row["es/update_norm"] > 0 for row in rows[1:])


def test_a_run_killed_at_two_ranks_resumes_to_the_uninterrupted_rows(tp2, tmp_path):
    run_dir = tmp_path / "killed"
    process = subprocess.run([sys.executable, str(HELPER), str(run_dir), "4", "--vllm", "--tp2"], capture_output=True,
                             text=True, timeout=600, env=_unbound_environment())
    assert process.returncode == -9, process.stderr[-2000:]
    assert [p.name for p in list_checkpoints(run_dir)] == ["000000", "000002"]
    resumed = ESRun.resume(run_dir, engine=tp2)
    assert resumed.generation == 2
    resumed.run()
    reference = ESRun.create(vllm_kill_config(tensor_parallel_size=2), tmp_path / "reference", engine=tp2)
    reference.run()
    rows = read_metrics(run_dir)
    assert [row["generation"] for row in rows] == list(range(6))
    assert without_times(rows) == without_times(read_metrics(tmp_path / "reference"))
    for name, tensor in reference.mean.tensors.items():
        assert torch.equal(resumed.mean.tensors[name], tensor), name
