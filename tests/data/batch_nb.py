# %% [markdown]
# # Batch fixture
# A tiny notebook for testing `evolm_lib.batch` without any model. It has no jupytext header on
# purpose: the runner must add the python3 kernelspec itself.

# %% tags=["parameters"]
seed: int = 0  # random seed
scale: float = 1.0  # multiplier on the seed; must be > 0
run_dir: str = "runs/x"  # folder for result.json
fail: bool = False  # raise a RuntimeError on purpose

# %%
import json
import pathlib

if scale <= 0:
    raise ValueError("scale must be > 0")
if fail:
    raise RuntimeError("failing on purpose")

# %%
out = pathlib.Path(run_dir)
out.mkdir(parents=True, exist_ok=True)
(out / "result.json").write_text(json.dumps({"seed": seed, "scale": scale, "value": seed * scale}))
print("wrote", out / "result.json")
