"""Validation examples: carved beside the training pool, disjoint from the held-out ones; scored in
runs as validation/reward; and ES's shuffled-fitness control."""
from __future__ import annotations

import json

import pytest
import torch

from evolm_lib.config import ESConfig
from evolm_lib.engines.synthetic import SyntheticEngine
from evolm_lib.tasks import get_task
from evolm_lib.train.es import ESRun, controlled_rewards


def _prompts(examples):
    return {(e.prompt, e.target) for e in examples}


@pytest.mark.parametrize("name, options", [
    ("arithmetic", {"num_train": 20, "num_eval": 30, "num_validation": 10}),
    ("countdown", {"num_train": 20, "num_eval": 30, "num_validation": 10}),
    ("conciseness", {"num_eval": 108, "num_validation": 50}),
])
def test_validation_is_disjoint_from_held_out_and_training(name, options):
    task = get_task(name, **options)
    train, held_out, validation = (_prompts(task.train_examples()), _prompts(task.eval_examples()),
                                   _prompts(task.validation_examples()))
    assert len(validation) == options["num_validation"] == len(task.validation_examples())
    assert not validation & held_out and not validation & train and not train & held_out
    # the training and held-out problems do not move when validation problems are added
    without = get_task(name, **{**options, "num_validation": 0})
    assert task.train_examples() == without.train_examples() and task.eval_examples() == without.eval_examples()
    assert without.validation_examples() == []


def test_conciseness_held_out_set_grows_past_the_eight_and_defaults_stay():
    default = get_task("conciseness")
    assert len(default.eval_examples()) == 8 and default.validation_examples() == []
    large = get_task("conciseness", num_eval=108)
    assert large.eval_examples()[:8] == default.eval_examples() and len(_prompts(large.eval_examples())) == 108
    with pytest.raises(ValueError, match="num_eval and num_validation"):
        get_task("conciseness", num_eval=108, num_validation=200)


def test_jsonl_validation_lines_and_carved_training_lines(tmp_path):
    path = tmp_path / "task.jsonl"
    lines = [{"prompt": f"q{i}", "target": str(i)} for i in range(5)]
    lines += [{"prompt": "v", "target": "v", "split": "validation"}, {"prompt": "e", "target": "e", "split": "eval"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    task = get_task("jsonl", path=str(path), num_validation=2)
    assert [e.prompt for e in task.train_examples()] == ["q0", "q1", "q2"]
    assert [e.prompt for e in task.validation_examples()] == ["v", "q3", "q4"]
    assert [e.prompt for e in task.eval_examples()] == ["e"]
    with pytest.raises(ValueError, match="num_validation"):
        get_task("jsonl", path=str(path), num_validation=5)


def _config(**changes) -> ESConfig:
    settings = dict(model="tiny-random", target_modules=("q_proj", "v_proj"), sigma=0.02, learning_rate=0.05,
                    population_size=4, num_generations=2, seed=5, task="conciseness",
                    task_options={"num_validation": 4})
    return ESConfig(**{**settings, **changes})


def test_runs_score_the_validation_examples_as_validation_reward(tmp_path):
    engine = SyntheticEngine()
    run = ESRun.create(_config(), tmp_path / "run", engine=engine)
    run.run()
    targets = [len(e.target) for e in run.task.validation_examples()]
    for row in run.history:
        # the synthetic engine answers every prompt of one adapter with one length; the row's train
        # completions show it, and the validation reward is minus its mean gap to the targets
        length = len(row["policy/train_completions"][0])
        assert row["validation/reward"] == pytest.approx(sum(-abs(length - t) for t in targets) / len(targets))
    assert run.counters["eval_completions"] == 3 * (2 + 8 + 4)  # three scorings of train, held-out, validation
    run.close()


def test_controlled_rewards_permute_the_members_seeded_by_the_generation():
    rewards = torch.arange(12, dtype=torch.float32).reshape(6, 2)  # (population, prompts)
    config = _config(fitness_control="shuffled")
    assert controlled_rewards(_config(), 1, rewards) is rewards
    shuffled = controlled_rewards(config, 1, rewards)
    assert sorted(map(tuple, shuffled.tolist())) == sorted(map(tuple, rewards.tolist()))  # whole rows, moved
    assert not torch.equal(shuffled, rewards)
    assert torch.equal(controlled_rewards(config, 1, rewards), shuffled)  # reproducible
    assert not torch.equal(controlled_rewards(config, 2, rewards), shuffled)  # another generation, another order


def test_shuffled_fitness_changes_the_update_and_repeats(tmp_path):
    means = {}
    for name, control in (("real", "none"), ("shuffled", "shuffled"), ("again", "shuffled")):
        run = ESRun.create(_config(fitness_control=control), tmp_path / name, engine=SyntheticEngine())
        run.run()
        means[name] = run.mean.tensors.flat.clone()
        rows = [{k: v for k, v in r.items() if k.startswith("train/")} for r in run.history]
        means[name + "_rows"] = rows
        run.close()
    assert torch.equal(means["shuffled"], means["again"])
    assert not torch.equal(means["real"], means["shuffled"])
    # what the members scored is reported as measured: only the update sees the permutation
    assert means["real_rows"][1]["train/reward_mean"] == means["shuffled_rows"][1]["train/reward_mean"]


def test_a_run_folder_without_the_setting_loads_with_no_control(tmp_path):
    run = ESRun.create(_config(), tmp_path / "run", engine=SyntheticEngine())
    run.close()
    text = (tmp_path / "run" / "config.yaml").read_text()
    assert "fitness_control: none" in text
    (tmp_path / "run" / "config.yaml").write_text(text.replace("fitness_control: none\n", ""))
    resumed = ESRun.resume(tmp_path / "run", engine=SyntheticEngine())
    assert resumed.config.fitness_control == "none"
    resumed.close()
