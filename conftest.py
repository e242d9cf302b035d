"""pytest over the whole project (``make test`` runs ``pytest tests notebooks --nbval-lax``): the
notebooks' default run folders go to a folder of this session, so the nbval run of notebook 03 never
resumes (or waits for) the run a user has open in JupyterLab under runs/notebooks/."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# evolm_lib.runs.NOTEBOOK_RUNS_ENV (tests/test_run_lock.py checks they agree); not imported here:
# torch must not load before tests/conftest.py has set the engine's thread settings
NOTEBOOK_RUNS_ENV = "EVOLM_NOTEBOOK_RUNS"

# Every process the tests start imports this checkout, and does not import jsonschema's optional
# IRI-format checker, rfc3987_syntax (the notebook stack installs it): jsonschema is imported by every
# process that imports Ray or vLLM, and that module builds dozens of Earley parsers at import, seconds
# of CPU in each process the suite starts (kernels, CLI workers, Ray's processes, policy processes).
# No test checks an IRI. Both go on PYTHONPATH here, which those processes inherit; pytest's own
# processes have the module already (nbval imports nbformat, and with it jsonschema, before this file).
ROOT = Path(__file__).parent
HIDDEN_MODULES = ROOT / "tests" / "hidden_modules"
_ours = [str(HIDDEN_MODULES), str(ROOT)]
os.environ["PYTHONPATH"] = os.pathsep.join(
    _ours + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in _ours])

# The files that take about 25 s or more in `make test`, heaviest first (seconds on the 2-core machine,
# 2026-11-27: each file alone, or its slowest tests in the suite). pytest-xdist (--dist loadfile) hands
# each file whole to the next free process in collection order. Its own reordering, by number of tests
# (off in the Makefile: --no-loadscope-reorder), ran the files of many light tests first and left these,
# each of few tests, to the end, where one process could run them while the other had finished.
HEAVY_FIRST = (
    "tests/test_notebooks.py",  # ~200 s: papermill runs of the notebooks, the batch CLI
    "tests/test_ray_modes.py",  # ~200 s: one, local and two Ray engines in turn, engines killed
    "tests/test_ray_engine.py",  # ~160 s: two Ray engines, the two-node cluster
    "tests/test_jupyterlab.py",  # ~150 s: JupyterLab and Chromium
    "tests/test_tune.py",  # ~115 s
    "tests/test_cli.py",  # ~105 s: Ctrl-C in a batch and in a sweep
    "tests/test_grpo_run.py",  # ~90 s: GRPO on SmolLM2
    "tests/test_batch.py",  # ~85 s
    "tests/test_benchmark.py",  # ~80 s: the Ray benchmark
    "tests/test_policy_process.py",  # ~70 s: the GRPO-update benchmark
    "tests/test_es_tensor_parallel_runs.py",  # ~75 s: 1- and 2-rank engines, full/EGGROLL/GRPO runs, a Ray actor's split engine
    "tests/test_tensor_parallel.py",  # ~55 s: a 2-rank engine beside a 1-rank one, a 2-rank run killed and resumed
    "tests/test_es_run.py",  # ~50 s
    "tests/test_grpo_full.py",  # ~50 s: its own engine, full-weight runs killed and resumed, folders of earlier code resumed
    "tests/test_engines.py",  # ~50 s
    "notebooks/06_grpo_stepper.ipynb",  # ~50 s (nbval, SmolLM2)
    "tests/test_full_pool.py",  # ~45 s
    "notebooks/07_tuning.ipynb",  # ~40 s (nbval)
    "tests/test_tune_study.py",  # ~40 s
    "tests/test_analysis.py",  # ~35 s: notebook 04 twice
    "tests/test_run_lock.py",  # ~35 s
    "notebooks/03_es_stepper.ipynb",  # ~30 s (nbval, SmolLM2)
    "notebooks/02_lora_initialization.ipynb",  # ~30 s (nbval, SmolLM2)
    "tests/test_es_modes.py",  # ~30 s
    "notebooks/05_zo_synthetic.ipynb",  # ~30 s (nbval)
    "notebooks/01_task_inspection.ipynb",  # ~25 s (nbval, SmolLM2)
    "tests/test_vllm_tensor_parallel_weights.py",  # ~30 s: 2-rank engines' weight slices
)


def pytest_configure(config):
    """Point the notebooks' default run folders at a fresh folder (kernels inherit the environment);
    under pytest-xdist, give each worker's vLLM engines a CPU of their own."""
    _bind_worker_cpu()
    if NOTEBOOK_RUNS_ENV not in os.environ:
        config._evolm_notebook_runs = os.environ[NOTEBOOK_RUNS_ENV] = tempfile.mkdtemp(prefix="evolm-notebook-runs-")


def pytest_collection_modifyitems(session, config, items):
    """HEAVY_FIRST's files first, in its order; every other file after them in the order collected."""
    rank = {path: index for index, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(HEAVY_FIRST)))  # stable: tests keep their order


def pytest_unconfigure(config):
    """Remove that folder again."""
    folder = getattr(config, "_evolm_notebook_runs", None)
    if folder is not None:
        os.environ.pop(NOTEBOOK_RUNS_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)


def _bind_worker_cpu() -> None:
    """With ``pytest -n N`` each worker process starts its own vLLM engines. vLLM's automatic binding
    puts every CPU engine's threads on the same core (it keeps one for the frontend), so two workers'
    engines would share one core while the other idles; worker k binds to core k instead (unless the
    user chose a binding). Kernels and Ray actors a worker starts inherit it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cpus = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cpus[int(worker[2:]) % len(cpus)])
