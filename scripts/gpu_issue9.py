"""Issue 9 on the lent GPU: the project's own vLLM path, resident slots (in_place) against files.

1. Throughput (``evolm_lib.throughput``; Qwen2.5-1.5B shapes with random bf16 weights, SmolLM2's
   tokenizer, ``scripts/qwen_shape.py``; CUDA graphs): population of 32 rank-r members x 8 prompts x
   128 new tokens (EOS ignored) in place (written into the resident slots from their seeds) and as
   adapter files, against the base model on the same 256 requests, median and best of 3 calls;
   r = 1 and 8.
2. An ES generation with the demo's settings at population 32 on SmolLM2 (``ESRun``, in_place and
   files; ``evolm_lib.benchmark.es_generations``): wall time per generation split into slot writes /
   adapter files, engine, reward, update and the mean adapter's scoring.
Writes OUT/issue9.json.   CPU check: python scripts/gpu_issue9.py --out /tmp/x --model tiny-random --small
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from evolm_lib.benchmark import es_generations, format_es_generations
from evolm_lib.env import apply_engine_defaults
from evolm_lib.throughput import ThroughputSpec, format_throughput, throughput_report


def throughput(model: str, rank: int, members: int, prompts: int, new_tokens: int, repeats: int, eager: bool,
               lora_configs: str | None = "auto") -> dict:
    """Base, in-place population and file population tokens/s on one engine, members around a random A-and-B mean."""
    gpu = torch.cuda.is_available()
    spec = ThroughputSpec(model=model, population=members, prompts=prompts, new_tokens=new_tokens, rank=rank,
                          alpha=float(2 * rank), init_scheme="random_ab", init_scale=0.1, sigma=0.01,
                          noise_device="cuda" if gpu else "cpu", repeats=repeats)
    report = throughput_report(spec, ("base", "in_place", "files"), kv_cache_gb=None if gpu else 0.25,
                               enforce_eager=eager, lora_kernel_configs=lora_configs)
    print(format_throughput(report), flush=True)
    return {**report, "eager": eager}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="qwen-shape", help="throughput model: qwen-shape (built here) or a name")
    parser.add_argument("--es-model", default="smollm2-135m-instruct")
    parser.add_argument("--small", action="store_true", help="tiny sizes, for a CPU check")
    parser.add_argument("--ranks", default="1,8")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-es", action="store_true")
    parser.add_argument("--lora-configs", default="auto", help="tuned LoRA kernel configs: auto, none or a folder")
    args = parser.parse_args()
    apply_engine_defaults()
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available()
    report = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "torch": torch.__version__}
    import vllm

    report["vllm"] = vllm.__version__
    members, prompts, tokens, repeats = (4, 2, 8, 2) if args.small else (32, 8, 128, 3)
    path = args.out / "issue9.json"
    if not args.skip_throughput:
        if args.model == "qwen-shape":
            from qwen_shape import build_qwen_shape  # scripts/, this script's folder

            model = str(build_qwen_shape())
        else:
            model = args.model
        report["throughput"] = []
        for rank in [int(r) for r in args.ranks.split(",")]:
            configs = None if args.lora_configs == "none" else args.lora_configs
            report["throughput"].append(throughput(model, rank, members, prompts, tokens, repeats, eager=not gpu,
                                                   lora_configs=configs))
            path.write_text(json.dumps(report, indent=1))
    if not args.skip_es:
        report["es_generation"] = es_generations(args.es_model if not args.small else args.model, 32 if not args.small else 4,
                                                 10 if not args.small else 3, workdir=args.out)
        print(format_es_generations(report["es_generation"]), flush=True)
        print(json.dumps(report["es_generation"]), flush=True)
    path.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
