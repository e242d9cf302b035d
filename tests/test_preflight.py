"""Engine settings are checked before a run folder exists, with the project's setting names."""
from __future__ import annotations

import json
import warnings

import pytest

from evolm_lib import preflight
from evolm_lib.config import ConfigError, ESConfig, GRPOConfig
from evolm_lib.train.es import ESRun
from evolm_lib.train.grpo import GRPORun
from evolm_lib.preflight import check_engine_settings

TINY = dict(model="tiny-random", max_model_len=256, kv_cache_gb=0.1, max_new_tokens=8, population_size=4)
# tiny-random: 2 layers x 1 KV head x head size 32 x K and V x 4 bytes (float32) = 512 bytes a token
TINY_BYTES_PER_TOKEN = 2 * 2 * 1 * 32 * 4


@pytest.fixture(autouse=True)
def plenty_of_memory(monkeypatch):
    """The machine's free memory as the checks see it (tests set it where it matters)."""
    monkeypatch.setattr(preflight, "_free_memory", lambda cuda: (20 * 2**30, 24 * 2**30))
    monkeypatch.setattr(preflight, "_engine_live", lambda: False)  # a session engine elsewhere must not matter


def test_the_tiny_settings_pass_and_report_the_budget(tiny_model_dir):
    budget = check_engine_settings(ESConfig(**TINY), tiny_model_dir)
    assert budget.context_length == 2048
    assert budget.kv_bytes_per_token == TINY_BYTES_PER_TOKEN
    assert budget.kv_tokens == int(0.1 * 2**30) // TINY_BYTES_PER_TOKEN
    assert budget.requests_per_call == 4 * 2  # population x the 2 conciseness train prompts
    assert 10 < budget.longest_prompt_tokens < 100


def test_context_longer_than_the_model_fails_before_the_run_folder(tiny_model_dir, tmp_path):
    config = ESConfig(**{**TINY, "max_model_len": 40960})
    with pytest.raises(ConfigError, match=r"max_model_len=40960 is longer than the model's context "
                                          r"\(max_position_embeddings=2048 in .*config.json\): set max_model_len <= 2048"):
        ESRun.create(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_kv_cache_smaller_than_one_sequence_names_kv_cache_gb(tiny_model_dir, tmp_path):
    config = ESConfig(**{**TINY, "kv_cache_gb": 0.0001})  # 209 tokens for a max_model_len of 256
    with pytest.raises(ConfigError) as caught:
        ESRun.create(config, tmp_path / "run")
    message = str(caught.value)
    assert "kv_cache_gb=0.0001 holds 209 tokens" in message and "max_model_len=256" in message
    assert "raise kv_cache_gb to at least 0.00013" in message and "gpu_memory_utilization" not in message
    assert not (tmp_path / "run").exists()
    config = ESConfig(**{**TINY, "kv_cache_gb": 0.00013})  # the suggestion works
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the population does not fit at once: a warning, checked below
        check_engine_settings(config, tiny_model_dir)


def test_a_population_that_does_not_fit_at_once_is_a_warning(tiny_model_dir):
    config = ESConfig(**{**TINY, "kv_cache_gb": 0.0002, "population_size": 32})  # 419 tokens, 64 requests
    with pytest.warns(UserWarning, match=r"of the 64 requests of a generation .* run at once.*kv_cache_gb="):
        check_engine_settings(config, tiny_model_dir)


def test_prompt_plus_new_tokens_must_fit_max_model_len(tiny_model_dir, tmp_path):
    longest = check_engine_settings(ESConfig(**TINY), tiny_model_dir).longest_prompt_tokens
    assert longest == 47  # the conciseness prompts with SmolLM2's chat template (its default system turn)
    config = ESConfig(**{**TINY, "max_model_len": 64, "max_new_tokens": 20})
    with pytest.raises(ConfigError, match=r"max_model_len=64 is too short for the task's longest prompt \(47 tokens\) "
                                          r"plus max_new_tokens=20: raise max_model_len to at least 67"):
        ESRun.create(config, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"max_new_tokens=64 leaves no room for a prompt in max_model_len=64"):
        check_engine_settings(ESConfig(**{**TINY, "max_model_len": 64, "max_new_tokens": 64}), tiny_model_dir)
    assert not (tmp_path / "run").exists()


def test_memory_the_machine_does_not_have(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(preflight, "_free_memory", lambda cuda: (2 * 2**30, 24 * 2**30))
    with pytest.raises(ConfigError, match=r"kv_cache_gb=4 plus the model's weights .* need more than the 2 GiB of RAM"):
        check_engine_settings(ESConfig(**{**TINY, "kv_cache_gb": 4.0}), tiny_model_dir)
    config = ESConfig(**{**TINY, "kv_cache_gb": None, "gpu_memory_utilization": 0.9})
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=0.9 asks for 21.6 GiB, the engine's share of RAM "
                                          r"\(on a CPU\), but 2 GiB are free now: lower gpu_memory_utilization or set kv_cache_gb"):
        check_engine_settings(config, tiny_model_dir)


def test_memory_is_not_checked_while_an_engine_runs_in_this_process(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(preflight, "_free_memory", lambda cuda: (2 * 2**30, 24 * 2**30))
    monkeypatch.setattr(preflight, "_engine_live", lambda: True)  # its memory is taken already; a run may share it
    check_engine_settings(ESConfig(**{**TINY, "kv_cache_gb": 4.0}), tiny_model_dir)


def test_gpu_utilization_below_the_weights(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(preflight, "_free_memory", lambda cuda: (80 * 2**30, 80 * 2**30))
    monkeypatch.setattr(preflight, "weights_bytes", lambda *a: 30 * 2**30)
    config = ESConfig(**{**TINY, "kv_cache_gb": None, "gpu_memory_utilization": 0.3})
    with pytest.raises(ConfigError, match="less than the model's weights .* raise gpu_memory_utilization"):
        check_engine_settings(config, tiny_model_dir, cuda=True)


def test_grpo_runs_are_checked_too(tiny_model_dir, tmp_path):
    config = GRPOConfig(model="tiny-random", max_model_len=4096, kv_cache_gb=0.1, max_new_tokens=8, group_size=4)
    with pytest.raises(ConfigError, match="max_model_len=4096 is longer"):
        GRPORun.create(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    budget = check_engine_settings(config.replace(max_model_len=256), tiny_model_dir)
    assert budget.requests_per_call == 4 * 2


def test_hf_engine_has_no_kv_cache_to_check(tiny_model_dir):
    config = ESConfig(**{**TINY, "engine": "hf", "kv_cache_gb": 0.0001, "max_model_len": 40960})
    assert check_engine_settings(config, tiny_model_dir).kv_cache_bytes is None


def test_context_length_reads_rope_scaling_and_old_names(tmp_path):
    assert preflight.context_length({"n_positions": 1024}) == 1024
    assert preflight.context_length({"max_position_embeddings": 4096,
                                     "rope_scaling": {"rope_type": "linear", "factor": 2.0}}) == 8192
    assert preflight.context_length({"max_position_embeddings": 131072,
                                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}) == 131072
    assert preflight.context_length({"max_position_embeddings": 32768, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}) == 131072
    assert preflight.context_length({}) is None
    nested = tmp_path / "config.json"
    nested.write_text(json.dumps({"text_config": {"max_position_embeddings": 512, "num_hidden_layers": 2}}))
    assert preflight.context_length(preflight.model_config(tmp_path)) == 512


def test_on_a_gpu_the_check_tests_the_share_the_engine_asks_for(tiny_model_dir, monkeypatch):
    """gpu_memory_utilization unset: the engine asks for 0.6 of the card (llm_arguments), and the
    check tests 0.6 too: 6 of 10 GiB fit in 7 free GiB (0.85 would not), not in 5."""
    from evolm_lib.engines import EngineSizing
    from evolm_lib.engines.vllm.startup import llm_arguments

    config = ESConfig(**{**TINY, "kv_cache_gb": None})
    asked = llm_arguments(tiny_model_dir, EngineSizing.from_config(config), on_gpu=True)["gpu_memory_utilization"]
    assert asked == 0.6
    monkeypatch.setattr(preflight, "_free_memory", lambda cuda: (7 * 2**30, 10 * 2**30))
    assert check_engine_settings(config, tiny_model_dir, cuda=True).kv_cache_bytes is None  # vLLM sizes it from the share
    monkeypatch.setattr(preflight, "_free_memory", lambda cuda: (5 * 2**30, 10 * 2**30))
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=0.6 asks for 6 GiB, the engine's share of GPU "
                                          r"memory, but 5 GiB are free now"):
        check_engine_settings(config, tiny_model_dir, cuda=True)


GIB = 2**30


def test_the_engines_one_card_holds_are_counted_from_one_engines_footprint():
    # weights 1 GiB, master 2 GiB, 4 sequences of 256 tokens at 512 bytes a token (0.5 MiB), allowance 2 GiB
    footprint = preflight.engine_footprint(GIB, 2 * GIB, 512, 4, 256)
    assert footprint.kv_cache == 4 * 256 * 512 and footprint.allowance == preflight.ENGINE_ALLOWANCE_BYTES == 2 * GIB
    assert footprint.total == 5 * GIB + 4 * 256 * 512
    assert preflight.engines_that_fit(80 * GIB, footprint) == 15  # 15 x 5.0005 = 75.0 GiB; 16 would need 80.008
    assert preflight.engines_that_fit(15 * footprint.total, footprint) == 15
    assert preflight.engines_that_fit(15 * footprint.total - 1, footprint) == 14
    assert preflight.engines_that_fit(4 * GIB, footprint) == 0
    # a max_model_len between KV blocks takes the whole last block: 250 tokens -> 16 blocks of 16
    assert preflight.engine_footprint(0, 0, 512, 1, 250, allowance=0).total == 256 * 512
    for card in (7 * GIB, 10 * GIB, 80 * GIB, 141 * GIB):  # the count never exceeds what the card holds
        fit = preflight.engines_that_fit(card, footprint)
        assert fit * footprint.total <= card < (fit + 1) * footprint.total


def test_engines_per_gpu_beyond_what_the_card_holds_is_refused_naming_it(tiny_model_dir, monkeypatch):
    """Each engine: 1 GiB of weights, no master (es_mode lora), 8 requests over 4 engines = 2 sequences of
    256 tokens at 512 bytes (256 KiB), 2 GiB allowance: 3 GiB + 256 KiB, so 10 free GiB hold 3 engines."""
    monkeypatch.setattr(preflight, "_free_memory", lambda cuda: (10 * GIB, 10 * GIB))
    monkeypatch.setattr(preflight, "weights_bytes", lambda *a: GIB)
    settings = {**TINY, "kv_cache_gb": None, "engine_host": "ray", "num_engines": 4}
    with pytest.raises(ConfigError, match=r"engines_per_gpu=4 engines need 12 GiB of GPU memory, 3 GiB \(weights 1 GiB, "
                                          r"float32 master and buffers 0 GiB, KV cache 0.000244 GiB, .*\) each for 2 "
                                          r"sequences of max_model_len=256, but the card has 10 GiB free now, which hold 3: "
                                          r"set engines_per_gpu <= 3"):
        check_engine_settings(ESConfig(**settings, engines_per_gpu=4), tiny_model_dir, cuda=True)
    check_engine_settings(ESConfig(**settings, engines_per_gpu=3), tiny_model_dir, cuda=True)  # 3 fit
    # on a CPU the engines take CPU slices: engines_per_gpu is not a card's count
    check_engine_settings(ESConfig(**{**settings, "kv_cache_gb": 0.1}, engines_per_gpu=4), tiny_model_dir, cuda=False)


def test_es_mode_full_counts_every_engines_master_and_the_shares_of_all_engines(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(preflight, "weights_bytes", lambda *a: GIB)
    config = ESConfig(**{**TINY, "kv_cache_gb": None}, es_mode="full", engine_host="ray", num_engines=2, engines_per_gpu=2)
    master = preflight.weights_mode_bytes(config, tiny_model_dir)  # float32 master and one member's noise
    monkeypatch.setattr(preflight, "_free_memory", lambda cuda: (10 * GIB, 10 * GIB))
    footprint = preflight.check_engines_per_gpu(config, tiny_model_dir, 10 * GIB, GIB, 512, 8)
    assert footprint.master == master > 0 and footprint.total == GIB + master + 4 * 256 * 512 + 2 * GIB
    check_engine_settings(config, tiny_model_dir, cuda=True)  # 2 x 0.3 of the card for the engines, masters beside
    # a share set by hand is each engine's: 2 x 0.6 of the card is more than the card
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=0.6 asks for 6 GiB, the engine's share of GPU memory "
                                          r"for each of engines_per_gpu=2 engines on the card, but 10 GiB are free now: "
                                          r"lower gpu_memory_utilization or engines_per_gpu"):
        check_engine_settings(config.replace(gpu_memory_utilization=0.6), tiny_model_dir, cuda=True)


# --------------------------------------------------------------------------- sizes a machine can hold

ABSURD = 10**9


@pytest.mark.parametrize("cls, field", [(ESConfig, "population_size"), (GRPOConfig, "group_size"),
                                        (ESConfig, "max_new_tokens"), (ESConfig, "num_generations"),
                                        (GRPOConfig, "num_steps")])
def test_a_size_of_ten_to_the_ninth_is_refused_naming_the_field_and_the_largest_value_that_fits(
        cls, field, tiny_model_dir):
    """10^9 members, group, completion tokens or generations: refused from the settings alone, against
    this machine's memory (psutil), naming the field and the largest value that fits; that value does fit
    and one more does not."""
    import psutil

    base = {k: v for k, v in TINY.items() if cls is ESConfig or k != "population_size"}
    config = cls(**base).model_copy(update={field: ABSURD})  # as a notebook or sweep would build it
    with pytest.raises(ConfigError, match=rf"^{field}=1,000,000,000 is more than this machine can hold: .*"
                                          rf"the largest {field} that fits is [\d,]+$") as refused:
        preflight.check_run_sizes(config, tiny_model_dir, cuda=False)
    largest = int(str(refused.value).rsplit(" ", 1)[1].replace(",", ""))
    assert 1 <= largest < ABSURD and refused.value.errors[0][0] == field
    assert f"this machine has {psutil.virtual_memory().total / 2**30:.3g} GiB" in str(refused.value)
    preflight.check_run_sizes(config.model_copy(update={field: largest}), tiny_model_dir, cuda=False)
    with pytest.raises(ConfigError, match="is more than this machine can hold"):  # one more does not fit
        preflight.check_run_sizes(config.model_copy(update={field: largest + 1}), tiny_model_dir, cuda=False)


def test_the_cards_memory_bounds_the_engines_lora_slots(tiny_model_dir):
    """On a GPU the engine's LoRA slots (population + 1, twice for resident slots) live on the card: a
    population whose slots exceed the card is refused naming GPU memory, while the host holds it."""
    config = ESConfig(**TINY)
    slot = preflight.lora_slot_bytes(config, tiny_model_dir)
    assert slot > 0
    sizes = preflight.check_run_sizes(config, tiny_model_dir, cuda=True, card_bytes=2**40)
    card = 100 * slot  # room for about 50 members' slots, in place (twice the slots)
    with pytest.raises(ConfigError, match=r"population_size=1,000 .* GPU memory for the engine's LoRA slots .*"
                                          r"the largest population_size that fits is (\d+)$") as refused:
        preflight.check_run_sizes(config.model_copy(update={"population_size": 1000}), tiny_model_dir,
                                  cuda=True, card_bytes=card)
    largest = int(str(refused.value).rsplit(" ", 1)[1])
    assert preflight.check_run_sizes(config.model_copy(update={"population_size": largest}), tiny_model_dir,
                                     cuda=True, card_bytes=card).card_bytes <= card < sizes.card_bytes * 1000


def test_a_task_of_ten_to_the_ninth_examples_is_refused_before_one_is_made():
    with pytest.raises(ConfigError, match=r"task_options: num_train=1,000,000,000 is more than this machine can "
                                          r"hold: .* the largest num_train that fits is [\d,]+"):
        ESConfig(task="arithmetic", task_options={"num_train": ABSURD})
    with pytest.raises(ConfigError, match=r"num_eval=1,000,000,000 .* the largest num_eval that fits"):
        GRPOConfig(task="countdown", task_options={"num_eval": ABSURD})


def test_a_gpu_run_gets_the_cards_memory_plan_before_its_engine(tiny_model_dir, monkeypatch):
    # a card with 2.5 GiB free: the engine's allowance (2 GiB) and the tiny model fit, with room
    monkeypatch.setattr(preflight, "_free_memory", lambda cuda: (int(2.5 * 2**30), 80 * 2**30))
    config = ESConfig(**{**TINY, "kv_cache_gb": 0.0625, "es_mode": "full", "es_weights": "all"})
    preflight.check_engine_settings(config, tiny_model_dir, cuda=True)
    # 2 GiB free: the allowance alone fills it, and one card is all there is
    monkeypatch.setattr(preflight, "_free_memory", lambda cuda: (2 * 2**30, 80 * 2**30))
    with pytest.raises(ConfigError, match="at no tensor_parallel_size up to the 1 cards present"):
        preflight.check_engine_settings(config, tiny_model_dir, cuda=True)
    two = ESConfig(**{**TINY, "kv_cache_gb": 0.0625, "es_mode": "full", "es_weights": "all",
                      "tensor_parallel_size": 2, "noise_scheme": "tiled"})
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 splits each engine over 2 cards, but 1 are present"):
        monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
        preflight.check_engine_settings(two, tiny_model_dir, cuda=True)
