"""The GRPO update with and without ``deterministic``, the policy in the engine's process or its own:
``python -m evolm_lib.benchmark grpo-update``.

vLLM's batch-invariant mode (``deterministic: true`` on a GPU) is process-wide, so every
configuration runs in a process of its own: one engine, then one GRPO run per policy and micro-batch
size on it, at the five-seed study's GRPO settings (``papermill_runs/study_addition_smollm2_gpu.yaml``:
SmolLM2, two-digit addition, 8 prompts x group 8, 16 new tokens, rank-8 LoRA on every projection,
bfloat16 engine). A configuration's figure is the median of the run's own ``time/update_s`` over its
steps after the first (and ``time/sync_s``, the write of full weights into the engine). Configurations:

  not_deterministic         deterministic false, the policy in the engine's process
  deterministic_same        deterministic true, the policy in the engine's process (the batch-invariant one)
  deterministic_own         deterministic true, the policy in its own process (deterministic algorithms there)
  deterministic_own_rerun   the same again: its rows must equal the run before's
  deterministic_own_loose   deterministic true, own process, without torch's deterministic algorithms
  deterministic_own_loose_rerun   the same again: do its rows repeat without those algorithms?

Printed: the medians, each over ``not_deterministic`` (the goal: ``deterministic_own`` <= 1.15), and
whether the runs that should repeat another's rows did (``SAME_ROWS``). ``--devices 0,1,2`` runs the
configurations side by side, one card each (CUDA_VISIBLE_DEVICES); without it one after the other.
Each configuration's process prints its progress (engine ready, each run's steps done) into a log;
with ``--json`` the logs are kept beside it (``NAME_logs/``), so a command stopped at a deadline
still shows where its time went.

Examples::

    python -m evolm_lib.benchmark grpo-update --devices 0,1,2,3 --json results/grpo_update.json
    python -m evolm_lib.benchmark grpo-update --policy-weights full --micro-batch-sizes 64
    python -m evolm_lib.benchmark grpo-update --model tiny-random --steps 2 --prompts 2 --group-size 4 \\
        --micro-batch-sizes 8 --examples 8 --new-tokens 4

Speed targets are read from these ratios on a named machine (docs/measurements.md), never asserted by tests.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from . import int_list

CONFIGURATIONS = {  # label -> GRPOConfig changes
    "not_deterministic": {"deterministic": False, "policy_process": "same"},
    "deterministic_same": {"deterministic": True, "policy_process": "same"},
    "deterministic_own": {"deterministic": True, "policy_process": "own"},
    "deterministic_own_rerun": {"deterministic": True, "policy_process": "own"},
    "deterministic_own_loose": {"deterministic": True, "policy_process": "own", "deterministic_update": False},
    "deterministic_own_sdpa": {"deterministic": True, "policy_process": "own", "policy_attention": "sdpa"},
    "deterministic_own_loose_rerun": {"deterministic": True, "policy_process": "own", "deterministic_update": False},
}
SAME_ROWS = {  # label -> the configuration whose rows it is compared with
    "deterministic_own_rerun": "deterministic_own",
    "deterministic_same": "deterministic_own",
    "deterministic_own_loose": "deterministic_own",
    "deterministic_own_loose_rerun": "deterministic_own_loose",
}
BASELINE = "not_deterministic"
GOAL = ("deterministic_own", 1.15)
"""The configuration whose update, over the baseline's, should be at most this."""
LEARNING_RATES = {"lora": 5e-4, "full": 1e-5}
"""The study's GRPO rate on the LoRA (grpo_lr5e4); full weights at the geometry page's rate."""
PHASES = ("update_s", "rollout_s", "sync_s")


def study_settings(args: argparse.Namespace, gpu: bool) -> dict[str, Any]:
    """The study's GRPO settings at the benchmark's sizes (``GRPOConfig`` fields)."""
    return dict(
        model=args.model, task="arithmetic",
        task_options={"digits": 2, "operations": "+", "num_train": args.examples, "num_eval": args.examples},
        dtype="bfloat16" if gpu else "float32", lora_rank=8, lora_alpha=16.0, max_new_tokens=args.new_tokens,
        max_model_len=512, kv_cache_gb=2.0 if gpu else 0.125, gpu_memory_utilization=0.12 if gpu else None,
        prompts_per_step=args.prompts, group_size=args.group_size, temperature=1.0, loss_type="grpo_clip",
        max_grad_norm=1.0, num_steps=args.steps, eval_every=0, checkpoint_every=args.steps, seed=0,
    )


def measure(label: str, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration, in this process: one engine, a GRPO run per policy and micro-batch size on it."""
    import torch

    from ..config import GRPOConfig
    from ..engines import EngineSizing, make_engine
    from ..env import apply_engine_defaults
    from ..train.grpo import GRPORun

    apply_engine_defaults()
    gpu = torch.cuda.is_available()
    base = GRPOConfig.from_dict({**study_settings(args, gpu), **CONFIGURATIONS[label]})
    started = time.perf_counter()
    # one engine serves every policy of the configuration: sized for a full one where one is asked for
    # (its weights are written in place, which a LoRA policy's engine cannot do)
    engine = make_engine(base, sizing=EngineSizing.from_config(
        base.replace(policy_weights="full") if "full" in args.policy_weights else base))
    print(f"{label}: engine ready after {time.perf_counter() - started:.1f} s", flush=True)
    folder = Path(tempfile.mkdtemp(prefix="evolm-grpo-update-"))
    result: dict[str, Any] = {"label": label, "device": torch.cuda.get_device_name() if gpu else "cpu", "runs": {}}
    try:
        for weights in args.policy_weights:
            for micro in args.micro_batch_sizes:
                config = base.replace(policy_weights=weights, micro_batch_size=micro, learning_rate=LEARNING_RATES[weights])
                run = GRPORun.create(config, folder / f"{weights}-{micro}", engine=engine)
                try:
                    rows = run.run()
                    result["policy_settings"] = getattr(run.trainer, "settings", None)  # the own process's torch
                finally:
                    run.close()
                later = rows[1:]  # the first step warms kernels and caches
                measured = {f"{phase}_steps": [r[f"time/{phase}"] for r in later if f"time/{phase}" in r] for phase in PHASES}
                measured.update({phase: statistics.median(measured[f"{phase}_steps"]) if measured[f"{phase}_steps"] else None
                                 for phase in PHASES})
                measured["rows"] = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]
                result["runs"][f"{weights}/{micro}"] = measured
                print(f"{label}: {weights}/{micro} {len(rows)} steps done after {time.perf_counter() - started:.1f} s, "
                      f"update median {measured['update_s']} s", flush=True)
    finally:
        engine.close()
        shutil.rmtree(folder, ignore_errors=True)
    return result


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each configuration's median update over the baseline's, per run; whether the deterministic
    own-process runs repeated (and matched the same-process one); whether the goal is met."""
    out: dict[str, Any] = {"update_over_baseline": {}, "rows_identical": {}, "goal_met": {}}
    keys = sorted({key for result in results.values() for key in result["runs"]})
    for key in keys:
        runs = {label: result["runs"][key] for label, result in results.items() if key in result["runs"]}
        base = runs.get(BASELINE)
        out["update_over_baseline"][key] = {label: run["update_s"] / base["update_s"] for label, run in runs.items()
                                            if base is not None and label != BASELINE}
        out["rows_identical"][key] = {label: runs[label]["rows"] == runs[reference]["rows"]
                                      for label, reference in SAME_ROWS.items() if label in runs and reference in runs}
        ratio = out["update_over_baseline"][key].get(GOAL[0])
        out["goal_met"][key] = None if ratio is None else ratio <= GOAL[1]
    return out


def format_results(results: dict[str, dict[str, Any]], summary: dict[str, Any]) -> str:
    """One line per configuration and run: the median update (and sync) in seconds and its ratio."""
    keys = list(summary["update_over_baseline"])
    lines = [f"{'GRPO update, median s/step':<28}" + "".join(f"{key:>22}" for key in keys)]
    for label, result in results.items():
        cells = []
        for key in keys:
            run = result["runs"].get(key)
            ratio = summary["update_over_baseline"][key].get(label)
            sync = f" +{run['sync_s']:.3f}" if run and run["sync_s"] is not None else ""
            cells.append("" if run is None else f"{run['update_s']:.3f}{sync}" + (f" ({ratio:.2f}x)" if ratio else ""))
        lines.append(f"{label:<28}" + "".join(f"{c:>22}" for c in cells))
    for key in keys:
        lines.append(f"{key}: rows identical {summary['rows_identical'][key] or 'not compared'}; "
                     f"{GOAL[0]} / {BASELINE} <= {GOAL[1]}: {summary['goal_met'][key]}")
    lines.append(f"(update seconds [+ sync into the engine] over the steps after the first; x: over {BASELINE}; "
                 f"device {', '.join(sorted({r['device'] for r in results.values()}))})")
    return "\n".join(lines)


def _worker_command(label: str, out: Path, argv: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "evolm_lib.benchmark", "grpo-update", *argv, "--worker", label, "--json", str(out)]


def run_configurations(labels: Sequence[str], argv: Sequence[str], devices: Sequence[str],
                       logs: Path | None = None) -> dict[str, dict[str, Any]]:
    """Each configuration in a process of its own: one after the other, or side by side, one card each;
    their logs in ``logs`` (kept), else in a folder removed at the end."""
    from ..env import child_environment

    folder = Path(tempfile.mkdtemp(prefix="evolm-grpo-update-"))
    logs = logs or folder
    logs.mkdir(parents=True, exist_ok=True)
    # a configuration's own settings decide batch invariance: none inherited from this shell
    environment = {k: v for k, v in child_environment().items() if k != "VLLM_BATCH_INVARIANT"}
    root = str(Path(__file__).resolve().parents[2])  # this evolm_lib, whatever the caller's sys.path
    environment["PYTHONPATH"] = os.pathsep.join(p for p in (root, environment.get("PYTHONPATH")) if p)
    pending, running, results = list(labels), {}, {}
    slots = list(devices) or [None]
    try:
        while pending or running:
            while pending and slots:
                label, device = pending.pop(0), slots.pop(0)
                env = dict(environment, **({"CUDA_VISIBLE_DEVICES": device} if device is not None else {}))
                log = open(logs / f"{label}.log", "w")
                process = subprocess.Popen(_worker_command(label, folder / f"{label}.json", argv), env=env,
                                           stdout=log, stderr=subprocess.STDOUT)
                running[label] = (process, device, log)
            time.sleep(0.5)
            for label, (process, device, log) in list(running.items()):
                if process.poll() is None:
                    continue
                log.close()
                del running[label]
                slots.append(device)
                if process.returncode != 0:
                    tail = (logs / f"{label}.log").read_text()[-3000:]
                    raise RuntimeError(f"grpo-update: configuration {label} failed (exit {process.returncode}):\n{tail}")
                results[label] = json.loads((folder / f"{label}.json").read_text())
                print(f"{label}: done", flush=True)
    finally:
        for process, _, log in running.values():
            process.kill()
            log.close()
        shutil.rmtree(folder, ignore_errors=True)
    return {label: results[label] for label in labels}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure every configuration (each in its own process), print the table, optionally write JSON."""
    import torch

    argv = list(sys.argv[1:] if argv is None else argv)
    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="python -m evolm_lib.benchmark grpo-update", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="known name or model folder")
    parser.add_argument("--steps", type=int, default=10 if gpu else 3, help="GRPO steps per run (>= 2: the first is not timed)")
    parser.add_argument("--micro-batch-sizes", default="64,8", help="rollouts per backward pass, one run each")
    parser.add_argument("--policy-weights", default="lora", help="lora, full or both (lora,full): one run each")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (the study: 8)")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt (the study: 8)")
    parser.add_argument("--new-tokens", type=int, default=16, help="max_new_tokens (the study: 16)")
    parser.add_argument("--examples", type=int, default=500, help="train and held-out problems each (the study: 500)")
    parser.add_argument("--configurations", default=",".join(CONFIGURATIONS), help=f"some of {list(CONFIGURATIONS)}")
    parser.add_argument("--devices", default="", help="CUDA devices to run the configurations on side by side (0,1,2)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one configuration, in this process
    args = parser.parse_args(argv)
    args.micro_batch_sizes = int_list(parser, args.micro_batch_sizes, "micro-batch-sizes")
    args.policy_weights = [w for w in args.policy_weights.split(",") if w]
    labels = [c for c in args.configurations.split(",") if c]
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the first step is not timed), got {args.steps}")
    for name in ("prompts", "group_size", "new_tokens", "examples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.micro_batch_sizes or any(m < 1 or (args.prompts * args.group_size) % m for m in args.micro_batch_sizes):
        parser.error(f"--micro-batch-sizes must divide the {args.prompts * args.group_size} rollouts of a step")
    if not args.policy_weights or any(w not in LEARNING_RATES for w in args.policy_weights):
        parser.error(f"--policy-weights must name some of {list(LEARNING_RATES)}")
    if not labels or any(c not in CONFIGURATIONS for c in labels):
        parser.error(f"--configurations must name some of {list(CONFIGURATIONS)}")
    if args.worker is not None:
        if args.worker not in CONFIGURATIONS or args.json is None:
            parser.error(f"--worker takes one of {list(CONFIGURATIONS)} and needs --json")
        result = measure(args.worker, args)
        args.json.write_text(json.dumps(result))
        return result
    devices = [d for d in args.devices.split(",") if d]
    logs = args.json.with_name(f"{args.json.stem}_logs") if args.json else None
    results = run_configurations(labels, _without_option(_without_option(argv, "--json"), "--devices"), devices, logs)
    summary = ratios(results)
    print(format_results(results, summary))
    result = {"settings": study_settings(args, gpu), "micro_batch_sizes": args.micro_batch_sizes,
              "policy_weights": args.policy_weights,
              "configurations": {label: {**r, "runs": {k: {p: v for p, v in run.items() if p != "rows"}
                                                        for k, run in r["runs"].items()}} for label, r in results.items()},
              **summary}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return result


def _without_option(argv: Sequence[str], option: str) -> list[str]:
    """``argv`` without ``option`` and its value (``--option value`` or ``--option=value``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out
