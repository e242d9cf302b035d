"""ES and GRPO on Countdown with SmolLM2-135M-Instruct at equal sample budgets (issue 11, on the lent GPU).

One vLLM engine serves every run. Before and after training, each adapter is scored greedily on
the held-out puzzles: accuracy (reward >= 1: the answer right) and format rate (the paper's
<think>...</think>\n<answer>...</answer> format). ES runs twice: at the paper's settings
(population 30, sigma 1e-3, alpha 5e-4, z-score shaping) and at settings that move a LoRA
(sigma 0.05, learning rate 0.4, centred ranks: the conciseness demo's ratio); GRPO once.

    python scripts/gpu_countdown.py --out OUT [--model tiny-random --generations 1 ...]  # CPU check
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from evolm_lib.config import ESConfig, GRPOConfig
from evolm_lib.engines import make_evaluator
from evolm_lib.env import apply_engine_defaults
from evolm_lib.train.es import ESRun
from evolm_lib.evaluation import evaluate_adapter
from evolm_lib.train.grpo import GRPORun
from evolm_lib.tasks import get_task
from evolm_lib.tasks.countdown import format_score


def held_out_scores(evaluator, task, adapter, examples, max_new_tokens) -> dict:
    """Accuracy and format rate of one adapter on the held-out puzzles (greedy)."""
    result = evaluate_adapter(evaluator, task, adapter, examples, max_new_tokens=max_new_tokens)
    formats = [format_score(text) > 0 for text in result["completions"]]
    return {"accuracy": result["accuracy"], "format_rate": sum(formats) / len(formats), "reward": result["reward"],
            "tokens": result["tokens"], "example_completion": result["completions"][0][:400]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--generations", type=int, default=20, help="ES generations (GRPO steps: the same budget)")
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--num-eval", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--grpo-lr", type=float, default=2e-3)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    apply_engine_defaults()
    common = dict(model=args.model, task="countdown", task_options={"num_train": 256, "num_eval": args.num_eval},
                  lora_rank=8, lora_alpha=16.0, max_new_tokens=args.max_new_tokens, max_model_len=1024,
                  prompts_per_step=args.prompts_per_step, eval_every=0, dtype=args.dtype, seed=0)
    population = 30
    runs = {
        "es_paper": ESConfig(**common, population_size=population, sigma=1e-3, learning_rate=5e-4,
                             fitness_shaping="z_score", num_generations=args.generations),
        "es_lora": ESConfig(**common, population_size=population, sigma=0.05, learning_rate=0.4,
                            fitness_shaping="centered_ranks", num_generations=args.generations),
        "grpo": GRPOConfig(**common, group_size=args.group_size, learning_rate=args.grpo_lr, temperature=1.0,
                           num_steps=args.generations * population // args.group_size),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    task = get_task("countdown", **common["task_options"])
    held_out = task.eval_examples()
    evaluator = make_evaluator(runs["es_paper"])  # its population, its mean and the GRPO policy
    summary = {"model": args.model, "budget_completions": args.generations * population * args.prompts_per_step,
               "num_eval": len(held_out), "max_new_tokens": args.max_new_tokens, "runs": {}}
    try:
        import torch

        summary["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        summary["base"] = held_out_scores(evaluator, task, None, held_out, args.max_new_tokens)
        print("base", summary["base"], flush=True)
        for name, config in runs.items():
            started = time.perf_counter()
            cls = ESRun if name.startswith("es") else GRPORun
            run = cls.create(config, args.out / name, evaluator=evaluator, overwrite=True)
            run.run()
            seconds = time.perf_counter() - started
            after = held_out_scores(evaluator, task, run.adapter, held_out, args.max_new_tokens)
            rows = run.history
            summary["runs"][name] = {
                "settings": {k: getattr(config, k) for k in ("learning_rate", "sigma", "population_size", "group_size",
                                                             "fitness_shaping") if hasattr(config, k)},
                "completions": rows[-1]["samples/completions"], "seconds": seconds,
                "seconds_per_update": sum(r.get("time/generation_s", 0.0) for r in rows[1:]) / max(1, len(rows) - 1),
                "update_s": sum(r.get("time/update_s", 0.0) for r in rows[1:]) / max(1, len(rows) - 1),
                "train_reward_first": rows[1].get("train/reward_mean"), "train_reward_last": rows[-1].get("train/reward_mean"),
                "after": after,
            }
            if name == "grpo":
                summary["runs"][name]["policy_device"] = str(run.trainer.device)
            print(name, json.dumps(summary["runs"][name], default=str)[:600], flush=True)
            (args.out / "countdown_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    finally:
        evaluator.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
