"""GPU benchmark without vLLM: what ES costs next to generation with HF transformers at GPU scale.

On a model with Qwen2.5-1.5B's shapes and random bfloat16 weights (``scripts/qwen_shape.py``), or
``--model``, for a population of N rank-r LoRA members on all 7 projections:
  1. ES overhead per generation (``evolm_lib.throughput.measure_es_overhead``): noise + perturbation
     of N members, writing their adapters in bfloat16 to /dev/shm, the gradient estimate and the
     update, with the mean on the GPU and the noise drawn on the CPU (portable bits) and on the GPU;
  2. generation with HF transformers (``evolm_lib.throughput.measure_throughput``): the base model
     batched over all N x M requests against member by member with peft (the paper's reference
     style), the same new tokens.
With vLLM on the machine, ``evolm bench --model FOLDER`` measures the same HF paths beside vLLM's.
Usage: python scripts/gpu_benchmark.py [--model qwen-shape] [--population 30] [--rank 8] [--json OUT]
CPU check (float32, noise on the CPU only):
       python scripts/gpu_benchmark.py --model tiny-random --population 4 --prompts 2 --new-tokens 4 --rank 1
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from evolm_lib.engines.hf_engine import HFEvaluator
from evolm_lib.throughput import ThroughputSpec, measure_es_overhead, measure_throughput, ratios


def main() -> None:
    """Measure both parts and print them as JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen-shape", help="qwen-shape (built by scripts/qwen_shape.py) or a model")
    parser.add_argument("--population", type=int, default=30)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.model == "qwen-shape":
        from qwen_shape import build_qwen_shape  # scripts/, this script's folder

        args.model = str(build_qwen_shape())
    spec = ThroughputSpec(model=args.model, population=args.population, prompts=args.prompts, new_tokens=args.new_tokens,
                          rank=args.rank)
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", "bfloat16") if gpu else ("cpu", "float32")
    noise_devices = ("cpu", "cuda") if gpu else ("cpu",)
    result = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", **dataclasses.asdict(spec)}
    for noise in noise_devices:
        result[f"es_overhead_noise_{noise}"] = measure_es_overhead(dataclasses.replace(spec, noise_device=noise),
                                                                   device=device, adapter_dtype=dtype)
    evaluator = HFEvaluator(spec.model, dtype=dtype, batch_size=spec.requests, device=device)
    try:
        rows = measure_throughput(evaluator, spec, ("base",), engine="hf")  # before peft wraps the model
        evaluator.batch_size = spec.prompts
        rows += measure_throughput(evaluator, spec, ("files",), engine="hf")
    finally:
        evaluator.close()
    result["generation"] = {"rows": rows, "ratios": ratios(rows)}
    for noise in noise_devices:  # against the batched base model's call, a stand-in for one multi-LoRA engine call
        result[f"overhead_share_noise_{noise}"] = result[f"es_overhead_noise_{noise}"]["overhead_s"] / rows[0]["seconds"]
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
