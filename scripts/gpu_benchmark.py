"""GPU benchmark (no vLLM needed): what ES costs next to generation at GPU scale.

Builds a model with random weights from a config (default: Qwen2.5-1.5B's shapes, bfloat16), then
measures on one GPU, for population N of rank-r LoRA adapters on all 7 projections:
  1. ES overhead per generation: noise regeneration + perturbation of N members, writing N adapters
     in PEFT format to /dev/shm (what the vLLM path does), the gradient estimate and the update;
     with noise drawn on the CPU (portable bits, the default) and on the GPU;
  2. generation with HF transformers: the base model batched over all N x M requests (a stand-in
     for a multi-LoRA engine's single call) against member-by-member with peft (the paper's
     reference style), same number of new tokens.
Usage: python scripts/gpu_benchmark.py --tokenizer DIR [--population 30] [--rank 8] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from evolm_lib import es
from evolm_lib.engines.hf_engine import HFEvaluator, SamplingSettings
from evolm_lib.lora import AdapterWeights, LoraSpec, adapter_shapes, init_adapter, save_adapter
from evolm_lib.types import Prompt

QWEN25_15B = dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True,
)


def build_model(out: Path, tokenizer_dir: Path, dtype: torch.dtype) -> Path:
    """A Qwen2-architecture model with random weights, saved with a real tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(**QWEN25_15B, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(dtype)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def es_overhead(model_dir: Path, population: int, rank: int, noise_device: str) -> dict:
    """Seconds per generation for everything ES adds around the engine call."""
    spec = LoraSpec(rank=rank, alpha=float(rank))
    shapes = adapter_shapes(model_dir, spec)
    mean = {k: v.to("cuda") for k, v in init_adapter(spec, shapes, "peft_default", seed=0).tensors.items()}
    members = es.population(0, 1, population, antithetic=True)
    root = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    timing = {}
    sync(); t0 = time.perf_counter()
    adapters = [es.perturb(mean, m, 1e-3, noise_device=noise_device) for m in members]
    sync(); t1 = time.perf_counter()
    for i, tensors in enumerate(adapters):
        save_adapter(AdapterWeights(spec, tensors), root / f"m{i}", dtype=torch.bfloat16)  # engine dtype, as VLLMEvaluator
    t2 = time.perf_counter()
    weights = es.centered_ranks(torch.randn(population))
    gradient = es.es_gradient(members, weights, shapes, 1e-3, noise_device=noise_device)
    gradient = {k: v.to("cuda") for k, v in gradient.items()}
    config = es.SGDConfig(5e-4)
    state = es.init_optimizer_state(config, mean)
    es.apply_update(config, state, mean, gradient)
    sync(); t3 = time.perf_counter()
    shutil.rmtree(root, ignore_errors=True)
    timing.update(perturb_s=t1 - t0, write_adapters_s=t2 - t1, gradient_update_s=t3 - t2, total_s=t3 - t0)
    timing["adapter_params"] = sum(int(torch.Size(s).numel()) for s in shapes.values())
    return timing


def generation(model_dir: Path, population: int, prompts_per_member: int, new_tokens: int, rank: int) -> dict:
    """HF: base model batched over all requests vs member by member with peft."""
    evaluator = HFEvaluator(model_dir, dtype="bfloat16", batch_size=population * prompts_per_member, device="cuda")
    spec = LoraSpec(rank=rank, alpha=float(rank))
    shapes = adapter_shapes(model_dir, spec)
    mean = init_adapter(spec, shapes, "peft_default", seed=0).tensors
    members = es.population(0, 1, population, antithetic=True)
    adapters = [AdapterWeights(spec, es.perturb(dict(mean), m, 1e-3)) for m in members]
    prompts = [Prompt.user(f"Question {i}: what is {i} + {i + 3}?") for i in range(prompts_per_member)]
    sampling = SamplingSettings(max_new_tokens=new_tokens, ignore_eos=True)
    evaluator.generate(prompts[:1], [None], SamplingSettings(max_new_tokens=4))  # warm-up
    sync(); t0 = time.perf_counter()
    base = evaluator.generate(prompts * population, [None], sampling)
    sync(); t1 = time.perf_counter()
    evaluator.batch_size = prompts_per_member
    evaluator.generate(prompts[:1], adapters[:1], SamplingSettings(max_new_tokens=4))  # warm-up with peft
    sync(); t2 = time.perf_counter()
    per_member = evaluator.generate(prompts, adapters, sampling)
    sync(); t3 = time.perf_counter()
    base_tokens = sum(c.num_tokens for row in base for c in row)
    member_tokens = sum(c.num_tokens for row in per_member for c in row)
    return {
        "batched_base_tok_s": base_tokens / (t1 - t0), "batched_base_s": t1 - t0,
        "member_by_member_tok_s": member_tokens / (t3 - t2), "member_by_member_s": t3 - t2,
        "ratio_batched_over_member_by_member": (base_tokens / (t1 - t0)) / (member_tokens / (t3 - t2)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, type=Path)
    parser.add_argument("--population", type=int, default=30)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model_dir = build_model(Path(tempfile.mkdtemp()) / "model", args.tokenizer, torch.bfloat16)
    result = {"device": torch.cuda.get_device_name(0), "model": "Qwen2.5-1.5B shapes, random, bf16",
              "population": args.population, "rank": args.rank, "prompts_per_member": args.prompts,
              "new_tokens": args.new_tokens}
    for device in ("cpu", "cuda"):
        es_overhead(model_dir, args.population, args.rank, device)  # warm-up
        result[f"es_overhead_noise_{device}"] = es_overhead(model_dir, args.population, args.rank, device)
    result["generation"] = generation(model_dir, args.population, args.prompts, args.new_tokens, args.rank)
    gen_s = result["generation"]["batched_base_s"]
    for device in ("cpu", "cuda"):
        result[f"overhead_share_noise_{device}"] = result[f"es_overhead_noise_{device}"]["total_s"] / gen_s
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
