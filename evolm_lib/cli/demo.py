"""`evolm demo` (what `make demo` runs): ES on the conciseness task with SmolLM2-135M-Instruct through the
stepper notebook, vLLM on this machine's CPU (or GPU).

    evolm demo                                  the demo: seed 0 of papermill_runs/conciseness_smollm2_cpu.yaml
    evolm demo --seed 1                         another seed of that grid
    evolm demo --figure figures/demo_fitness.png
                                                the demo, its fitness plot also copied to the README's figure
    evolm demo --spec papermill_runs/arithmetic_smollm2_cpu.yaml --out runs/demo_arithmetic
                                                the same for another batch file's settings

Runs notebooks/03_es_stepper.py through papermill with the settings of one grid point of the batch file
(the one place those settings live), into OUT/<timestamp>/ (notebook.ipynb, run/, figures/), and prints
each generation's rewards as it lands. Nothing outside OUT is written unless asked: --figure PATH
(make demo DEMO_FIGURE=figures/demo_fitness.png) also copies the fitness plot there, which is how the
README's figure is refreshed.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from ..batch import NOTEBOOK_FILE, execute_notebook, expand_runs, load_batch_spec
from ..env import apply_engine_defaults
from ..paths import project_root, resolve_in_project
from ..runs import read_metrics
from ..viz.labels import model_note
from .help import HelpFormatter

DEFAULT_SPEC = "papermill_runs/conciseness_smollm2_cpu.yaml"  # relative to the project folder
FITNESS_FIGURE = "es_stepper_fitness"  # the stem 03_es_stepper exports its fitness plot under
README_FIGURE = "figures/demo_fitness.png"  # tracked: written only when --figure names it


def demo_parameters(spec_path: str | Path = DEFAULT_SPEC, seed: int = 0) -> tuple[Path, dict]:
    """(notebook, parameters) of the grid point with this seed in the batch file."""
    spec = load_batch_spec(resolve_in_project(spec_path))
    for run in expand_runs(spec):
        if run.parameters.get("seed", 0) == seed:
            return spec.notebook, dict(run.parameters)
    raise ValueError(f"{spec_path} has no run with seed {seed}")


def gpu_settings() -> dict:
    """What the demo changes on a GPU machine: bfloat16 (vLLM 0.26's GPU LoRA kernels reject a float32
    engine) and noise drawn on the card; nothing on a CPU."""
    import torch

    return {"dtype": "bfloat16", "noise_device": "cuda"} if torch.cuda.is_available() else {}


def _follow(run_dir: Path, done: threading.Event, total: int) -> None:
    """Print each metrics row as its generation lands (the notebook itself runs in a kernel)."""
    seen = 0
    while True:
        finished = done.wait(2.0)
        rows = read_metrics(run_dir)
        for row in rows[seen:]:
            print("  " + _row_line(row, total), flush=True)
        seen = len(rows)
        if finished:
            return


def _row_line(row: dict, total: int) -> str:
    parts = [f"generation {row.get('generation', '?'):>3}/{total}"]
    if "train/reward_mean" in row:
        parts.append(f"population mean {row['train/reward_mean']:8.3f}")
    if "policy/train_reward" in row:
        parts.append(f"mean adapter train {row['policy/train_reward']:8.3f}  eval {row['eval/reward']:8.3f}")
    if "time/wall_s" in row:
        parts.append(f"{row['time/wall_s']:6.0f} s")
    return "  ".join(parts)


def copy_figure(figures_dir: Path, target: str | Path | None) -> Path | None:
    """The demo's fitness PNG in ``figures_dir`` copied to ``target`` (relative to the project folder);
    None, writing nothing, without a target or a PNG."""
    png = Path(figures_dir) / f"{FITNESS_FIGURE}.png"
    if target is None or not png.exists():
        return None
    path = Path(target)
    if not path.is_absolute():
        path = project_root() / path
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(png, path)
    return path


def run_demo(spec_path: str | Path = DEFAULT_SPEC, seed: int = 0, out_root: str | Path = "runs/demo",
             figure: str | Path | None = None) -> dict:
    """Run the demo notebook into ``out_root``; with ``figure``, its fitness PNG is also copied there
    (README_FIGURE refreshes the README's). Returns paths, rewards and wall time."""
    apply_engine_defaults()  # inherited by the notebook's kernel
    root = project_root()
    notebook, parameters = demo_parameters(spec_path, seed)
    out = Path(out_root)
    if not out.is_absolute():
        out = root / out
    out = out / datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir, figures_dir, executed = out / "run", out / "figures", out / NOTEBOOK_FILE
    parameters.update(run_dir=str(run_dir), figures_dir=str(figures_dir), resume=False)
    parameters["settings"] = {**gpu_settings(), **dict(parameters.get("settings") or {})}
    total = parameters.get("num_generations", "?")
    print(f"EvoLM demo: ES on {parameters.get('task')} with {parameters.get('model')}, population "
          f"{parameters.get('population_size')}, {total} generations (settings: {Path(spec_path).name}, seed {seed})")
    if model_note(parameters.get("model")):
        print(model_note(parameters.get("model")))
    print(f"running {notebook.relative_to(root) if notebook.is_relative_to(root) else notebook} "
          f"-> {executed}", flush=True)

    done = threading.Event()
    follower = threading.Thread(target=_follow, args=(run_dir, done, total), daemon=True)
    follower.start()
    started = time.perf_counter()
    try:
        execute_notebook(notebook, executed, parameters, cwd=root)
    except Exception:
        print(f"the executed notebook, with the failing cell marked: {executed}", file=sys.stderr)
        raise
    finally:
        done.set()
        follower.join(10)
    wall = time.perf_counter() - started

    rows = read_metrics(run_dir)
    first = next(r for r in rows if r.get("generation") == 0)
    last = rows[-1]
    figures = sorted(figures_dir.glob(f"{FITNESS_FIGURE}.*"))
    return {
        "notebook": executed, "run_dir": run_dir, "figures": figures,
        "copied_figure": copy_figure(figures_dir, figure),
        "generation_0": {"train": first["policy/train_reward"], "eval": first["eval/reward"]},
        "final": {"generation": last["generation"], "train": last["policy/train_reward"], "eval": last["eval/reward"]},
        "wall_s": wall,
    }


def build_parser() -> argparse.ArgumentParser:
    """The command line of `evolm demo`."""
    parser = argparse.ArgumentParser(prog="evolm demo", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--spec", default=DEFAULT_SPEC, help="batch YAML holding the demo settings")
    parser.add_argument("--seed", type=int, default=0, help="which seed of the YAML's grid to run")
    parser.add_argument("--out", default="runs/demo", help="parent folder of the timestamped output")
    parser.add_argument("--figure", default=None, metavar="PATH",
                        help=f"also copy the fitness PNG to PATH ({README_FIGURE}: the README's figure)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command line: run the demo and print where everything is."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = run_demo(args.spec, args.seed, args.out, figure=args.figure)
    except Exception as error:  # noqa: BLE001 - one readable line, the notebook holds the traceback
        ename, evalue = getattr(error, "ename", None), getattr(error, "evalue", None)
        print(f"demo failed: {ename + ': ' + evalue if ename else f'{type(error).__name__}: {error}'}", file=sys.stderr)
        return 1
    g0, final = result["generation_0"], result["final"]
    print()
    print(f"executed notebook: {result['notebook']}")
    print(f"run folder:        {result['run_dir']}")
    for path in result["figures"]:
        print(f"figure:            {path}")
    if result["copied_figure"]:
        print(f"copied to:         {result['copied_figure']}")
    print(f"mean adapter reward, generation 0:  train {g0['train']:.3f}  eval {g0['eval']:.3f}")
    print(f"mean adapter reward, generation {final['generation']}: train {final['train']:.3f}  eval {final['eval']:.3f}")
    print(f"wall time: {result['wall_s'] / 60:.1f} min")
    return 0
