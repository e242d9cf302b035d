"""Rebuild tests/data/es_vs_grpo/: tiny ES and GRPO run folders (2 seeds each, equal budgets) that
notebooks/04_es_vs_grpo.py shows by default and tests/test_analysis.py reads.

Runs on tiny-random with the deterministic SyntheticEvaluator (no engine for training: the reward is
the conciseness of a completion whose length grows with the adapter's distance from a hidden
target), so the numbers mean nothing about ES or GRPO; the KL of each final adapter to the base
model is measured with a real vLLM engine on tiny-random (about 30 s; --no-kl skips it). Checkpoints
and final adapters are deleted: only config.yaml and metrics.jsonl are kept (a few KB a run).

Usage: python scripts/make_analysis_fixtures.py [--out tests/data/es_vs_grpo] [--no-kl]
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from evolm_lib import sweep

REPO = Path(__file__).resolve().parents[1]
FIXTURE_SWEEP = {
    "common": {"model": "tiny-random", "task": "conciseness", "target_modules": ["q_proj", "v_proj"],
               "lora_rank": 1, "max_new_tokens": 64, "max_model_len": 256, "kv_cache_gb": 0.25, "eval_every": 1},
    "es": {"population_size": 8, "sigma": 0.02, "learning_rate": 0.05},  # tests/test_es_run.py's synthetic settings
    # synthetic completions are identical within a group: only raw rewards carry a gradient
    "grpo": {"group_size": 8, "loss_type": "no_baseline", "normalize_by_std": False, "learning_rate": 0.001},
    "generations": 4,
    "seeds": [0, 1],
}


def main(argv: list[str] | None = None) -> int:
    """Train the fixture runs, measure their KL, keep only config.yaml and metrics.jsonl."""
    from evolm_lib.engines.synthetic import SyntheticEvaluator

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "data" / "es_vs_grpo")
    parser.add_argument("--no-kl", action="store_true", help="do not start a vLLM engine for the KL")
    args = parser.parse_args(argv)

    plan = sweep.plan_sweep(FIXTURE_SWEEP)
    if args.out.exists():
        shutil.rmtree(args.out)
    kl_evaluator = None if args.no_kl else sweep.make_shared_evaluator(plan)
    try:
        sweep.run_sweep(plan, args.out, evaluator=SyntheticEvaluator(), kl_evaluator=kl_evaluator,
                        kl_settings=None if args.no_kl else {"num_samples": 2, "temperature": 1.0})
    finally:
        if kl_evaluator is not None:
            kl_evaluator.close()
    (args.out / "sweep_summary.jsonl").unlink(missing_ok=True)  # wall times: not fixture data
    for run_dir in sorted(p for p in args.out.iterdir() if p.is_dir()):
        for extra in ("checkpoints", "final_adapter"):
            shutil.rmtree(run_dir / extra, ignore_errors=True)
        size = sum(p.stat().st_size for p in run_dir.iterdir())
        print(f"{run_dir.relative_to(REPO) if run_dir.is_relative_to(REPO) else run_dir}: {size / 1024:.1f} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
