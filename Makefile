# EvoLM: `make demo` runs the main job, `make test` runs the test suite. Both set up .venv first.
PY := .venv/bin/python
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export VLLM_LOGGING_LEVEL ?= WARNING
export TOKENIZERS_PARALLELISM ?= false
# Spinning OpenMP threads starve the engine on a busy 2-core machine (one HF call: 154 s instead of 8 s).
export OMP_WAIT_POLICY ?= PASSIVE
# vLLM's CPU worker binds its own threads; extra OpenMP threads made LoRA decoding 10-50x slower here.
export OMP_NUM_THREADS ?= 1

.PHONY: setup demo test test-fast benchmark lab sync figures clean docs docs-build

setup:
	@bash scripts/setup_env.sh

# make demo DEMO_FIGURE=figures/demo_fitness.png: also refresh the README's figure (the run's own
# figures go to runs/demo/<time>/figures/ either way)
DEMO_FIGURE ?=
demo: setup
	$(PY) -m evolm_lib.cli demo $(if $(DEMO_FIGURE),--figure $(DEMO_FIGURE))

# Two processes, a test file (or notebook) each at a time: on 2 cores the suite runs in about half
# the time (each process's vLLM engines bound to a core of their own: conftest.py), the heaviest files first
# (conftest.py's HEAVY_FIRST; xdist's own reordering by test count off). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: setup sync
	$(PY) -m pytest -q -p no:cacheprovider tests notebooks --nbval-lax --durations=15 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-fast: setup sync
	$(PY) -m pytest -q -m "not slow and not browser" tests

benchmark: setup
	$(PY) -m evolm_lib.benchmark
	$(PY) -m evolm_lib.cli bench --es-overhead

# make lab ARGS="--port 8890 --no-browser": options for `evolm lab` (and jupyter-lab)
lab: setup
	$(PY) -m evolm_lib.cli lab $(ARGS)

# The documentation site (mkdocs.yml, docs/): served with live reload, or built as the tests build it.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

docs-build: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The .py (percent format) is the source of truth; the paired .ipynb is regenerated from it.
sync: setup
	$(PY) -m jupytext --sync notebooks/*.py >/dev/null

clean:
	rm -rf runs papermill_runs/out .pytest_cache
