"""Rebuild tests/data/es_vs_grpo/: tiny run folders of four methods (ES with a LoRA adapter, ES
EGGROLL, ES full-parameter, GRPO; 2 seeds each, equal budgets) that notebooks/04_es_vs_grpo.py shows
by default and tests/test_analysis.py reads.

The LoRA ES and GRPO runs (es_seedN, grpo_seedN) are trained on tiny-random with the deterministic
SyntheticEngine (no engine for training: the reward is the conciseness of a completion whose
length grows with the adapter's distance from a hidden target), so their numbers mean nothing about
ES or GRPO; the KL of each final adapter to the base model is measured with a real vLLM engine on
tiny-random (about 30 s; --no-kl skips it). Checkpoints and final adapters are deleted: only
config.yaml and metrics.jsonl are kept (a few KB a run).

Made by hand, so the tests can check the study's tables against numbers worked out on paper:
- es_eggroll_seedN and es_full_seedN (ES modes that need an engine writing its weights in place):
  config.yaml from the LoRA ES run's settings with `es_mode` changed, validated by ESConfig, and
  metrics rows whose greedy completions are "x" strings `gap` characters longer than each target,
  the gap shrinking by a fixed step per generation (`MODE_RUNS`);
- heldout.jsonl of every run: the eight conciseness eval problems with completions whose length
  gaps are listed in `HELDOUT_GAPS` (a gap of 0 is a success), rewards from the task's own reward;
- kl.jsonl of every run: the KL of checkpoints 3 and 4 (the two kept), 0.75 x the final KL and the final KL.

Usage: python scripts/make_analysis_fixtures.py [--out tests/data/es_vs_grpo] [--no-kl] [--hand-made-only]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import yaml

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

# Hand-made ES runs of the other modes: {folder: (es_mode, length gap at generation 0, gap lost per
# generation, seconds per generation, final KL)}.
MODE_RUNS = {
    "es_eggroll_seed0": ("eggroll", 90, 10, 0.005, 0.002),
    "es_eggroll_seed1": ("eggroll", 88, 12, 0.006, 0.0025),
    "es_full_seed0": ("full", 95, 5, 0.02, 0.004),
    "es_full_seed1": ("full", 93, 7, 0.03, 0.005),
}
# Held-out length gaps per problem of the eight conciseness eval problems (0: exact length, a success;
# -1: one character short). Successes: es 8 and 6, eggroll 4 and 4, full 3 and 5, grpo 2 and 1.
HELDOUT_GAPS = {
    "es_seed0": [0, 0, 0, 0, 0, 0, 0, 0],
    "es_seed1": [0, 0, 0, 2, 0, 0, -1, 0],
    "es_eggroll_seed0": [0, 1, 0, 1, 0, 1, 0, 1],
    "es_eggroll_seed1": [1, 0, 1, 0, 1, 0, 1, 0],
    "es_full_seed0": [0, 0, 0, 2, 2, 2, 2, 2],
    "es_full_seed1": [0, 0, 0, 0, 0, 4, 4, 4],
    "grpo_seed0": [0, 0, 3, 3, 3, 3, 3, 3],
    "grpo_seed1": [0, 5, 5, 5, 5, 5, 5, 5],
}
CHECKPOINT_KL_SHARES = {3: 0.75, 4: 1.0}  # kl.jsonl: generation -> share of the run's final KL (the two kept checkpoints)


def _completions(examples, gap: int) -> list[str]:
    """ "x" strings ``gap`` characters longer than each example's target (shorter for a negative gap)."""
    return ["x" * max(0, len(example.target) + gap) for example in examples]


def write_mode_run(out: Path, name: str) -> None:
    """One hand-made ES run of another mode: the LoRA ES run's settings with its es_mode, and rows."""
    from evolm_lib.config import ESConfig
    from evolm_lib.runs import write_run_config
    from evolm_lib.tasks import get_task

    mode, gap0, step, seconds, final_kl = MODE_RUNS[name]
    seed = int(name.rsplit("seed", 1)[1])
    settings = yaml.safe_load((out / f"es_seed{seed}" / "config.yaml").read_text())
    settings.pop("kind")
    config = ESConfig(**{**settings, "es_mode": mode})
    task = get_task(config.task, **config.task_options)
    train, held_out = task.train_examples(), task.eval_examples()
    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_config(run_dir, config, "es")
    rows, wall = [], 0.0
    per_generation = config.population_size * len(train)
    for generation in range(config.num_generations + 1):
        gap = gap0 - step * generation
        train_completions, eval_completions = _completions(train, gap), _completions(held_out, gap)
        row = {"generation": generation, "method": "es", "seed": seed}
        if generation:
            wall += seconds
            row.update({"train/reward_mean": -gap - 2.0, "train/reward_std": 2.0, "train/reward_best": -gap + 1.0,
                        "train/reward_worst": -gap - 5.0, "train/reward_p20": -gap - 3.0, "train/reward_p80": -gap - 1.0})
        row.update({
            "policy/train_reward": sum(task.reward_fn(train_completions, train)) / len(train),
            "eval/reward": sum(task.reward_fn(eval_completions, held_out)) / len(held_out),
            "policy/train_completions": train_completions, "policy/eval_completions": eval_completions,
            "samples/completions": per_generation * generation,
            "samples/tokens": sum(len(c) for c in train_completions) * config.population_size * generation,
        })
        if generation:
            row["time/generation_s"] = seconds
        row["time/wall_s"] = wall
        rows.append(row)
    rows[-1]["policy/kl"] = final_kl
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def write_heldout(run_dir: Path) -> None:
    """heldout.jsonl of a run: the conciseness eval problems with completions of the listed gaps."""
    from evolm_lib.tasks import get_task

    task = get_task("conciseness")
    examples = task.eval_examples()
    gaps = HELDOUT_GAPS[run_dir.name]
    completions = ["x" * (len(e.target) + gap) for e, gap in zip(examples, gaps)]
    rewards = task.reward_fn(completions, examples)
    lines = [{"index": i, "prompt": e.prompt, "target": e.target, "completion": c, "reward": r + 0.0,  # -0.0 written as 0.0
              "success": r >= task.success_threshold}
             for i, (e, c, r) in enumerate(zip(examples, completions, rewards))]
    (run_dir / "heldout.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def write_checkpoint_kls(run_dir: Path) -> None:
    """kl.jsonl of a run: shares of the KL its last metrics row holds, at the listed generations."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final_kl = rows[-1].get("policy/kl")
    if final_kl is None:  # trained with --no-kl: no KL to share out
        (run_dir / "kl.jsonl").unlink(missing_ok=True)
        return
    lines = [{"generation": g, "policy/kl": share * final_kl} for g, share in CHECKPOINT_KL_SHARES.items()]
    (run_dir / "kl.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def write_hand_made(out: Path) -> None:
    """The hand-made parts: the EGGROLL and full-parameter runs, heldout.jsonl and kl.jsonl of every run."""
    for name in MODE_RUNS:
        write_mode_run(out, name)
    for name in HELDOUT_GAPS:
        write_heldout(out / name)
        write_checkpoint_kls(out / name)


def main(argv: list[str] | None = None) -> int:
    """Train the fixture runs, measure their KL, keep only config.yaml and metrics.jsonl; add the hand-made files."""
    from evolm_lib.engines.synthetic import SyntheticEngine

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "data" / "es_vs_grpo")
    parser.add_argument("--no-kl", action="store_true", help="do not start a vLLM engine for the KL")
    parser.add_argument("--hand-made-only", action="store_true",
                        help="keep the trained runs in --out; rewrite only the hand-made files")
    args = parser.parse_args(argv)
    if args.hand_made_only:
        write_hand_made(args.out)
        _sizes(args.out)
        return 0

    plan = sweep.plan_sweep(FIXTURE_SWEEP)
    if args.out.exists():
        shutil.rmtree(args.out)
    kl_engine = None if args.no_kl else sweep.make_shared_engine(plan)
    try:
        sweep.run_sweep(plan, args.out, engine=SyntheticEngine(), kl_engine=kl_engine,
                        kl_settings=None if args.no_kl else {"num_samples": 2, "temperature": 1.0})
    finally:
        if kl_engine is not None:
            kl_engine.close()
    (args.out / "sweep_summary.jsonl").unlink(missing_ok=True)  # wall times: not fixture data
    for run_dir in sorted(p for p in args.out.iterdir() if p.is_dir()):
        for extra in ("checkpoints", "final_adapter"):
            shutil.rmtree(run_dir / extra, ignore_errors=True)
    write_hand_made(args.out)
    _sizes(args.out)
    return 0


def _sizes(out: Path) -> None:
    for run_dir in sorted(p for p in out.iterdir() if p.is_dir()):
        size = sum(p.stat().st_size for p in run_dir.iterdir())
        print(f"{run_dir.relative_to(REPO) if run_dir.is_relative_to(REPO) else run_dir}: {size / 1024:.1f} KB")


if __name__ == "__main__":
    sys.exit(main())
