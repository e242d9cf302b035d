"""es_mode full and eggroll with engine_host: ray (issue 19): every engine keeps its own float32 master
of the mean and serves a block of the members. On a local 2-CPU Ray cluster with tiny-random: a run
on two engines gives the metrics rows of the same run on one engine and on the engine in this
process, every engine ends with the same master, and an engine lost with the mean is given it back
(from the other engine, or from the run folder's snapshot and seed log where no engine keeps it) and
the run ends with the rows and means of a run never interrupted; an engine lost past its attempts
stops the run, which then resumes to the same rows.

es_mode lora on two Ray engines (members split by blocks, each engine writing its members into its
slots) giving the rows of the engine in this process is ``test_es_run_on_two_engines_equals_one_engine``
in tests/test_ray_engine.py; several engines sharing one GPU (``engines_per_gpu``) change nothing of a
call, so the same tests stand for them (on the CPU each engine takes its own CPU slice).

The engines are started in turn (the cluster has one CPU per engine): one Ray engine, then the
engine in this process, then two Ray engines. Starting them takes minutes on this shared 2-core
machine: every test that needs engines is ``slow``.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from evolm_lib import es
from evolm_lib.config import ConfigError, ESConfig
from evolm_lib.engines import SamplingSettings
from evolm_lib.engines.ray.engines import RayEngines
from evolm_lib.engines.ray.pool import EngineLostError, FaultPolicy
from evolm_lib.engines.ray.sharding import plan_members
from evolm_lib.engines.sizing import EngineSizing
from evolm_lib.runs import read_metrics
from evolm_lib.train.es import ESRun
from test_ray_engine import PROMPTS, ray_cluster, without_times  # noqa: F401 (ray_cluster: the fixture, one cluster per module)

MODES = ("full", "eggroll")
SETTINGS = dict(model="tiny-random", task="conciseness", population_size=4, sigma=0.1, learning_rate=0.05,
                target_modules=["q_proj", "v_proj", "down_proj"], noise_rank=2, max_new_tokens=6, max_model_len=256,
                kv_cache_gb=0.0625, num_generations=2, eval_every=1, seed=0)
# Every engine of these tests, whichever mode it serves: the population's slots and the mean's, rank 2.
SIZING = EngineSizing(max_loras=5, max_lora_rank=2, max_model_len=256, kv_cache_gb=0.0625, seed=0)


def config_for(mode: str, engines: int | None) -> ESConfig:
    """The run's settings on ``engines`` Ray engines, or (None) on the engine in this process."""
    ray = {} if engines is None else {"engine_host": "ray", "num_engines": engines}
    return ESConfig(**SETTINGS, es_mode=mode, **ray)


# ----------------------------------------------------------------------------- settings (no Ray)


@pytest.mark.parametrize("mode", MODES)
def test_both_modes_accept_ray_engines_and_keep_their_other_refusals(mode):
    assert config_for(mode, 2).engine_host == "ray"
    for changes, message in (({"adapter_transfer": "files"}, f"adapter_transfer: es_mode {mode}"),
                             ({"estimator": "zoar"}, f"estimator: es_mode {mode}"),
                             ({"noise_mode": "per_layer"}, f"noise_mode: es_mode {mode}")):
        with pytest.raises(ConfigError, match=message):
            config_for(mode, 2).replace(**changes)


def test_members_go_in_contiguous_blocks_and_the_scoring_prompts_beside_them():
    # 5 members and 3 scoring prompts on 2 engines: members 0-2 and prompts 0-1, then members 3-4 and prompt 2
    assert plan_members(5, 3, 2) == [(0, slice(0, 3), slice(0, 2)), (1, slice(3, 5), slice(2, 3))]
    assert plan_members(4, 0, 2) == [(0, slice(0, 2), None), (1, slice(2, 4), None)]  # no scoring this generation
    # fewer members than engines: the last engine only scores (an empty block of members)
    assert plan_members(1, 3, 2) == [(0, slice(0, 1), slice(0, 2)), (1, slice(1, 1), slice(2, 3))]
    assert plan_members(4, 1, 3) == [(0, slice(0, 2), slice(0, 1)), (1, slice(2, 3), None), (2, slice(3, 4), None)]
    assert plan_members(0, 0, 2) == []


# ----------------------------------------------------------------------------- engines


def run_both_modes(engine, engines: int | None, folder) -> dict:
    """Each mode's run on ``engine``: its rows (timings apart), every engine's master checksum, the mean."""
    out = {}
    for mode in MODES:
        run = ESRun.create(config_for(mode, engines), folder / mode, engine=engine)
        run.run()
        weights = run.parameters.weights
        out[mode] = {"rows": read_metrics(run.run_dir),
                     "checksums": weights.checksums() if engines else [weights.checksum()],
                     "master": weights.read()["master"]}
        run.close()  # the engines serve the model folder's weights again for the next mode
    return out


@pytest.fixture(scope="module")
def one_engine_runs(ray_cluster, tmp_path_factory):
    """Both modes on one Ray engine, which is then shut down (its CPU goes to the next engines)."""
    with RayEngines("tiny-random", SIZING, num_engines=1) as engine:
        return run_both_modes(engine, 1, tmp_path_factory.mktemp("one_engine"))


@pytest.fixture(scope="module")
def local_runs(one_engine_runs, tmp_path_factory):
    """Both modes on an engine in this process (its own: the modes change the layers they move)."""
    from evolm_lib.engines.vllm.engine import VLLMEngine

    with VLLMEngine("tiny-random", SIZING) as engine:
        return run_both_modes(engine, None, tmp_path_factory.mktemp("local"))


@pytest.fixture(scope="module")
def two_engines(ray_cluster, one_engine_runs):
    """Two Ray engines, started once the one-engine runs have given their CPU back; Ray may restart
    each often enough for every kill of this module."""
    with RayEngines("tiny-random", SIZING, num_engines=2, policy=FaultPolicy(max_restarts=10)) as engine:
        yield engine


@pytest.fixture(scope="module")
def two_engine_runs(two_engines, tmp_path_factory):
    return run_both_modes(two_engines, 2, tmp_path_factory.mktemp("two_engines"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_two_ray_engines_give_the_rows_of_one_and_of_the_local_engine(mode, one_engine_runs, local_runs,
                                                                       two_engine_runs):
    rows = without_times(two_engine_runs[mode]["rows"])
    assert [row["generation"] for row in rows] == [0, 1, 2]
    assert len(rows[1]["es/rewards"]) == 4 and rows[-1]["policy/train_reward"] is not None
    assert rows == without_times(one_engine_runs[mode]["rows"])
    assert rows == without_times(local_runs[mode]["rows"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_every_engine_ends_with_the_same_master_as_one_engine(mode, one_engine_runs, local_runs, two_engine_runs):
    first, second = two_engine_runs[mode]["checksums"]
    assert first == second  # same bits, and each engine serves them exactly
    assert first["restored"] and first["step"] == 2  # both engines took both updates
    assert one_engine_runs[mode]["checksums"] == [first] == local_runs[mode]["checksums"]
    assert torch.equal(two_engine_runs[mode]["master"], local_runs[mode]["master"])
    assert not torch.equal(two_engine_runs["full"]["master"], two_engine_runs["eggroll"]["master"])  # the modes moved it


@pytest.mark.slow
def test_the_timing_keys_split_a_generation_over_the_engines(two_engine_runs):
    full = two_engine_runs["full"]["rows"][1]
    assert full["time/adapters/write_s"] > 0 and full["time/adapters/restore_s"] > 0 and full["time/generate_s"] > 0
    # the slowest engine's writes and restores make up the adapters phase
    assert full["time/adapters_s"] == pytest.approx(full["time/adapters/write_s"] + full["time/adapters/restore_s"])
    eggroll = two_engine_runs["eggroll"]["rows"][1]
    assert eggroll["time/adapters_s"] > 0 and eggroll["time/generate_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_each_engine_serves_its_block_of_members_in_one_concurrent_call(mode, two_engines, two_engine_runs):
    """Four members over two engines in one call: every row equals that member served alone (on engine 0)."""
    targets = SETTINGS["target_modules"]
    noise = "full" if mode == "full" else "lowrank"
    weights = two_engines.resident_weights(targets, noise=noise, noise_rank=2)
    slots = None
    if mode == "eggroll":
        from evolm_lib.lora import LoraSpec

        slots = two_engines.lowrank_slots(LoraSpec(target_modules=tuple(targets), rank=2, alpha=2.0), 4)
    greedy = SamplingSettings(max_new_tokens=6)
    members = es.population(0, 1, 4)
    submitted = []
    try:
        two_engines.pool.on_submitted = lambda pool, engines: submitted.append(engines)
        table, scores, _ = two_engines.run_members(weights, members, 0.5, PROMPTS, greedy, score=(PROMPTS[:1], greedy),
                                                   slots=slots)
        two_engines.pool.on_submitted = None
        alone = [two_engines.run_members(weights, [member], 0.5, PROMPTS, greedy, slots=slots)[0][0] for member in members]
        (mean,) = two_engines.run_members(weights, [], 0.5, PROMPTS, greedy, score=(PROMPTS, greedy), slots=slots)[1]
    finally:
        two_engines.pool.on_submitted = None
        if slots is not None:
            slots.close()
        weights.close()
    assert submitted == [[0, 1]]  # one call, both engines
    assert [[c.token_ids for c in row] for row in table] == [[c.token_ids for c in row] for row in alone]
    assert len({tuple(c.token_ids for c in row) for row in table}) > 1  # the members differ from each other
    assert [c.token_ids for c in scores[0]] == [c.token_ids for c in mean[:1]]


def kill_at_call(*engines: int, call: int = 1):
    """A hook that kills ``engines``' actors (Ray restarts them) right after the ``call``-th submission
    from now. Their processes get SIGKILL, which lands before the call can run: ``ray.kill`` is
    asynchronous, and on a loaded machine a short call (the update) could end before it took effect."""
    state = {"calls": 0}

    def hook(pool, submitted: list[int]) -> None:
        state["calls"] += 1
        if state["calls"] == call:
            pool.on_submitted = None
            for engine in engines:
                os.kill(pool.engine_info[engine]["pid"], signal.SIGKILL)  # the local cluster's actors: this host

    return hook


# (mode, engines killed, which call of generation 2: 1 its members and scoring, 2 its update, source of the mean)
REBUILDS = [
    ("full", (1,), 1, "engine 0"),
    ("eggroll", (1,), 1, "engine 0"),
    ("full", (1,), 2, "engine 0"),  # the update in flight: engine 0 has taken it, engine 1 gets the mean after it
    ("eggroll", (0, 1), 1, "the newest snapshot and the seed log"),  # no engine keeps the mean: the run folder has it
]


@pytest.mark.slow
@pytest.mark.parametrize("mode, killed, call, source", REBUILDS, ids=["full-members", "eggroll-members", "full-update",
                                                                       "eggroll-both-engines"])
def test_an_engine_lost_with_the_mean_is_given_it_back_and_the_run_ends_as_uninterrupted(
        mode, killed, call, source, two_engines, two_engine_runs, tmp_path):
    config = config_for(mode, 2)
    pids_before = [info["pid"] for info in two_engines.engine_info]
    faults_before = len(two_engines.faults)
    run = ESRun.create(config, tmp_path / "run", engine=two_engines)
    run.step()
    two_engines.pool.on_submitted = kill_at_call(*killed, call=call)  # in generation 2
    try:
        run.run()
    finally:
        two_engines.pool.on_submitted = None
    weights = run.parameters.weights
    for engine in killed:
        assert two_engines.engine_info[engine]["pid"] != pids_before[engine]  # a new process, with a fresh engine
    assert {f["engine"] for f in two_engines.faults[faults_before:]} == set(killed)
    # every killed engine given the mean back; the first from ``source`` (a later one may copy an engine rebuilt before it)
    assert {r["engine"] for r in weights.rebuilds} == set(killed) and weights.rebuilds[0]["source"] == source
    # the rows of the run never interrupted, and bit-exact means on every engine
    assert without_times(read_metrics(run.run_dir)) == without_times(two_engine_runs[mode]["rows"])
    first, second = weights.checksums()
    assert first == second == two_engine_runs[mode]["checksums"][0]
    run.close()


@pytest.mark.slow
def test_an_engine_that_stays_lost_past_its_attempts_ends_the_run_and_it_resumes_to_the_same_rows(
        ray_cluster, two_engines, two_engine_runs, tmp_path):
    config = config_for("full", 2)
    run = ESRun.create(config, tmp_path / "run", engine=two_engines)
    run.step()
    policy = two_engines.pool.policy
    two_engines.pool.policy = FaultPolicy(max_attempts=1)  # one loss is too many: the run must stop cleanly
    two_engines.pool.on_submitted = kill_at_call(1)
    try:
        # the kill follows the members' call; where that short call ends first, the update's call is the
        # one lost: either way the generation is not counted
        lost = "engine 1 of 2 .* is lost: its (run_members|weights_step) call was lost 1 times"
        with pytest.raises(EngineLostError, match=lost):
            run.step()
    finally:
        two_engines.pool.on_submitted = None
        two_engines.pool.policy = policy
    assert [r["generation"] for r in read_metrics(run.run_dir)] == [0, 1]
    # Ray restarts the lost engine on its own; the pool gave up on it, so nobody counted that restart:
    # wait until it answers, restarted and holding no mean, so that closing always meets it so
    key = run.parameters.weights.key
    deadline = time.monotonic() + 120
    while True:
        try:
            assert ray_cluster.get(two_engines.pool.actors[1].weights_held.remote(key), timeout=10) is False
            break
        except (ray_cluster.exceptions.RayActorError, ray_cluster.exceptions.GetTimeoutError):
            assert time.monotonic() < deadline, "the lost engine did not come back"
            time.sleep(0.5)
    run.close()  # hands the engines back serving the model folder's weights: engine 1 set up again for that
    resumed = ESRun.open(config, tmp_path / "run", engine=two_engines)
    assert resumed.generation == 1
    resumed.run()
    assert without_times(read_metrics(run.run_dir)) == without_times(two_engine_runs["full"]["rows"])
    first, second = resumed.parameters.weights.checksums()
    assert first == second == two_engine_runs["full"]["checksums"][0]
    resumed.close()


@pytest.mark.slow
def test_grpo_on_the_model_weights_writes_every_ray_engine(two_engines, tmp_path):
    """GRPO with policy_weights: full on two Ray engines: after each step the trained weights reach
    both engines (their masters agree, bit for bit, with the trainer's weights), so the rollouts of
    step 2, shared out over both engines, are scored alike by the engines and the trainer."""
    from evolm_lib.config import GRPOConfig
    from evolm_lib.train.grpo import GRPORun

    config = GRPOConfig(model="tiny-random", task="conciseness", policy_weights="full",
                        target_modules=["q_proj", "v_proj"], group_size=2, max_new_tokens=6, max_model_len=256,
                        kv_cache_gb=0.0625, num_steps=2, temperature=1.0, learning_rate=1e-3, seed=0,
                        engine_host="ray", num_engines=2)
    run = GRPORun.create(config, tmp_path / "run", engine=two_engines)
    rows = run.run()
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["grpo/engine_logprob_gap"] < 1e-4 for r in rows), [r["grpo/engine_logprob_gap"] for r in rows]
    first, second = run.engine_weights.checksums()
    assert first["master"] == second["master"]
    assert torch.equal(run.engine_weights.read()["master"], run.trainer.flat_weights().float().cpu())
    run.close()  # the engines serve the model folder's weights again
