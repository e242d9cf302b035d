"""How long a fresh process takes to import vLLM, start a tiny-random engine, serve calls, close it
and start and close a second, in this checkout against another commit of it, the two trees
alternating (and taking turns to go first) so that the machine's drift falls on both.

    python scripts/engine_start_times.py --against c83bc08 --rounds 3

Each round runs one child process per tree (``git worktree`` of ``--against`` in a temporary
folder, removed at the end), each with the tree first on ``PYTHONPATH``. Prints each child's phases
and, per phase, the median of this tree over the median of the other (below 1: this tree faster).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")
began = time.perf_counter()
from evolm_lib.engines.base import SamplingSettings
from evolm_lib.engines.vllm.engine import VLLMEngine
from evolm_lib.models import resolve_model
model = str(resolve_model("tiny-random"))
calls = int(sys.argv[1])
phases = {}
def start():
    return VLLMEngine(model, max_loras=8, max_lora_rank=8, max_model_len=512, kv_cache_gb=0.125)
engine = start()
phases["import and start"] = time.perf_counter() - began
mark = time.perf_counter()
sampling = SamplingSettings(max_new_tokens=32, temperature=1.0, seed=0)
for _ in range(calls):
    engine.generate(["What is 2+2?"] * 16, [None], sampling)
phases["calls"] = time.perf_counter() - mark
mark = time.perf_counter()
engine.close()
phases["close"] = time.perf_counter() - mark
mark = time.perf_counter()
engine = start()
phases["second start"] = time.perf_counter() - mark
mark = time.perf_counter()
engine.close()
phases["second close"] = time.perf_counter() - mark
phases["process"] = time.perf_counter() - began
print("PHASES " + json.dumps(phases), flush=True)
"""


def run_child(tree: Path, calls: int) -> dict[str, float]:
    """One fresh process on ``tree``'s code: its phases in seconds."""
    env = dict(os.environ)
    hidden = REPO / "tests" / "hidden_modules"  # as the suite's processes run (see conftest.py)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(hidden)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    done = subprocess.run([sys.executable, "-c", CHILD, str(calls)], cwd=tree, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PHASES ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the child on {tree} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("PHASES "):])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="the commit to compare this checkout with")
    parser.add_argument("--rounds", type=int, default=3, help="child processes per tree, alternating")
    parser.add_argument("--calls", type=int, default=20, help="engine calls (16 prompts x 32 tokens) between start and close")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.calls < 0:
        parser.error("--rounds must be at least 1 and --calls at least 0")
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{args.against}^{{commit}}"], cwd=REPO,
                            capture_output=True, text=True)
    if commit.returncode != 0:
        parser.error(f"--against {args.against!r} is not a commit of {REPO}")
    results: dict[str, list[dict[str, float]]] = {"this tree": [], args.against: []}
    with tempfile.TemporaryDirectory(prefix="engine_start_") as scratch:
        other = Path(scratch) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(other), commit.stdout.strip()], cwd=REPO, check=True)
        try:
            for round_ in range(args.rounds):
                order = [("this tree", REPO), (args.against, other)]
                for name, tree in order if round_ % 2 == 0 else order[::-1]:  # neither tree always first
                    phases = run_child(tree, args.calls)
                    results[name].append(phases)
                    print(f"round {round_ + 1} {name}: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=REPO, check=False)
    print(f"\nmedians over {args.rounds} rounds, this tree / {args.against}:")
    for phase in results["this tree"][0]:
        ours = statistics.median(r[phase] for r in results["this tree"])
        theirs = statistics.median(r[phase] for r in results[args.against])
        print(f"  {phase}: {ours:.2f} s / {theirs:.2f} s = {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
