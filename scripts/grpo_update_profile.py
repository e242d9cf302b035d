"""Where a deterministic GRPO update spends its time: the policy's own ``train`` step
(``PolicyTrainer``, the settings of ``python -m evolm_lib.benchmark grpo-update``: SmolLM2, rank-8
LoRA on every projection, 8 prompts x group 8, one micro-batch of 64) on a fixed rollout batch, each
setting in a fresh process set up as the policy's own process sets itself
(``policy_process._training_settings``):

- ``deterministic``: torch's deterministic algorithms on, the attention ``policy_attention: auto``
  picks (eager on a GPU);
- ``deterministic_sdpa``: on, with torch's fused attention kernel (whose backward they slow);
- ``deterministic_workspace_kept``: on, with the cuBLAS workspace setting (``CUBLAS_WORKSPACE_CONFIG``)
  kept for every call, as before ``policy_process._start_cublas`` dropped it once cuBLAS had started
  (torch 2.11 parses it with a regex on every cuBLAS call);
- ``loose``: off;
- ``loose_workspace``: off, with the cuBLAS workspace setting the deterministic mode needs, kept, to
  tell that setting's cost from the algorithms'.

Prints each setting's median step over ``loose``'s, and the torch ops whose time (on the device,
and on the host) differs most between ``deterministic`` and ``loose``.

    python scripts/grpo_update_profile.py [--model smollm2-135m-instruct] [--steps 8] [--json out.json]
    python scripts/grpo_update_profile.py --model tiny-random --steps 2 --new-tokens 4   # on a CPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = ("deterministic", "deterministic_sdpa", "deterministic_workspace_kept", "loose", "loose_workspace")


def measure(setting: str, args: argparse.Namespace) -> dict:
    """One setting in this (fresh) process: its median train step and its ops' device times."""
    import torch

    from evolm_lib.benchmark.grpo_update import study_settings
    from evolm_lib.config import GRPOConfig
    from evolm_lib.lora import adapter_shapes, init_adapter
    from evolm_lib.models import resolve_model
    from evolm_lib.train.policy import PolicyTrainer, rollout_batch
    from evolm_lib.train.policy_process import DETERMINISTIC_CUBLAS_WORKSPACE, _start_cublas, _training_settings

    gpu = torch.cuda.is_available()
    if setting == "loose_workspace":  # read when cuBLAS starts: before any CUDA work
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = DETERMINISTIC_CUBLAS_WORKSPACE
    applied = _training_settings(setting.startswith("deterministic"), torch.get_num_threads())
    model_dir = resolve_model(args.model)
    config = GRPOConfig.from_dict({**study_settings(args, gpu), "micro_batch_size": args.prompts * args.group_size,
                                   "policy_attention": "sdpa" if setting == "deterministic_sdpa" else "auto"})
    spec = config.lora_spec()
    trainer = PolicyTrainer(model_dir, init_adapter(spec, adapter_shapes(model_dir, spec), seed=0), config)
    applied["attention"] = trainer.attention
    if setting in ("deterministic", "deterministic_sdpa"):  # as the policy's own process starts cuBLAS
        applied.update(_start_cublas(trainer.device))
    rows = args.prompts * args.group_size
    generator = torch.Generator().manual_seed(0)
    vocab = trainer.vocab_size
    prompts = [torch.randint(0, vocab, (args.prompt_tokens,), generator=generator).tolist() for _ in range(rows)]
    completions = [torch.randint(0, vocab, (args.new_tokens,), generator=generator).tolist() for _ in range(rows)]
    batch = rollout_batch(prompts, completions, trainer.pad_token_id)
    rewards = torch.rand(rows, generator=generator)
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    sync = torch.cuda.synchronize if gpu else (lambda: None)

    def step() -> float:
        sync()
        started = time.perf_counter()
        trainer.train(batch, rewards, advantages)
        sync()
        return time.perf_counter() - started

    seconds = [step() for _ in range(args.steps)]  # the first warms up; the rest are the figure
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(args.profiled_steps):
            step()
    ops = {}
    for event in profiler.key_averages():
        device_us = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
        ops[event.key] = {"device_ms": device_us / 1e3 / args.profiled_steps, "cpu_ms": event.self_cpu_time_total / 1e3 / args.profiled_steps,
                          "calls": event.count / args.profiled_steps}
    return {"setting": setting, "settings_applied": applied, "device": torch.cuda.get_device_name() if gpu else "cpu",
            "step_s": statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0], "step_s_each": seconds,
            "ops_per_step": ops}


def differences(results: dict, top: int) -> list[tuple[str, float, float, float, float]]:
    """(op, deterministic and loose device ms, deterministic and loose host ms) a step of the ops whose
    time differs most between the two, on the device or on the host."""
    on, off = results["deterministic"]["ops_per_step"], results["loose"]["ops_per_step"]
    rows = [(op, *(side.get(op, {}).get(key, 0.0) for key in ("device_ms", "cpu_ms") for side in (on, off)))
            for op in set(on) | set(off)]
    return sorted(rows, key=lambda r: max(abs(r[1] - r[2]), abs(r[3] - r[4])), reverse=True)[:top]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=8, help="timed train steps (the first is a warm-up)")
    parser.add_argument("--profiled-steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--examples", type=int, default=16)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", choices=SETTINGS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 2 or args.profiled_steps < 1:
        parser.error("--steps must be at least 2 and --profiled-steps at least 1")
    if args.worker:
        args.out.write_text(json.dumps(measure(args.worker, args)))
        return {}
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for setting in SETTINGS:  # a fresh process each: torch's deterministic mode is process-wide
            out = Path(folder) / f"{setting}.json"
            env = {k: v for k, v in os.environ.items() if k not in ("VLLM_BATCH_INVARIANT", "CUBLAS_WORKSPACE_CONFIG")}
            subprocess.run([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--worker", setting,
                            "--out", str(out)], check=True, env=env)
            results[setting] = json.loads(out.read_text())
    loose = results["loose"]["step_s"]
    print(f"train step, median of {args.steps - 1} on {results['loose']['device']}: "
          + "; ".join(f"{setting} {results[setting]['step_s'] * 1e3:.1f} ms ({results[setting]['step_s'] / loose:.2f}x)"
                      for setting in SETTINGS))
    print(f"{'op (deterministic against loose, ms a step)':60s} {'device on':>10s} {'off':>8s} {'host on':>10s} {'off':>8s}")
    for op, device_on, device_off, host_on, host_off in differences(results, args.top):
        print(f"{op[:60]:60s} {device_on:10.2f} {device_off:8.2f} {host_on:10.2f} {host_off:8.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
