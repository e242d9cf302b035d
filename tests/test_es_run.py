"""Tests for evolm_lib.train.es: ES runs on the synthetic engine (convergence, metrics, exact resume,
kills, run folders, final adapter) and one end-to-end run on a real vLLM engine with tiny-random."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
import time
from pathlib import Path

import pytest
import torch

from evolm_lib import es
from evolm_lib.config import ConfigError, ESConfig
from evolm_lib.lora import load_adapter
from evolm_lib.train.es import ESRun, noise_cards_problem
from evolm_lib.runs import load_run_config
from evolm_lib.runs import RunFolderExists, list_checkpoints, read_metrics
from evolm_lib.engines.synthetic import SyntheticEngine
from evolm_lib.tasks.conciseness import EVAL_PAIRS, TRAIN_PAIRS
from evolm_lib.metrics import without_times

from helpers_data import assert_rows_close, data_script
from helpers_kill_run import kill_config

HELPER = Path(__file__).with_name("helpers_kill_run.py")
TRAIN_TARGETS = [len(target) for _, target in TRAIN_PAIRS]  # [1, 2]
EVAL_TARGETS = [len(target) for _, target in EVAL_PAIRS]


def small_config(**changes) -> ESConfig:
    """A fast synthetic run: 448 adapter parameters (q and v of tiny-random's two layers), population 4."""
    settings = dict(
        model="tiny-random",
        target_modules=("q_proj", "v_proj"),
        sigma=0.02,
        learning_rate=0.05,
        population_size=4,
        num_generations=3,
        seed=5,
    )
    return ESConfig(**{**settings, **changes})


def synthetic_length(engine: SyntheticEngine, adapter, max_new_tokens: int) -> int:
    """The synthetic engine's completion length, from its documented formula."""
    return 1 + min(round(engine.length_scale * engine.distance(adapter)), 4 * max_new_tokens)


def mean_gap_reward(length: int, targets: list[int]) -> float:
    """Conciseness reward averaged over prompts: mean of -|length - target length|."""
    return sum(-abs(length - t) for t in targets) / len(targets)


def run_to_end(config: ESConfig, run_dir: Path) -> ESRun:
    """An uninterrupted reference run."""
    run = ESRun.create(config, run_dir, engine=SyntheticEngine())
    run.run()
    run.close()
    return run


def assert_same_adapter(a, b) -> None:
    assert a.spec == b.spec and set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        assert torch.equal(a.tensors[name], b.tensors[name]), name


# ------------------------------------------------------------------------------ convergence


@pytest.mark.parametrize("seed", [0, 1])
def test_es_improves_the_synthetic_quadratic(tmp_path, seed):
    # SGD, sigma 0.02, lr 0.05, 16 antithetic members, centred ranks, 448 parameters: over five seeds
    # the reward rose by 38-47 and the distance to the target fell to 0.54-0.61 of its start.
    # (All 2048 parameters of the seven projections: only +9..+12 in 40 generations; lr 0.1 diverges.)
    config = small_config(population_size=16, num_generations=40, learning_rate=0.05, eval_every=5, seed=seed)
    engine = SyntheticEngine()
    run = ESRun.create(config, tmp_path / "run", engine=engine)
    start_reward = run.history[0]["policy/train_reward"]
    start_distance = engine.distance(run.mean)
    rows = run.run()
    assert len(rows) == 40
    assert rows[-1]["policy/train_reward"] >= start_reward + 25
    assert engine.distance(run.mean) < 0.75 * start_distance
    scored = [row["policy/train_reward"] for row in run.history if "policy/train_reward" in row]
    assert len(scored) == 9  # generation 0 and every 5th
    assert scored[-1] > scored[4] > scored[0]  # still climbing at the half way mark
    early = sum(r["train/reward_mean"] for r in rows[:5]) / 5
    late = sum(r["train/reward_mean"] for r in rows[-5:]) / 5
    assert late > early + 20


# ------------------------------------------------------------------------------ metrics


def test_metrics_rows_follow_the_synthetic_formula(tmp_path):
    config = small_config(momentum=0.0)
    engine = SyntheticEngine()
    run = ESRun.create(config, tmp_path / "run", engine=engine)
    row0 = run.history[0]
    mean_length = synthetic_length(engine, run.mean, config.max_new_tokens)
    assert row0["generation"] == 0 and row0["method"] == "es" and row0["seed"] == 5
    assert row0["policy/train_reward"] == mean_gap_reward(mean_length, TRAIN_TARGETS)
    assert row0["eval/reward"] == mean_gap_reward(mean_length, EVAL_TARGETS)
    assert row0["policy/train_completions"] == ["x" * mean_length] * 2
    assert row0["samples/completions"] == 0 and row0["samples/eval_completions"] == 2 + 8

    population, prompts = config.population_size, len(TRAIN_PAIRS)
    tokens = 0
    for generation in (1, 2, 3):
        members = run.ask()
        assert [m.sign for m in members] == [1, -1, 1, -1]  # antithetic pairs share a seed
        assert members[0].seed == members[1].seed and members[2].seed == members[3].seed
        lengths = [synthetic_length(engine, a, config.max_new_tokens) for a in run.parameters.member_adapters(members)]
        before = {k: v.clone() for k, v in run.mean.tensors.items()}
        result = run.evaluate(members)
        assert tuple(result.rewards.shape) == (population, prompts)
        row = run.tell(members, result)
        assert "policy/train_reward" not in row and len(read_metrics(run.run_dir)) == generation  # not yet committed
        row.update(run.score())
        run.commit(row)

        assert row["generation"] == generation == run.generation
        rewards = [mean_gap_reward(length, TRAIN_TARGETS) for length in lengths]
        assert row["es/rewards"] == rewards
        # centred ranks by hand: (strictly below + at-or-below - 1) / 2 / (n - 1) - 0.5
        ranks = [((sum(s < r for s in rewards) + sum(s <= r for s in rewards) - 1) / 2) / 3 - 0.5 for r in rewards]
        assert row["es/weights"] == pytest.approx(ranks, abs=1e-7)
        assert sum(row["es/weights"]) == pytest.approx(0.0, abs=1e-7)
        ordered = sorted(rewards)
        assert row["train/reward_mean"] == pytest.approx(sum(rewards) / 4)
        assert row["train/reward_best"] == max(rewards) and row["train/reward_worst"] == min(rewards)
        # torch.quantile, linear: p20 at position 0.6, p80 at 2.4 of the 4 sorted rewards
        assert row["train/reward_p20"] == pytest.approx(ordered[0] + 0.6 * (ordered[1] - ordered[0]))
        assert row["train/reward_p80"] == pytest.approx(ordered[2] + 0.4 * (ordered[3] - ordered[2]))
        best, worst = lengths[rewards.index(max(rewards))], lengths[rewards.index(min(rewards))]
        assert row["best_completions"] == ["x" * best] * prompts
        assert row["worst_completions"] == ["x" * worst] * prompts
        assert row["prompts"] == [prompt for prompt, _ in TRAIN_PAIRS]

        # the update is plain SGD on the qiu gradient: mean += lr / N * sum w_i sign_i eps_i
        gradient = es.es_gradient(members, torch.tensor(row["es/weights"]), run.parameters.shapes, config.sigma)
        for name, tensor in run.mean.tensors.items():
            torch.testing.assert_close(tensor, before[name] + config.learning_rate * gradient[name], rtol=0, atol=1e-7)
        step = math.sqrt(sum(float(((run.mean.tensors[k] - before[k]).double() ** 2).sum()) for k in before))
        assert row["es/update_norm"] == pytest.approx(step, rel=1e-6)

        assert result.num_tokens == sum(lengths) * prompts  # one token per character
        tokens += result.num_tokens
        assert row["samples/completions"] == population * prompts * generation
        assert row["samples/tokens"] == tokens
        assert row["samples/eval_completions"] == (2 + 8) * (generation + 1)  # eval_every=1

        times = {key: row[f"time/{key}"] for key in ("adapters_s", "generate_s", "reward_s", "update_s", "eval_s")}
        assert all(value >= 0 for value in times.values())
        assert row["time/generation_s"] == pytest.approx(sum(times.values()))
        assert row["time/wall_s"] > run.history[-2]["time/wall_s"]

    rows = read_metrics(tmp_path / "run")
    assert [r["generation"] for r in rows] == [0, 1, 2, 3]
    assert rows == json.loads(json.dumps(run.history))
    config_text = (tmp_path / "run" / "config.yaml").read_text()
    assert "kind: es" in config_text.splitlines()
    assert load_run_config(tmp_path / "run") == config
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["000002", "000003"]  # keep_checkpoints=2


# ------------------------------------------------------------------------------ resume


@pytest.mark.parametrize("checkpoint_every", [1, 2])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_resume_ends_bit_for_bit_like_an_uninterrupted_run(tmp_path, checkpoint_every, optimizer):
    extra = {"momentum": 0.9, "learning_rate": 0.02} if optimizer == "sgd" else {"learning_rate": 0.002}
    config = small_config(num_generations=6, checkpoint_every=checkpoint_every, optimizer=optimizer, **extra)
    reference = run_to_end(config, tmp_path / "reference")

    first = ESRun.create(config, tmp_path / "run", engine=SyntheticEngine())
    first.run(3)
    first.close()
    resumed = ESRun.resume(tmp_path / "run", engine=SyntheticEngine())
    # checkpoint_every=2: generation 3 had no checkpoint, so it reruns and its row is dropped
    assert resumed.generation == (3 if checkpoint_every == 1 else 2)
    assert [r["generation"] for r in read_metrics(tmp_path / "run")] == list(range(resumed.generation + 1))
    resumed.run()

    assert resumed.generation == reference.generation == 6
    assert_same_adapter(resumed.mean, reference.mean)
    expected_state = es.optimizer_state_to_tensors(reference.parameters.optimizer_state)
    actual_state = es.optimizer_state_to_tensors(resumed.parameters.optimizer_state)
    assert set(expected_state) == set(actual_state)
    assert all(torch.equal(expected_state[k], actual_state[k]) for k in expected_state)
    rows, expected = read_metrics(tmp_path / "run"), read_metrics(tmp_path / "reference")
    assert [r["generation"] for r in rows] == list(range(7))  # no duplicate generations
    assert [r.get("es/rewards") for r in rows] == [r.get("es/rewards") for r in expected]
    assert without_times(rows) == without_times(expected)


def test_kill_mid_generation_then_resume(tmp_path):
    run_dir = tmp_path / "killed"
    process = subprocess.run(
        [sys.executable, str(HELPER), str(run_dir), "4"], capture_output=True, text=True, timeout=120
    )
    assert process.returncode == -9, process.stderr[-2000:]
    # died inside generation 4: rows 0..3 written, the last checkpoint is generation 2 (checkpoint_every=2)
    assert [r["generation"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]
    assert [p.name for p in list_checkpoints(run_dir)] == ["000000", "000002"]

    resumed = ESRun.resume(run_dir, engine=SyntheticEngine())
    assert resumed.generation == 2
    resumed.run()
    reference = run_to_end(kill_config(), tmp_path / "reference")
    assert_same_adapter(resumed.mean, reference.mean)
    rows = read_metrics(run_dir)
    assert [r["generation"] for r in rows] == list(range(7))
    assert without_times(rows) == without_times(read_metrics(tmp_path / "reference"))


def test_kill_mid_generation_on_vllm_in_place_then_resume_bit_exact(tmp_path):
    """SIGKILL inside a population call on a real vLLM engine with resident slots (and the mean's
    scoring riding): the resumed run ends as an uninterrupted one, row for row and bit for bit."""
    from helpers_kill_run import vllm_engine, vllm_kill_config

    run_dir = tmp_path / "killed"
    process = subprocess.run([sys.executable, str(HELPER), str(run_dir), "4", "--vllm"], capture_output=True,
                             text=True, timeout=600)
    assert process.returncode == -9, process.stderr[-2000:]
    assert [p.name for p in list_checkpoints(run_dir)] == ["000000", "000002"]
    engine = vllm_engine()
    try:
        resumed = ESRun.resume(run_dir, engine=engine)
        assert resumed.generation == 2
        resumed.run()
        reference = ESRun.create(vllm_kill_config(), tmp_path / "reference", engine=engine)
        reference.run()
        assert engine.adapter_transfer == "in_place" and engine.slots.resident is not None  # no silent fall-back
    finally:
        engine.close()
    assert_same_adapter(resumed.mean, reference.mean)
    rows = read_metrics(run_dir)
    assert [r["generation"] for r in rows] == list(range(6))
    assert without_times(rows) == without_times(read_metrics(tmp_path / "reference"))


def test_kill_between_checkpoint_and_metrics_line(tmp_path):
    config = small_config(num_generations=6)
    run = ESRun.create(config, tmp_path / "run", engine=SyntheticEngine())
    run.run(3)
    run.close()
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    lost = json.loads(lines[-1])
    assert lost["generation"] == 3
    metrics.write_text("".join(lines[:-1]))  # checkpoint 3 landed, its metrics line did not

    resumed = ESRun.resume(tmp_path / "run", engine=SyntheticEngine())
    assert resumed.generation == 3
    restored = read_metrics(tmp_path / "run")
    assert [r["generation"] for r in restored] == [0, 1, 2, 3]
    assert restored[-1] == lost  # the row comes back from the checkpoint's state.json
    resumed.run()
    reference = run_to_end(config, tmp_path / "reference")
    assert_same_adapter(resumed.mean, reference.mean)
    assert without_times(read_metrics(tmp_path / "run")) == without_times(read_metrics(tmp_path / "reference"))


@pytest.mark.parametrize("cut", ["update", "write_checkpoint", "append_metrics"])
def test_a_generation_cut_after_its_update_stops_the_run_and_opening_it_again_continues(tmp_path, monkeypatch, cut):
    """Ctrl-C in a notebook after a generation's update and before its commit has returned (after
    the mean moved, after its checkpoint, after its metrics line): the run object is ahead of its
    folder, so it refuses to go on (it would skip or repeat a row), naming what to do; opened
    again, the run ends with the rows of an uninterrupted one."""
    import evolm_lib.train.loop as loop

    config = small_config(num_generations=5)
    run = ESRun.create(config, tmp_path / "run", engine=SyntheticEngine())
    run.run(2)
    owner = run.parameters if cut == "update" else loop
    done = getattr(owner, cut)

    def then_ctrl_c(*args, **kwargs):
        done(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, cut, then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        run.step()
    monkeypatch.setattr(owner, cut, done)
    rows = read_metrics(tmp_path / "run")
    for go_on in (run.step, run.ask, run.save_final):  # run.ask: the stepper notebook's own loop
        with pytest.raises(RuntimeError, match=r"generation 3 was cut short .* run = ESRun\.open\(config, run_dir\)"):
            go_on()
    assert read_metrics(tmp_path / "run") == rows and not (tmp_path / "run" / "final_adapter").exists()
    run.close()
    resumed = ESRun.open(config, tmp_path / "run", engine=SyntheticEngine())
    resumed.run()
    reference = run_to_end(config, tmp_path / "reference")
    assert_same_adapter(resumed.mean, reference.mean)
    assert without_times(read_metrics(tmp_path / "run")) == without_times(read_metrics(tmp_path / "reference"))


class RoundTrips(SyntheticEngine):
    """The synthetic engine, declaring that it batches grids (so scoring rides in the population's
    call), and counting engine round trips: one per ``generate`` or ``generate_grids`` call."""

    batches_grids = True

    def __init__(self):
        super().__init__()
        self.round_trips = 0
        self._inside = False

    def generate(self, *args, **kwargs):
        self.round_trips += not self._inside
        return super().generate(*args, **kwargs)

    def generate_grids(self, grids):
        self.round_trips += 1
        self._inside = True
        try:
            return super().generate_grids(grids)
        finally:
            self._inside = False


SCORE_KEYS = ("policy/train_reward", "eval/reward", "policy/train_completions", "policy/eval_completions",
              "policy/train_tokens")


def scores_by_mean(rows: list[dict]) -> dict[int, tuple]:
    """Each scored mean's generation -> its scores, wherever the row that holds them sits."""
    return {row.get("policy/generation", row["generation"]): tuple(row[k] for k in SCORE_KEYS)
            for row in rows if "eval/reward" in row}


def test_scoring_rides_in_the_population_call_of_the_generation_it_produced(tmp_path):
    config = small_config(num_generations=4, eval_every=1)
    reference = run_to_end(config.replace(score_in_population=False), tmp_path / "reference")
    engine = RoundTrips()
    seen = []
    run = ESRun.create(config, tmp_path / "run", engine=engine)
    run.run(callback=lambda row: seen.append((row["generation"], row.get("policy/generation"))))
    # generation 0's scoring, 4 population calls (generations 2-3 carry the mean that produced
    # them), and the last mean's scoring: 6 round trips, against 1 + 2 x 4 without riding
    assert engine.round_trips == 6
    assert seen == [(1, None), (2, 1), (3, 2), (4, None)]  # each row final when handed over, in order
    rows, expected = read_metrics(tmp_path / "run"), read_metrics(tmp_path / "reference")
    assert rows == [r for r in read_metrics(tmp_path / "run")]  # nothing rewritten later
    trained = [{k: v for k, v in r.items() if k not in SCORE_KEYS + ("policy/generation", "samples/eval_completions")}
               for r in rows]
    assert without_times(trained) == without_times(
        [{k: v for k, v in r.items() if k not in SCORE_KEYS + ("samples/eval_completions",)} for r in expected])
    riding, own = scores_by_mean(rows), scores_by_mean(expected)
    assert sorted(riding) == [0, 1, 2, 4]  # the mean of the budget's second-to-last generation is not scored
    assert all(riding[mean] == own[mean] for mean in riding)  # the same mean scores the same
    assert_same_adapter(run.mean, reference.mean)


def test_every_committed_row_is_final(tmp_path):
    config = small_config(num_generations=3, eval_every=1, checkpoint_every=1)
    run = ESRun.create(config, tmp_path / "run", engine=RoundTrips())
    for generation in (1, 2):
        row = run.step()
        assert row["generation"] == generation
        assert read_metrics(tmp_path / "run")[-1] == json.loads(json.dumps(row))  # logged as returned
        state = json.loads((list_checkpoints(tmp_path / "run")[-1] / "state.json").read_text())
        assert state["row"] == read_metrics(tmp_path / "run")[-1] and "scores_pending" not in state


def test_a_folder_whose_row_waited_for_its_scores_is_scored_on_resume(tmp_path):
    """Folders of the earlier layout checkpointed a row whose scores rode in the next call: on
    resume the row is scored in a call of its own and logged, then the run goes on."""
    config = small_config(num_generations=4, eval_every=1, checkpoint_every=1)
    reference = run_to_end(config.replace(score_in_population=False), tmp_path / "reference")
    run = ESRun.create(config.replace(score_in_population=False), tmp_path / "run", engine=SyntheticEngine())
    run.run(2)
    run.close()
    checkpoint = list_checkpoints(tmp_path / "run")[-1]
    state = json.loads((checkpoint / "state.json").read_text())
    state["row"] = {k: v for k, v in state["row"].items() if k not in SCORE_KEYS + ("time/eval_s",)}
    state["scores_pending"] = True
    state.pop("checkpoint_format", None)
    (checkpoint / "state.json").write_text(json.dumps(state))
    (checkpoint / "manifest.json").unlink()  # the earlier layout's checkpoints had no manifest either
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:-1]))  # killed before its line

    resumed = ESRun.resume(tmp_path / "run", engine=SyntheticEngine())
    assert resumed.generation == 2
    rows = read_metrics(tmp_path / "run")
    assert [r["generation"] for r in rows] == [0, 1, 2]
    assert scores_by_mean(rows)[2] == scores_by_mean(read_metrics(tmp_path / "reference"))[2]
    resumed.run()
    assert_same_adapter(resumed.mean, reference.mean)


def test_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
    config = small_config(num_generations=4)
    run = ESRun.create(config, tmp_path / "run", engine=SyntheticEngine())
    run.run(2)
    run.close()
    with open(tmp_path / "run" / "metrics.jsonl", "a") as handle:
        handle.write('{"generation": 3, "train/rew')  # a kill in the middle of a write
    resumed = ESRun.resume(tmp_path / "run", engine=SyntheticEngine())
    assert resumed.generation == 2
    assert [r["generation"] for r in read_metrics(tmp_path / "run")] == [0, 1, 2]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3


def test_resume_without_checkpoint_fails(tmp_path):
    (tmp_path / "run").mkdir()
    small_config().to_yaml(tmp_path / "run" / "config.yaml")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ESRun.resume(tmp_path / "run", engine=SyntheticEngine())


# ------------------------------------------------------------------------------ run folders


def test_existing_run_folder_is_refused_unless_overwrite(tmp_path):
    config = small_config()
    run_dir = tmp_path / "run"
    run_to_end(config, run_dir)
    before = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(RunFolderExists, match="overwrite=True"):
        ESRun.create(config, run_dir, engine=SyntheticEngine())
    assert (run_dir / "metrics.jsonl").read_text() == before  # untouched

    fresh = ESRun.create(config, run_dir, engine=SyntheticEngine(), overwrite=True)
    assert fresh.generation == 0
    assert [r["generation"] for r in read_metrics(run_dir)] == [0]
    assert [p.name for p in list_checkpoints(run_dir)] == ["000000"]


def test_open_resumes_a_matching_run_and_refuses_other_settings(tmp_path):
    config = small_config(num_generations=4)
    run_dir = tmp_path / "run"
    created = ESRun.open(config, run_dir, engine=SyntheticEngine())  # empty folder: creates
    assert created.generation == 0
    created.run(2)
    created.close()

    reopened = ESRun.open(config, run_dir, engine=SyntheticEngine())
    assert reopened.generation == 2
    assert_same_adapter(reopened.mean, created.mean)
    assert [r["generation"] for r in read_metrics(run_dir)] == [0, 1, 2]
    reopened.close()

    with pytest.raises(ConfigError) as caught:
        ESRun.open(config.replace(learning_rate=0.1), run_dir, engine=SyntheticEngine())
    message = str(caught.value)
    assert "(learning_rate)" in message and "overwrite=True" in message, message
    with pytest.raises(ConfigError, match=r"\(population_size, sigma\)"):
        ESRun.open(config.replace(sigma=0.5, population_size=6), run_dir, engine=SyntheticEngine())
    with pytest.raises(RunFolderExists):
        ESRun.open(config, run_dir, resume=False, engine=SyntheticEngine())
    fresh = ESRun.open(config.replace(sigma=0.5), run_dir, resume=False, overwrite=True, engine=SyntheticEngine())
    assert fresh.generation == 0 and load_run_config(run_dir).sigma == 0.5


def test_open_resumes_a_run_another_writer_made_between_its_look_and_its_lock(tmp_path, monkeypatch):
    # two tuning workers reach one rerun together: the first finds an empty folder, and before it holds
    # the lock the other has made (here, finished) the run there; the first resumes it, never raises
    config = small_config(num_generations=2)
    run_dir = tmp_path / "run"
    checked, raced = ESRun._checked.__func__, []

    def checked_while_another_writes(cls, settings, initial_adapter):
        result = checked(cls, settings, initial_adapter)
        if not raced:
            raced.append(True)
            other = ESRun.create(settings, run_dir, engine=SyntheticEngine())
            other.run()
            other.close()
        return result

    monkeypatch.setattr(ESRun, "_checked", classmethod(checked_while_another_writes))
    run = ESRun.open(config, run_dir, engine=SyntheticEngine())
    assert raced and run.generation == 2  # resumed at the other writer's end, not created again
    run.close()
    assert [r["generation"] for r in read_metrics(run_dir)] == [0, 1, 2]


def test_a_run_made_before_noise_scheme_resumes_with_per_tensor_noise(tmp_path):
    config = small_config(num_generations=4, noise_scheme="per_tensor")
    reference = run_to_end(config, tmp_path / "reference")
    run = ESRun.create(config, tmp_path / "run", engine=SyntheticEngine())
    run.run(2)
    run.close()
    with pytest.raises(ConfigError, match=r"other settings \(noise_scheme\); use another run_dir or overwrite=True$"):
        ESRun.open(config.replace(noise_scheme="flat"), tmp_path / "run", engine=SyntheticEngine())  # it names it: no hint
    settings = tmp_path / "run" / "config.yaml"
    settings.write_text("".join(line for line in settings.read_text().splitlines(keepends=True)
                                if not line.startswith("noise_scheme:")))  # as written before the setting existed
    assert load_run_config(tmp_path / "run").noise_scheme == "per_tensor"
    with pytest.raises(ConfigError, match="noise_scheme='per_tensor' to continue it"):
        ESRun.open(config.replace(noise_scheme="flat"), tmp_path / "run", engine=SyntheticEngine())
    resumed = ESRun.open(config, tmp_path / "run", engine=SyntheticEngine())
    resumed.run()
    assert_same_adapter(resumed.mean, reference.mean)
    # and the two schemes are different draws: a flat run moves elsewhere
    flat = run_to_end(config.replace(noise_scheme="flat"), tmp_path / "flat")
    assert not torch.equal(next(iter(flat.mean.tensors.values())), next(iter(reference.mean.tensors.values())))


def test_noise_drawn_on_cards_of_other_sm_counts_is_refused():
    """torch sizes its CUDA random kernels from the SM count: every engine must see one count, and
    with es_mode lora this process too (it draws the update's noise, the engines the members')."""
    assert noise_cards_problem("lora", 132, []) is None  # the engine in this process
    assert noise_cards_problem("lora", 132, [132, 132]) is None and noise_cards_problem("full", 132, [16, 16]) is None
    assert "the engines see 16, 132 SMs" in noise_cards_problem("full", 132, [132, 16])
    assert "the engines see 16 SMs and this process 132" in noise_cards_problem("lora", 132, [16, 16])
    assert noise_cards_problem("eggroll", 132, [108, 108]) is None  # its engines draw members and update alike


def test_a_run_whose_engines_see_other_sm_counts_stops_before_its_first_generation(tmp_path, monkeypatch):
    import evolm_lib.train.es as es_run

    class TwoKindsOfCards(SyntheticEngine):  # as Ray engines report themselves, on two kinds of card
        engine_info = [{"sm_count": 132}, {"sm_count": 108}]

    monkeypatch.setattr(es_run, "resolve_noise_device", lambda requested: "cuda")  # as on a GPU machine
    monkeypatch.setattr(es_run, "sm_count", lambda: 132)
    with pytest.raises(RuntimeError, match="the engines see 108, 132 SMs"):
        ESRun.create(small_config(noise_device="cuda"), tmp_path / "run", engine=TwoKindsOfCards())
    assert not list_checkpoints(tmp_path / "run")


def test_a_lora_run_resumed_where_its_noise_is_drawn_otherwise_warns_and_goes_on(tmp_path, monkeypatch):
    """The SMs that drew the noise are kept in each checkpoint; a LoRA mean is in the checkpoint, so a
    resume on cards of another count warns (its members from there on are not an unbroken run's)."""
    import evolm_lib.train.es as es_run

    config = small_config(num_generations=2, checkpoint_every=1)
    monkeypatch.setattr(es_run, "noise_sm_count", lambda *args: 132)  # as if drawn on an H200
    run = ESRun.create(config, tmp_path / "run", engine=SyntheticEngine())
    run.run(1)
    run.close()
    state = json.loads((list_checkpoints(tmp_path / "run")[-1] / "state.json").read_text())
    assert state["noise_sm_count"] == 132
    resumed = ESRun.resume(tmp_path / "run", engine=SyntheticEngine())  # the same count: silent
    resumed.close()
    monkeypatch.setattr(es_run, "noise_sm_count", lambda *args: 108)  # an A100
    with pytest.warns(RuntimeWarning, match="drew its noise on cards showing 132 SMs and would now draw it on cards "
                                            "showing 108 SMs.*not those of an unbroken run"):
        resumed = ESRun.resume(tmp_path / "run", engine=SyntheticEngine())
    resumed.run()
    resumed.close()


def test_weights_rebuilt_from_the_seed_log_are_refused_where_the_noise_would_differ():
    from evolm_lib.train.es import resumed_noise_problem

    resumed_noise_problem("full", 132, 132)  # the same cards: nothing to say
    for before, now, where in ((132, 108, "on cards showing 108 SMs"), (132, None, "on the CPU"), (None, 132, "on cards showing 132 SMs")):
        with pytest.raises(RuntimeError, match=f"would now draw it {where}.*es_mode full rebuilds its mean"):
            resumed_noise_problem("full", before, now)
    with pytest.raises(RuntimeError, match="es_mode eggroll rebuilds its mean"):
        resumed_noise_problem("eggroll", 132, 16)


def test_mps_thread_percentage_is_refused_where_the_update_draws_its_noise_in_this_process():
    with pytest.raises(ConfigError, match="mps_thread_percentage: 50 % of the SMs gives the engines other noise"):
        small_config(engine_host="ray", num_engines=2, mps_thread_percentage=50, noise_device="cuda")
    for changes in ({"es_mode": "full", "es_weights": "all"}, {"noise_device": "cpu"}):
        settings = {"engine_host": "ray", "num_engines": 2, "mps_thread_percentage": 50, "noise_device": "cuda", **changes}
        assert small_config(**settings).mps_thread_percentage == 50


def test_bad_lora_targets_fail_before_any_engine_or_folder(tmp_path):
    config = small_config(target_modules=("nonexistent_proj",))
    started = time.perf_counter()
    with pytest.raises(ValueError, match="nonexistent_proj.*not found.*q_proj"):
        ESRun.create(config, tmp_path / "run")  # no engine: a vLLM engine would be started after the check
    assert time.perf_counter() - started < 5
    assert not (tmp_path / "run").exists()

    with pytest.raises(ValueError, match=r"layers_to_transform \[7\] out of range"):
        ESRun.create(small_config(layers_to_transform=(0, 7)), tmp_path / "run")
    assert not (tmp_path / "run").exists()

    # overwrite=True on an existing run: the bad settings fail before the old run is deleted
    run_to_end(small_config(), tmp_path / "old")
    before = (tmp_path / "old" / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="nonexistent_proj"):
        ESRun.create(config, tmp_path / "old", overwrite=True)
    assert (tmp_path / "old" / "metrics.jsonl").read_text() == before


# ------------------------------------------------------------------------------ final adapter


def test_save_final_loads_in_evolm_and_peft(tmp_path, tiny_model_dir):
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    config = small_config(target_modules=("q_proj", "v_proj", "down_proj"), num_generations=2)
    run = ESRun.create(config, tmp_path / "run", engine=SyntheticEngine())
    run.run()
    path = run.save_final()
    run.close()
    assert path == tmp_path / "run" / "final_adapter"
    assert {p.name for p in path.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    adapter_config = json.loads((path / "adapter_config.json").read_text())
    assert adapter_config["r"] == 1 and adapter_config["base_model_name_or_path"] == str(tiny_model_dir)
    assert_same_adapter(load_adapter(path), run.mean)
    assert any(bool(t.abs().sum() > 0) for k, t in run.mean.tensors.items() if ".lora_B." in k)  # B moved off 0

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(path))
    state = get_peft_model_state_dict(model)
    assert set(state) == set(run.mean.tensors)
    assert all(torch.equal(state[k], run.mean.tensors[k]) for k in state)
    input_ids = torch.tensor([[1, 42, 7, 99]])
    with torch.no_grad():
        adapted = model(input_ids=input_ids).logits
        with model.disable_adapter():
            plain = model(input_ids=input_ids).logits
    assert not torch.allclose(adapted, plain)  # the loaded adapter changes the model's output


# ------------------------------------------------------------------------------ real engine


def test_two_generations_on_vllm_tiny_random(tmp_path):
    from evolm_lib.engines.vllm.engine import VLLMEngine

    config = ESConfig(model="tiny-random", population_size=4, num_generations=3, max_new_tokens=8, sigma=0.05,
                      learning_rate=0.05, temperature=0.7, seed=1, eval_every=1)
    # On CPU vLLM sizes the KV cache as utilization x node RAM minus this process's RSS, which alone
    # is ~1 GiB in a test process: 0.04 goes negative. An explicit 64 MiB KV cache skips that sum.
    engine = VLLMEngine("tiny-random", max_lora_rank=1, max_loras=5, max_model_len=256, kv_cache_gb=0.0625)
    try:
        run = ESRun.create(config, tmp_path / "run", engine=engine)
        rows = run.run()
    finally:
        engine.close()
    assert [r["generation"] for r in read_metrics(tmp_path / "run")] == [0, 1, 2, 3]
    # the mean of generation 0 was scored at creation; generation 2's call scores the mean that made
    # it (generation 1's); the last mean is scored in a call of its own
    assert "eval/reward" not in rows[0] and rows[1]["policy/generation"] == 1 and "policy/generation" not in rows[2]
    for row in rows:
        assert len(row["es/rewards"]) == 4 and all(math.isfinite(r) for r in row["es/rewards"])
        assert all(-4 * 8 * 10 < r <= 0 for r in row["es/rewards"])  # at most 8 tokens: a bounded length gap
        for key in ("best_completions", "worst_completions"):
            assert all(isinstance(text, str) for text in row[key]), key
        assert len(row["best_completions"]) == 2
        assert row["time/generate_s"] > 0
        assert 0 < row["samples/tokens"] <= 4 * 2 * 8 * row["generation"]
    for row in rows[1:]:
        assert math.isfinite(row["policy/train_reward"]) and math.isfinite(row["eval/reward"])
        assert all(isinstance(text, str) for text in row["policy/train_completions"])
    assert rows[-1]["samples/completions"] == 4 * 2 * 3
    assert [p.name for p in list_checkpoints(tmp_path / "run")][-1] == "000003"


def test_a_lora_run_sets_its_slots_up_when_it_opens_and_its_generations_only_write_them(tmp_path):
    """Once ``ESRun.open`` returns, before any generation, the engine holds resident slots for the
    run's adapter, pinned inside its worker; the generations write those same slots. On an engine
    shared with a run of another adapter layout, each run's opening (the resumed one's too) sets its
    slots up again, and a generation of a run whose slots another run's opening replaced has them set
    up again in its call."""
    from evolm_lib.engines.vllm.engine import VLLMEngine
    from evolm_lib.engines.vllm.slots import describe

    config = ESConfig(model="tiny-random", population_size=4, num_generations=3, max_new_tokens=4, sigma=0.05,
                      learning_rate=0.05, seed=2, lora_rank=1)
    other = config.replace(lora_alpha=2.0)  # another layout: the slots fold alpha / r into B
    engine = VLLMEngine("tiny-random", max_lora_rank=1, max_loras=5, max_model_len=256, kv_cache_gb=0.0625)
    try:
        assert engine.adapter_transfer == "in_place" and engine.slots.resident is None
        run = ESRun.open(config, tmp_path / "run", engine=engine)
        slots = engine.slots.resident
        assert slots is not None and slots.spec == run.mean.spec == config.lora_spec()
        assert slots.num_slots >= config.population_size
        assert set(slots.ids) <= set(describe(engine.llm)["pinned"])  # pinned inside the engine's worker
        with pytest.raises(RuntimeError, match="call write"):
            slots.lora_requests()  # set up, not yet written: no generation ran
        run.run(2)
        assert engine.slots.resident is slots and len(slots.lora_requests()) == config.population_size
        # another run of the shared engine: its own slots at its opening, the first run's released
        second = ESRun.open(other, tmp_path / "other", engine=engine)
        replaced = engine.slots.resident
        assert replaced is not slots and replaced.spec == other.lora_spec()
        assert slots.llm is None  # released inside the engine
        second.run(1)
        assert engine.slots.resident is replaced
        second.close()
        run.step()  # its slots were replaced: set up again in this call, and the generation runs
        assert engine.slots.resident.spec == config.lora_spec() and run.generation == 3
        run.close()
        resumed = ESRun.open(other, tmp_path / "other", engine=engine)  # resumed: set up again at its opening
        reopened = engine.slots.resident
        assert resumed.generation == 1 and reopened.spec == other.lora_spec() and reopened is not replaced
        resumed.run()
        assert engine.slots.resident is reopened and resumed.generation == 3
        resumed.close()
    finally:
        engine.close()


def test_sigma_below_the_engine_dtype_resolution_warns(tmp_path):
    # random A (PEFT's kaiming init, rms ~ 0.3 on tiny-random) with sigma 1e-4: bfloat16 rounds most of it away
    with pytest.warns(UserWarning, match="ulps"):
        ESRun.create(small_config(sigma=1e-4, dtype="bfloat16"), tmp_path / "bf16", engine=SyntheticEngine())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ESRun.create(small_config(sigma=1e-4, dtype="float32"), tmp_path / "fp32", engine=SyntheticEngine())


def test_in_place_slots_and_files_give_the_same_run_and_resume_bit_exact(tmp_path):
    """Resident slots written from seeds and adapter files serve the same members: same metrics rows;
    a run stopped after its checkpoint and resumed on a fresh engine ends as the uninterrupted one."""
    from evolm_lib.engines.vllm.engine import VLLMEngine

    config = ESConfig(model="tiny-random", population_size=4, num_generations=3, max_new_tokens=8, sigma=0.5,
                      learning_rate=0.5, temperature=0.0, seed=3, lora_rank=1)

    def engine(transfer: str) -> VLLMEngine:
        return VLLMEngine("tiny-random", max_lora_rank=1, max_loras=5, max_model_len=256, kv_cache_gb=0.0625,
                             adapter_transfer=transfer)

    files = engine("files")
    try:
        reference = ESRun.create(config.replace(adapter_transfer="files"), tmp_path / "files", engine=files)
        reference.run()
        # started without the worker extension (as a GRPO LoRA run's engine): asked for the model's own
        # weights, it names the setting that starts one with it, before any call reaches the worker
        assert files.hosts_weights is False
        with pytest.raises(ValueError, match="started with adapter_transfer 'files', without the worker extension"):
            files.resident_weights(["q_proj"])
    finally:
        files.close()
    slots = engine("in_place")
    # slot names are fixed: an in-place engine runs without a prefix cache (nothing to go stale)
    assert slots.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is False
    as_files = []  # the adapters of each call that travelled as files
    real = slots.files.written
    slots.files.written = lambda adapters: (as_files.append([a for a in adapters if a is not None]), real(adapters))[1]
    try:
        run = ESRun.create(config, tmp_path / "slots", engine=slots)
        run.run(num_generations=2)
        assert slots.adapter_transfer == "in_place" and slots.slots.resident is not None  # not a silent fall-back
    finally:
        slots.close()
    run.close()  # the folder is free for the resume below (the engine was the test's: closed above)
    # generation 0's scoring goes as a file; the population calls write none (generation 1's mean
    # rides in generation 2's call, served from the slot after the members'); every row is complete
    # when the call returns
    assert [len(adapters) for adapters in as_files] == [1]
    fresh = engine("in_place")
    try:
        resumed = ESRun.resume(tmp_path / "slots", engine=fresh)
        resumed.run()
    finally:
        fresh.close()
    rows, expected = read_metrics(tmp_path / "slots"), read_metrics(tmp_path / "files")
    assert len(set(rows[1]["es/rewards"])) > 1  # the members really differ: the comparison can fail
    assert without_times(rows) == without_times(expected)
    assert_same_adapter(resumed.mean, reference.mean)


# ------------------------------------------------------------------------------ zeroth-order estimators


@pytest.mark.parametrize("estimator", ["zoar", "zoar_0", "rl", "twopoint"])
def test_estimator_run_resumes_bit_for_bit(tmp_path, estimator):
    """A run with a zeroth-order estimator (zoar: query reuse over past generations' seeds) learns,
    checkpoints the estimator's memory and resumes exactly; killed after generation 3, it ends as
    the uninterrupted run."""
    # raw-reward estimators scale with the reward (hundreds here): Adam makes one learning rate fit all
    config = small_config(num_generations=6, population_size=16, estimator=estimator, estimator_histories=2,
                          optimizer="adam", learning_rate=0.005)
    reference = run_to_end(config, tmp_path / "reference")
    rows = read_metrics(tmp_path / "reference")
    assert rows[-1]["policy/train_reward"] > rows[0]["policy/train_reward"]  # it learns on the synthetic quadratic
    first = ESRun.create(config, tmp_path / "run", engine=SyntheticEngine())
    first.run(3)
    first.close()
    resumed = ESRun.resume(tmp_path / "run", engine=SyntheticEngine())
    if estimator == "zoar":  # the buffer came back from the checkpoint, not empty
        assert len(resumed.parameters.estimator_state.generations) == 2
    resumed.run()
    assert_same_adapter(resumed.mean, reference.mean)
    assert without_times(read_metrics(tmp_path / "run")) == without_times(rows)


def test_zoar_reuses_past_generations_and_differs_from_its_baseline_only_variant(tmp_path):
    settings = dict(optimizer="adam", learning_rate=0.005, population_size=16)
    with_reuse = run_to_end(small_config(estimator="zoar", estimator_histories=2, **settings), tmp_path / "zoar")
    without = run_to_end(small_config(estimator="zoar_0", **settings), tmp_path / "zoar_0")
    assert len(with_reuse.parameters.estimator_state.generations) == 2 and without.parameters.estimator_state.generations == ()
    assert not torch.equal(next(iter(with_reuse.mean.tensors.values())), next(iter(without.mean.tensors.values())))


def test_estimator_settings_fail_with_the_field_named():
    with pytest.raises(ConfigError, match="estimator: unknown 'nope'.*zoar"):
        small_config(estimator="nope")
    with pytest.raises(ConfigError, match="estimator: 'xnes' needs explicit positions"):
        small_config(estimator="xnes")
    with pytest.raises(ConfigError, match="num_histories must be >= 1 for zoar"):
        small_config(estimator="zoar", estimator_histories=0)
    with pytest.raises(ConfigError, match="twopoint.*antithetic"):
        small_config(estimator="twopoint", antithetic=False)
    with pytest.raises(ConfigError, match="estimator_baseline"):
        small_config(estimator="zoo", estimator_baseline="single")
    with pytest.raises(ConfigError, match="estimator: 'zohs' needs the reward of the mean adapter"):
        small_config(estimator="zohs")


# ------------------------------------------------------------------ folders written before the ES state

BEFORE_ES_STATE = Path(__file__).with_name("data") / "before_es_state"


def _before_es_state():
    """The settings tests/data/make_before_es_state_runs.py wrote the folders with (one source)."""
    return data_script("make_before_es_state_runs")


@pytest.fixture(scope="module")
def before_es_state_engine(tiny_model_dir):
    """An engine of the settings the folders were written on (its weights move in es_mode full)."""
    from evolm_lib.engines.vllm.engine import VLLMEngine

    engine = VLLMEngine(str(tiny_model_dir), **_before_es_state().ENGINE)
    yield engine
    engine.close()


@pytest.mark.parametrize("name", ["lora", "full", "eggroll"])
def test_a_run_folder_written_before_the_es_state_resumes_like_an_uninterrupted_run(tmp_path, name,
                                                                                    before_es_state_engine):
    """tests/data/before_es_state: a LoRA folder (resident slots, scores riding in the population's
    call, Adam), a full-parameter and an EGGROLL folder (seed log, snapshot), written on vLLM by the
    code before an ES generation became a state with pure ask and tell (commit 5c54530) and stopped
    after generation 2. Their settings name no optimizer_step: opened with today's default (torch.optim's
    step) they are refused, naming the setting; opened with the formulas term by term they stepped with,
    they end at an uninterrupted run's mean bit for bit, with its rows."""
    old = _before_es_state()
    run_dir = tmp_path / "old"
    import shutil

    shutil.copytree(BEFORE_ES_STATE / name, run_dir)
    with pytest.raises(ConfigError, match="made before optimizer_step existed and steps by the formulas term by term: "
                                          "pass optimizer_step='formulas'"):
        ESRun.open(ESConfig.from_dict(old.SETTINGS[name]), run_dir, engine=before_es_state_engine)
    config = ESConfig.from_dict({**old.SETTINGS[name], "optimizer_step": "formulas"})
    resumed = ESRun.open(config, run_dir, engine=before_es_state_engine)
    assert resumed.generation == old.STOP
    resumed.run()
    resumed_checksum = None if name == "lora" else resumed.parameters.weights.checksum()["master"]
    resumed_mean = resumed.mean.tensors if name == "lora" else None
    resumed.close()  # the shared engine serves the model folder's weights again
    reference = ESRun.create(config, tmp_path / "reference", engine=before_es_state_engine)
    reference.run()
    if name == "lora":
        for key, value in reference.mean.tensors.items():
            assert torch.equal(resumed_mean[key], value), key
    else:
        assert resumed_checksum == reference.parameters.weights.checksum()["master"]
    reference.close()
    rows, expected = without_times(read_metrics(run_dir)), without_times(read_metrics(tmp_path / "reference"))
    assert [r["generation"] for r in rows] == [r["generation"] for r in expected] == list(range(config.num_generations + 1))
    assert_rows_close(rows, expected, "generation")  # the old rows' float sums were made on another CPU
