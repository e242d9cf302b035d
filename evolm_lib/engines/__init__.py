"""Engines behind one protocol (``base``): vLLM (multi-LoRA, one call per population), HF
transformers + peft, and a synthetic engine for tests. Engine bugs are worked around in
``workarounds``, each with its version."""
from __future__ import annotations

from .base import CompletionTable, Evaluator, Population, PromptEncoder, SamplingSettings, TokenScorer

__all__ = ["CompletionTable", "Evaluator", "Population", "PromptEncoder", "SamplingSettings", "TokenScorer",
           "make_evaluator"]


def make_evaluator(config, max_loras: int = 8) -> Evaluator:
    """The evaluator a run's settings ask for (``config.evaluator``, ``config.engine``), sized for
    ``max_loras`` adapters per call (shared out over the engines with ``evaluator: ray``)."""
    # what every vLLM engine of a run gets, in this process or in Ray actors
    engine = dict(max_lora_rank=config.lora_rank, max_loras=max_loras, max_model_len=config.max_model_len,
                  dtype=config.dtype, gpu_memory_utilization=config.gpu_memory_utilization,
                  kv_cache_gb=config.kv_cache_gb, seed=config.seed,
                  adapter_transfer=getattr(config, "adapter_transfer", "files"))  # GRPO serves one adapter: files
    if getattr(config, "evaluator", "local") == "ray":
        from .ray_engine import RayEvaluator  # imports Ray only when asked for

        return RayEvaluator(config.model, num_engines=config.num_engines, ray_address=config.ray_address,
                            population_size=getattr(config, "population_size", None), **engine)
    if config.engine == "hf":
        from .hf_engine import HFEvaluator

        return HFEvaluator(config.model, dtype=config.dtype)
    from .vllm_engine import VLLMEvaluator

    return VLLMEvaluator(config.model, **engine)
