"""transformers + peft as an engine: batched over prompts, one adapter after another (the paper's
reference style). For machines without vLLM, and as a cross-check of the vLLM engine."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from ..env import apply_engine_defaults
from ..lora import AdapterWeights
from ..types import Completion, PromptLike
from .weights.resident import MembersInPlace
from .base import CompletionTable, GridsOneByOne, PromptEncoder, SamplingSettings, check_adapters, materialize

class HFEngine(GridsOneByOne, MembersInPlace):
    """transformers + peft, batched over prompts, one adapter after another (the paper's reference style)."""

    def __init__(self, model: str | Path, *, dtype: str = "float32", batch_size: int = 16, device: str | None = None):
        apply_engine_defaults()
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ..models import resolve_model

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model_dir = resolve_model(str(model))
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, dtype)).to(self.device)
        self.model.eval()
        self.batch_size = batch_size
        self.encoder = PromptEncoder(self.tokenizer)
        self._peft_spec = None
        self.peft_model = None

    def _use_adapter(self, adapter: AdapterWeights | None):
        """Return the module to generate with, with the adapter's weights loaded in place."""
        import torch
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        if adapter is None:
            if self.peft_model is None:
                return self.model
            return _DisabledAdapter(self.peft_model)
        if self._peft_spec != adapter.spec:
            if self.peft_model is not None:
                self.model = self.peft_model.unload()
            config = LoraConfig(**{k: v for k, v in adapter.spec.peft_config().items() if k in _LORA_CONFIG_KEYS})
            self.peft_model = get_peft_model(self.model, config)
            self.peft_model.eval()
            self._peft_spec = adapter.spec
        state = {k: v.to(self.device) for k, v in adapter.tensors.items()}
        with torch.no_grad():
            result = set_peft_model_state_dict(self.peft_model, state)
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise ValueError(f"adapter has tensors the model lacks: {unexpected[:3]}")
        return self.peft_model

    def generate(
        self,
        prompts: Sequence[PromptLike],
        adapters: Sequence[AdapterWeights | None] = (None,),
        sampling: SamplingSettings = SamplingSettings(),
    ) -> CompletionTable:
        """Completions indexed ``[adapter][prompt]``; each adapter's prompts run in batches."""
        import torch

        started = time.perf_counter()
        adapters = materialize(adapters)
        t_adapters = time.perf_counter() - started
        check_adapters(adapters, self.model_dir, None)
        encoded = [self.encoder.encode(p) for p in prompts]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        eos = self.tokenizer.eos_token_id
        result: list[list[Completion]] = []
        t_generate = 0.0
        for adapter in adapters:
            t0 = time.perf_counter()
            module = self._use_adapter(adapter)
            t1 = time.perf_counter()
            row: list[Completion] = []
            for start in range(0, len(encoded), self.batch_size):
                batch = encoded[start : start + self.batch_size]
                width = max(len(ids) for ids in batch)
                input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch], device=self.device)
                attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=self.device)
                if not sampling.greedy and sampling.seed is not None:
                    torch.manual_seed(sampling.request_seed(start))
                with torch.no_grad():
                    out = module.generate(input_ids=input_ids, attention_mask=attention,
                                          generation_config=generation_config(sampling, pad, eos))
                for ids in out[:, width:].tolist():
                    if not sampling.ignore_eos and eos in ids:
                        cut = ids.index(eos)
                        tokens, reason = ids[: cut + 1], "stop"
                    else:
                        tokens, reason = ids, "length"
                    text_ids = tokens[:-1] if reason == "stop" else tokens
                    row.append(Completion(self.tokenizer.decode(text_ids, skip_special_tokens=True), tuple(tokens), reason))
            t_adapters += t1 - t0
            t_generate += time.perf_counter() - t1
            result.append(row)
        return CompletionTable(result, {"adapters_s": t_adapters, "generate_s": t_generate})

    def encode(self, prompt: PromptLike) -> list[int]:
        """Token ids of a rendered prompt."""
        return self.encoder.encode(prompt)

    def resident_weights(self, target_modules, *, noise: str = "full", noise_rank: int = 1, noise_scheme: str = "flat",
                         layers_to_transform=None):
        """The model's targeted weights, written in place (``weights.resident.HostWeights``); members
        are then served one at a time, with no adapter."""
        from .weights.resident import HostWeights

        if self.peft_model is not None:  # the plain model's parameter names
            self.model, self.peft_model, self._peft_spec = self.peft_model.unload(), None, None
        return HostWeights(self.model, self.model_dir, target_modules, noise=noise, noise_rank=noise_rank,
                           noise_scheme=noise_scheme, layers_to_transform=layers_to_transform)

    def lowrank_slots(self, spec, num_slots: int) -> None:
        """None: this engine has no LoRA slots, so EGGROLL's members are served one at a time as dense deltas."""
        return None

    def run_members(self, weights, members, sigma: float, prompts: Sequence[PromptLike], sampling: SamplingSettings,
                    score=None, slots=None) -> tuple[CompletionTable, CompletionTable | None, dict[str, float]]:
        """ES members of ``weights`` (from ``resident_weights``) one after another, EGGROLL's as dense
        deltas (no LoRA slots here), then ``score``'s prompts under the mean: see
        ``weights.resident.MembersInPlace``."""
        if slots is not None:
            raise ValueError("the HF engine has no low-rank slots: its members are served one at a time")
        return self.run_members_one_by_one(weights, members, sigma, prompts, sampling, score)

    def close(self) -> None:
        """Drop the model."""
        self.model = self.peft_model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_LORA_CONFIG_KEYS = {"r", "lora_alpha", "lora_dropout", "target_modules", "layers_to_transform", "bias", "task_type"}


class _DisabledAdapter:
    """Generate with the peft model's adapters switched off (the base model)."""

    def __init__(self, peft_model):
        self.peft_model = peft_model

    def generate(self, **kwargs):
        with self.peft_model.disable_adapter():
            return self.peft_model.generate(**kwargs)


def generation_config(sampling: SamplingSettings, pad_token_id: int, eos_token_id: int | None):
    """An explicit transformers GenerationConfig for these settings and nothing else.

    ``generate`` would otherwise merge the model's own ``generation_config.json`` (Qwen2.5-Instruct
    sets repetition_penalty 1.05, top_k 20, ...) into every call, so HF would decode a different
    policy than vLLM serves and GRPO scores.
    """
    from transformers import GenerationConfig

    # Every field left None is filled from the model's own config, so the neutral values are explicit.
    settings: dict[str, Any] = dict(
        max_new_tokens=sampling.max_new_tokens, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
        do_sample=not sampling.greedy, num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0,
        temperature=1.0, top_p=1.0, top_k=0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
    )
    if not sampling.greedy:
        settings.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    if sampling.ignore_eos:
        settings.update(eos_token_id=None, min_new_tokens=sampling.max_new_tokens)
    return GenerationConfig(**settings)

