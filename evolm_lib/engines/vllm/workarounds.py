"""Workarounds for vLLM bugs, each with the engine version it was found on. Remove one when the
pinned engine no longer needs it; its regression test says so: ``base_as_zero_adapter`` in
tests/test_engines.py (test_base_requests_batched_with_adapters), ``vllm_cpu_prompt_logprobs_fix``
in tests/test_scoring.py (test_mean_kl_to_base_is_zero_for_a_zero_adapter_and_positive_otherwise),
``fresh_cuda_graph_pool`` on a GPU only (a second engine started in a process after the first
closed), which no CPU test can show; ``one_collection`` in tests/test_engines.py
(test_engines_shut_down_together_cost_one_garbage_collection)."""
from __future__ import annotations

import contextlib
import gc
import sys
from typing import Iterator

from ...lora import AdapterWeights


@contextlib.contextmanager
def vllm_cpu_prompt_logprobs_fix() -> Iterator[None]:
    """vllm-cpu 0.32 applies the lm_head LoRA of prompt-logprob logits with per-request indices to
    per-token rows, and fails (einsum size mismatch) even for the base model once LoRA is enabled.
    Our adapters never target lm_head (LoraSpec targets layer modules only), so that term is zero:
    skip it where the row counts differ."""
    try:
        from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    except Exception:  # no vLLM, or a build without the CPU wrapper: nothing to patch
        yield
        return
    original = PunicaWrapperCPU.add_lora_logits

    def add_lora_logits(self, y, x, *args, **kwargs):
        if x.reshape(-1, x.shape[-1]).shape[0] != self.sampler_indices.shape[0]:
            return None
        return original(self, y, x, *args, **kwargs)

    PunicaWrapperCPU.add_lora_logits = add_lora_logits
    try:
        yield
    finally:
        PunicaWrapperCPU.add_lora_logits = original


def base_as_zero_adapter(adapters: list[AdapterWeights | None]) -> list[AdapterWeights | None]:
    """In a call that mixes base requests with adapters, serve the base through an all-zero adapter.

    vllm-cpu 0.32 marks "no adapter" with index -1 and indexes its weight stack with it, which in
    torch picks the LAST loaded adapter: base requests batched with adapters silently got one of
    them. A zero adapter gives exactly the base model's output.
    """
    present = [a for a in adapters if a is not None]
    if not present or len(present) == len(adapters):
        return adapters
    import torch

    template = present[0]
    zero = AdapterWeights(template.spec, {n: torch.zeros_like(t) for n, t in template.tensors.items()})
    return [zero if a is None else a for a in adapters]


def fresh_cuda_graph_pool() -> None:
    """Forget vLLM's process-wide CUDA graph memory pool once every engine has shut down.

    vLLM 0.26 captures every engine's CUDA graphs into one pool, made once per process
    (``Platform._global_graph_pool``). When the last engine that used it is gone, PyTorch releases
    the pool, and the next engine of the process failed its capture on an H100 with
    "it->second->use_count > 0 INTERNAL ASSERT FAILED" (CUDACachingAllocator.cpp): a second engine
    after closing the first. A fresh pool for the next engine avoids it."""
    try:
        from vllm.platforms import current_platform
    except Exception:  # no vLLM: nothing to reset
        return
    platform = type(current_platform)
    if getattr(platform, "_global_graph_pool", None) is not None:
        platform._global_graph_pool = None


@contextlib.contextmanager
def one_collection() -> Iterator[None]:
    """Engines shut down together, then one full garbage collection for all of them.

    vllm-cpu 0.32 runs full collections inside each engine's shutdown (``cleanup_dist_env_and_memory``
    among them: twice an engine, over the whole heap of the process), while the engines shut down
    together are all still referenced: on a heap of 3 million objects, seven engines closed at once
    took 8.6 s, and 1.3 s with one collection. Inside this block ``gc.collect`` does nothing (in every
    thread); on leaving it, one collection runs and the CUDA cache is emptied."""
    collect = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = collect
        collect()
        torch = sys.modules.get("torch")  # an engine has imported it
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
