"""The notebooks: .py and .ipynb in sync, each runs through papermill on tiny-random and the checks of
what it produced live here, on its executed outputs and files (a notebook ends with its results and
holds no asserts), bad parameters fail in the config cell with the library's message, and the batch
runner gives the same run."""
from __future__ import annotations

import ast
import csv
import json
import os
import time
from pathlib import Path

import pytest

from evolm_lib import batch
from evolm_lib.cli import batch as batch_cli
from evolm_lib.parameters import SETTINGS
from evolm_lib.train.loop import RunLoop
from evolm_lib.viz.labels import TINY_MODEL_NOTE

# Kernels inherit this: on a busy 2-core machine two spinning OpenMP threads per engine make vLLM's
# LoRA decoding 10-50x slower; one thread avoids it (measured: nbval of notebooks/ 11.5 -> 2.6 min).
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
STEPPER = NOTEBOOKS / "03_es_stepper.py"
CI_SPEC = REPO / "papermill_runs" / "ci_tiny.yaml"
# the ES settings of CI (tiny-random, population 4, 2 generations): one source for every test here
CI_PARAMETERS = batch.load_batch_spec(CI_SPEC).parameters
TINY = {key: CI_PARAMETERS[key] for key in ("model", "max_new_tokens", "max_model_len", "kv_cache_gb")}
MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "pdf": b"%PDF-"}


def plotly_values(values) -> list:
    """A trace's values as the notebook's JSON holds them: a list, or plotly's typed array (a numpy
    array written as ``{"dtype": "f8", "bdata": base64}``)."""
    import base64

    import numpy as np

    if isinstance(values, dict) and "bdata" in values:
        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=np.dtype(values["dtype"])).tolist()
    return list(values)


def test_notebooks_exist():
    assert [p.stem for p in SOURCES] == ["01_task_inspection", "02_lora_initialization", "03_es_stepper", "04_es_vs_grpo",
                                        "05_zo_synthetic", "06_grpo_stepper", "07_tuning"]


# --------------------------------------------------------------------------- static checks


def _cells(path: Path) -> list[tuple[str, str]]:
    import jupytext

    return [(c.cell_type, c.source.strip()) for c in jupytext.read(str(path)).cells]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_py_and_ipynb_in_sync(source):
    paired = source.with_suffix(".ipynb")
    assert paired.exists(), f"{paired.name} missing: run `make sync`"
    assert _cells(source) == _cells(paired), f"{source.name} and {paired.name} differ: run `make sync`"
    notebook = json.loads(paired.read_text())
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in notebook["cells"] if c["cell_type"] == "code"), "commit the .ipynb without outputs"
    assert notebook["metadata"]["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_notebook_shape(source):
    """Title, ONE parameters cell of typed, commented scalars (and the `settings` mapping), a config
    cell, no definitions."""
    import jupytext

    cells = jupytext.read(str(source)).cells
    assert cells[0].cell_type == "markdown" and cells[0].source.startswith("# ")
    tagged = [i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1
    parameters = cells[tagged[0]].source.strip().splitlines()
    declared = batch.notebook_parameters(source)
    assert len(declared) == len(parameters), "every line of the parameters cell must parse as a parameter"
    for line, (name, info) in zip(parameters, declared.items()):
        assert line.startswith(f"{name}: "), line
        types = ("str", "int", "float", "bool") + (("dict",) if name == SETTINGS else ())
        assert info["inferred_type_name"] in types and info["help"], line
    # the cell after the parameters validates them with the library (a config, or the runs to compare)
    build = cells[tagged[0] + 1].source
    assert any(call in build for call in ("config = ESConfig.from_dict(", "groups = load_runs(",
                                          "config = ComparisonConfig.from_dict(",
                                          "config = notebook_config(ESConfig, globals())",
                                          "config = notebook_config(GRPOConfig, globals())",
                                          "spec = tune.load_tune_spec(")), build
    if SETTINGS in declared:  # every setting reachable: the parameters by name and the rest through `settings`
        kind = batch.notebook_info(source).kind
        assert kind in ("es", "grpo") and f"notebook_config({kind.upper()}Config" in build
    for cell in cells:
        if cell.cell_type == "code":
            nodes = list(ast.walk(ast.parse(cell.source)))
            assert not any(isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Lambda)) for n in nodes), cell.source
    assert cells[-1].cell_type == "code"


# the tuning notebook's checks move into its tests with the tuning notebook's own change
CHECKS_IN_TESTS = SOURCES


@pytest.mark.parametrize("source", CHECKS_IN_TESTS, ids=lambda p: p.stem)
def test_a_notebook_ends_with_its_results_and_leaves_checks_to_the_tests(source):
    """No assert anywhere in a notebook: a reader meets results, not checks written for CI; the tests
    that run the notebook assert on its outputs and files (tests/test_notebooks.py, test_analysis.py,
    test_zo_notebook.py), as papermill's own tests do. A bad input is an error with words
    (``raise ValueError``), not an assert."""
    import jupytext

    for cell in jupytext.read(str(source)).cells:
        if cell.cell_type == "code":
            asserts = [n for n in ast.walk(ast.parse(cell.source)) if isinstance(n, ast.Assert)]
            assert not asserts, f"{source.name}: an assert cell\n{cell.source}"


# --------------------------------------------------------------------------- papermill runs


def _execute(notebook: Path, output: Path, parameters: dict) -> Path:
    started = time.perf_counter()
    batch.execute_notebook(notebook, output, parameters, cwd=REPO)
    print(f"{notebook.name}: {time.perf_counter() - started:.1f} s")
    return output


def _errors(executed: Path) -> list[dict]:
    notebook = json.loads(executed.read_text())
    return [o for c in notebook["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]


def _figures_shown(executed: Path) -> list[dict]:
    """The plotly figures an executed notebook shows (displayed, or returned by a cell), in order."""
    cells = json.loads(executed.read_text())["cells"]
    return [o["data"]["application/vnd.plotly.v1+json"] for c in cells for o in c.get("outputs", [])
            if "application/vnd.plotly.v1+json" in o.get("data", {})]


def _output_text(executed: Path, source_start: str) -> str:
    """The text (printed and text/plain) of the executed cell whose source starts with ``source_start``."""
    [cell] = [c for c in json.loads(executed.read_text())["cells"]
              if c["cell_type"] == "code" and "".join(c["source"]).startswith(source_start)]
    return "".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                   for o in cell.get("outputs", []))


@pytest.mark.slow
def test_task_inspection_scores_every_example_and_shows_the_prompt_the_model_sees(tmp_path):
    """Notebook 01 on tiny-random: the chat prompt as rendered holds the first example's prompt, every
    example shown gets a finite reward in the histogram, and the title calls the model a plumbing check."""
    import math

    from evolm_lib.tasks import get_task

    executed = _execute(NOTEBOOKS / "01_task_inspection.py", tmp_path / "01.ipynb",
                        {**TINY, "num_examples": 2, "figures_dir": str(tmp_path / "figures")})
    assert not _errors(executed)
    task = get_task("conciseness")
    rendered = _output_text(executed, "inference_engine = make_engine(")
    assert task.prompt(task.train_examples()[0]).messages[-1]["content"] in rendered
    [distribution] = _figures_shown(executed)
    rewards = plotly_values(distribution["data"][0]["x"])
    assert len(rewards) == 2 * 2 and all(math.isfinite(r) for r in rewards)  # train and eval, 2 each
    assert TINY_MODEL_NOTE in distribution["layout"]["title"]["text"]
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == [
        f"task_inspection_rewards.{fmt}" for fmt in ("pdf", "png", "svg")]


@pytest.mark.slow
def test_lora_initialization_runs_and_saves_adapter(tmp_path):
    from evolm_lib.lora import load_adapter

    adapter_dir = tmp_path / "init_adapter"
    executed = _execute(NOTEBOOKS / "02_lora_initialization.py", tmp_path / "02.ipynb",
                        {**TINY, "population_size": 4, "init_scheme": "random_ab", "init_adapter_dir": str(adapter_dir)})
    assert not _errors(executed)
    adapter = load_adapter(adapter_dir)
    assert adapter.spec.rank == 1 and any(".lora_B." in k and v.abs().sum() > 0 for k, v in adapter.tensors.items())
    # the notebook's last cell shows where the adapter went; both schemes were previewed, the model
    # named as a plumbing check; the two per-layer figures cover the same layers
    assert str(adapter_dir) in _output_text(executed, "saved = save_adapter(")
    diversity = _output_text(executed, "diversity = ")
    assert "peft_default" in diversity and "random_ab" in diversity and TINY_MODEL_NOTE in diversity
    magnitudes, sigmas = _figures_shown(executed)[:2]
    assert len(plotly_values(magnitudes["data"][0]["x"])) == len(plotly_values(sigmas["data"][0]["x"])) > 0


@pytest.fixture(scope="module")
def stepper_run(tmp_path_factory):
    """03_es_stepper run once by papermill with the CI settings."""
    out = tmp_path_factory.mktemp("stepper")
    parameters = {**CI_PARAMETERS, "run_dir": str(out / "run"), "figures_dir": str(out / "figures")}
    executed = _execute(STEPPER, out / "notebook.ipynb", parameters)
    return out, executed


@pytest.mark.slow
def test_es_stepper_papermill_run(stepper_run):
    out, executed = stepper_run
    assert executed.stat().st_size < 1_000_000, "widget state or large outputs leaked into the notebook"
    assert not _errors(executed)
    run_dir = out / "run"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["generation"] for r in rows] == list(range(CI_PARAMETERS["num_generations"] + 1))
    # a smoke test that can show a bug: in every generation the members' completions differ (their noise
    # reached the engine), so do their rewards on this task, and the update moved the mean
    for row in rows[1:]:
        assert row["best_completions"] != row["worst_completions"], row["generation"]
        assert row["train/reward_best"] > row["train/reward_worst"] and row["es/update_norm"] > 0, row
    assert (run_dir / "config.yaml").exists() and (run_dir / "final_adapter" / "adapter_model.safetensors").exists()
    assert "eval/reward" in rows[-1]  # the last generation's mean was scored on the eval prompts
    titles = [f["layout"]["title"]["text"] for f in _figures_shown(executed) if f["layout"].get("title")]
    assert "ES on conciseness (tiny-random: a plumbing check; its rewards mean nothing)" in titles
    figures = {p.suffix[1:]: p for p in (out / "figures").iterdir()}
    assert sorted(figures) == ["pdf", "png", "svg"]
    for fmt, magic in MAGIC.items():
        assert figures[fmt].read_bytes().startswith(magic), fmt
    assert b"<svg" in figures["svg"].read_bytes()[:500]


def _stream_text(executed: Path) -> str:
    cells = json.loads(executed.read_text())["cells"]
    return "".join("".join(o.get("text", "")) for c in cells for o in c.get("outputs", [])
                   if o.get("output_type") == "stream")


@pytest.mark.slow
def test_es_stepper_output_holds_no_engine_notices(stepper_run):
    from evolm_lib.quiet import notice_lines

    _, executed = stepper_run
    text = _stream_text(executed)
    assert "generation   1" in text  # the loop's own lines are there
    assert not notice_lines(text), notice_lines(text)


def _run_files(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())


def _rewards(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keep = ("generation", "train/", "policy/train_reward", "eval/", "es/rewards", "best_completions")
    return [{k: v for k, v in r.items() if k.startswith(keep)} for r in rows]


@pytest.mark.slow
def test_batch_cli_gives_the_same_run(stepper_run, tmp_path):
    from safetensors.torch import load_file

    out, _ = stepper_run
    results = batch.run_batch(CI_SPEC, tmp_path / "batch")
    assert [r.status for r in results] == ["ok"], results[0].error
    batch_run = results[0].folder / "run"
    assert _run_files(batch_run) == _run_files(out / "run")
    assert _rewards(batch_run) == _rewards(out / "run")
    ours = load_file(str(out / "run" / "final_adapter" / "adapter_model.safetensors"))
    theirs = load_file(str(batch_run / "final_adapter" / "adapter_model.safetensors"))
    assert ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours)
    assert sorted(p.suffix for p in (results[0].folder / "figures").iterdir()) == [".pdf", ".png", ".svg"]


GRPO_STEPPER = NOTEBOOKS / "06_grpo_stepper.py"
GRPO_SPEC = REPO / "papermill_runs" / "grpo_tiny.yaml"
GRPO_PARAMETERS = batch.load_batch_spec(GRPO_SPEC).parameters  # tiny-random, group 4 x 2 prompts, 2 steps


@pytest.mark.slow
def test_grpo_stepper_papermill_run(tmp_path):
    """Notebook 06 through papermill, as `evolm batch` runs it: every step logged, the reward figure
    in three formats, the final adapter, the loop's own lines in the output and no engine notices."""
    from evolm_lib.quiet import notice_lines

    parameters = {**GRPO_PARAMETERS, "run_dir": str(tmp_path / "run"), "figures_dir": str(tmp_path / "figures")}
    executed = _execute(GRPO_STEPPER, tmp_path / "notebook.ipynb", parameters)
    assert not _errors(executed)
    assert executed.stat().st_size < 1_000_000, "widget state or large outputs leaked into the notebook"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(GRPO_PARAMETERS["num_steps"] + 1))
    assert all(len(r["grpo/rewards"]) == GRPO_PARAMETERS["group_size"] * GRPO_PARAMETERS["prompts_per_step"]
               for r in rows[1:])
    assert (tmp_path / "run" / "final_adapter" / "adapter_model.safetensors").exists()
    assert "eval/reward" in rows[-1]  # the last step's policy was scored on the eval prompts
    titles = [f["layout"]["title"]["text"] for f in _figures_shown(executed) if f["layout"].get("title")]
    assert f"GRPO on {GRPO_PARAMETERS['task']} ({TINY_MODEL_NOTE})" in titles
    figures = {p.suffix[1:]: p for p in (tmp_path / "figures").iterdir()}
    assert sorted(figures) == ["pdf", "png", "svg"] and figures["png"].stem == "grpo_stepper_reward"
    for fmt, magic in MAGIC.items():
        assert figures[fmt].read_bytes().startswith(magic), fmt
    text = _stream_text(executed)
    assert "step   2/2" in text and not notice_lines(text), notice_lines(text)


@pytest.mark.slow
def test_tuning_notebook_tunes_every_method_and_reruns_each_winner_on_fresh_seeds(tmp_path):
    """Notebook 07 on tiny-random: every method gets its trials, each winner is rerun on every final
    seed, and no tuning seed is among the final seeds (read from the summary it wrote)."""
    import yaml

    out = tmp_path / "study"
    executed = _execute(NOTEBOOKS / "07_tuning.py", tmp_path / "07.ipynb",
                        {"spec_path": str(REPO / "papermill_runs" / "tune_tiny.yaml"), "out": str(out),
                         "figures_dir": str(tmp_path / "figures")})
    assert not _errors(executed)
    summary = json.loads((out / "tune_summary.json").read_text())
    spec = yaml.safe_load((REPO / "papermill_runs" / "tune_tiny.yaml").read_text())
    methods = summary["methods"]
    assert set(methods) == {"es", "grpo"} and all(entry["trials"] == 2 for entry in methods.values())  # `trials`
    assert {row["method"]: row["seeds"] for row in summary["final"]} == {m: len(spec["final_seeds"]) for m in methods}
    assert not set(spec["tune"]["seeds"]) & set(summary["final_seeds"])


def test_a_batch_checks_grpo_points_as_their_kernel_builds_them(tmp_path):
    """`evolm batch --dry-run` on notebook 06: the points' settings go through GRPOConfig (a bad one is
    named before any kernel starts), exactly as for the ES stepper."""
    info = batch.notebook_info(GRPO_STEPPER)
    assert info.kind == "grpo"
    assert [p.action for p in batch.plan_points(batch.load_batch_spec(GRPO_SPEC), tmp_path / "out")] == ["run", "run"]
    spec = batch.spec_from_dict({"notebook": str(GRPO_STEPPER), "parameters": GRPO_PARAMETERS,
                                 "grid": {"loss_type": ["grpo_clip", "no_baseline"], "micro_batch_size": [3]}})
    points = batch.plan_points(spec, tmp_path / "bad")
    assert [p.action for p in points] == ["invalid", "invalid"]
    assert all("micro_batch_size" in p.error and "does not divide" in p.error for p in points), points[0].error


# --------------------------------------------------------------------------- bad parameters

BAD = [
    ("01_task_inspection", {"task": "no-such-task"}, "task: unknown task 'no-such-task'"),
    ("02_lora_initialization", {"sigma": -0.5}, "sigma: Input should be greater than 0"),
    ("03_es_stepper", {"model": "no-such-model"}, "model: unknown model 'no-such-model'"),
]


@pytest.mark.slow
@pytest.mark.parametrize("stem, parameters, message", BAD, ids=[b[0] for b in BAD])
def test_bad_parameters_fail_in_config_cell(tmp_path, stem, parameters, message):
    from papermill.exceptions import PapermillExecutionError

    with pytest.raises(PapermillExecutionError) as caught:
        batch.execute_notebook(NOTEBOOKS / f"{stem}.py", tmp_path / "out.ipynb", {**TINY, **parameters})
    error = caught.value
    assert error.ename == "ConfigError"
    assert error.evalue.startswith("invalid ESConfig: ") and message in error.evalue
    # the config cell, before any engine starts
    assert "config = ESConfig.from_dict(" in error.source or "config = notebook_config(ESConfig" in error.source


@pytest.mark.slow
def test_batch_cli_reports_bad_parameters_per_run(tmp_path, capsys):
    spec = tmp_path / "bad.yaml"
    spec.write_text(json.dumps({"notebook": str(STEPPER), "name": "bad", "parameters": CI_PARAMETERS,
                                "grid": {"sigma": [-1.0, 0.0]}}))  # JSON is YAML
    code = batch_cli.main([str(spec), "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert code == 1 and "0 ok, 2 failed" in printed
    assert not (tmp_path / "out").exists()  # points that fail their checks create nothing, not even a summary
    for name in ("bad__sigma--1", "bad__sigma-0"):
        line = next(line for line in printed.splitlines() if line.startswith(name + " "))
        assert "failed" in line and "ConfigError: invalid ESConfig: sigma: Input should be greater than 0" in line


# --------------------------------------------------------------------------- the stepper widgets


class FakeRun(RunLoop):
    """Just enough of ESRun for the stepper (RunLoop's real run()): generations that take a little time."""

    def __init__(self, seconds: float = 0.0):
        from evolm_lib.tasks import get_task
        from evolm_lib.tasks.base import Example

        self.seconds = seconds
        self.task = get_task("arithmetic")
        self.train_examples = [Example("Solve: 3 + 5 =", "8")]
        self.generation = 0
        self.history = [{"generation": 0, "policy/train_reward": -10.0, "eval/reward": -12.0}]
        self.checkpoints = []

    def step(self) -> dict:
        time.sleep(self.seconds)
        self.generation += 1
        g = float(self.generation)
        row = {"generation": self.generation, "train/reward_mean": -10 + g, "train/reward_best": -8 + g,
               "train/reward_worst": -12 + g, "train/reward_p20": -11 + g, "train/reward_p80": -9 + g,
               "policy/train_reward": -9 + g, "eval/reward": -11 + g, "prompts": ["Solve: 3 + 5 ="],
               "best_completions": ["8"], "worst_completions": ["<b>eight</b>"]}
        self.history.append(row)
        return row

    def save_checkpoint(self):
        self.checkpoints.append(self.generation)
        return Path(f"checkpoints/{self.generation:06d}")


def _mean_points(stepper) -> int:
    return len(next(t for t in stepper.plot.figure.data if t.name == "mean").x)


def test_stepper_step_run_pause_and_save():
    from evolm_lib.viz.stepper import ESStepper

    run = FakeRun(seconds=0.05)
    stepper = ESStepper(run)
    assert _mean_points(stepper) == 0 and "generation 0" in stepper.status.value
    stepper.step_button.click()
    assert not stepper.start(1), "a second start while running must be ignored"
    assert stepper.step_button.disabled and not stepper.pause_button.disabled
    stepper.wait(10)
    assert run.generation == 1 and _mean_points(stepper) == 1
    assert "generation 1" in stepper.status.value and not stepper.step_button.disabled
    assert "&lt;b&gt;eight&lt;/b&gt;" in stepper.table.value  # completions are escaped
    rows = stepper._completion_rows(run.history[-1])  # the table's lines: target, and each member's reward
    assert rows == [{"prompt": "Solve: 3 + 5 =", "target": "8", "best member": "8", "best reward": 1.0,
                     "worst member": "<b>eight</b>", "worst reward": 0.0}]
    assert all(f"<th>{name}</th>" in stepper.table.value for name in ("target", "best reward", "worst reward"))

    stepper.count.value = 1000
    stepper.run_button.click()
    time.sleep(0.2)
    stepper.pause_button.click()
    stepper.wait(10)
    assert 1 < run.generation < 1000 and "paused" in stepper.status.value
    assert _mean_points(stepper) == run.generation

    stepper.save_button.click()
    assert run.checkpoints == [run.generation] and "checkpoint saved" in stepper.status.value
    assert "application/vnd.jupyter.widget-view+json" in stepper._repr_mimebundle_()


def test_stepper_shows_errors_of_the_background_thread():
    from evolm_lib.viz.stepper import ESStepper

    run = FakeRun()
    run.step = lambda: 1 / 0  # noqa: E731 - a generation that fails
    stepper = ESStepper(run)
    stepper.start(3)
    stepper.wait(10)
    assert isinstance(stepper.error, ZeroDivisionError) and "ZeroDivisionError" in stepper.status.value
    assert not stepper.step_button.disabled


# --------------------------------------------------------------------------- every setting reaches the stepper

# settings that have no parameter of their own in notebook 03: they reach it through `settings`
UNREACHABLE = {"optimizer": "adam", "adam_beta2": 0.99, "lora_alpha": 2.0, "noise_scheme": "per_tensor",
               "antithetic": False, "population_size": 3, "checkpoint_every": 2, "keep_checkpoints": 3}


@pytest.mark.slow
def test_every_setting_reaches_the_stepper_through_settings(tmp_path):
    """A papermill run of 03 with settings that have no parameter (and one that overrides a parameter:
    population_size) finds them in the run folder's config; the dry run resolved the very same settings."""
    import yaml

    spec = tmp_path / "reach.yaml"
    spec.write_text(json.dumps({"notebook": str(STEPPER), "name": "reach",
                                "parameters": {**CI_PARAMETERS, "settings": UNREACHABLE}}))
    [point] = batch.plan_points(batch.load_batch_spec(spec), tmp_path / "out")
    assert point.action == "run" and point.error == ""
    [result] = batch.run_batch(spec, tmp_path / "out")
    assert result.status == "ok", result.error
    written = yaml.safe_load((result.folder / "run" / "config.yaml").read_text())
    assert written.pop("kind") == "es"
    assert {key: written[key] for key in UNREACHABLE} == UNREACHABLE
    assert written["model"] == CI_PARAMETERS["model"] and written["sigma"] == 0.05  # parameters and their defaults
    assert written == point.config.to_dict()  # the dry run checks what the kernel builds
    rows = [json.loads(line) for line in (result.folder / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows[-1]["es/rewards"]) == 3  # an odd population, allowed without antithetic pairs
    with open(tmp_path / "out" / "summary.csv", newline="") as f:
        [row] = list(csv.DictReader(f))
    assert row["settings.optimizer"] == "adam" and row["settings.lora_alpha"] == "2.0" and row["model"] == "tiny-random"


def test_the_stepper_exports_the_figure_again_after_every_step(tmp_path):
    """03's fitness figure in figures_dir follows the run: Step rewrites it, so it never shows a run
    that has since moved on."""
    from evolm_lib.viz.stepper import ESStepper

    stepper = ESStepper(FakeRun(), figures_dir=tmp_path)
    assert not list(tmp_path.iterdir())  # nothing is written before a generation runs
    stepper.step_button.click()
    stepper.wait(120)
    assert stepper.error is None and sorted(p.name for p in stepper.figure_paths) == [
        "es_stepper_fitness.pdf", "es_stepper_fitness.png", "es_stepper_fitness.svg"]
    after_one = (tmp_path / "es_stepper_fitness.svg").read_text()
    stepper.step_button.click()
    stepper.wait(120)
    after_two = (tmp_path / "es_stepper_fitness.svg").read_text()
    assert stepper.run.generation == 2 and after_two != after_one and "figure not exported" not in stepper.status.value
