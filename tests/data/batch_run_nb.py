# %% [markdown]
# # Batch fixture with a run folder
# For testing batches that continue (tests/test_batch.py) without a model: it checks its settings in a
# config cell as the real notebooks do, then fills `run_dir` with a copy of a fixture ES run
# (tests/data/es_vs_grpo/es_seed{seed % 2}), and can hold mid-run until a file appears (to be killed there).

# %% tags=["parameters"]
seed: int = 0  # seed of the run; the fixture run es_seed{seed % 2} is copied
sigma: float = 0.05  # checked by ESConfig in the config cell: must be > 0
task_options: str = "{}"  # task options as JSON text
run_dir: str = "runs/x"  # run folder to fill
hold: str = ""  # a file to wait for after the first rows (empty: no wait)
hold_seed: int = -1  # the seed whose run holds

# %%
import json

from evolm_lib.config import ESConfig

config = ESConfig.from_dict(dict(model="tiny-random", sigma=sigma, seed=seed, max_model_len=256, kv_cache_gb=0.1,
                                 task_options=json.loads(task_options)))

# %%
import os
import pathlib
import shutil
import time

source = pathlib.Path("tests/data/es_vs_grpo") / f"es_seed{seed % 2}"
out = pathlib.Path(run_dir)
out.mkdir(parents=True, exist_ok=True)
with open(out.parent / "executions.txt", "a") as log:
    log.write(f"{os.getpid()}\n")
shutil.copyfile(source / "config.yaml", out / "config.yaml")
rows = (source / "metrics.jsonl").read_text().splitlines(keepends=True)
(out / "metrics.jsonl").write_text("".join(rows[:2]))
if hold and seed == hold_seed:
    (out / "kernel.pid").write_text(str(os.getpid()))
    deadline = time.monotonic() + 300
    while not pathlib.Path(hold).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
(out / "metrics.jsonl").write_text("".join(rows))
print("copied", len(rows), "rows")
