# %% [markdown]
# # Batch fixture with a run folder
# For testing batches that continue (tests/test_batch.py) without a model: it builds its settings in a
# config cell as the real notebooks do (its parameters cell is tagged `settings:es`), then fills `run_dir`
# with those settings and the metrics of a fixture ES run (tests/data/es_vs_grpo/es_seed{seed % 2}), and
# can hold mid-run until a file appears (to be killed there) or fail at the end.

# %% tags=["parameters", "settings:es"]
seed: int = 0  # seed of the run; the fixture run es_seed{seed % 2} is copied
sigma: float = 0.05  # checked by ESConfig in the config cell: must be > 0
task_options: str = "{}"  # task options as JSON text
model: str = "tiny-random"  # the model of the fixture runs
max_model_len: int = 256  # engine context, small enough for the pre-run check on any machine
kv_cache_gb: float = 0.1  # vLLM KV cache size in GiB
num_generations: int = 4  # the budget of the fixture runs (their metrics reach generation 4)
settings: dict = {}  # any other ESConfig setting
fail: bool = False  # raise after the run folder is written (a failed attempt)
run_dir: str = "runs/x"  # run folder to fill
hold: str = ""  # a file to wait for after the first rows (empty: no wait)
hold_seed: int = -1  # the seed whose run holds

# %%
from evolm_lib.config import ESConfig
from evolm_lib.parameters import notebook_config

config = notebook_config(ESConfig, globals())

# %%
import os
import pathlib
import time

from evolm_lib.runs import write_run_config

source = pathlib.Path("tests/data/es_vs_grpo") / f"es_seed{seed % 2}"
out = pathlib.Path(run_dir)
out.mkdir(parents=True, exist_ok=True)
with open(out.parent / "executions.txt", "a") as log:
    log.write(f"{os.getpid()}\n")
write_run_config(out, config, "es")  # the settings this point was given, as a real run folder has them
rows = (source / "metrics.jsonl").read_text().splitlines(keepends=True)
(out / "metrics.jsonl").write_text("".join(rows[:2]))
if hold and seed == hold_seed:
    (out / "kernel.pid").write_text(str(os.getpid()))
    deadline = time.monotonic() + 300
    while not pathlib.Path(hold).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
(out / "metrics.jsonl").write_text("".join(rows))
print("copied", len(rows), "rows")
if fail:
    raise RuntimeError("failing on purpose")
