"""Quiet engines: known engine notices are hidden, other warnings stay, EVOLM_VERBOSE shows all; and a
kernel started without `make` (plain papermill or JupyterLab) still gets one thread and a quiet engine."""
from __future__ import annotations

import io
import json
import logging
import warnings

import pytest

from evolm_lib import quiet
from evolm_lib.env import apply_engine_defaults



@pytest.fixture
def vllm_log(monkeypatch):
    """A handler at WARNING on a vLLM-named logger, as vLLM configures its own; yields the text it printed."""
    monkeypatch.setattr(quiet, "_state", {"verbose_override": None, "c10_level": None})
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.WARNING)
    logger = logging.getLogger("vllm.test_quiet")
    logger.addHandler(handler)
    logger.propagate = False
    previous = logging.getLogRecordFactory()
    yield logger, stream
    logging.setLogRecordFactory(previous)
    logger.removeHandler(handler)


def test_known_engine_notices_are_hidden_and_others_stay(vllm_log):
    logger, stream = vllm_log
    assert quiet.quiet_engines()
    logger.warning("%s is not found in LD_PRELOAD. For best performance, ...", "libtcmalloc")
    logger.warning("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.")
    logger.warning("Triton is installed, but doesn't include CPU backend. Disabling Triton.")
    logger.warning("max_num_seqs is too small for this model")  # not known noise: a user may act on it
    logger.error("The global random seed is set to 0")  # errors always show
    assert stream.getvalue().splitlines() == ["max_num_seqs is too small for this model",
                                              "The global random seed is set to 0"]
    assert quiet.quiet_engines()
    chain, factory = [], logging.getLogRecordFactory()  # vLLM may wrap ours (it keeps the factory it finds)
    while factory is not None and len(chain) < 8:
        chain.append(type(factory).__name__)
        factory = getattr(factory, "_factory", None)
    assert "_DemotingRecordFactory" in chain, chain


def test_notice_lines_recognise_what_engines_print():
    printed = """(MainProcess pid=1) WARNING 11-26 10:11:08 [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD.
Triton is installed, but doesn't include CPU backend. Disabling Triton.
/x/vllm/triton_utils/dispatcher.py:138: FutureWarning: `torch.distributed.reduce_op` is deprecated
[W1126 10:11:08.755346745 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy (function init_cpu_memory_env)
generation   1  reward mean  -95.000
Loading safetensors checkpoint shards: 100% Completed | 1/1"""
    # vLLM colours its lines in a kernel's stdout (copied from a notebook 03 output, issue 21)
    printed += ("\n\x1b[0;36m(MainProcess pid=10293)\x1b[0;0m \x1b[33mWARNING\x1b[0m \x1b[90m11-26 20:09:04\x1b[0m "
                "\x1b[90m[cpu.py:317]\x1b[0m Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'.")
    found = quiet.notice_lines(printed)
    assert len(found) == 6
    assert [line for line in printed.splitlines() if line not in found and "\x1b" not in line] == [
        "generation   1  reward mean  -95.000"]
    assert found[-1].startswith("(MainProcess pid=10293) WARNING 11-26 20:09:04 [cpu.py:317] Reset SSM")


def test_engine_notices_are_hidden_on_stdout_and_stderr_and_user_prints_stay(vllm_log, capsys):
    """vLLM's handler writes to stdout by default (VLLM_LOGGING_STREAM), to stderr if the user says so:
    the same notice is hidden on both, while the user's prints and an actionable warning stay."""
    import sys

    handlers = {name: logging.StreamHandler(stream) for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr))}
    loggers = {name: logging.getLogger(f"vllm.platforms.test_{name}") for name in handlers}
    for name, logger in loggers.items():
        handlers[name].setLevel(logging.WARNING)
        logger.addHandler(handlers[name])
        logger.propagate = False
    try:
        quiet.quiet_engines()
        for name, logger in loggers.items():
            print(f"my own {name} line: WARNING 11-26 10:11 is just text", file=getattr(sys, name))
            logger.warning("Reset SSM cache type to float32 for accelerated GDN mamba backend '%s'.", "none")
            logger.warning("max_num_seqs is too small for this model")
        captured = capsys.readouterr()
    finally:
        for name, logger in loggers.items():
            logger.removeHandler(handlers[name])
    for name, text in (("stdout", captured.out), ("stderr", captured.err)):
        assert text.splitlines() == [f"my own {name} line: WARNING 11-26 10:11 is just text",
                                     "max_num_seqs is too small for this model"], (name, text)


def test_the_checkpoint_loading_bar_is_off_unless_verbose(vllm_log, monkeypatch):
    assert quiet.engine_load_options() == {"use_tqdm_on_load": False}
    monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
    assert quiet.engine_load_options() == {"use_tqdm_on_load": True}


def test_other_loggers_are_untouched(vllm_log):
    quiet.quiet_engines()
    assert not quiet.is_engine_noise("myproject", "libtcmalloc is not found in LD_PRELOAD")
    assert quiet.is_engine_noise("vllm.v1.worker.cpu_worker", "libiomp is not found in LD_PRELOAD")


def test_verbose_shows_everything(vllm_log, monkeypatch):
    logger, stream = vllm_log
    quiet.quiet_engines()
    monkeypatch.setenv(quiet.VERBOSE_ENV, "1")
    logger.warning("libtcmalloc is not found in LD_PRELOAD")
    assert "LD_PRELOAD" in stream.getvalue()
    assert not quiet.quiet_engines()  # nothing installed while verbose


def test_set_verbose_reaches_kernels_and_vllm(vllm_log, monkeypatch):
    # set, then delete: monkeypatch records the value before the test only through setenv (a delenv
    # of an unset name records nothing, and set_verbose's values would outlive the test, reaching
    # every kernel this worker starts later)
    for name in (quiet.VERBOSE_ENV, "VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    quiet.set_verbose(False)  # the notebooks' default: quiet unless the environment says otherwise
    assert not quiet.verbose()
    quiet.set_verbose(True)
    assert quiet.verbose()
    import os

    assert os.environ[quiet.VERBOSE_ENV] == "1" and os.environ["VLLM_LOGGING_LEVEL"] == "INFO"


def test_engine_future_warnings_are_filtered_but_others_show(vllm_log):
    quiet.quiet_engines()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet.quiet_engines()  # catch_warnings reset the filters: install them again inside
        warnings.warn_explicit("`torch.distributed.reduce_op` is deprecated, please use ...", FutureWarning,
                               "dispatcher.py", 138, module="vllm.triton_utils.dispatcher")
        warnings.warn_explicit("this setting is deprecated", FutureWarning, "mine.py", 1, module="mine")
    assert [str(w.message) for w in caught] == ["this setting is deprecated"]


def test_apply_engine_defaults_keeps_user_values(monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    changed = apply_engine_defaults(cpu=False)
    import os

    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR" and "VLLM_LOGGING_LEVEL" not in changed
    assert changed.get("TOKENIZERS_PARALLELISM") == "false"


KERNEL_NOTEBOOK = """
# %%
import os
import time

import torch

from evolm_lib.config import ESConfig
from evolm_lib.engines import SamplingSettings, make_engine
from evolm_lib.tasks import get_task

threads_before = torch.get_num_threads()
config = ESConfig(model="tiny-random", max_model_len=256, kv_cache_gb=0.1, max_new_tokens=8)
engine = make_engine(config, max_loras=2)
task = get_task("conciseness")
started = time.perf_counter()
table = engine.generate([task.prompt(e) for e in task.eval_examples()], [None], SamplingSettings(max_new_tokens=8))
seconds = time.perf_counter() - started
engine.close()
print("RESULT", {"before": threads_before, "after": torch.get_num_threads(),
                 "omp": os.environ.get("OMP_NUM_THREADS"), "seconds": seconds})
"""


@pytest.mark.slow
def test_kernel_started_without_make_gets_one_thread_and_a_quiet_engine(tmp_path, monkeypatch):
    """As JupyterLab or papermill start a kernel outside `make`/`evolm`: no OMP_NUM_THREADS, no vLLM
    variables. The engine's defaults still give one torch thread, and its start prints no notices."""
    from evolm_lib import batch

    for name in ("OMP_NUM_THREADS", "VLLM_LOGGING_LEVEL", "VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_WAIT_POLICY",
                 "TORCH_CPP_LOG_LEVEL", quiet.VERBOSE_ENV):
        monkeypatch.delenv(name, raising=False)
    source = tmp_path / "kernel.py"
    source.write_text(KERNEL_NOTEBOOK)
    executed = batch.execute_notebook(source, tmp_path / "kernel.ipynb", {}, cwd=tmp_path)
    outputs = [o for c in json.loads(executed.read_text())["cells"] for o in c.get("outputs", [])]
    streams = {name: "".join("".join(o.get("text", "")) for o in outputs if o.get("name") == name)
               for name in ("stdout", "stderr")}
    result = eval(streams["stdout"].split("RESULT ", 1)[1].splitlines()[0])  # noqa: S307 - our own printed dict
    assert result["omp"] == "1" and result["after"] == 1, result
    # vLLM logs to stdout: both streams are checked, and the user's print (RESULT) is there
    for name, text in streams.items():
        assert not quiet.notice_lines(text), (name, quiet.notice_lines(text))
    # the checkpoint loader's bar came as a widget with a text/plain twin, not as a stream
    rich = [json.dumps(o.get("data", {})) for o in outputs if o.get("output_type") != "stream"]
    assert not [r for r in rich if "checkpoint shards" in r], rich
    print(f"kernel: {result}")
