"""pytest over the whole project (``make test`` runs ``pytest tests notebooks --nbval-lax``): the
notebooks' default run folders go to a folder of this session, so the nbval run of notebook 03 never
resumes (or waits for) the run a user has open in JupyterLab under runs/notebooks/."""
from __future__ import annotations

import os
import shutil
import tempfile

# evolm_lib.runs.NOTEBOOK_RUNS_ENV (tests/test_run_lock.py checks they agree); not imported here:
# torch must not load before tests/conftest.py has set the engine's thread settings
NOTEBOOK_RUNS_ENV = "EVOLM_NOTEBOOK_RUNS"


def pytest_configure(config):
    """Point the notebooks' default run folders at a fresh folder (kernels inherit the environment);
    under pytest-xdist, give each worker's vLLM engines a CPU of their own."""
    _bind_worker_cpu()
    if NOTEBOOK_RUNS_ENV not in os.environ:
        config._evolm_notebook_runs = os.environ[NOTEBOOK_RUNS_ENV] = tempfile.mkdtemp(prefix="evolm-notebook-runs-")


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
