"""Sweep ES settings on conciseness with SmolLM2 on the CPU; one shared vLLM engine for all runs.

Each variant changes a few settings of the base below; every run writes a normal run folder under
OUT/<variant>/ and one summary line to OUT/summary.jsonl (base and final greedy train/eval reward
of the mean adapter, best generation, wall time, sample completions).
Usage: python scripts/sweep_conciseness.py [--out runs/sweep] [--only A,B] [--generations 10]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from evolm_lib.config import ESConfig
from evolm_lib.engines import EngineSizing, make_evaluator
from evolm_lib.train.es import ESRun

BASE = dict(
    model="smollm2-135m-instruct", task="conciseness", population_size=16, antithetic=True, sigma=0.05,
    learning_rate=0.2, fitness_shaping="centered_ranks", optimizer="sgd", lora_rank=1, max_new_tokens=64,
    init_scheme="peft_default", seed=0, eval_every=1,
)
VARIANTS = {
    "A_proto": {},
    "B_seed1": {"seed": 1},
    "C_sigma0.03": {"sigma": 0.03, "learning_rate": 0.12},
    "D_ratio2": {"learning_rate": 0.1},
    "E_ratio8": {"learning_rate": 0.4},
    "E_ratio8_seed1": {"learning_rate": 0.4, "seed": 1},
    "E_ratio8_seed2": {"learning_rate": 0.4, "seed": 2},
    "F_pop8": {"population_size": 8},
    "G_zscore": {"fitness_shaping": "z_score"},
    "H_random_ab": {"init_scheme": "random_ab", "init_scale": 0.1},
    "I_rank8": {"lora_rank": 8, "lora_alpha": 8.0},
    "J_seed2": {"seed": 2},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("runs/sweep"))
    parser.add_argument("--only", default=",".join(VARIANTS))
    parser.add_argument("--generations", type=int, default=10)
    args = parser.parse_args()
    names = args.only.split(",")
    configs = {n: ESConfig(**{**BASE, **VARIANTS[n], "num_generations": args.generations}) for n in names}
    first = next(iter(configs.values()))
    evaluator = make_evaluator(first, sizing=EngineSizing.from_config(first).covering(configs.values()))
    args.out.mkdir(parents=True, exist_ok=True)
    for name, config in configs.items():
        started = time.perf_counter()
        run = ESRun.open(config, args.out / name, evaluator=evaluator)
        run.run(callback=lambda r: print(f"{name} gen {r['generation']}: pop mean {r['train/reward_mean']:.1f} "
                                          f"mean adapter {r.get('policy/train_reward')} eval {r.get('eval/reward')} "
                                          f"({r['time/generation_s']:.0f} s)", flush=True))
        rows = run.history
        base, final = rows[0], rows[-1]
        scored = [r for r in rows if r.get("policy/train_reward") is not None]
        best = max(scored, key=lambda r: r["policy/train_reward"])
        summary = {
            "variant": name, **VARIANTS[name],
            "base_train": base["policy/train_reward"], "final_train": final["policy/train_reward"],
            "best_train": best["policy/train_reward"], "best_generation": best["generation"],
            "base_eval": base["eval/reward"], "final_eval": final["eval/reward"],
            "improvement": 1 - final["policy/train_reward"] / base["policy/train_reward"],
            "wall_s": time.perf_counter() - started, "s_per_generation": sum(r.get("time/generation_s", 0) for r in rows) / max(1, len(rows) - 1),
            "final_train_completions": final["policy/train_completions"],
            "final_eval_completions": final["policy/eval_completions"],
        }
        with open(args.out / "summary.jsonl", "a") as handle:
            handle.write(json.dumps(summary) + "\n")
        print(json.dumps(summary), flush=True)
    evaluator.close()


if __name__ == "__main__":
    main()
