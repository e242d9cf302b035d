"""The one place that sets the environment engines run best in. Nothing here runs at import: the
engines call ``apply_engine_defaults()`` before they import vLLM or torch's thread pools matter, and
so do the command line, the notebooks' kernels (through the engines) and the tests.

Every value is a default: a variable the user already set is left alone.
"""
from __future__ import annotations

import os

from .quiet import quiet_engines, verbose

ENGINE_DEFAULTS = {
    # The engine in this process: works in scripts without a __main__ guard and in Jupyter kernels.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # vLLM's INFO lines drown a notebook's output; warnings a user can act on stay (EVOLM_VERBOSE=1: INFO).
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    # Spinning OpenMP threads starve the engine on a busy machine (one HF call: 154 s instead of 8 s).
    "OMP_WAIT_POLICY": "PASSIVE",
}
# vLLM's CPU worker binds its own threads; extra OpenMP threads made LoRA decoding 10-50x slower on a
# 2-core machine (a generation took 47 s instead of 6 s). GPUs do not care.
CPU_DEFAULTS = {"OMP_NUM_THREADS": "1"}


PROCESS_INTERNAL = ("VLLM_DIST_IDENT",)
"""Variables a vLLM engine sets in its own process for itself (the CPU worker's communicator id):
meaningless to a child process, where vLLM warns about them as unknown."""


def child_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a child it starts (a JupyterLab server and its kernels), with
    ``extra`` and without the variables an engine of this process set for itself."""
    env = {key: value for key, value in os.environ.items() if key not in PROCESS_INTERNAL}
    return {**env, **(extra or {})}


def apply_engine_defaults(cpu: bool | None = None) -> dict[str, str]:
    """Set the engine's environment defaults (and one torch thread on a CPU machine), and hide engine
    notices a user cannot act on (``evolm_lib.quiet``); returns the variables it set."""
    if cpu is None:
        cpu = not has_cuda()
    defaults = {**ENGINE_DEFAULTS, **(CPU_DEFAULTS if cpu else {})}
    if verbose():
        defaults["VLLM_LOGGING_LEVEL"] = "INFO"
    changed = {}
    for key, value in defaults.items():
        if key not in os.environ:
            os.environ[key] = value
            changed[key] = value
    quiet_engines()
    if cpu and os.environ.get("OMP_NUM_THREADS") == "1":
        import torch

        # torch read OMP_NUM_THREADS at import, before it was set (a kernel started without it).
        # After an engine started, vLLM's CPU worker has bound the threads and replaced
        # torch.set_num_threads by a stub that only logs: leave it alone then.
        if torch.get_num_threads() != 1 and type(torch.set_num_threads).__name__ == "builtin_function_or_method":
            torch.set_num_threads(1)
    return changed


def has_cuda() -> bool:
    """True when torch sees a CUDA device (False without torch)."""
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
