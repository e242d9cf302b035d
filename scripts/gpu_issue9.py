"""Issue 9 on the lent GPU: the project's own vLLM path, resident slots (in_place) against files.

1. Throughput (Qwen2.5-1.5B shapes with random bf16 weights, SmolLM2's tokenizer; CUDA graphs):
   population of 32 rank-r adapters x 8 prompts x 128 new tokens (EOS ignored) through
   ``VLLMEvaluator`` with a ``Population`` (members written in place from their seeds) and with the
   same members as adapter files, against the base model on the same 256 requests; r = 1 and 8.
2. An ES generation with the demo's settings at population 32 on SmolLM2 (``ESRun``, in_place and
   files; ``evolm_lib.benchmark.es_generations``): wall time per generation split into slot writes /
   adapter files, engine, reward, update and the mean adapter's scoring.
Writes OUT/issue9.json.   CPU check: python scripts/gpu_issue9.py --out /tmp/x --model tiny-random --small
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from evolm_lib.benchmark import es_generations, format_es_generations  # noqa: E402
from evolm_lib.engines import Population, SamplingSettings  # noqa: E402
from evolm_lib.engines.vllm_engine import VLLMEvaluator  # noqa: E402
from evolm_lib.env import apply_engine_defaults  # noqa: E402
from evolm_lib.es import population  # noqa: E402
from evolm_lib.lora import LoraSpec, adapter_shapes, base_weight_magnitudes, init_adapter  # noqa: E402
from evolm_lib.models import resolve_model  # noqa: E402
from evolm_lib.types import Prompt  # noqa: E402

PROMPTS = ["What is 17 + 25? Explain briefly.", "Name three colours of the rainbow.", "Write a haiku about the sea.",
           "Give one tip for learning to cook.", "What is the capital of France?", "Describe a cat in one sentence.",
           "Why is the sky blue?", "List two prime numbers above 10."]


def tokens_of(table) -> int:
    return sum(c.num_tokens for row in table for c in row)


def throughput(model_dir: Path, rank: int, members: int, prompts: int, new_tokens: int, repeats: int, eager: bool,
               lora_configs: str | None = "auto") -> dict:
    """Base, in-place population and file population tokens/s on one engine."""
    spec = LoraSpec(rank=rank, alpha=float(2 * rank))
    shapes = adapter_shapes(model_dir, spec)
    mean = init_adapter(spec, shapes, "random_ab", 0, base_weight_magnitudes(model_dir, spec), 0.1)
    chats = [Prompt.user(PROMPTS[i % len(PROMPTS)]) for i in range(prompts)]
    sampling = SamplingSettings(max_new_tokens=new_tokens, ignore_eos=True)
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    started = time.perf_counter()
    engine = VLLMEvaluator(model_dir, max_lora_rank=rank, max_loras=members, max_model_len=512, dtype=dtype,
                           enforce_eager=eager, adapter_transfer="in_place", lora_kernel_configs=lora_configs,
                           kv_cache_gb=None if torch.cuda.is_available() else 0.25)
    result = {"rank": rank, "members": members, "prompts": prompts, "new_tokens": new_tokens,
              "engine_start_s": time.perf_counter() - started, "eager": eager,
              "lora_kernel_configs": engine.lora_kernel_configs}
    try:
        def timed(name, call):
            call()  # warm-up (and, for slots, their set-up)
            seconds, tokens, splits = [], 0, []
            for generation in range(repeats):
                t = time.perf_counter()
                table = call(generation)
                seconds.append(time.perf_counter() - t)
                tokens = tokens_of(table)
                splits.append(dict(table.timing))
            best = min(seconds)
            result[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / best,
                            "timing": splits[seconds.index(best)]}

        base = [c for _ in range(members) for c in chats]
        timed("base", lambda g=0: engine.generate(base, [None], sampling))
        pop = lambda g: Population(mean, tuple(population(0, g + 1, members)), 0.01, "cuda" if torch.cuda.is_available() else "cpu")  # noqa: E731
        timed("in_place", lambda g=0: engine.generate(chats, pop(g), sampling))
        timed("files", lambda g=0: engine.generate(chats, pop(g).adapters(), sampling))
        for name in ("in_place", "files"):
            result[name]["of_base"] = result[name]["tokens_per_s"] / result["base"]["tokens_per_s"]
        result["transfer"] = engine.adapter_transfer
    finally:
        engine.close()
    return result


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
            from gpu_benchmark import build_model

            model_dir = build_model(Path("/root/cache/qwen25-1.5b-shape"), resolve_model("smollm2-135m-instruct"), torch.bfloat16)
        else:
            model_dir = resolve_model(args.model)
        report["throughput"] = []
        for rank in [int(r) for r in args.ranks.split(",")]:
            configs = None if args.lora_configs == "none" else args.lora_configs
            report["throughput"].append(throughput(model_dir, rank, members, prompts, tokens, repeats, eager=not gpu,
                                                   lora_configs=configs))
            print(json.dumps(report["throughput"][-1])[:800], flush=True)
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
