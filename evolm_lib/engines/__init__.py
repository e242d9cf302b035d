"""Engines behind one protocol (``base``): vLLM (multi-LoRA, one call per population), HF
transformers + peft, and a synthetic engine for tests. Every vLLM engine of a run is sized by one
``EngineSizing`` derived from its settings (``sizing``). The vLLM engine is the package ``vllm``
(its bugs worked around in ``vllm.workarounds``, each with its version); engines in Ray actors are
the package ``ray``. The model's own weights, written in place inside any of them (es_mode full and
eggroll, GRPO's policy_weights full), are the package ``weights``."""
from __future__ import annotations

from .base import (CompletionTable, Engine, EngineBase, Population, PromptEncoder, SamplingSettings, TokenScorer,
                   WeightsEngine)
from .sizing import EngineSizing, resolve_noise_device

__all__ = ["CompletionTable", "Engine", "EngineBase", "EngineSizing", "Population", "PromptEncoder", "SamplingSettings",
           "TokenScorer", "WeightsEngine", "make_engine", "resolve_noise_device"]


def make_engine(config, max_loras: int | None = None, sizing: EngineSizing | None = None) -> Engine:
    """The engine a run's settings ask for (``config.engine_host``, ``config.engine``), of ``sizing``
    (None: ``EngineSizing.from_config(config, max_loras)``, i.e. an ES population and its mean, or
    GRPO's one adapter, unless ``max_loras`` says otherwise), shared out over the engines with
    ``engine_host: ray``."""
    if config.engine == "hf":
        from .hf_engine import HFEngine

        return HFEngine(config.model, dtype=config.dtype)
    sizing = sizing or EngineSizing.from_config(config, max_loras)
    if config.engine_host == "ray":
        from .ray.engines import RayEngines  # imports Ray only when asked for

        return RayEngines(config.model, sizing, num_engines=config.num_engines,
                            engines_per_gpu=config.engines_per_gpu, ray_address=config.ray_address,
                            mps_thread_percentage=config.mps_thread_percentage)
    from .vllm.engine import VLLMEngine

    return VLLMEngine(config.model, sizing)
