"""`deterministic` on a GPU, one measurement per process (vLLM reads batch invariance once per process):

    python scripts/gpu_deterministic.py throughput --rank 1 --deterministic 1 --json out.json
        `evolm_lib.throughput.measure_throughput`: the in-place population against the base model on
        Qwen2.5-1.5B's shapes (32 x 8 x 128), and how often greedy completions repeat: the same call
        twice, and 16 members inside a 32-member call
    python scripts/gpu_deterministic.py es --json out.json
        `evolm_lib.train.es.ESRun` on SmolLM2, conciseness, deterministic: two ES runs with the same
        settings, and a run killed (SIGKILL) in its second generation then resumed, against an
        uninterrupted one: identical rows?

Add ``--model tiny-random`` to check the script on a CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def repeat_share(a, b) -> float:
    """Share of (member, prompt) completions with identical tokens in two tables."""
    pairs = [(x.token_ids, y.token_ids) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b)]
    return sum(x == y for x, y in pairs) / len(pairs)


def throughput(args) -> dict:
    from evolm_lib.engines import Population, SamplingSettings
    from evolm_lib.throughput import (ThroughputSpec, bench_prompts, machine_info, mean_adapter, measure_throughput,
                                      members_of, ratios, start_engine)
    from qwen_shape import build_qwen_shape

    small = args.model == "tiny-random"  # a check of this script on a CPU
    spec = ThroughputSpec(model=args.model if small else str(build_qwen_shape()), population=4 if small else 32,
                          prompts=2 if small else 8, new_tokens=8 if small else 128, rank=args.rank,
                          repeats=1 if small else 3, noise_device="cpu" if small else "cuda", init_scheme="random_ab")
    engine = start_engine(spec, max_model_len=512, deterministic=bool(args.deterministic))
    rows = measure_throughput(engine, spec, ("base", "in_place"))
    mean, prompts = mean_adapter(spec), bench_prompts(spec.prompts)
    greedy = SamplingSettings(max_new_tokens=64)
    members = members_of(spec, 7)
    first = engine.generate(prompts, Population(mean, tuple(members), spec.sigma, spec.noise_device), greedy)
    second = engine.generate(prompts, Population(mean, tuple(members), spec.sigma, spec.noise_device), greedy)
    half = engine.generate(prompts, Population(mean, tuple(members[: len(members) // 2]), spec.sigma, spec.noise_device), greedy)
    engine.close()
    return {"machine": machine_info(), "rank": args.rank, "deterministic": bool(args.deterministic),
            "engine_deterministic": engine.deterministic,
            "rows": [{k: v for k, v in r.items() if k != "calls"} for r in rows], "ratios": ratios(rows),
            "same_call_twice": repeat_share(first, second), "half_inside_all": repeat_share(half, first[: len(half)])}


CONFIG = dict(model="smollm2-135m-instruct", task="conciseness", population_size=32, sigma=0.05, learning_rate=0.4,
              num_generations=3, max_new_tokens=64, dtype="bfloat16", noise_device="cuda", deterministic=True,
              checkpoint_every=1)
CHILD = """
import os, signal, sys
from evolm_lib.config import ESConfig
from evolm_lib.train.es import ESRun
run = ESRun.open(ESConfig(**{config!r}), {folder!r})
run.run(1)
def dying(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
run.evaluate = dying
run.run()
"""


def es(args) -> dict:
    from evolm_lib.config import ESConfig
    from evolm_lib.engines import make_engine
    from evolm_lib.runs import read_metrics
    from evolm_lib.train.es import ESRun

    settings = dict(CONFIG)
    if args.model == "tiny-random":  # a check of this script on a CPU
        settings.update(model="tiny-random", population_size=4, max_new_tokens=8, dtype="float32", noise_device="cpu",
                        max_model_len=256, kv_cache_gb=0.0625)
    root = Path(tempfile.mkdtemp(prefix="det-"))
    child = subprocess.run([sys.executable, "-c", CHILD.format(config=settings, folder=str(root / "killed"))],
                           capture_output=True, text=True)
    config = ESConfig(**settings)
    engine = make_engine(config)

    def rows(folder):
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in read_metrics(folder)]

    for name in ("a", "b", "killed"):  # killed: resumed from the checkpoint its generation 1 left
        run = ESRun.open(config, root / name, engine=engine)
        run.run()
        run.close()
    engine.close()
    a, b, killed = rows(root / "a"), rows(root / "b"), rows(root / "killed")
    return {"child_returncode": child.returncode, "killed_by_sigkill": child.returncode == -signal.SIGKILL,
            "generations": len(a), "two_runs_identical": a == b, "resumed_identical": killed == a,
            "rewards": [r.get("train/reward_mean") for r in a], "child_stderr_tail": child.stderr[-500:]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("throughput", "es"))
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--deterministic", type=int, default=1)
    parser.add_argument("--model", default="qwen-shape", help="qwen-shape / smollm2 (the GPU), or tiny-random to check the script on a CPU")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    from evolm_lib.env import apply_engine_defaults

    apply_engine_defaults()
    report = throughput(args) if args.what == "throughput" else es(args)
    args.json.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=None)[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
