"""Full-parameter GRPO against LoRA GRPO on the same rollouts, and the in-place weight sync's time.

One engine generates one batch of rollouts (G samples per prompt, with their log-probs) from the base
model; then for each form, ``policy_weights: lora`` (a rank-``--lora-rank`` adapter) and ``full``
(the model weights of ``--grpo-weights``), a ``PolicyTrainer`` takes ``--repeats`` update steps on
exactly those rollouts (the first, warm-up, is left out of the median). For ``full`` it also times
the write of the trained weights into the resident engine (``resident_weights(...).load``, as
``GRPORun.sync_engine`` does after each step). Prints one JSON object and writes it to ``--out``.

    python scripts/gpu_grpo_full.py --out gpu_grpo_full.json                  # SmolLM2, bfloat16 on a GPU
    python scripts/gpu_grpo_full.py --model tiny-random --prompts 2 --group-size 2 --max-new-tokens 4 --repeats 2
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def measure(args: argparse.Namespace) -> dict:
    """Rollouts once, then each form's update steps and the full form's weight sync; seconds per step."""
    import torch

    from evolm_lib.config import GRPOConfig
    from evolm_lib.engines import SamplingSettings, make_engine
    from evolm_lib.grpo.primitives import compute_group_normalized_rewards
    from evolm_lib.lora import adapter_shapes, init_adapter
    from evolm_lib.models import resolve_model
    from evolm_lib.tasks import get_task
    from evolm_lib.train.policy import PolicyTrainer, rollout_batch

    on_gpu = torch.cuda.is_available()
    common = dict(model=args.model, task=args.task, group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                  prompts_per_step=args.prompts, dtype=args.dtype or ("bfloat16" if on_gpu else "float32"),
                  lora_rank=args.lora_rank, lora_alpha=float(args.lora_rank), learning_rate=1e-5,
                  micro_batch_size=args.micro_batch_size, max_model_len=args.max_model_len)
    full = GRPOConfig(**common, policy_weights="full", grpo_weights=args.grpo_weights)
    lora = GRPOConfig(**common)
    task = get_task(args.task)
    model_dir = resolve_model(args.model)
    engine = make_engine(full)  # in place: the worker extension that writes the weights
    examples = task.train_examples()[: args.prompts]
    prompts = [task.prompt(e) for e in examples for _ in range(args.group_size)]
    sampling = SamplingSettings(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0, logprobs=True)
    started = time.perf_counter()
    completions = engine.generate(prompts, [None], sampling)[0]
    rollout_s = time.perf_counter() - started
    repeated = [e for e in examples for _ in range(args.group_size)]
    rewards = task.reward_fn([c.text for c in completions], repeated)
    advantages, raw, _ = compute_group_normalized_rewards(lambda _r, i: rewards[int(i)], [c.text for c in completions],
                                                          [str(i) for i in range(len(completions))], args.group_size,
                                                          1e-6, True)
    prompt_ids = [engine.encode(p) for p in prompts]
    result = {"device": torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu",
              "torch": torch.__version__, "model": args.model, "dtype": full.dtype, "rollouts": len(completions),
              "tokens": sum(c.num_tokens for c in completions), "rollout_s": rollout_s}
    for name, config in (("lora", lora), ("full", full)):
        adapter = None
        if name == "lora":
            spec = config.lora_spec()
            adapter = init_adapter(spec, adapter_shapes(model_dir, spec), "peft_default", 0)
        trainer = PolicyTrainer(model_dir, adapter, config)
        batch = rollout_batch(prompt_ids, [list(c.token_ids) for c in completions], trainer.pad_token_id)
        steps = []
        for _ in range(args.repeats):
            _synchronize()
            started = time.perf_counter()
            trainer.train(batch, raw, advantages)
            _synchronize()
            steps.append(time.perf_counter() - started)
        result[f"{name}/trained_values"] = sum(p.numel() for p in trainer.parameters)
        result[f"{name}/step_s"] = statistics.median(steps[1:] if len(steps) > 1 else steps)
        result[f"{name}/steps_s"] = steps
        if name == "full":
            targets, layers = config.weight_targets()
            weights = engine.resident_weights(targets, noise="full", layers_to_transform=layers)
            syncs = []
            for _ in range(args.repeats):
                _synchronize()
                started = time.perf_counter()
                weights.load({"master": trainer.flat_weights()})
                _synchronize()
                syncs.append(time.perf_counter() - started)
            result["full/sync_s"] = statistics.median(syncs[1:] if len(syncs) > 1 else syncs)
            result["full/syncs_s"] = syncs
            result["full/engine_restored"] = bool(weights.checksum()["restored"])
            weights.close()
        del trainer
        if on_gpu:
            torch.cuda.empty_cache()
    engine.close()
    result["full_over_lora"] = result["full/step_s"] / result["lora/step_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--task", default="arithmetic")
    parser.add_argument("--prompts", type=int, default=8, help="prompts of the batch")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=None, help="rollouts per forward/backward (None: one group)")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--grpo-weights", default="all", help="full form: 'all' (every parameter) or 'none' (the LoRA targets)")
    parser.add_argument("--dtype", default=None, help="engine dtype (default: bfloat16 on a GPU, float32 on a CPU)")
    parser.add_argument("--repeats", type=int, default=4, help="update steps per form (the first is a warm-up)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    args.grpo_weights = None if args.grpo_weights == "none" else args.grpo_weights
    from evolm_lib.env import apply_engine_defaults

    apply_engine_defaults()
    result = measure(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
