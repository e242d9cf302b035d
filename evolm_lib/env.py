"""The one place that sets the environment engines run best in. Nothing here runs at import: the
engines call ``apply_engine_defaults()`` before they import vLLM or torch's thread pools matter, and
so do the command line, the notebooks' kernels (through the engines) and the tests.

Every value is a default: a variable the user already set is left alone.
"""
from __future__ import annotations

import os

ENGINE_DEFAULTS = {
    # The engine in this process: works in scripts without a __main__ guard and in Jupyter kernels.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # vLLM's INFO lines drown a notebook's output; warnings a user can act on stay.
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    # Spinning OpenMP threads starve the engine on a busy machine (one HF call: 154 s instead of 8 s).
    "OMP_WAIT_POLICY": "PASSIVE",
}
# vLLM's CPU worker binds its own threads; extra OpenMP threads made LoRA decoding 10-50x slower on a
# 2-core machine (a generation took 47 s instead of 6 s). GPUs do not care.
CPU_DEFAULTS = {"OMP_NUM_THREADS": "1"}


def apply_engine_defaults(cpu: bool | None = None) -> dict[str, str]:
    """Set the engine's environment defaults (and one torch thread on a CPU machine); returns what was set."""
    if cpu is None:
        cpu = not _has_cuda()
    changed = {}
    for key, value in {**ENGINE_DEFAULTS, **(CPU_DEFAULTS if cpu else {})}.items():
        if key not in os.environ:
            os.environ[key] = value
            changed[key] = value
    if cpu and os.environ.get("OMP_NUM_THREADS") == "1":
        import torch

        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)  # torch read OMP_NUM_THREADS at import, before it was set
    return changed


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
