"""Shared fixtures: the model folders and ONE in-process vLLM engine on tiny-random for the session.

A vLLM engine start costs about 20 s here, so every test that needs the tiny engine shares
``tiny_vllm``; tests on the real SmolLM2 model are marked ``@pytest.mark.slow``.
"""
from __future__ import annotations

import os

import pytest

# In-process engine (no child process, no __main__ guard) and a quiet log, before vLLM is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# Sleeping, not spinning, OpenMP waits: on a busy 2-core machine spinning threads made one HF
# generate call about 20 times slower (154 s instead of 8 s). Set before torch loads libgomp.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # vLLM binds its own threads; more made decoding 10-50x slower here

TINY_MAX_LORAS = 8
TINY_MAX_LORA_RANK = 8


@pytest.fixture(scope="session")
def tiny_model_dir():
    """Folder of the 2-layer tiny-random Llama (built once into the cache)."""
    from evolm_lib.models import resolve_model

    return resolve_model("tiny-random")


@pytest.fixture(scope="session")
def smollm2_dir():
    """Folder of the real SmolLM2-135M-Instruct (float32, converted once into the cache)."""
    from evolm_lib.models import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_vllm(tiny_model_dir):
    """One vLLM engine on tiny-random with LoRA (max_loras=8, max_lora_rank=8), shared by the session."""
    from evolm_lib.engines.vllm.engine import VLLMEngine

    engine = VLLMEngine(
        str(tiny_model_dir), max_loras=TINY_MAX_LORAS, max_lora_rank=TINY_MAX_LORA_RANK, max_model_len=512, kv_cache_gb=0.125
    )
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def tiny_hf(tiny_model_dir):
    """transformers + peft engine on tiny-random (the reference the vLLM engine is checked against)."""
    from evolm_lib.engines.hf_engine import HFEngine

    engine = HFEngine(str(tiny_model_dir))
    yield engine
    engine.close()
