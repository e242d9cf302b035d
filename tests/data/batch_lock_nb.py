# %% [markdown]
# # Batch fixture that writes a run folder
# For tests/test_run_lock.py: an ES run on the synthetic engine (no model server) opened in
# `run_dir`, which can hold with the run open until a file appears (saying so in `hold`.open), then
# runs to its budget.

# %% tags=["parameters"]
num_generations: int = 3  # generations of the run
run_dir: str = "runs/x"  # run folder
hold: str = ""  # a file to wait for with the run open (empty: no wait)

# %%
from evolm_lib.config import ESConfig

config = ESConfig.from_dict(dict(model="tiny-random", target_modules=["q_proj", "v_proj"], sigma=0.02,
                                 learning_rate=0.05, population_size=4, num_generations=num_generations, seed=3,
                                 max_model_len=256, kv_cache_gb=0.1))

# %%
import pathlib
import time

from evolm_lib.engines.synthetic import SyntheticEngine
from evolm_lib.train.es import ESRun

run = ESRun.open(config, run_dir, engine=SyntheticEngine())
if hold:
    pathlib.Path(hold + ".open").write_text("")  # the run is open: the test may look now
deadline = time.monotonic() + 300
while hold and not pathlib.Path(hold).exists() and time.monotonic() < deadline:
    time.sleep(0.2)
rows = run.run()
run.close()

# %%
assert [r["generation"] for r in run.history] == list(range(num_generations + 1))
