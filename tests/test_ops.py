"""ops/: the maintainers' scripts for an offline GPU host, outside the package. A study folder of real
files (a real Optuna storage, checkpoints written by the run folders' own code) packed in parts and
joined again gives the same bytes; a missing or damaged part, or a study folder already there, is
refused; the staged wheels unpack into a site folder; and ops/ stays small, separate and in the
product's words."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OPS = REPO / "ops"
PART = 2**20  # PART_MB=1


def _run(script: str, *args, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "EVOLM": f"{sys.executable} -m evolm_lib.cli", "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(["bash", str(OPS / script), *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _study(root: Path) -> Path:
    """A study folder: an Optuna storage with two trials, a finished trial's run (rows, scores, two
    checkpoints, its saved adapter) and a rerun under way (rows, two checkpoints, one of 3 MB), a figure."""
    import optuna
    import torch

    from evolm_lib.runs.checkpoints import write_checkpoint

    study = root / "study"
    study.mkdir()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    search = optuna.create_study(study_name="es_lora", storage=f"sqlite:///{study / 'optuna.db'}",
                                 sampler=optuna.samplers.TPESampler(seed=0))
    search.optimize(lambda trial: trial.suggest_float("sigma", 1e-4, 1e-2, log=True), n_trials=2)
    generator = torch.Generator().manual_seed(0)
    for run, finished, floats in (("trials/es_lora/trial_0000/seed0", True, 1000), ("final/es_lora/seed0", False, 800_000)):
        folder = study / run
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text("method: es_lora\n")
        (folder / "metrics.jsonl").write_text("".join(f'{{"generation": {g}, "train/reward_mean": {g / 10}}}\n' for g in range(5)))
        for step in (2, 4):
            write_checkpoint(folder, step, None, {"m": torch.randn(floats, generator=generator)}, {"generation": step}, "base")
        if finished:
            (folder / "heldout.jsonl").write_text('{"index": 0, "reward": 1.0, "success": true}\n')
            (folder / "final_adapter").mkdir()
            (folder / "final_adapter" / "adapter_model.safetensors").write_bytes(os.urandom(5000))
    (study / "figures").mkdir()
    (study / "figures" / "best.png").write_bytes(os.urandom(100))
    (study / "tune_summary.json").write_text('{"methods": ["es_lora"]}\n')
    return study


def test_a_study_packed_in_parts_and_unpacked_is_the_same_study_with_each_run_s_newest_checkpoint(tmp_path):
    import optuna

    study = _study(tmp_path)
    packed = _run("study.sh", "pack", study, tmp_path / "pack", env={"PART_MB": "1"})
    assert packed.returncode == 0, packed.stderr
    parts = sorted((tmp_path / "pack").glob("study.tar.gz.part-*"))
    assert len(parts) >= 3 and all(p.stat().st_size <= PART for p in parts)  # 3 MB of checkpoint, 1 MiB parts
    assert (tmp_path / "pack" / "left_out.txt").read_text() == ""
    back = _run("study.sh", "unpack", tmp_path / "pack", tmp_path / "back")
    assert back.returncode == 0, back.stderr
    before, after = _files(study), _files(tmp_path / "back")
    carried = {name for name in before if not re.search(r"checkpoints/000002/|final_adapter/|figures/|optuna\.db$", name)}
    assert set(after) == carried | {"optuna.db"}
    assert all(after[name] == before[name] for name in carried)
    for run in ("trials/es_lora/trial_0000/seed0", "final/es_lora/seed0"):
        from evolm_lib.runs.checkpoints import latest_intact_checkpoint

        assert latest_intact_checkpoint(tmp_path / "back" / run).name == "000004"
    trials = optuna.load_study(study_name="es_lora", storage=f"sqlite:///{tmp_path / 'back' / 'optuna.db'}").trials
    assert [t.params for t in trials] == [t.params for t in optuna.load_study(
        study_name="es_lora", storage=f"sqlite:///{study / 'optuna.db'}").trials]


def test_a_checkpoint_over_the_limit_stays_behind_and_an_unfinished_run_with_it(tmp_path):
    study = _study(tmp_path)
    packed = _run("study.sh", "pack", study, tmp_path / "pack", env={"CHECKPOINT_MB": "2"})
    assert packed.returncode == 0, packed.stderr
    assert (tmp_path / "pack" / "left_out.txt").read_text() == "final/es_lora/seed0 (its checkpoint: 4 MB)\n"
    assert _run("study.sh", "unpack", tmp_path / "pack", tmp_path / "back").returncode == 0
    names = set(_files(tmp_path / "back"))
    assert not any(name.startswith("final/") for name in names)
    assert "trials/es_lora/trial_0000/seed0/checkpoints/000004/optimizer.safetensors" in names


def test_unpack_refuses_a_missing_or_damaged_part_and_a_study_folder_already_there(tmp_path):
    study = _study(tmp_path)
    assert _run("study.sh", "pack", study, tmp_path / "pack", env={"PART_MB": "1"}).returncode == 0
    assert _run("study.sh", "pack", study, tmp_path / "pack").returncode == 2  # a pack is never overwritten
    refused = _run("study.sh", "unpack", tmp_path / "pack", study)
    assert refused.returncode == 2 and "exists and is not empty" in refused.stderr
    part = tmp_path / "pack" / "study.tar.gz.part-001"
    whole = part.read_bytes()
    part.write_bytes(whole[:-10])
    damaged = _run("study.sh", "unpack", tmp_path / "pack", tmp_path / "back")
    assert damaged.returncode == 2 and "study.tar.gz.part-001: FAILED" in damaged.stdout + damaged.stderr
    part.unlink()
    missing = _run("study.sh", "unpack", tmp_path / "pack", tmp_path / "back")
    assert missing.returncode == 2 and "part-001" in missing.stderr and not (tmp_path / "back").exists()
    assert _run("study.sh", "pack", tmp_path / "nothing", tmp_path / "p2").stderr.startswith("STUDY")


def test_run_checks_its_arguments_before_it_starts_anything(tmp_path):
    missing = _run("study.sh", "run", tmp_path / "spec.yaml", tmp_path / "study", 60)
    assert missing.returncode == 2 and "spec.yaml: no such file" in missing.stderr
    (tmp_path / "spec.yaml").write_text("tune: {}\n")
    wrong = _run("study.sh", "run", tmp_path / "spec.yaml", tmp_path / "study", "1h")
    assert wrong.returncode == 2 and "SECONDS 1h" in wrong.stderr and not (tmp_path / "study").exists()
    assert _run("speed.sh", "fast", tmp_path).returncode == 2 and not (REPO / "runs" / "speed_fast").exists()


def test_staged_wheels_unpack_from_their_parts_into_a_site_folder(tmp_path):
    package = tmp_path / "src"
    (package / "evolm_ops_probe").mkdir(parents=True)
    (package / "evolm_ops_probe" / "__init__.py").write_text("ANSWER = 42\n")
    (package / "pyproject.toml").write_text('[project]\nname = "evolm-ops-probe"\nversion = "1.0"\n'
                                            '[tool.setuptools]\npackages = ["evolm_ops_probe"]\n')
    stage = tmp_path / "stage"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(stage / "wheels"), str(package)], check=True, capture_output=True)
    # the layout `stage.sh download` writes: the wheels/ folder in tar parts, and their checksums
    subprocess.run(f"tar -cf - -C {stage} wheels | split -b 1K -d - {stage}/wheels.tar.part- && cd {stage} && "
                   "sha256sum wheels.tar.part-* > wheels.sha256", shell=True, check=True)
    assert len(list(stage.glob("wheels.tar.part-*"))) >= 2
    installed = _run("stage.sh", "install", stage, tmp_path / "site")
    assert installed.returncode == 0, installed.stderr
    probe = subprocess.run([sys.executable, "-c", "import evolm_ops_probe; print(evolm_ops_probe.ANSWER)"],
                           env={**os.environ, "PYTHONPATH": str(tmp_path / "site")}, capture_output=True, text=True)
    assert probe.stdout.strip() == "42"
    (stage / "wheels.tar.part-01").unlink()
    assert _run("stage.sh", "install", stage, tmp_path / "site2").returncode == 1


def test_ops_is_small_outside_the_package_and_in_the_product_s_words():
    files = sorted(p for p in OPS.rglob("*") if p.is_file())
    assert sum(len(p.read_text().splitlines()) for p in files) <= 400
    text = "\n".join(p.read_text() for p in files).lower()
    workshop = r"\b(leases?|lent machines?|device calls?|salvage|restart|claim|claim.until|finish.by)\b"
    assert not re.findall(workshop, text)
    library = "\n".join(p.read_text() for p in (REPO / "evolm_lib").rglob("*.py"))
    assert not re.search(r"^\s*(from|import)\s+ops\b|ops/(study|speed|stage|mps)\.sh", library, re.M)
    packaging = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert packaging["include"] == ["evolm_lib*"]
    mkdocs = (REPO / "mkdocs.yml").read_text()
    assert re.search(r"^docs_dir: docs$", mkdocs, re.M) and "ops/" not in mkdocs
