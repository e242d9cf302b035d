"""Do two versions of the library give the same metrics rows? One short deterministic ES run per
mode, run with whichever ``evolm_lib`` is on ``PYTHONPATH``, then a comparison of two such folders.

    # on a GPU machine, once per code tree (each run in its own process: vLLM reads batch invariance once)
    PYTHONPATH=OLD_TREE python scripts/gpu_same_rows.py run --mode lora --out runs/same_rows/old
    PYTHONPATH=.        python scripts/gpu_same_rows.py run --mode lora --out runs/same_rows/new
    python scripts/gpu_same_rows.py compare runs/same_rows/old runs/same_rows/new

``run`` uses only ``ESConfig``, ``ESRun.open(...).run()`` and the run folder's metrics.jsonl, which
every version has. ``compare`` checks, for every mode, that the rows agree field for field on what
the population and the update produced (rewards, fitness, update norms, sample counters) and that
every mean both versions scored has the same scores (``metrics.by_mean``: a mean's scores may sit in
another row where they rode in a population call); timings are not compared.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MODES = ("lora", "full", "eggroll")
SCORES = ("policy/train_reward", "eval/reward", "policy/train_completions", "policy/eval_completions")
TRAINED = ("generation", "train/reward_mean", "train/reward_best", "train/reward_worst", "es/rewards", "es/weights",
           "es/update_norm", "best_completions", "worst_completions", "samples/completions", "samples/tokens")


def settings(mode: str, model: str, num_generations: int, dtype: str, memory: float | None = None) -> dict:
    """Small addition runs at the study's per-mode sigma and learning rate, deterministic."""
    per_mode = {"lora": dict(sigma=0.05, learning_rate=0.2),
                "full": dict(sigma=1e-3, learning_rate=5e-4, es_mode="full"),
                "eggroll": dict(sigma=1e-3, learning_rate=5e-4, es_mode="eggroll")}[mode]
    return dict(model=model, task="arithmetic", task_options={"digits": 2, "operations": "+"}, population_size=8,
                prompts_per_step=4, max_new_tokens=32, num_generations=num_generations, eval_every=1,
                deterministic=True, dtype=dtype, seed=0, gpu_memory_utilization=memory, **per_mode)


def run(mode: str, out: Path, model: str, num_generations: int, dtype: str, memory: float | None) -> None:
    """One run of ``mode`` into out/mode with the evolm_lib on the path."""
    from evolm_lib.config import ESConfig
    from evolm_lib.train.es import ESRun

    run = ESRun.open(ESConfig(**settings(mode, model, num_generations, dtype, memory)), out / mode)
    try:
        run.run()
    finally:
        run.close()


def rows_of(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]


def compare(first: Path, second: Path) -> bool:
    """Print, per mode, whether the two folders' rows agree; True when every mode does."""
    from evolm_lib.metrics import by_mean

    same = True
    for mode in MODES:
        if not ((first / mode / "metrics.jsonl").exists() and (second / mode / "metrics.jsonl").exists()):
            print(f"{mode}: missing in one of the folders")
            same = False
            continue
        a, b = rows_of(first / mode), rows_of(second / mode)
        trained = [[{k: r.get(k) for k in TRAINED} for r in rows] for rows in (a, b)]
        scored = []
        for rows in (a, b):
            scored.append({r.get("generation"): tuple(r.get(k) for k in SCORES) for r in by_mean(rows) if "eval/reward" in r})
        common = sorted(set(scored[0]) & set(scored[1]))
        differ = [g for g in common if scored[0][g] != scored[1][g]]
        ok = trained[0] == trained[1] and not differ and common
        same = same and bool(ok)
        print(f"{mode}: {len(a)} and {len(b)} rows; population and update rows "
              f"{'identical' if trained[0] == trained[1] else 'DIFFER'}; means scored by both {common}, "
              f"{'identical' if not differ else f'DIFFER at {differ}'}")
    return same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("run", help="one short run of a mode with the evolm_lib on the path")
    one.add_argument("--mode", choices=MODES, required=True)
    one.add_argument("--out", type=Path, required=True)
    one.add_argument("--model", default="smollm2-135m-instruct")
    one.add_argument("--num-generations", type=int, default=4)
    one.add_argument("--dtype", default="bfloat16", help="the engine's dtype (float32 on a CPU)")
    one.add_argument("--gpu-memory-utilization", type=float, default=None,
                     help="the card's share for this engine (several runs on one card)")
    both = commands.add_parser("compare", help="compare two folders written by run")
    both.add_argument("first", type=Path)
    both.add_argument("second", type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.mode, args.out, args.model, args.num_generations, args.dtype, args.gpu_memory_utilization)
        return 0
    return 0 if compare(args.first, args.second) else 1


if __name__ == "__main__":
    sys.exit(main())
