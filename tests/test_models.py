"""Model resolution: known names, the locked atomic cache build, and clear errors for bad names."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from evolm_lib import models
from evolm_lib.models import CONVERSION_VERSION, check_model_name, ensure_model, known_models, resolve_model


def test_known_names():
    assert known_models() == ["smollm2-135m-instruct", "tiny-random"]


@pytest.mark.parametrize("name", ["tiny-random", "smollm2-135m-instruct"])
def test_known_names_resolve_to_model_folders(name):
    folder = resolve_model(name)
    assert folder.name == f"{name}-v{CONVERSION_VERSION}"
    assert (folder / "config.json").exists()
    assert list(folder.glob("*.safetensors"))
    assert (folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists()
    assert resolve_model(name) == folder  # cached: the same folder again


def test_tiny_random_architecture(tiny_model_dir, smollm2_dir):
    tiny = json.loads((tiny_model_dir / "config.json").read_text())
    real = json.loads((smollm2_dir / "config.json").read_text())
    assert tiny["num_hidden_layers"] == 2
    assert tiny["hidden_size"] == 64
    assert tiny["vocab_size"] == real["vocab_size"] == 49152
    assert real["num_hidden_layers"] == 30 and real["hidden_size"] == 576

    from transformers import AutoTokenizer

    tiny_tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    real_tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "What is 12 + 30? Answer: 42"
    assert tiny_tok(text)["input_ids"] == real_tok(text)["input_ids"]
    assert tiny_tok.chat_template == real_tok.chat_template


_CONCURRENT_BUILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from evolm_lib import models

    log, start_at = Path(sys.argv[1]), float(sys.argv[2])
    builder = models.BUILDERS["tiny-random"]

    def logged_builder(out):
        with open(log, "a") as handle:
            handle.write("build\\n")
        builder(out)

    models.BUILDERS["tiny-random"] = logged_builder
    import transformers, torch  # noqa: F401  (import before the start line so both race the build)
    time.sleep(max(0.0, start_at - time.time()))
    print(models.ensure_model("tiny-random"))
    """
)


def test_concurrent_build_is_atomic_and_locked(tmp_path, tiny_model_dir, smollm2_dir):
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    # The tiny builder takes SmolLM2's tokenizer: link the converted folder so the fresh cache
    # does not convert the 517 MB model again.
    (cache / "models" / smollm2_dir.name).symlink_to(smollm2_dir.resolve(), target_is_directory=True)
    log = tmp_path / "builds.log"
    env = {**os.environ, "EVOLM_CACHE_DIR": str(cache)}
    start_at = time.time() + 8.0  # both processes have imported torch by then and start together
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONCURRENT_BUILD, str(log), str(start_at)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=180) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err[-2000:]
    paths = {out.strip().splitlines()[-1] for out, _ in results}
    final = cache / "models" / f"tiny-random-v{CONVERSION_VERSION}"
    assert paths == {str(final)}
    assert log.read_text().splitlines() == ["build"]  # the lock made the second process wait, not rebuild

    entries = sorted(p.name for p in (cache / "models").iterdir())
    leftovers = [name for name in entries if (cache / "models" / name).is_dir() and name.startswith(".")]
    assert leftovers == [], f"temporary build folders left behind: {leftovers}"
    assert sorted(n for n in entries if not n.startswith(".")) == sorted([final.name, smollm2_dir.name])

    # A valid folder, identical to the normal cache's (the weights come from a fixed seed).
    from safetensors.torch import load_file

    fresh = load_file(str(final / "model.safetensors"))
    normal = load_file(str(tiny_model_dir / "model.safetensors"))
    assert fresh.keys() == normal.keys()
    assert all((fresh[k] == normal[k]).all() for k in fresh)
    assert json.loads((final / "config.json").read_text())["hidden_size"] == 64
    assert oct(final.stat().st_mode & 0o777) == oct(0o755)


def test_failed_build_leaves_no_temp_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("EVOLM_CACHE_DIR", str(tmp_path))

    def broken(out: Path) -> None:
        (out / "half-written.bin").write_bytes(b"x")
        raise RuntimeError("conversion failed")

    monkeypatch.setitem(models.BUILDERS, "tiny-random", broken)
    with pytest.raises(RuntimeError, match="conversion failed"):
        ensure_model("tiny-random")
    assert [p.name for p in (tmp_path / "models").iterdir() if p.is_dir()] == []


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError) as info:
        resolve_model("no-such-model")
    message = str(info.value)
    assert "no-such-model" in message
    assert "tiny-random" in message and "smollm2-135m-instruct" in message
    with pytest.raises(ValueError, match="tiny-random"):
        ensure_model("no-such-model")


def test_hub_name_offline_says_how_to_pass_a_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    started = time.perf_counter()
    with pytest.raises(FileNotFoundError) as info:
        resolve_model("some-org/some-model-that-is-not-cached")
    assert time.perf_counter() - started < 5.0
    message = str(info.value)
    assert "some-org/some-model-that-is-not-cached" in message
    assert "path" in message and "--local-dir" in message
    assert "tiny-random" in message


def test_folder_without_config_is_rejected(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="config.json"):
        check_model_name(str(tmp_path))
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))


def test_local_folder_resolves_to_itself(tiny_model_dir, tmp_path):
    link = tmp_path / "my-model"
    link.symlink_to(tiny_model_dir, target_is_directory=True)
    assert resolve_model(str(link)) == tiny_model_dir.resolve()


@pytest.mark.parametrize("name", ["tiny-random", "smollm2-135m-instruct", "Qwen/Qwen2.5-0.5B-Instruct", "org/name"])
def test_check_model_name_accepts(name):
    check_model_name(name)


def test_check_model_name_accepts_a_model_folder(tiny_model_dir):
    check_model_name(str(tiny_model_dir))


@pytest.mark.parametrize(
    "name, match",
    [
        ("", "non-empty"),
        (None, "non-empty"),
        (3, "non-empty"),
        ("tiny_random", "known name"),
        ("org/name/extra", "model folder 'org/name/extra' not found"),  # a path, not a hub name
        ("org/", "model folder 'org/' not found"),
        ("/no/such/folder", "model folder '/no/such/folder' not found"),
        ("./missing/folder", r"model folder './missing/folder' not found \(relative to "),
    ],
)
def test_check_model_name_rejects(name, match):
    with pytest.raises(ValueError, match=match):
        check_model_name(name)


def test_check_model_name_does_not_build(tmp_path, monkeypatch):
    monkeypatch.setenv("EVOLM_CACHE_DIR", str(tmp_path))
    check_model_name("tiny-random")
    assert not (tmp_path / "models").exists()


def test_cache_dir_follows_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("EVOLM_CACHE_DIR", str(tmp_path / "c"))
    assert models.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("EVOLM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "xdg" / "evolm"


def test_a_file_is_not_a_model_folder(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file, not a model folder"):
        check_model_name(str(tmp_path / "weights.bin"))


def test_cached_model_dir_builds_nothing(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setenv("EVOLM_CACHE_DIR", str(tmp_path))
    assert models.cached_model_dir("tiny-random") is None  # not built in this cache: no build either
    assert not (tmp_path / "models").exists()
    assert models.cached_model_dir(str(tiny_model_dir)) == tiny_model_dir.resolve()
    assert models.cached_model_dir("some-org/some-model") is None
