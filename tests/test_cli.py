"""The `evolm` command: every subcommand answers --help, and importing the library sets no environment."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from evolm_lib.cli import COMMANDS, main

REPO = Path(__file__).resolve().parents[1]


def test_console_script_points_at_a_main_that_runs():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"evolm": "evolm_lib.cli:main"}
    result = subprocess.run([sys.executable, "-m", "evolm_lib.cli", "--help"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0
    assert all(name in result.stdout for name in ("demo", "bench", "batch", "sweep", "lab"))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_answers_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"evolm {command}" in capsys.readouterr().out


def test_unknown_subcommand_is_refused_with_the_list(capsys):
    assert main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err


def test_importing_every_module_sets_no_environment():
    code = """
import importlib, json, os, pkgutil, sys
before = dict(os.environ)
import evolm_lib
for info in pkgutil.walk_packages(evolm_lib.__path__, "evolm_lib."):
    if not info.name.endswith("__main__"):
        importlib.import_module(info.name)
changed = sorted(k for k in set(os.environ) | set(before) if os.environ.get(k) != before.get(k))
print(json.dumps(changed))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "OMP_", "TOKENIZERS_"))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_the_benchmark_reports_throughput_and_split_es_generations_in_one_run(tmp_path, capsys):
    from evolm_lib.benchmark import main as benchmark

    out = tmp_path / "benchmark.json"
    result = benchmark(["--model", "tiny-random", "--population", "4", "--generations", "3", "--prompts", "2",
                        "--new-tokens", "8", "--variants", "in_place,files", "--json", str(out)])
    printed = capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    throughput = result["throughput"]
    assert [row["name"] for row in throughput["rows"]] == ["vllm in_place", "vllm files", "vllm base"]
    assert all(row["tokens"] == 4 * 2 * 8 for row in throughput["rows"])  # members x prompts x new tokens, EOS ignored
    by_name = {row["name"]: row["tokens_per_s"] for row in throughput["rows"]}
    assert throughput["ratios"]["vllm in_place / vllm base"] == pytest.approx(by_name["vllm in_place"] / by_name["vllm base"])
    assert throughput["ratios"]["vllm files / vllm base"] == pytest.approx(by_name["vllm files"] / by_name["vllm base"])
    in_place, files = result["es_generations"]["in_place"], result["es_generations"]["files"]
    assert in_place["slots_write_s"] > 0 and files["slots_write_s"] == 0  # the members went where each path says
    for split in (in_place, files):
        assert split["generate_s"] > 0 and split["update_s"] > 0 and split["tokens_per_generation"] > 0
        assert split["es_overhead_s"] == pytest.approx(split["adapters_s"] + split["update_s"])
        assert split["generation_s"] >= split["generate_s"] + split["update_s"]
    assert "vllm in_place / vllm base" in printed and "in_place_own_scoring_call" not in printed
    assert "files" in printed and "%" in printed


def test_the_benchmark_refuses_bad_options(capsys):
    from evolm_lib.benchmark import main as benchmark

    for argv, message in ((["--population", "3"], "even"), (["--variants", "nope"], "--variants"),
                          (["--rank", "0"], "--rank")):
        with pytest.raises(SystemExit):
            benchmark(argv)
        assert message in capsys.readouterr().err


# --------------------------------------------------------------------------- the bare command and --version
# (issue 21, item 7: the lab/CLI helper's block; batch and sweep tests live above)


def test_evolm_without_a_command_prints_the_list_and_fails():
    result = subprocess.run([sys.executable, "-m", "evolm_lib.cli"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2, result
    assert result.stdout == ""  # the list is an error message here, on stderr
    assert result.stderr.startswith("usage: evolm COMMAND") and all(name in result.stderr for name in COMMANDS)


def test_evolm_version_prints_the_package_version(capsys):
    expected = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"evolm {expected}\n"
    result = subprocess.run([sys.executable, "-m", "evolm_lib.cli", "-V"], capture_output=True, text=True, cwd=REPO)
    assert (result.returncode, result.stdout) == (0, f"evolm {expected}\n")


# --------------------------------------------------------------------------- help that shows how to run

import ast
import re
import shlex
import signal
import time

from helpers_terminal import ctrl_c_as_in_a_terminal

HELPED = ["batch", "sweep", "tune", "bench", "lab", "demo"]
DRY_RUN = ["batch", "sweep", "tune", "bench"]  # the commands whose examples run here, in --dry-run form


def _help(command: str | None, capsys) -> str:
    if command is None:
        assert main(["--help"]) == 0
    else:
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
    return capsys.readouterr().out


def _examples(text: str) -> list[str]:
    """The example command lines of a help text: indented lines starting with `evolm`, the command up
    to the two spaces before its explanation."""
    return [re.split(r"\s{2,}", line.strip())[0] for line in text.splitlines() if re.match(r"^\s{2,}evolm \S", line)]


def _library_names() -> set[str]:
    """Names of the functions and classes the library defines (their names are no help for a user)."""
    names = set()
    for path in (REPO / "evolm_lib").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and (
                    "_" in node.name.strip("_") or isinstance(node, ast.ClassDef)) and node.name not in ("main",):
                names.add(node.name)
    return names


@pytest.mark.parametrize("command", [None, *HELPED])
def test_help_opens_with_commands_to_run_and_names_no_library_function(command, capsys):
    text = _help(command, capsys)
    lines = text.splitlines()
    examples = _examples(text)
    assert len(examples) >= 2, text
    after_usage = lines.index("")  # the usage line(s) end at the first blank line
    first = next(i for i, line in enumerate(lines) if re.match(r"^\s{2,}evolm \S", line))
    assert first - after_usage <= 6, f"the examples should open the help:\n{text}"
    assert "evolm_lib" not in text and "summarize" not in text
    named = sorted(name for name in _library_names() if re.search(rf"\b{re.escape(name)}\b", text))
    assert not named, named
    for path in re.findall(r"\b(?:papermill_runs|notebooks)/[\w./*-]+\.(?:yaml|py)\b", text):
        assert list(REPO.glob(path)), f"{path} named in the help is not in the repository"


@pytest.mark.parametrize("command", HELPED)
def test_help_states_every_default(command, capsys):
    from importlib import import_module

    module = import_module(f"evolm_lib.cli.{command}")
    parser = module.build_parser() if hasattr(module, "build_parser") else module._parser()
    text = _help(command, capsys)
    options = text[text.index("\noptions:"):]
    for action in parser._actions:
        if action.default is None or action.default is False or action.default == "==SUPPRESS==":
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        block = re.search(rf"\n  {re.escape(name)}\b.*?(?=\n  \S|\Z)", text[text.index("\npositional") if not
                          action.option_strings and "\npositional" in text else text.index("\noptions:"):], re.S)
        assert block and "default" in block.group(0), (name, options)


@pytest.mark.parametrize("command", DRY_RUN)
def test_the_examples_of_the_help_run_in_dry_run_form(command, capsys):
    examples = _examples(_help(command, capsys))
    assert len(examples) >= 2
    for example in examples:
        argv = shlex.split(example)[1:]
        if "--dry-run" not in argv:
            argv.append("--dry-run")
        assert main(argv) == 0, example
        assert capsys.readouterr().out.strip(), example


def test_bench_dry_run_lists_what_it_would_measure_and_refuses_bad_settings(capsys):
    from evolm_lib.cli import bench

    result = bench.main(["--model", "tiny-random", "--population", "4", "--prompts", "2", "--no-hf-batched-base",
                         "--dry-run"])
    printed = capsys.readouterr().out
    assert result["dry_run"] and "4 (rank 1) x 2 prompts" in printed and "8 requests" in printed
    assert "HF + peft, one adapter at a time" in printed and "HF base model" not in printed
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--model", "./no/such/folder", "--dry-run"])
    assert exit_info.value.code == 2 and "--model" in capsys.readouterr().err


# --------------------------------------------------------------------------- Ctrl-C in a batch


def _status(folder: Path) -> str:
    try:
        return json.loads((folder / "status.json").read_text()).get("status", "")
    except (OSError, ValueError):
        return ""


def _interrupt_when(process: subprocess.Popen, tmp_path: Path, ready, waiting_for: str, timeout: float) -> int:
    """Ctrl-C as a terminal sends it: SIGINT once ``ready()`` (the command still running), then exit 130
    within two minutes; returns the length of tmp_path/stderr before the signal (the process is
    killed if it outlives the test)."""
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert process.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
            assert time.monotonic() < deadline, waiting_for
            time.sleep(0.5)
        before = len((tmp_path / "stderr").read_text())
        process.send_signal(signal.SIGINT)
        assert process.wait(120) == 130
        return before
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


@pytest.mark.slow
def test_ctrl_c_in_a_batch_prints_one_line_and_the_same_command_continues(tmp_path):
    """SIGINT while the second of two GRPO points runs: exit 130, one line saying what was kept and
    how to continue, no traceback, no kernel left holding the point; a dry run of the same command then
    skips the finished point and resumes the interrupted one."""
    from evolm_lib import batch
    from evolm_lib.cli.interrupt import child_processes

    spec, out = REPO / "papermill_runs" / "grpo_tiny.yaml", tmp_path / "out"
    stdout, stderr = open(tmp_path / "stdout", "w+"), open(tmp_path / "stderr", "w+")
    process = subprocess.Popen([sys.executable, "-m", "evolm_lib.cli", "batch", str(spec), "--out", str(out)],
                               cwd=REPO, stdout=stdout, stderr=stderr, preexec_fn=ctrl_c_as_in_a_terminal)
    first, second = out / "grpo_tiny__seed-0", out / "grpo_tiny__seed-1"
    kernels = []

    def ready() -> bool:
        if not (_status(first) == "ok" and _status(second) == "running" and child_processes(process.pid)):
            return False
        time.sleep(3)  # into the second point's notebook
        kernels.extend(child_processes(process.pid))
        return True

    before = _interrupt_when(process, tmp_path, ready, "the batch did not reach its second point", timeout=400)
    stderr.seek(0)
    after = stderr.read()[before:]
    printed = after.replace("\r", "\n")
    lines = [line for line in printed.splitlines() if line.strip()]
    assert "Traceback" not in printed and "KeyboardInterrupt" not in printed, printed
    assert lines[-1] == (f"interrupted: 1 of 2 point(s) finished and kept in {out.resolve()}; "
                         "run the same command again to continue"), printed
    assert len([line for line in lines if not line.startswith("batch:")]) == 1, printed  # tqdm's bar aside
    assert not [pid for pid in kernels if Path(f"/proc/{pid}").exists()
                and "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()], "a kernel outlived the batch"
    points = batch.plan_points(batch.load_batch_spec(spec), out)
    assert [(p.run.name, p.action) for p in points] == [("grpo_tiny__seed-0", "skip"), ("grpo_tiny__seed-1", "resume")]


# --------------------------------------------------------------------------- Ctrl-C in a sweep


@pytest.mark.slow
def test_ctrl_c_in_a_sweep_prints_one_line_and_exits_130(tmp_path):
    """SIGINT while the first run of a tiny sweep trains: exit 130 and one line saying what was kept and
    how to continue, no traceback."""
    out = tmp_path / "out"
    stdout, stderr = open(tmp_path / "stdout", "w+"), open(tmp_path / "stderr", "w+")
    process = subprocess.Popen([sys.executable, "-m", "evolm_lib.cli", "sweep", "--model", "tiny-random",
                                # generations enough that the first run cannot end between the poll that
                                # sees generation 1 and the signal (4 did once, on a loaded machine)
                                "--generations", "50", "--seeds", "0,1", "--max-new-tokens", "8", "--methods", "es",
                                "--no-kl", "--no-notebook", "--out", str(out)],
                               cwd=REPO, stdout=stdout, stderr=stderr, preexec_fn=ctrl_c_as_in_a_terminal)
    before = _interrupt_when(process, tmp_path, lambda: "es_seed0    1/50" in (tmp_path / "stdout").read_text(),
                             "the sweep did not reach its first generation", timeout=300)
    stderr.seek(0)
    printed = stderr.read()[before:]
    lines = [line for line in printed.splitlines() if line.strip()]
    assert "Traceback" not in printed and "KeyboardInterrupt" not in printed, printed
    assert lines == [f"interrupted: 0 of 2 run(s) finished and kept in {out.resolve()}; "
                     "run the same command again to continue"], printed
    assert (out / "es_seed0" / "metrics.jsonl").read_text().strip()  # the generations it finished are kept
