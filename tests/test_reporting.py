"""Tests for evolm_lib.reporting (``report_to``): ES and GRPO runs stream each metrics row to TensorBoard
event files in the run folder whose scalars, read back with TensorBoard's own reader, are the rows of
metrics.jsonl; the default writes none; an unknown backend is refused naming the field; a killed and
resumed run, a run that gains report_to when extended, and event files named by a clock ahead of this
one all end with one point per generation."""
from __future__ import annotations

import subprocess
import sys
import time
import typing
from pathlib import Path

import numpy as np
import pytest

from evolm_lib.metrics import by_mean
from evolm_lib.config import ConfigError, ESConfig, GRPOConfig, ReportTo
from evolm_lib.engines.synthetic import SyntheticEngine
from evolm_lib.parameters import notebook_config
from evolm_lib.reporting import BACKENDS, TENSORBOARD_DIR, scalars
from evolm_lib.runs import list_checkpoints, read_metrics
from evolm_lib.train.es import ESRun
from evolm_lib.train.grpo import GRPORun

TESTS = Path(__file__).resolve().parent
STEP_KEYS = ("generation", "step")
ES_SETTINGS = dict(model="tiny-random", target_modules=("q_proj", "v_proj"), sigma=0.02, learning_rate=0.05,
                   population_size=4, num_generations=3, seed=5, report_to=["tensorboard"])
GRPO_SETTINGS = dict(model="tiny-random", target_modules=["q_proj", "v_proj"], lora_rank=2, lora_alpha=2.0,
                     max_new_tokens=4, loss_type="no_baseline", normalize_by_std=False, group_size=2,
                     learning_rate=1e-2, num_steps=3, eval_every=2, report_to=["tensorboard"])


def tensorboard_points(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of every scalar point in the run's event files, tag by tag, as TensorBoard's
    own reader gives them (with its purge of points a restarted writer dropped); the reader behind
    ``tensorboard --load_fast=false``, which purges by other rules, must give the same."""
    from tensorboard.backend.event_processing import plugin_event_accumulator
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    accumulator = EventAccumulator(str(run_dir / TENSORBOARD_DIR), size_guidance={"scalars": 0})  # 0: keep all
    accumulator.Reload()
    points = {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
              for tag in accumulator.Tags()["scalars"]}
    server = plugin_event_accumulator.EventAccumulator(str(run_dir / TENSORBOARD_DIR), size_guidance={"tensors": 0})
    server.Reload()
    assert {tag: [(event.step, tensor_util.make_ndarray(event.tensor_proto).item()) for event in server.Tensors(tag)]
            for tag in server.Tags()["tensors"]} == points
    return points


def jsonl_points(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The points metrics.jsonl's rows should give: every number of a row (not a flag, text, list or
    null) at step = its generation, a mean's scores at that mean's generation (``by_mean``), as the
    float32 TensorBoard stores."""
    points: dict[str, list[tuple[int, float]]] = {}
    for row in by_mean(rows):
        for key, value in row.items():
            if key in STEP_KEYS or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            points.setdefault(key, []).append((row["generation"], float(np.float32(value))))
    return points


def assert_tensorboard_matches_metrics(run_dir: Path, generations: int) -> None:
    rows = read_metrics(run_dir)
    assert [r["generation"] for r in rows] == list(range(generations + 1))
    expected = jsonl_points(rows)
    assert {"train/reward_mean", "eval/reward", "samples/tokens", "time/wall_s", "seed"} <= set(expected)
    points = tensorboard_points(run_dir)
    assert points == expected
    assert points["time/wall_s"] == [(g, points["time/wall_s"][g][1]) for g in range(generations + 1)]  # one per step


# ------------------------------------------------------------------------------ settings


@pytest.mark.parametrize("config_class", [ESConfig, GRPOConfig])
def test_report_to_defaults_to_none_and_refuses_unknown_backends(config_class):
    assert config_class(model="tiny-random").report_to == ()
    assert config_class(model="tiny-random", report_to=["tensorboard"]).report_to == ("tensorboard",)
    assert config_class(model="tiny-random", report_to="tensorboard").report_to == ("tensorboard",)
    with pytest.raises(ConfigError) as error:
        config_class(model="tiny-random", report_to=["tensorboard", "wandb"])
    assert str(error.value) == (f"invalid {config_class.__name__}: report_to: 'wandb' is not supported; "
                                "allowed: ['tensorboard']")
    assert set(BACKENDS) == set(typing.get_args(ReportTo))  # every name the settings allow has a backend


def test_notebook_settings_and_text_parameters_reach_report_to():
    # notebook 03 passes any ESConfig setting through `settings`; a text parameter is split at commas
    assert notebook_config(ESConfig, {"settings": {"report_to": ["tensorboard"]}}).report_to == ("tensorboard",)
    assert notebook_config(ESConfig, {"settings": "{report_to: [tensorboard]}"}).report_to == ("tensorboard",)
    assert notebook_config(ESConfig, {"report_to": "tensorboard"}).report_to == ("tensorboard",)
    with pytest.raises(ConfigError, match=r"settings\.report_to: 'csv' is not supported"):
        notebook_config(ESConfig, {"settings": {"report_to": ["csv"]}})


def test_scalars_of_a_row_are_its_finite_numbers_without_the_step():
    row = {"generation": 4, "step": 4, "method": "es", "seed": 7, "train/reward_mean": -1.5, "es/rewards": [1.0],
           "grpo/loss": float("nan"), "es/update_norm": float("inf"), "flag": True, "samples/tokens": 120}
    assert scalars(row) == {"seed": 7, "train/reward_mean": -1.5, "samples/tokens": 120}


# ------------------------------------------------------------------------------ runs


def test_es_run_on_vllm_streams_each_row_to_tensorboard(tmp_path, tiny_vllm):
    # a real engine batches grids: the scoring of the mean of generation 2 rides in generation 3's
    # population call and is in generation 3's row; its points land at the mean's generation, 2
    config = ESConfig(**{**ES_SETTINGS, "target_modules": ("q_proj", "v_proj", "o_proj"), "max_new_tokens": 6,
                         "sigma": 0.5, "learning_rate": 0.5, "eval_every": 2, "num_generations": 4})
    run = ESRun.create(config, tmp_path / "run", engine=tiny_vllm)
    run.run()
    run.close()
    assert_tensorboard_matches_metrics(tmp_path / "run", 4)
    rows = read_metrics(tmp_path / "run")
    assert rows[3]["policy/generation"] == 2 and "eval/reward" not in rows[2]
    assert [s for s, _ in tensorboard_points(tmp_path / "run")["eval/reward"]] == [0, 2, 4]


def test_grpo_run_streams_each_row_to_tensorboard(tmp_path):
    run = GRPORun.create(GRPOConfig(**GRPO_SETTINGS), tmp_path / "run", engine=SyntheticEngine())
    run.run()
    run.close()
    assert_tensorboard_matches_metrics(tmp_path / "run", 3)
    points = tensorboard_points(tmp_path / "run")
    assert "step" not in points and "generation" not in points  # the x axis, not charts
    assert {"grpo/loss", "grpo/grad_norm", "grpo/adapter_norm"} <= set(points)


def test_the_default_writes_no_tensorboard_folder(tmp_path):
    run = ESRun.create(ESConfig(**{**ES_SETTINGS, "report_to": []}), tmp_path / "run", engine=SyntheticEngine())
    run.run()
    run.close()
    assert not (tmp_path / "run" / TENSORBOARD_DIR).exists()
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if not p.name.startswith(".")) == \
        ["checkpoints", "config.yaml", "metrics.jsonl"]


def test_a_missing_tensorboard_package_is_named_before_the_folder_is_touched(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # what Python does where it is not installed
    with pytest.raises(ImportError, match=r"report_to: 'tensorboard' needs the tensorboard package \(pip install"):
        ESRun.create(ESConfig(**ES_SETTINGS), tmp_path / "run", engine=SyntheticEngine())
    assert not (tmp_path / "run" / "config.yaml").exists()


# ------------------------------------------------------------------------------ resume

KILLED_RUN = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from helpers_kill_run import KillingEngine, kill_config
from evolm_lib.train.es import ESRun
engine = KillingEngine(4)
run = ESRun.open(kill_config().replace(report_to=["tensorboard"]), Path(sys.argv[1]), engine=engine)
engine.run = run
run.run()
"""


def test_a_killed_and_resumed_run_has_one_point_per_generation(tmp_path):
    from helpers_kill_run import kill_config

    run_dir = tmp_path / "killed"
    process = subprocess.run([sys.executable, "-c", KILLED_RUN.format(tests=str(TESTS)), str(run_dir)],
                             capture_output=True, text=True, timeout=120)
    assert process.returncode == -9, process.stderr[-2000:]
    # SIGKILL inside generation 4: rows 0..3 were logged and their points flushed; checkpoint 2 is the last
    assert [p.name for p in list_checkpoints(run_dir)] == ["000000", "000002"]
    assert [s for s, _ in tensorboard_points(run_dir)["time/wall_s"]] == [0, 1, 2, 3]
    killed_wall = dict(tensorboard_points(run_dir)["time/wall_s"])

    resumed = ESRun.resume(run_dir, engine=SyntheticEngine())
    assert resumed.generation == 2  # generation 3 is redone: its first points must go
    resumed.run()
    resumed.close()
    assert_tensorboard_matches_metrics(run_dir, kill_config().num_generations)
    wall = dict(tensorboard_points(run_dir)["time/wall_s"])
    assert wall[3] != killed_wall[3]  # the redone generation's point, not the killed process's


def test_a_run_resumed_twice_keeps_one_point_per_generation(tmp_path):
    config = ESConfig(**{**ES_SETTINGS, "num_generations": 5})
    run = ESRun.create(config, tmp_path / "run", engine=SyntheticEngine())
    run.run(2)
    run.close()
    for target in (3, 5):
        resumed = ESRun.resume(tmp_path / "run", engine=SyntheticEngine())
        resumed.run(target)
        resumed.close()
    assert_tensorboard_matches_metrics(tmp_path / "run", 5)
    assert len(list((tmp_path / "run" / TENSORBOARD_DIR).iterdir())) == 3  # one event file per process


def test_report_to_added_when_a_run_is_extended_gets_every_row(tmp_path):
    config = ESConfig(**{**ES_SETTINGS, "report_to": []})
    run = ESRun.create(config, tmp_path / "run", engine=SyntheticEngine())
    run.run()
    run.close()
    extended = ESRun.open(config.replace(report_to=["tensorboard"], num_generations=5), tmp_path / "run",
                          engine=SyntheticEngine())
    extended.run()
    extended.close()
    assert_tensorboard_matches_metrics(tmp_path / "run", 5)


def _resumed_after_renaming_its_event_file(tmp_path, seconds_ahead: int, host: str) -> tuple[ESRun, int]:
    """A 4-generation run stopped after 3 whose one event file is renamed as if opened ``seconds_ahead``
    from now on ``host``, then resumed (not yet run); and that second."""
    config = ESConfig(**{**ES_SETTINGS, "num_generations": 4})
    run = ESRun.create(config, tmp_path / "run", engine=SyntheticEngine())
    run.run(3)
    run.close()
    (event_file,) = (tmp_path / "run" / TENSORBOARD_DIR).iterdir()
    second = int(time.time()) + seconds_ahead
    event_file.rename(event_file.with_name(f"events.out.tfevents.{second}.{host}"))
    return ESRun.resume(tmp_path / "run", engine=SyntheticEngine()), second


def test_a_resumed_writer_waits_until_its_event_file_sorts_after_the_earlier_ones(tmp_path):
    # TensorBoard reads a folder's event files in name order, and a name starts with its second: an
    # earlier file of another host named with this second (here the next one) must be read before the
    # resumed run's, whose purge drops its points
    resumed, soon = _resumed_after_renaming_its_event_file(tmp_path, 1, "zzzz.99999.9")  # sorts last in its second
    assert time.time() >= soon + 1
    resumed.run()
    resumed.close()
    assert_tensorboard_matches_metrics(tmp_path / "run", 4)


def test_event_files_named_by_a_clock_ahead_are_rebuilt_from_metrics(tmp_path):
    # a run folder copied from a machine whose clock is ahead: waiting for this clock to pass its event
    # file's name is not an option, so the folder is rebuilt from metrics.jsonl
    resumed, ahead = _resumed_after_renaming_its_event_file(tmp_path, 3600, "elsewhere.1.0")
    resumed.run()
    resumed.close()
    assert_tensorboard_matches_metrics(tmp_path / "run", 4)
    assert not list((tmp_path / "run" / TENSORBOARD_DIR).glob(f"*tfevents.{ahead}.*"))
