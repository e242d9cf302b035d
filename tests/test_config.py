"""Tests for evolm_lib.config: defaults, YAML round trip, and a ConfigError naming the field for every bad input."""
from __future__ import annotations

import pytest

from evolm_lib.config import CommonConfig, ConfigError, ESConfig
from evolm_lib.lora import ALL_PROJECTIONS, LoraSpec
from evolm_lib.tasks import list_tasks


def test_defaults_are_valid():
    config = ESConfig()
    assert config.population_size == 16 and config.antithetic and config.population_size % 2 == 0
    assert config.sigma > 0 and config.learning_rate > 0
    assert config.target_modules == ALL_PROJECTIONS
    assert config.lora_spec() == LoraSpec(ALL_PROJECTIONS, 1, 1.0, None)
    assert CommonConfig().task in list_tasks()
    # every default survives its own validation
    assert ESConfig.from_dict(config.to_dict()) == config


def test_yaml_round_trip(tmp_path):
    config = ESConfig(
        model="tiny-random",
        task="countdown",
        task_options={"num_train": 4, "num_eval": 2},
        target_modules=("q_proj", "v_proj"),
        layers_to_transform=(0, 1),
        lora_rank=8,
        lora_alpha=16.0,
        sigma=0.003,
        optimizer="adam",
        learning_rate=5e-4,
        population_size=6,
        fitness_shaping="z_score",
        seed=7,
    )
    path = tmp_path / "config.yaml"
    text = config.to_yaml(path)
    assert path.read_text() == text
    loaded = ESConfig.from_yaml(path)
    assert loaded == config
    assert loaded.target_modules == ("q_proj", "v_proj")  # YAML lists come back as tuples
    assert loaded.layers_to_transform == (0, 1)
    assert loaded.lora_spec() == LoraSpec(("q_proj", "v_proj"), 8, 16.0, (0, 1))


def test_yaml_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        ESConfig.from_yaml(path)


def test_empty_yaml_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert ESConfig.from_yaml(path) == ESConfig()


@pytest.mark.parametrize(
    ("changes", "field", "detail"),
    [
        ({"sigmaa": 0.1}, "sigmaa", "unknown setting"),
        ({"sigma": "abc"}, "sigma", "valid number"),
        ({"population_size": "many"}, "population_size", "valid integer"),
        ({"antithetic": "maybe"}, "antithetic", "valid boolean"),
        ({"target_modules": "q_proj"}, "target_modules", "tuple"),
        ({"optimizer": "rmsprop"}, "optimizer", "'sgd' or 'adam'"),
        ({"sigma": 0.0}, "sigma", "greater than 0"),
        ({"sigma": -0.1}, "sigma", "greater than 0"),
        ({"population_size": 5}, "population_size", "even"),
        ({"noise_device": "tpu"}, "noise_device", "'cpu' or 'cuda'"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization", "less than or equal to 1"),
        ({"learning_rate": 0.0}, "learning_rate", "greater than 0"),
        ({"learning_rate": -1e-3}, "learning_rate", "greater than 0"),
        ({"lora_rank": 0}, "lora_rank", "greater than or equal to 1"),
        ({"temperature": -0.5}, "temperature", "greater than or equal to 0"),
        ({"target_modules": []}, "target_modules", "at least one module"),
        ({"model": "no-such-model"}, "model", "unknown model 'no-such-model'"),
        ({"task": "no-such-task"}, "task", "unknown task 'no-such-task'"),
        ({"task": "countdown", "task_options": {"num_train": -1}}, "num_train", ">= 0"),
    ],
)
def test_bad_input_is_a_config_error_naming_the_field(changes, field, detail):
    with pytest.raises(ConfigError) as caught:
        ESConfig.from_dict(changes)
    message = str(caught.value)
    assert field in message and detail in message, message


def test_unknown_model_lists_known_names():
    with pytest.raises(ConfigError, match="tiny-random") as caught:
        ESConfig.from_dict({"model": "no-such-model"})
    assert str(caught.value).startswith("invalid ESConfig: model:")


def test_unknown_task_lists_known_tasks():
    with pytest.raises(ConfigError) as caught:
        ESConfig.from_dict({"task": "no-such-task"})
    message = str(caught.value)
    assert message.startswith("invalid ESConfig: task:")
    assert all(name in message for name in list_tasks()), message


def test_unknown_task_option_is_a_config_error_naming_it():
    with pytest.raises(ConfigError) as caught:
        ESConfig.from_dict({"task": "countdown", "task_options": {"bogus": 1}})
    message = str(caught.value)
    assert "bogus" in message and "num_train" in message, message  # names the bad option and the accepted ones


def test_every_bad_field_is_named_at_once():
    with pytest.raises(ConfigError) as caught:
        ESConfig.from_dict({"sigma": -1, "lora_rank": 0, "temperature": -1})
    message = str(caught.value)
    assert all(name in message for name in ("sigma", "lora_rank", "temperature")), message


def test_odd_population_is_fine_without_antithetic():
    config = ESConfig.from_dict({"population_size": 5, "antithetic": False})
    assert config.population_size == 5 and not config.antithetic


def test_direct_construction_also_rejects_bad_values():
    # The constructor raises pydantic's ValidationError (a ValueError), from_dict a ConfigError.
    with pytest.raises(ValueError, match="sigma"):
        ESConfig(sigma=0.0)


def test_replace_validates_and_keeps_the_rest():
    config = ESConfig(model="tiny-random", sigma=0.01, seed=3)
    changed = config.replace(sigma=0.02, population_size=8)
    assert (changed.sigma, changed.population_size) == (0.02, 8)
    assert changed.seed == 3 and changed.model == "tiny-random"
    assert config.sigma == 0.01  # frozen: the original is untouched
    with pytest.raises(ConfigError, match="sigma"):
        config.replace(sigma=-1.0)
    with pytest.raises(ConfigError, match="population_size"):
        config.replace(population_size=7)
    with pytest.raises(ConfigError, match="nonsense: unknown setting"):
        config.replace(nonsense=1)


def test_config_is_frozen():
    config = ESConfig()
    with pytest.raises(ValueError):
        config.sigma = 1.0


def test_optimizer_config_follows_the_settings():
    from evolm_lib.es import AdamConfig, SGDConfig

    sgd = ESConfig(learning_rate=0.3, momentum=0.5, weight_decay=0.01).optimizer_config()
    assert sgd == SGDConfig(0.3, momentum=0.5, weight_decay=0.01)
    adam = ESConfig(optimizer="adam", learning_rate=1e-3, adam_beta1=0.8, adam_beta2=0.99).optimizer_config()
    assert adam == AdamConfig(1e-3, 0.8, 0.99, weight_decay=0.0)


def test_checks_over_several_fields_name_their_field_and_misspellings_the_nearest_name():
    with pytest.raises(ConfigError) as caught:
        ESConfig.from_dict({"population_size": 5})
    assert str(caught.value) == "invalid ESConfig: population_size: must be even with antithetic sampling (+/- pairs), got 5; use an even population or antithetic: false"
    assert caught.value.errors == [("population_size", "must be even with antithetic sampling (+/- pairs), got 5; use an even population or antithetic: false")]  # not "(settings)"
    with pytest.raises(ConfigError, match=r"^invalid ESConfig: num_engines: 2 engines need engine_host: ray"):
        ESConfig.from_dict({"engine_host": "local", "num_engines": 2})
    with pytest.raises(ConfigError) as caught:
        ESConfig.from_dict({"sigmaa": 0.1, "learnig_rate": 0.1, "zzz": 1})
    assert str(caught.value) == ("invalid ESConfig: sigmaa: unknown setting (did you mean sigma?); learnig_rate: "
                                 "unknown setting (did you mean learning_rate?); zzz: unknown setting")


def test_task_option_errors_name_the_option_by_its_path():
    with pytest.raises(ConfigError) as caught:
        ESConfig.from_dict({"task": "countdown", "task_options": {"num_trian": 8}})
    assert str(caught.value).startswith("invalid ESConfig: task_options.num_trian: task 'countdown' has no option "
                                        "'num_trian' (did you mean num_train?); accepted options: num_train")
    with pytest.raises(ConfigError, match=r"^invalid ESConfig: task_options: JSONL task file nope.jsonl not found"):
        ESConfig.from_dict({"task": "jsonl", "task_options": {"path": "nope.jsonl"}})


def test_a_config_error_can_name_where_a_field_was_written():
    with pytest.raises(ConfigError) as caught:
        ESConfig.from_dict({"sigma": -1.0, "lora_rank": 0})
    located = caught.value.located({"sigma": "sweep.es.sigma"})
    assert str(located) == ("invalid ESConfig: lora_rank: Input should be greater than or equal to 1; "
                            "sweep.es.sigma: Input should be greater than 0")


def test_a_setting_by_its_older_name_reads_under_its_name_now_and_both_names_disagreeing_are_refused():
    assert ESConfig.from_dict({"evaluator": "ray", "num_engines": 2}).engine_host == "ray"
    assert "evaluator" not in ESConfig.from_dict({"evaluator": "local"}).to_dict()
    assert ESConfig.from_dict({"evaluator": "ray", "engine_host": "ray"}).engine_host == "ray"
    with pytest.raises(ConfigError, match=r"evaluator: the older name of engine_host, given as 'ray' beside engine_host: 'local'"):
        ESConfig.from_dict({"evaluator": "ray", "engine_host": "local"})
