"""Resident LoRA slots written in place (``evolm_lib.engines.vllm.slots``, the client, and
``vllm.worker_slots``, the extension inside the engine) on a real vLLM engine:
the same completions as the file path, the trainer's exact member tensors in the slots, rewrites
that take effect (prefix cache included), pinned slots that survive file-path calls, and errors.

The fast tests share ONE tiny-random engine started with the worker extension; the ``slow`` test
starts its own SmolLM2 engine.
"""
from __future__ import annotations

import pytest
import torch

from evolm_lib import es
from evolm_lib.engines import SamplingSettings
from evolm_lib.engines.vllm import worker_slots
from evolm_lib.engines.vllm.engine import VLLMEngine
from evolm_lib.engines.vllm.requests import RequestGrid, run_requests
from evolm_lib.engines.vllm.rpc import stored_form
from evolm_lib.engines.vllm.slots import EXTENSION, ResidentSlots, SlotsUnsupported, describe, supported
from evolm_lib.lora import AdapterWeights, LoraSpec, adapter_shapes, init_adapter
from evolm_lib.types import Prompt

# rank 2 < the engine's max_lora_rank 8 (padding); alpha / r = 1.5 (folded into B by vLLM)
SPEC = LoraSpec(rank=2, alpha=3.0)
SIGMA = 0.05  # large enough on tiny-random for members to differ from each other and from the base
POPULATION = 4
MAX_LORAS = 8  # file-path adapters per call; the engine has more slots (see free_slots)
GREEDY = SamplingSettings(max_new_tokens=12)
PROMPTS = [Prompt.user("What is 2+3?"), Prompt.user("Name a colour."), "Once upon a time"]
# vLLM's GPU LoRA kernels take half-precision weights only; bfloat16 is slow on CPU.
DTYPE = "bfloat16" if torch.cuda.is_available() else "float32"
TORCH_DTYPE = getattr(torch, DTYPE)
# Longer than one KV block (128 tokens on CPU), so the prefix cache holds full blocks of it.
LONG_PROMPT = Prompt.user("Count the words in this sentence, please. " * 30)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """One tiny-random engine with the slot extension for the module."""
    engine = VLLMEngine(
        str(tiny_model_dir), max_loras=MAX_LORAS, max_lora_rank=8, max_model_len=512, kv_cache_gb=0.125, dtype=DTYPE,
        # the prefix cache on (VLLMEngine turns it off for in-place engines): stale KV blocks under
        # the fixed slot names are the danger the writes must reset
        engine_kwargs={"worker_extension_cls": EXTENSION, "enable_prefix_caching": True},
    )
    yield engine
    engine.close()


@pytest.fixture
def resident(engine):
    population = ResidentSlots(engine.llm, SPEC, POPULATION, engine.model_dir, engine.dtype)
    yield population
    population.close()


def make_mean(model_dir, spec: LoraSpec = SPEC) -> AdapterWeights:
    """A mean adapter with non-zero A and B (PEFT init moved by one seeded step)."""
    init = init_adapter(spec, adapter_shapes(model_dir, spec), "peft_default", seed=0)
    return AdapterWeights(spec, es.perturb(dict(init.tensors), es.Member(99), 0.02))


def member_adapters(mean: AdapterWeights, members, sigma=SIGMA, scheme="flat") -> list[AdapterWeights]:
    """What the trainer builds for the file path (``ESRun.member_adapters``)."""
    return [AdapterWeights(mean.spec, es.perturb(dict(mean.tensors), m, sigma, scheme=scheme)) for m in members]


def free_slots(llm) -> int:
    """Engine LoRA slots that are not pinned by a resident population."""
    info = describe(llm)
    return info["max_loras"] - len(info["pinned"])


def token_ids(rows) -> list[list[tuple[int, ...]]]:
    return [[c.token_ids for c in row] for row in rows]


def test_supported_on_an_engine_with_the_extension(engine):
    ok, reason = supported(engine.llm)
    assert ok, reason
    assert "max_lora_rank 8" in reason
    info = describe(engine.llm)
    assert info["ok"] and info["max_loras"] > POPULATION + 1 and not info["pinned"]
    # tiny-random has 2 layers: qkv_proj, o_proj, gate_up_proj, down_proj in each
    assert len(info["modules"]) == 8


def test_not_supported_without_extension_or_lora():
    class NoExtension:
        class llm_engine:
            class vllm_config:
                lora_config = object()

        def collective_rpc(self, method, args=()):
            raise AttributeError(f"'CPUWorker' object has no attribute {method!r}")

    ok, reason = supported(NoExtension())
    assert not ok and "worker_extension_cls" in reason

    class NoLora(NoExtension):
        class llm_engine:
            class vllm_config:
                lora_config = None

    ok, reason = supported(NoLora())
    assert not ok and "enable_lora" in reason
    with pytest.raises(SlotsUnsupported, match="worker_extension_cls"):
        ResidentSlots(NoExtension(), SPEC, 2, ".", "float32")


def test_slots_give_the_file_paths_greedy_completions(engine, resident):
    mean = make_mean(engine.model_dir)
    members = es.population(base_seed=7, generation=1, population_size=POPULATION)
    timing = resident.write(mean, members, SIGMA)
    assert timing["slots_write_s"] >= 0 and timing["slots_call_s"] >= timing["slots_write_s"]
    from_slots = resident.generate(PROMPTS, GREEDY, with_base=True)
    from_files = engine.generate(PROMPTS, member_adapters(mean, members), GREEDY)
    base = engine.generate(PROMPTS, [None], GREEDY)
    assert token_ids(from_slots[:POPULATION]) == token_ids(from_files)
    assert [[c.text for c in row] for row in from_slots[:POPULATION]] == [[c.text for c in row] for row in from_files]
    assert token_ids(from_slots[POPULATION:]) == token_ids(base)  # the zero slot is the base model
    # the test can fail: members differ from each other and from the base
    assert len({tuple(row) for row in token_ids(from_files)}) == POPULATION
    assert all(row != token_ids(base)[0] for row in token_ids(from_files))


def test_a_population_is_served_from_the_slots_prepared_for_it_or_set_up_in_its_call(engine):
    """``prepare_population`` sets the slots up before any population is sent, and a population's call
    writes those slots (the same object); on an engine not prepared the call sets them up itself, and
    both serve the same completions. A population larger than the slots is refused at preparation."""
    from evolm_lib.engines import Population

    members = tuple(es.population(base_seed=5, generation=1, population_size=POPULATION))
    population = Population(make_mean(engine.model_dir), members, SIGMA)
    assert engine.slots.resident is None
    try:
        unprepared = engine.generate(PROMPTS, population, GREEDY)  # no slots yet: set up in this call
        assert engine.slots.resident is not None and engine.slots.resident.spec == SPEC
        engine.slots.close()
        engine.prepare_population(SPEC, POPULATION)
        prepared = engine.slots.resident
        assert prepared is not None and prepared.spec == SPEC
        table = engine.generate(PROMPTS, population, GREEDY)
        assert engine.slots.resident is prepared and table.timing["slots_write_s"] >= 0
        assert token_ids(table) == token_ids(unprepared)
        assert len({tuple(row) for row in token_ids(table)}) == POPULATION  # the members differ: the test can fail
        with pytest.raises(ValueError, match=f"a population of {MAX_LORAS + 1} exceeds the engine's max_loras={MAX_LORAS}"):
            engine.prepare_population(SPEC, MAX_LORAS + 1)
    finally:
        engine.slots.close()


@pytest.mark.parametrize(
    "spec, scheme",
    [(SPEC, "flat"), (LoraSpec(("q_proj", "v_proj", "down_proj"), rank=1, alpha=1.0, layers_to_transform=(1,)), "flat"),
     (SPEC, "per_tensor")],
    ids=["all-projections-r2", "q-v-down-layer1-r1", "all-projections-r2-per-tensor-noise"],
)
def test_slot_checksums_equal_the_trainers_member_tensors(engine, spec, scheme):
    # The second spec leaves k_proj (a slice of the packed qkv_proj), gate/up/o and layer 0 out: zero there.
    mean = make_mean(engine.model_dir, spec)
    members = es.population(base_seed=3, generation=5, population_size=POPULATION)
    with ResidentSlots(engine.llm, spec, POPULATION, engine.model_dir, engine.dtype) as population:
        population.write(mean, members, SIGMA, noise_scheme=scheme)
        host = member_adapters(mean, members, scheme=scheme)  # es.perturb on the host, as the trainer does
        assert population.checksums() == [population.expected_checksum(a.tensors) for a in host]
        scaling = spec.alpha / spec.rank
        for index, adapter in enumerate(host):
            held = population.read(index)
            for name, tensor in adapter.tensors.items():
                expected = stored_form(tensor, ".lora_A." in name, TORCH_DTYPE, TORCH_DTYPE, scaling)
                assert torch.equal(held[name], expected), name
        # a checksum that cannot tell members apart would pass trivially
        assert len(set(population.checksums())) == POPULATION


def test_the_mean_written_after_the_members_is_the_mean_exactly(engine, resident):
    """The slot after the members holds the mean itself (sign 0): what the mean's greedy scoring
    uses when it rides in the population's call, instead of an adapter file."""
    mean = make_mean(engine.model_dir)
    members = es.population(base_seed=17, generation=1, population_size=POPULATION - 2)
    resident.write(mean, members, SIGMA, with_mean=True)
    assert resident.checksums()[len(members)] == resident.expected_checksum(mean.tensors)
    assert resident.checksums()[: len(members)] == [resident.expected_checksum(a.tensors)
                                                    for a in member_adapters(mean, members)]
    encoded = [engine.encoder.encode(p) for p in PROMPTS]
    (served,) = run_requests(engine.llm, [RequestGrid(encoded, [resident.mean_request()], GREEDY)])
    assert token_ids(served) == token_ids(engine.generate(PROMPTS, [mean], GREEDY))
    resident.write(mean, members, SIGMA)
    with pytest.raises(RuntimeError, match="with_mean"):
        resident.mean_request()
    with pytest.raises(ValueError, match="and the mean"):
        resident.write(mean, es.population(base_seed=17, generation=1, population_size=POPULATION), SIGMA, with_mean=True)


def test_a_rewritten_slot_serves_the_new_weights(engine, resident):
    mean = make_mean(engine.model_dir)
    prompts = [LONG_PROMPT] + PROMPTS
    first = es.population(base_seed=11, generation=1, population_size=POPULATION)
    second = es.population(base_seed=11, generation=2, population_size=POPULATION)
    resident.write(mean, first, SIGMA)
    before = resident.generate(prompts, GREEDY)
    resident.write(mean, second, SIGMA)
    after = resident.generate(prompts, GREEDY)
    # the new weights, not the old ones (nor KV blocks cached under the same slot names)
    assert token_ids(after) == token_ids(engine.generate(prompts, member_adapters(mean, second), GREEDY))
    assert token_ids(after) != token_ids(before)
    # writing the first generation again brings its completions back
    resident.write(mean, first, SIGMA)
    assert token_ids(resident.generate(prompts, GREEDY)) == token_ids(before)


def test_antithetic_pairs_are_opposite_in_the_slots(engine, resident):
    mean = make_mean(engine.model_dir)
    members = es.population(base_seed=5, generation=0, population_size=POPULATION)
    assert members[0].seed == members[1].seed and (members[0].sign, members[1].sign) == (1, -1)
    resident.write(mean, members, SIGMA)
    scaling = SPEC.alpha / SPEC.rank
    plus, minus = resident.read(0), resident.read(1)
    for name, tensor in mean.tensors.items():
        centre = stored_form(tensor, ".lora_A." in name, TORCH_DTYPE, TORCH_DTYPE, scaling).double()
        up, down = plus[name].double() - centre, minus[name].double() - centre
        assert up.abs().max() > 0.1 * SIGMA
        # equal up to the rounding of mean +- step to the engine dtype
        torch.testing.assert_close(up, -down, rtol=0, atol=1e-6 if DTYPE == "float32" else 2e-3)


def test_slots_stay_resident_through_file_path_calls(engine, resident):
    mean = make_mean(engine.model_dir)
    members = es.population(base_seed=13, generation=1, population_size=POPULATION)
    resident.write(mean, members, SIGMA)
    checksums = resident.checksums()
    before = token_ids(resident.generate(PROMPTS, GREEDY))
    free = free_slots(engine.llm)
    per_call = min(MAX_LORAS, free)
    # file-path adapters with new ids, more than the free slots hold: vLLM evicts, but not the resident slots
    for generation in range(free // per_call + 2):
        others = member_adapters(mean, es.population(13, 100 + generation, per_call, antithetic=False))
        engine.generate(PROMPTS[:1], others, GREEDY)
    assert resident.checksums() == checksums
    assert token_ids(resident.generate(PROMPTS, GREEDY)) == before
    resident.write(mean, members, SIGMA)  # the slot layout check passes
    # the pinned slots are not offered to a second population
    with pytest.raises(ValueError, match="free LoRA slots"):
        ResidentSlots(engine.llm, SPEC, free, engine.model_dir, engine.dtype, first_id=2_000_000_000)


def test_a_loader_mismatch_is_refused_and_the_slots_released(engine, monkeypatch):
    # Pretend vLLM's loader stopped folding alpha / r into B: the fingerprint check must refuse.
    def unscaled(tensor, is_a, file_dtype, slot_dtype, scaling):
        return tensor.to(file_dtype).to(slot_dtype)

    monkeypatch.setattr(worker_slots, "stored_form", unscaled)
    with pytest.raises(SlotsUnsupported, match="differently from the in-place write"):
        ResidentSlots(engine.llm, SPEC, POPULATION, engine.model_dir, engine.dtype)
    monkeypatch.undo()
    # nothing stayed pinned: a population of the same size fits again
    with ResidentSlots(engine.llm, SPEC, POPULATION, engine.model_dir, engine.dtype) as population:
        population.write(make_mean(engine.model_dir), es.population(1, 1, 2), SIGMA)
        assert len(population.lora_requests()) == 2


def test_bad_input_is_refused(engine, resident):
    mean = make_mean(engine.model_dir)
    with pytest.raises(RuntimeError, match="call write"):
        resident.lora_requests()
    with pytest.raises(ValueError, match="5 members but only 4 resident slots"):
        resident.write(mean, es.population(1, 1, 6)[:5], SIGMA)
    with pytest.raises(ValueError, match="must not be empty"):
        resident.write(mean, [], SIGMA)
    with pytest.raises(ValueError, match="spec"):
        resident.write(make_mean(engine.model_dir, LoraSpec(rank=1)), es.population(1, 1, 2), SIGMA)
    partial = AdapterWeights(SPEC, dict(list(mean.tensors.items())[1:]))
    with pytest.raises(ValueError, match="missing"):
        resident.write(partial, es.population(1, 1, 2), SIGMA)
    with pytest.raises(ValueError, match="sigma"):
        resident.write(mean, es.population(1, 1, 2), -1.0)
    with pytest.raises(ValueError, match="noise_device"):
        resident.write(mean, es.population(1, 1, 2), SIGMA, noise_device="tpu")
    with pytest.raises(TypeError, match="es.Member"):
        resident.write(mean, [(1, 1)], SIGMA)
    with pytest.raises(ValueError, match="max_lora_rank 8"):
        ResidentSlots(engine.llm, LoraSpec(rank=16), 2, engine.model_dir, engine.dtype, first_id=2_000_000_000)
    with pytest.raises(ValueError, match="free LoRA slots"):
        ResidentSlots(engine.llm, SPEC, describe(engine.llm)["max_loras"], engine.model_dir, engine.dtype,
                           first_id=2_000_000_000)


@pytest.mark.slow
def test_slots_match_the_file_path_on_smollm2(smollm2_dir):
    spec = LoraSpec(rank=1, alpha=2.0)
    prompts = [Prompt.user("What is 2+3?"), Prompt.user("Name a colour.")]
    sampling = SamplingSettings(max_new_tokens=16)
    with VLLMEngine(str(smollm2_dir), max_loras=8, max_lora_rank=1, max_model_len=512, kv_cache_gb=0.25,
                       dtype=DTYPE, engine_kwargs={"worker_extension_cls": EXTENSION}) as engine:
        mean = make_mean(smollm2_dir, spec)
        members = es.population(base_seed=1, generation=1, population_size=POPULATION)
        with ResidentSlots(engine.llm, spec, POPULATION, smollm2_dir, engine.dtype) as population:
            population.write(mean, members, 0.02)
            from_slots = population.generate(prompts, sampling)
            adapters = member_adapters(mean, members, 0.02)
            from_files = engine.generate(prompts, adapters, sampling)
            assert population.checksums() == [population.expected_checksum(a.tensors) for a in adapters]
            assert len({tuple(row) for row in token_ids(from_files)}) > 1
            if not torch.cuda.is_available():
                # vLLM's GPU LoRA kernels do not repeat bit for bit across batch layouts (two file-path
                # calls with the same adapters differ too): exact completions only on the CPU
                assert token_ids(from_slots) == token_ids(from_files)
