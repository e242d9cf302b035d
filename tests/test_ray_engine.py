"""Ray engines: settings and planning without Ray; then a local Ray cluster with 2 engines on
tiny-random that must give exactly what one in-process engine gives (calls, an ES run, a GRPO run),
lose nothing when an engine is killed mid-generation, and fail clearly when an engine stays lost.

The cluster (2 CPUs, one per engine) and the two engines are shared by the module; the reference is
the session's in-process engine. Starting the cluster takes 20-35 s on this shared 2-core machine,
and the two engines 75-160 s more: every test that needs engines is ``slow`` (``make test`` runs
them; ``make test-fast`` keeps the settings, planning, error and cluster-only fault tests).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

from evolm_lib import es
from evolm_lib.config import ConfigError, ESConfig, GRPOConfig
from evolm_lib.engines import Population, SamplingSettings, make_engine
from evolm_lib.engines.base import balanced_blocks
from evolm_lib.env import record_placement
from evolm_lib.engines.sizing import EngineSizing
from evolm_lib.engines.ray.cluster import RayUnavailableError, check_cluster_resources
from evolm_lib.engines.ray.engines import RayEngines
from evolm_lib.engines.ray.pool import EngineLostError, EnginePool, FaultPolicy, start_waves
from evolm_lib.engines.ray.sharding import ShardPlan, ShardSampling, plan_grid, shard_sampling
from evolm_lib.train.es import ESRun
from evolm_lib.lora import AdapterWeights, LoraSpec, adapter_shapes, init_adapter
from evolm_lib.runs import list_checkpoints, read_metrics
from evolm_lib.types import Prompt
from evolm_lib.metrics import without_times

# Small engines: each actor is a vLLM engine in its own process.
ENGINE = dict(model="tiny-random", max_model_len=256, kv_cache_gb=0.25, seed=0)
ES_SETTINGS = dict(**ENGINE, task="conciseness", population_size=4, num_generations=2, max_new_tokens=8,
                   sigma=0.05, learning_rate=0.4)
PROMPTS = [Prompt.user("What is 2+3?"), Prompt.user("Name a colour."), "Once upon a time"]
GREEDY = SamplingSettings(max_new_tokens=8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def token_ids(tables) -> list:
    return [[c.token_ids for c in row] for row in tables]


# ----------------------------------------------------------------------------- settings (no Ray)


def test_settings_default_to_one_local_engine_and_accept_ray():
    for config_class in (ESConfig, GRPOConfig):
        config = config_class(model="tiny-random")
        assert (config.engine_host, config.num_engines, config.ray_address) == ("local", 1, None)
        config = config_class(model="tiny-random", engine_host="ray", num_engines=2, ray_address="10.0.0.1:6379")
        assert config_class.from_dict(config.to_dict()) == config
        for address in ("ray://head:10001", "auto", "[::1]:6379"):
            assert config.replace(ray_address=address).ray_address == address


@pytest.mark.parametrize("changes, message", [
    ({"engine_host": "local", "num_engines": 2}, "num_engines: 2 engines need engine_host: ray"),
    ({"ray_address": "10.0.0.1:6379"}, "ray_address: set, but engine_host is 'local'"),
    ({"engine_host": "ray", "engine": "hf"}, "engine must be 'vllm'"),
    ({"engine_host": "ray", "ray_address": "headnode"}, "ray_address: expected host:port"),
    ({"engine_host": "ray", "num_engines": 0}, "num_engines"),
    ({"engine_host": "gpu"}, "engine_host"),
    ({"engine_host": "ray", "num_engines": 6, "population_size": 4}, "population_size: 4 members cannot keep num_engines=6"),
])
def test_bad_ray_settings_name_the_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        ESConfig(model="tiny-random", **changes)


def test_mps_thread_percentage_is_a_ray_setting_from_1_to_100():
    config = ESConfig(model="tiny-random", engine_host="ray", num_engines=4, engines_per_gpu=4, mps_thread_percentage=25)
    assert ESConfig.from_dict(config.to_dict()) == config and ESConfig(model="tiny-random").mps_thread_percentage is None
    for changes, message in (({"mps_thread_percentage": 25}, "mps_thread_percentage: 25 applies to engines in Ray actors"),
                             ({"engine_host": "ray", "mps_thread_percentage": 0}, "mps_thread_percentage"),
                             ({"engine_host": "ray", "mps_thread_percentage": 101}, "mps_thread_percentage")):
        with pytest.raises(ConfigError, match=message):
            ESConfig(model="tiny-random", **changes)
    with pytest.raises(ValueError, match="mps_thread_percentage must be an integer from 1 to 100, got 0"):
        RayEngines("tiny-random", num_engines=2, mps_thread_percentage=0)  # refused before Ray is joined


def test_engines_per_gpu_is_a_ray_setting_and_splits_the_default_share_of_the_card():
    config = ESConfig(model="tiny-random", engine_host="ray", num_engines=4, engines_per_gpu=4)
    assert ESConfig.from_dict(config.to_dict()) == config and ESConfig(model="tiny-random").engines_per_gpu == 1
    for changes, message in (({"engines_per_gpu": 2}, "engines_per_gpu: 2 engines on one GPU need engine_host: ray"),
                             ({"engine_host": "ray", "engines_per_gpu": 0}, "engines_per_gpu"),
                             ({"engine_host": "ray", "engines_per_gpu": 1.5}, "engines_per_gpu")):
        with pytest.raises(ConfigError, match=message):
            ESConfig(model="tiny-random", **changes)
    sizing = EngineSizing.from_config(config)
    assert sizing.engines_per_gpu == 4
    assert sizing.memory(on_gpu=True).gpu_memory_utilization == pytest.approx(0.6 / 4)  # GPU_MEMORY_SHARE split
    assert sizing.memory(on_gpu=False) == EngineSizing().memory(on_gpu=False)  # a CPU engine: as one alone
    assert EngineSizing.from_config(config.replace(gpu_memory_utilization=0.3)).memory(True).gpu_memory_utilization == 0.3
    with pytest.raises(ValueError, match="engines_per_gpu must be an integer >= 1"):
        EngineSizing(engines_per_gpu=0)


def test_grpo_has_no_population_to_check():
    assert GRPOConfig(model="tiny-random", engine_host="ray", num_engines=4).num_engines == 4


# ----------------------------------------------------------------------------- planning (no Ray)


@pytest.mark.parametrize("count, parts", [(4, 2), (5, 2), (30, 4), (64, 4), (3, 3), (7, 1)])
def test_member_blocks_are_population_split(count, parts):
    spec = LoraSpec(rank=1)
    mean = AdapterWeights(spec, {"x": torch.zeros(1)})
    population = Population(mean, tuple(es.Member(i) for i in range(count)), 0.1)
    blocks = balanced_blocks(count, parts)
    assert [population.members[b] for b in blocks] == [p.members for p in population.split(parts)]
    assert max(b.stop - b.start for b in blocks) - min(b.stop - b.start for b in blocks) <= 1


def test_plan_splits_members_when_there_are_enough_else_prompts():
    full = slice(0, 10)
    # a population of 8 over 2 engines: members 0-3 and 4-7, every prompt
    assert plan_grid(8, 10, 2, engine_max_loras=5) == [(slice(0, 4), full), (slice(4, 8), full)]
    # the mean adapter alone (greedy scoring, GRPO rollouts): prompts 0-4 and 5-9
    assert plan_grid(1, 10, 2, engine_max_loras=5) == [(slice(0, 1), slice(0, 5)), (slice(0, 1), slice(5, 10))]
    # fewer prompts than engines: some engines idle, none gets an empty block
    assert plan_grid(1, 2, 4, engine_max_loras=2) == [(slice(0, 1), slice(0, 1)), (slice(0, 1), slice(1, 2))]
    # 3 adapters on 4 engines that hold 2 each: by adapters, so no engine holds more than it can
    assert plan_grid(3, 10, 4, engine_max_loras=2) == [(slice(i, i + 1), full) for i in range(3)]
    assert plan_grid(0, 10, 2, 4) == [] and plan_grid(3, 0, 2, 4) == []


def test_a_shard_plan_puts_every_engines_answer_back_in_place():
    """A population split by members and one adapter split by prompts, on 2 engines: each engine
    answers its work with (who, prompt) labels, and the assembled tables hold every label in place."""
    spec = LoraSpec(rank=1)
    mean, other = AdapterWeights(spec, {"x": torch.zeros(1)}), AdapterWeights(spec, {"x": torch.ones(1)})
    population = Population(mean, tuple(es.population(0, 1, 4)), 0.1)
    prompts = ["p0", "p1", "p2"]
    plan = ShardPlan.of([(prompts, population, GREEDY), (prompts, [other], GREEDY)], num_engines=2, engine_max_loras=3)
    assert [a is b for a, b in zip(plan.shared, (mean, other))] == [True, True] and len(plan.shared) == 2
    # engine 0: members 0-1 on every prompt, the other adapter on p0-p1; engine 1: members 2-3, the other on p2
    assert [[list(block_prompts) for block_prompts, _, _ in work] for work in plan.work] == \
           [[prompts, ["p0", "p1"]], [prompts, ["p2"]]]

    def who(wire) -> list:
        if hasattr(wire, "members"):  # a PopulationBlock: its members travel as seeds and signs
            return [(m.seed, m.sign) for m in wire.members]
        return [("adapter", ref.index) for ref in wire]

    results = {engine: [[[(w, p) for p in block_prompts] for w in who(wire)] for block_prompts, wire, _ in work]
               for engine, work in enumerate(plan.work)}
    members_table, other_table = plan.assemble(results, {"generate_s": 1.5})
    assert members_table == [[((m.seed, m.sign), p) for p in prompts] for m in population.members]
    assert other_table == [[(("adapter", 1), p) for p in prompts]]
    assert other_table.timing == {"generate_s": 1.5}
    # the block of prompts p2 keeps the seed p2 has in the whole call
    (_, _, shard), = [grid for grid in plan.work[1] if not hasattr(grid[1], "members")]
    assert isinstance(shard, ShardSampling) and shard.prompt_offset == 2


def test_a_block_of_prompts_keeps_each_request_seed():
    sampling = SamplingSettings(max_new_tokens=4, temperature=1.0, seed=11)
    block = shard_sampling(sampling, 5)
    assert isinstance(block, ShardSampling) and block.temperature == 1.0 and block.max_new_tokens == 4
    assert [block.request_seed(i) for i in range(3)] == [sampling.request_seed(i) for i in range(5, 8)]
    assert shard_sampling(sampling, 0) is sampling


def test_cluster_resources_one_gpu_per_engine_else_a_cpu_slice():
    assert check_cluster_resources(4, {"CPU": 64.0, "GPU": 4.0}) == {"num_gpus": 1}
    assert check_cluster_resources(2, {"CPU": 2.0}) == {"num_cpus": 1.0}
    with pytest.raises(ValueError, match="num_engines: 8 engines need 8 GPUs .* has 4"):
        check_cluster_resources(8, {"CPU": 64.0, "GPU": 4.0})
    with pytest.raises(ValueError, match="num_engines: 3 CPU engines need 3 CPUs .* has 2"):
        check_cluster_resources(3, {"CPU": 2.0})


def test_engines_sharing_a_gpu_ask_for_their_part_of_it():
    assert check_cluster_resources(4, {"CPU": 16.0, "GPU": 1.0}, engines_per_gpu=4) == {"num_gpus": 0.25}
    assert check_cluster_resources(8, {"CPU": 64.0, "GPU": 4.0}, engines_per_gpu=2) == {"num_gpus": 0.5}
    assert check_cluster_resources(3, {"CPU": 64.0, "GPU": 4.0}, engines_per_gpu=2) == {"num_gpus": 0.5}
    with pytest.raises(ValueError, match=r"num_engines: 9 engines need 5 GPUs \(engines_per_gpu=2\) but the Ray cluster "
                                         r"has 4; use num_engines <= 8, a larger engines_per_gpu"):
        check_cluster_resources(9, {"CPU": 64.0, "GPU": 4.0}, engines_per_gpu=2)
    # a CPU cluster: each engine takes its CPU slice, engines_per_gpu places nothing
    assert check_cluster_resources(2, {"CPU": 2.0}, engines_per_gpu=4) == {"num_cpus": 1.0}


def test_engines_sharing_a_gpu_without_an_mps_daemon_are_warned(tmp_path):
    """A warning only where engines share GPUs and no control pipe is in the MPS pipe directory (the
    variable's, else NVIDIA's default); a directory with the daemon's control pipe (a real FIFO, as the
    daemon makes it) quiets it."""
    from evolm_lib.engines.ray.cluster import MPS_DEFAULT_PIPE, shared_card_warning

    shared = check_cluster_resources(8, {"CPU": 16.0, "GPU": 1.0}, engines_per_gpu=8)
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    warning = shared_card_warning(8, shared, {"CUDA_MPS_PIPE_DIRECTORY": str(pipe)})
    assert warning.startswith(f"engines_per_gpu: 8 engines share each GPU, but no CUDA MPS control daemon was found at {pipe}")
    os.mkfifo(pipe / "control")
    assert shared_card_warning(8, shared, {"CUDA_MPS_PIPE_DIRECTORY": str(pipe)}) is None
    if not os.path.exists(os.path.join(MPS_DEFAULT_PIPE, "control")):
        assert f"found at {MPS_DEFAULT_PIPE}:" in shared_card_warning(8, shared, {})
    assert shared_card_warning(1, check_cluster_resources(4, {"CPU": 64.0, "GPU": 4.0}), {}) is None  # one a card
    assert shared_card_warning(4, check_cluster_resources(2, {"CPU": 2.0}, engines_per_gpu=4), {}) is None  # no GPU


def test_engines_of_one_card_start_one_after_another_and_cards_side_by_side():
    assert start_waves(["a", "a", "b", None, "b"]) == [[0, 2, 3], [1, 4]]
    assert start_waves(["gpu0"] * 4) == [[0], [1], [2], [3]]  # four engines on one card: one at a time
    assert start_waves(["gpu0", "gpu1", "gpu2", "gpu3"]) == [[0, 1, 2, 3]]  # one per card: all together
    assert start_waves([None, None]) == [[0, 1]]  # CPU slices share nothing
    assert start_waves(["n1/gpu0", "n2/gpu0", "n1/gpu0", "n2/gpu0", "n1/gpu0"]) == [[0, 1], [2, 3], [4]]
    assert start_waves([]) == []
    assert start_waves(["gpu0"] * 4, together=True) == [[0, 1, 2, 3]]  # fixed KV caches: no memory profiling
    assert start_waves([], together=True) == []


# ----------------------------------------------------------------------------- bad input before any engine


def test_without_ray_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(RayUnavailableError, match=r"pip install -e '\.\[ray\]'"):
        RayEngines("tiny-random", num_engines=2)
    config = ESConfig(**ES_SETTINGS, engine_host="ray", num_engines=2)  # settings alone never need Ray
    with pytest.raises(ImportError, match=r"pip install -e '\.\[ray\]'"):
        make_engine(config)


def test_unreachable_address_fails_fast_before_ray_starts():
    ray = pytest.importorskip("ray")
    was_initialized = ray.is_initialized()
    started = time.perf_counter()
    with pytest.raises(ConnectionError, match=r"ray_address: no Ray cluster answers at 127.0.0.1:\d+.*ray start --head"):
        RayEngines("tiny-random", num_engines=2, ray_address=f"127.0.0.1:{free_port()}")
    assert time.perf_counter() - started < 10
    assert ray.is_initialized() == was_initialized


def test_more_engines_than_the_population_is_refused_before_ray():
    # one check, in the settings: a run's engine is made from validated settings only
    with pytest.raises(ConfigError, match="population_size: 2 members cannot keep num_engines=3"):
        make_engine(ESConfig(**{**ES_SETTINGS, "population_size": 2}, engine_host="ray", num_engines=3))


# ----------------------------------------------------------------------------- a local Ray cluster


def start_local_ray(ray, attempts: int = 3) -> None:
    """ray.init of a 2-CPU local cluster, robust to a busy 2-core machine.

    Ray's raylet aborts when its dashboard agent has not written its ports in time, and each of Ray's
    helper processes imports jsonschema. With other jobs on both cores, the seconds that jsonschema's
    optional `rfc3987_syntax` spent at import missed that deadline; the root conftest.py hides that
    module from the suite's processes. Retries cover the rest.
    """
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
            return
        except Exception:
            ray.shutdown()
            if attempt == attempts:
                raise


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    start_local_ray(ray)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def es_config():
    # each engine's share of the card under CUDA's MPS travels to its actor's environment; outside MPS
    # (here a CPU) it changes nothing, so the rows are still the local engine's
    return ESConfig(**ES_SETTINGS, engine_host="ray", num_engines=2, mps_thread_percentage=50)


@pytest.fixture(scope="module")
def local_engine(tiny_vllm):
    """The reference: the session's in-process engine on tiny-random. Its sizes (max_loras 8, rank 8,
    KV cache) differ from the actors' and change no completion."""
    return tiny_vllm


@pytest.fixture(scope="module")
def ray_engines(ray_cluster, es_config):
    """Two engines, one Ray actor each, as an ES run makes them."""
    engine = make_engine(es_config)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def reference_rows(es_config, local_engine, tmp_path_factory):
    """Metrics rows of the ES run with the engine in this process."""
    run = ESRun.create(es_config.replace(engine_host="local", num_engines=1, mps_thread_percentage=None),
                       tmp_path_factory.mktemp("es_local") / "run", engine=local_engine)
    run.run()
    return without_times(read_metrics(run.run_dir))


def population_around_init(seed: int, size: int) -> Population:
    spec = LoraSpec(rank=1)
    from evolm_lib.models import resolve_model

    mean = init_adapter(spec, adapter_shapes(resolve_model("tiny-random"), spec), "peft_default", seed=0)
    return Population(mean, tuple(es.population(seed, 1, size, antithetic=True)), 0.05)


@pytest.mark.slow  # starting 2 engines in actors: 75-95 s of setup on this shared 2-core machine
def test_two_engines_give_what_one_engine_gives(ray_engines, local_engine):
    assert len(ray_engines.engine_info) == 2 and len({i["pid"] for i in ray_engines.engine_info}) == 2
    assert all(i["device"] == "cpu" and i["torch_threads"] == 1 for i in ray_engines.engine_info)
    assert [(i["mps_thread_percentage"], i["sm_count"]) for i in ray_engines.engine_info] == [("50", None)] * 2
    population = population_around_init(3, 4)
    members = population.adapters()
    # a population: split by members, each engine making its members from the seeds
    table = ray_engines.generate(PROMPTS, population, GREEDY)
    assert token_ids(table) == token_ids(local_engine.generate(PROMPTS, members, GREEDY))
    assert set(table.timing) == {"adapters_s", "generate_s"}
    # several grids in one call: the population and its mean's greedy scoring
    grids = [(PROMPTS, population, GREEDY), (PROMPTS[:2], [population.mean], GREEDY)]
    assert [token_ids(t) for t in ray_engines.generate_grids(grids)] == \
           [token_ids(local_engine.generate(PROMPTS, members, GREEDY)), token_ids(local_engine.generate(PROMPTS[:2], [population.mean], GREEDY))]
    # one adapter, sampled with per-request seeds and log-probs (GRPO's rollouts): split by prompts
    sampled = SamplingSettings(max_new_tokens=8, temperature=1.0, seed=7, logprobs=True)
    prompts = [p for p in PROMPTS for _ in range(3)]
    remote = ray_engines.generate(prompts, [members[0]], sampled)
    local = local_engine.generate(prompts, [members[0]], sampled)
    assert token_ids(remote) == token_ids(local)
    assert torch.allclose(torch.tensor([lp for c in remote[0] for lp in c.logprobs]),
                          torch.tensor([lp for c in local[0] for lp in c.logprobs]), atol=1e-4)
    # token scoring: encode and prompt log-probs (KL to the base model)
    assert [ray_engines.encode(p) for p in PROMPTS] == [local_engine.encode(p) for p in PROMPTS]
    prompt_ids = [local_engine.encode(p) for p in prompts]
    completion_ids = [c.token_ids for c in local[0]]
    for adapter in (None, members[1]):
        remote_lp = ray_engines.prompt_logprobs(prompt_ids, completion_ids, adapter=adapter)
        local_lp = local_engine.prompt_logprobs(prompt_ids, completion_ids, adapter=adapter)
        assert torch.allclose(torch.tensor(sum(remote_lp, [])), torch.tensor(sum(local_lp, [])), atol=1e-4)
    assert ray_engines.faults == []


@pytest.mark.slow
def test_es_run_on_two_engines_equals_one_engine(ray_engines, es_config, reference_rows, tmp_path):
    run = ESRun.create(es_config, tmp_path / "run", engine=ray_engines)
    run.run()
    assert [r["generation"] for r in reference_rows] == [0, 1, 2]
    assert without_times(read_metrics(run.run_dir)) == reference_rows
    # the run's placement line says where each Ray engine ran, not only where the driver did
    line = record_placement(run.run_dir, es_config, run.placement())
    engines = json.loads((run.run_dir / "placement.jsonl").read_text().splitlines()[-1])["engines"]
    assert engines == line["engines"] and [e["engine"] for e in engines] == [0, 1]
    assert len({e["pid"] for e in engines}) == 2 and os.getpid() not in {e["pid"] for e in engines}
    assert all(e["device"] == "cpu" and e["host"] == socket.gethostname() for e in engines)


def test_more_engines_than_the_cluster_holds_is_refused_before_any_starts(ray_cluster):
    started = time.perf_counter()
    with pytest.raises(ValueError, match="num_engines: 3 CPU engines need 3 CPUs .* has 2"):
        RayEngines("tiny-random", num_engines=3)
    assert time.perf_counter() - started < 10  # an engine start alone takes 20 s or more here
    assert ray_cluster.is_initialized()  # a cluster it did not start is left alone


def kill_once(engine: int, at_call: int):
    """A hook that kills ``engine``'s actor (Ray restarts it) right after the ``at_call``-th submission."""
    state = {"calls": 0}

    def hook(pool: EnginePool, engines: list[int]) -> None:
        state["calls"] += 1
        if state["calls"] == at_call:
            ray = sys.modules["ray"]
            ray.kill(pool.actors[engine], no_restart=False)

    return hook


@pytest.mark.slow
def test_an_engine_killed_mid_generation_loses_nothing(ray_engines, es_config, reference_rows, tmp_path):
    pid_before = ray_engines.engine_info[1]["pid"]
    faults_before = len(ray_engines.faults)
    # calls of a run: create scores generation 0 (1), generation 1: population (2), score (3);
    # generation 2: population (4) -> killed while it runs
    ray_engines.pool.on_submitted = kill_once(engine=1, at_call=4)
    try:
        run = ESRun.create(es_config, tmp_path / "run", engine=ray_engines)
        run.run()
    finally:
        ray_engines.pool.on_submitted = None
    assert without_times(read_metrics(run.run_dir)) == reference_rows
    new_faults = ray_engines.faults[faults_before:]
    assert [(f["engine"], f["method"], f["attempt"]) for f in new_faults] == [(1, "generate_grids", 1)]
    assert ray_engines.engine_info[1]["pid"] != pid_before  # a new process, with a new engine


@pytest.mark.slow
def test_an_engine_that_stays_lost_stops_the_run_at_its_last_generation(ray_engines, es_config, reference_rows, tmp_path):
    policy = ray_engines.pool.policy
    ray_engines.pool.policy = FaultPolicy(max_attempts=1)  # one loss is too many: the run must stop cleanly
    ray_engines.pool.on_submitted = kill_once(engine=0, at_call=4)
    try:
        run = ESRun.create(es_config, tmp_path / "run", engine=ray_engines)
        run.step()
        with pytest.raises(EngineLostError, match=r"engine 0 of 2 \(Ray actor \w+, last on .* pid \d+\) is lost") as lost:
            run.step()
    finally:
        ray_engines.pool.on_submitted = None
        ray_engines.pool.policy = policy
    assert lost.value.engine == 0 and lost.value.attempts == 1
    # the run holds generation 1, finished and checkpointed; nothing of generation 2
    assert [r["generation"] for r in read_metrics(run.run_dir)] == [0, 1]
    assert list_checkpoints(run.run_dir)[-1].name.endswith("1")
    run.close()  # its folder is free again (the engines are the fixture's: they stay)
    # started again (the engine is back: Ray restarted it), it ends as if never interrupted
    resumed = ESRun.open(es_config, run.run_dir, engine=ray_engines)
    assert resumed.generation == 1
    resumed.run()
    assert without_times(read_metrics(run.run_dir)) == reference_rows


def test_an_engine_dead_for_good_raises_engine_lost_error(ray_cluster):
    """Ray will not restart an actor whose restarts are used up: the shard is not retried forever."""
    ray = ray_cluster

    class SlowEngine:  # defined here, so Ray ships the class itself to the worker
        def ready(self):
            return {"host": "here", "pid": os.getpid()}

        def generate_grids(self, grids, *shared):
            time.sleep(30)

    actor = ray.remote(SlowEngine).options(num_cpus=0, max_restarts=0).remote()  # a stand-in engine
    pool = EnginePool([actor], [ray.get(actor.ready.remote())], FaultPolicy(max_attempts=3, restart_timeout_s=60.0))
    pool.on_submitted = lambda pool, engines: ray.kill(pool.actors[0], no_restart=False)
    with pytest.raises(EngineLostError, match="engine 0 of 1 .* is lost: it is dead and Ray will not restart it") as lost:
        pool.run([(0, "generate_grids", ([],))])
    assert lost.value.attempts == 1 and len(pool.faults) == 1


def test_an_engine_back_without_the_state_it_held_ends_the_call(ray_cluster):
    """A restarted engine that lost what it kept between calls (a run's mean, es_mode full / eggroll)
    is not handed the call again: the pool's on_restarted names why, and EngineLostError says it."""
    ray = ray_cluster

    class SlowEngine:  # a stand-in engine that Ray restarts once
        def ready(self):
            return {"host": "here", "pid": os.getpid()}

        def generate_grids(self, grids, *shared):
            time.sleep(30)

    actor = ray.remote(SlowEngine).options(num_cpus=0, max_restarts=1).remote()
    pool = EnginePool([actor], [ray.get(actor.ready.remote())], FaultPolicy(max_attempts=3, restart_timeout_s=60.0))
    pid_before = pool.engine_info[0]["pid"]
    asked = []
    pool.on_restarted = lambda engine: asked.append(engine) or "it came back without the run's mean"
    pool.on_submitted = lambda pool, engines: ray.kill(pool.actors[0], no_restart=False)
    try:
        with pytest.raises(EngineLostError, match="engine 0 of 1 .* is lost: it came back without the run's mean") as lost:
            pool.run([(0, "generate_grids", ([],))])
    finally:
        ray.kill(actor, no_restart=True)
    assert asked == [0] and lost.value.attempts == 1  # asked once, after the engine answered again
    assert pool.engine_info[0]["pid"] != pid_before


@pytest.mark.slow
def test_grpo_run_on_two_engines_equals_one_engine(ray_engines, local_engine, tmp_path):
    from evolm_lib.train.grpo import GRPORun

    settings = dict(**ENGINE, task="conciseness", group_size=4, num_steps=2, max_new_tokens=6, learning_rate=1e-2,
                    micro_batch_size=8, beta=0.05)
    rows = {}
    for name, engine, extra in (("local", local_engine, {}), ("ray", ray_engines, {"engine_host": "ray", "num_engines": 2})):
        run = GRPORun.create(GRPOConfig(**settings, **extra), tmp_path / name, engine=engine)
        run.run()
        rows[name] = without_times(read_metrics(run.run_dir))
    # Log-probs differ in their last bits between engines of other sizes (the session engine has
    # rank-8 LoRA slots, the actors rank-1 ones): the engine-vs-trainer gap is compared to 1e-6.
    gap = "grpo/engine_logprob_gap"
    assert [r.get(gap) for r in rows["ray"]] == pytest.approx([r.get(gap) for r in rows["local"]], abs=1e-6)
    assert [{k: v for k, v in r.items() if k != gap} for r in rows["ray"]] == \
           [{k: v for k, v in r.items() if k != gap} for r in rows["local"]]


@pytest.mark.slow
def test_a_two_node_cluster_runs_the_batch_cli(tmp_path):
    """scripts/ray_two_nodes.py: the README's several-machines commands rehearsed on two Ray nodes of
    this host; `evolm batch` with ray_address finishes its run, and the run's placement.jsonl puts one
    of its engines on each node."""
    import json
    import subprocess

    pytest.importorskip("ray")
    script = Path(__file__).parents[1] / "scripts" / "ray_two_nodes.py"
    result = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    nodes = next(line for line in result.stdout.splitlines() if line.startswith("engines on nodes"))
    assert len(set(json.loads(nodes.removeprefix("engines on nodes ")))) == 2
    summary = json.loads((tmp_path / "out" / "batch" / "summary.json").read_text())
    assert [run["status"] for run in summary["runs"]] == ["ok"]
    run = tmp_path / "out" / "batch" / "two_nodes" / "run"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["generation"] for row in metrics] == [0, 1, 2]
    placement = [json.loads(line) for line in (run / "placement.jsonl").read_text().splitlines()]
    assert len(placement) == 1 and placement[0]["from_generation"] == 0
    assert sorted(info["node"] for info in placement[0]["engines"]) == sorted(json.loads(nodes.removeprefix("engines on nodes ")))
