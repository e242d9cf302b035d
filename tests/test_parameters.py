"""evolm_lib.parameters: notebook parameters as run settings, the translation a notebook's config cell
and `evolm batch --dry-run` share."""
from __future__ import annotations

import os

import pytest

from evolm_lib.config import ConfigError, ESConfig, GRPOConfig
from evolm_lib.parameters import kind_of_tags, notebook_config, read_yaml_setting


def test_parameters_by_name_then_settings_over_them():
    namespace = {"model": "tiny-random", "sigma": 0.1, "population_size": 4, "run_dir": "runs/x", "verbose": True,
                 "settings": {"optimizer": "adam", "population_size": 6, "lora_alpha": 4.0}}
    config = notebook_config(ESConfig, namespace)
    assert (config.model, config.sigma, config.optimizer, config.lora_alpha) == ("tiny-random", 0.1, "adam", 4.0)
    assert config.population_size == 6  # settings win over the parameter of the same name
    assert config.learning_rate == ESConfig().learning_rate  # not given: the class default


def test_text_for_mappings_and_tuples_and_empty_values_for_none():
    config = notebook_config(ESConfig, {"task": "countdown", "task_options": "{num_train: 8, num_eval: 4}",
                                        "target_modules": "q_proj, v_proj", "estimator": "", "ray_address": "",
                                        "prompts_per_step": 0, "kv_cache_gb": None})
    assert config.task_options == {"num_train": 8, "num_eval": 4}
    assert config.target_modules == ("q_proj", "v_proj")
    assert config.estimator is None and config.ray_address is None and config.prompts_per_step is None
    assert notebook_config(ESConfig, {"task_options": ""}).task_options == {}
    # an empty value means None only where None is the default: 0 generations stays an error
    with pytest.raises(ConfigError, match="num_generations: Input should be greater than or equal to 1"):
        notebook_config(ESConfig, {"num_generations": 0})
    # a notebook's `settings` given as YAML text (e.g. typed in a form) reads as well
    assert notebook_config(GRPOConfig, {"settings": "{group_size: 4, beta: 0.1}"}).beta == 0.1


def test_errors_name_the_setting_its_path_and_the_nearest_name():
    with pytest.raises(ConfigError) as caught:
        notebook_config(ESConfig, {"sigma": -1.0, "settings": {"optimizr": "adam", "lora_alpha": 0}})
    message = str(caught.value)
    assert message.startswith("invalid ESConfig: ")
    assert "sigma: Input should be greater than 0" in message  # a parameter: its own name
    assert "settings.optimizr: unknown setting (did you mean optimizer?)" in message  # from settings: its path
    assert "settings.lora_alpha: Input should be greater than 0" in message
    with pytest.raises(ConfigError, match="settings: expected a mapping of ESConfig settings, got 3"):
        notebook_config(ESConfig, {"settings": 3})


def test_invalid_yaml_names_the_setting_and_the_line():
    with pytest.raises(ConfigError) as caught:
        notebook_config(ESConfig, {"task": "countdown", "task_options": "num_train: 8\nnum_eval: [4", "sigma": 0})
    message = str(caught.value)
    assert "task_options: not valid YAML at line 2, column" in message, message
    assert "sigma: Input should be greater than 0" in message  # the other fields are still checked
    with pytest.raises(ConfigError, match=r"^settings: not valid YAML at line 1, column \d+"):
        read_yaml_setting("settings", "{optimizer: adam")


def test_odd_population_names_the_field_and_antithetic_is_reachable():
    with pytest.raises(ConfigError, match=r"invalid ESConfig: population_size: must be even with antithetic sampling \(\+/- pairs\), got 5"):
        notebook_config(ESConfig, {"population_size": 5})
    assert notebook_config(ESConfig, {"population_size": 5, "settings": {"antithetic": False}}).population_size == 5


def test_kind_tags():
    assert kind_of_tags(["parameters", "settings:es"]) == "es"
    assert kind_of_tags(["parameters"]) is None
    with pytest.raises(ConfigError, match="unknown run kind 'ez'"):
        kind_of_tags(["parameters", "settings:ez"])


def test_a_notebook_run_opened_again_in_one_kernel_resumes_and_other_settings_get_their_own_folder(tmp_path, monkeypatch):
    """What Run All twice does in one kernel: the run opened before is closed, the same settings resume
    in the same folder; a raised budget extends that run; changed settings open a folder of their own."""
    from evolm_lib.config import ESConfig
    from evolm_lib.engines.synthetic import SyntheticEngine
    from evolm_lib.parameters import open_notebook_run
    from evolm_lib.runs import NOTEBOOK_RUNS_ENV, RunFolderBusy, WriterLock, notebook_run_dir
    from evolm_lib.train.es import ESRun

    monkeypatch.setenv(NOTEBOOK_RUNS_ENV, str(tmp_path))
    config = ESConfig(model="tiny-random", target_modules=("q_proj", "v_proj"), sigma=0.02, learning_rate=0.05,
                      population_size=4, num_generations=1, seed=5)
    first = open_notebook_run(ESRun, config, "stepper", engine=SyntheticEngine())
    first.run()
    assert first.run_dir == notebook_run_dir("stepper", config) and first.run_dir.name.startswith("stepper-")
    again = open_notebook_run(ESRun, config, "stepper", engine=SyntheticEngine())  # the first is closed
    assert (again.run_dir, again.generation) == (first.run_dir, 1)
    longer = open_notebook_run(ESRun, config.replace(num_generations=3, eval_every=2), "stepper", engine=SyntheticEngine())
    assert (longer.run_dir, longer.generation) == (first.run_dir, 1)  # budget and cadence: the same run, extended
    other = open_notebook_run(ESRun, config.replace(sigma=0.05), "stepper", engine=SyntheticEngine())
    assert other.run_dir != first.run_dir and other.generation == 0
    other.close()
    with WriterLock.acquire(first.run_dir):  # a writer other than this notebook's run is still refused
        with pytest.raises(RunFolderBusy):
            open_notebook_run(ESRun, config, "stepper", engine=SyntheticEngine())
    # each opening said where it ran and from which generation its rows go on; the refused one wrote nothing
    from evolm_lib.env import PLACEMENT
    from evolm_lib.runs import read_jsonl

    lines = read_jsonl(first.run_dir / PLACEMENT)
    assert [line["from_generation"] for line in lines] == [0, 1, 1]
    assert {line["device"] for line in lines} == {"cpu"} and all(line["pid"] == os.getpid() for line in lines)
    assert [line["from_generation"] for line in read_jsonl(other.run_dir / PLACEMENT)] == [0]
