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
