"""Evaluators: prompts x adapters in, completions out, behind one small protocol.

``VLLMEvaluator`` serves a whole population (N adapters x M prompts) in ONE batched vLLM call;
``HFEvaluator`` does the same with transformers + peft, for machines without vLLM and as a
cross-check. Both render chat prompts with the model's chat template and tokenise them the same
way, so greedy decoding gives the same tokens on both.
"""
from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

from .lora import AdapterWeights, adapter_shapes, save_adapter
from .types import Completion, Prompt, PromptLike

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class SamplingSettings:
    """How to decode. ``temperature == 0`` is greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None  # per-request seeds derive from it (same prompt index -> same seed)
    ignore_eos: bool = False
    logprobs: bool = False  # return the log-prob of each sampled token

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def request_seed(self, prompt_index: int) -> int | None:
        """The seed of one request: every adapter sees the same seed for the same prompt (common random numbers)."""
        if self.seed is None:
            return None
        digest = hashlib.blake2b(f"{self.seed}/{prompt_index}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little") & 0x7FFFFFFF


class Evaluator(Protocol):
    """Generate completions for every (adapter, prompt) pair in one call."""

    def generate(
        self, prompts: Sequence[PromptLike], adapters: Sequence[AdapterWeights | None], sampling: SamplingSettings
    ) -> list[list[Completion]]:
        """Completions indexed [adapter][prompt]; ``None`` as an adapter means the base model."""
        ...

    def close(self) -> None:
        """Release the engine."""
        ...


def _as_prompt(prompt: PromptLike) -> Prompt | str:
    if isinstance(prompt, (Prompt, str)):
        return prompt
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in prompt):
        return Prompt(tuple(prompt))
    raise TypeError(f"a prompt must be a Prompt, a list of chat messages or a string, got {type(prompt).__name__}")


class _PromptEncoder:
    """Chat template + tokenisation shared by both evaluators, so their inputs are identical."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def encode(self, prompt: PromptLike) -> list[int]:
        prompt = _as_prompt(prompt)
        if isinstance(prompt, str):
            text = prompt
        else:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError("this model's tokenizer has no chat template: pass prompts as plain strings")
            text = self.tokenizer.apply_chat_template(list(prompt.messages), tokenize=False, add_generation_prompt=True)
            text += prompt.assistant_prefix
        # The template already holds the special tokens; adding them again would double the BOS.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render(self, prompt: PromptLike) -> str:
        """The exact text the model sees (for display)."""
        return self.tokenizer.decode(self.encode(prompt))


def _check_adapters(adapters: Sequence[AdapterWeights | None], model_dir: Path, max_rank: int | None) -> None:
    checked: dict[Any, dict] = {}
    for adapter in adapters:
        if adapter is None:
            continue
        if max_rank is not None and adapter.spec.rank > max_rank:
            raise ValueError(
                f"adapter rank {adapter.spec.rank} exceeds the engine's max_lora_rank {max_rank}: "
                "start the evaluator with a larger max_lora_rank"
            )
        if adapter.spec not in checked:
            checked[adapter.spec] = adapter_shapes(model_dir, adapter.spec)
        expected = checked[adapter.spec]
        if set(adapter.tensors) != set(expected):
            extra = sorted(set(adapter.tensors) - set(expected))[:3]
            missing = sorted(set(expected) - set(adapter.tensors))[:3]
            raise ValueError(f"adapter tensors do not match the model: unexpected {extra}, missing {missing}")
        for name, shape in expected.items():
            if tuple(adapter.tensors[name].shape) != tuple(shape):
                raise ValueError(f"adapter tensor {name} has shape {tuple(adapter.tensors[name].shape)}, expected {shape}")


def _default_adapter_root() -> Path:
    # RAM-backed where it exists: a population is written every generation.
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class VLLMEvaluator:
    """One vLLM engine with LoRA enabled; every (adapter x prompt) request of a call goes into ONE generate."""

    # vLLM keeps process-wide state (parallel groups) that shutting one engine down tears down for
    # every other engine in the process, and an engine that is garbage-collected shuts down by
    # itself: closed engines are kept (not collected) until the last live one closes.
    _live_engines = 0
    _retired: list = []

    def __init__(
        self,
        model: str | Path,
        *,
        max_lora_rank: int = 8,
        max_loras: int = 8,
        max_model_len: int = 1024,
        dtype: str = "float32",
        gpu_memory_utilization: float | None = None,
        kv_cache_gb: float | None = None,
        seed: int = 0,
        enforce_eager: bool = True,
        max_num_seqs: int = 256,
        adapter_root: str | Path | None = None,
        engine_kwargs: dict | None = None,
    ):
        from .models import resolve_model

        if max_lora_rank < 1 or max_lora_rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"max_lora_rank must be in 1..{VLLM_LORA_RANKS[-1]}, got {max_lora_rank}")
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.model_dir = resolve_model(str(model))
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.dtype = dtype
        # In-process engine: works in scripts (no __main__ guard needed) and in Jupyter kernels.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        import torch
        from vllm import LLM

        on_gpu = torch.cuda.is_available()
        engine_kwargs = dict(engine_kwargs or {})
        if kv_cache_gb is None and gpu_memory_utilization is None and not on_gpu:
            # On CPU vLLM sizes the KV cache as a share of RAM minus what the process already holds,
            # which fails or wastes memory depending on the process; a fixed size is predictable.
            kv_cache_gb = 1.0
        if kv_cache_gb is not None:
            engine_kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
        if gpu_memory_utilization is None:
            gpu_memory_utilization = 0.85 if on_gpu else 0.5
        engine_rank = next(r for r in VLLM_LORA_RANKS if r >= max_lora_rank)
        started = time.perf_counter()
        self.llm = LLM(
            model=str(self.model_dir),
            dtype=dtype,
            seed=seed,
            enable_lora=True,
            max_lora_rank=engine_rank,
            max_loras=max_loras + 1,  # +1: the zero adapter that stands in for the base model in mixed calls
            max_cpu_loras=2 * (max_loras + 1),
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            max_num_seqs=max_num_seqs,
            **engine_kwargs,
        )
        self.start_seconds = time.perf_counter() - started
        VLLMEvaluator._live_engines += 1
        self.encoder = _PromptEncoder(self.llm.get_tokenizer())
        self._adapter_root = Path(adapter_root) if adapter_root else _default_adapter_root()
        self._workdir = Path(tempfile.mkdtemp(prefix="evolm-adapters-", dir=self._adapter_root))
        # A kernel restarted or a script that never calls close() must not leave adapters in RAM.
        weakref.finalize(self, shutil.rmtree, str(self._workdir), True)
        # vLLM caches adapters by int id and its prefix cache by name: every adapter version gets new ones.
        self._ids = itertools.count(1)
        self.last_timing: dict[str, float] = {}

    @property
    def _torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def _lora_requests(self, adapters: Sequence[AdapterWeights | None]):
        from vllm.lora.request import LoRARequest

        requests, paths, seen = [], [], {}
        for adapter in adapters:
            if adapter is None:
                requests.append(None)
                continue
            if id(adapter) in seen:  # the same object twice in one call: one adapter, one slot
                requests.append(seen[id(adapter)])
                continue
            lora_id = next(self._ids)
            # Written in the engine's dtype: the engine would round to it anyway, and at GPU scale
            # float32 doubles the bytes written per generation.
            path = save_adapter(adapter, self._workdir / f"a{lora_id}", base_model=str(self.model_dir), dtype=self._torch_dtype)
            paths.append(path)
            requests.append(LoRARequest(f"evolm-{lora_id}", lora_id, str(path)))
            seen[id(adapter)] = requests[-1]
        return requests, paths

    def generate(
        self,
        prompts: Sequence[PromptLike],
        adapters: Sequence[AdapterWeights | None] = (None,),
        sampling: SamplingSettings = SamplingSettings(),
    ) -> list[list[Completion]]:
        """Completions indexed [adapter][prompt], from one batched engine call."""
        (completions,) = self.generate_grids([(prompts, adapters, sampling)])
        return completions

    def generate_grids(
        self, grids: Sequence[tuple[Sequence[PromptLike], Sequence[AdapterWeights | None], SamplingSettings]]
    ) -> list[list[list[Completion]]]:
        """Several (prompts x adapters, sampling) grids in ONE engine call, e.g. a population and the
        greedy scoring of its mean adapter; returns one [adapter][prompt] table per grid."""
        from vllm import SamplingParams

        all_adapters = [a for _, adapters, _ in grids for a in adapters]
        distinct = len({id(a) for a in all_adapters if a is not None})
        if distinct > self.max_loras:
            raise ValueError(
                f"{distinct} adapters in one call but the engine holds max_loras={self.max_loras}: "
                "start the evaluator with max_loras >= the population size"
            )
        _check_adapters(all_adapters, self.model_dir, self.max_lora_rank)
        t0 = time.perf_counter()
        lora_requests, paths = self._lora_requests(_base_as_zero_adapter(all_adapters))
        t1 = time.perf_counter()
        inputs, params, loras, shapes = [], [], [], []
        offset = 0
        for prompts, adapters, sampling in grids:
            token_prompts = [{"prompt_token_ids": self.encoder.encode(p)} for p in prompts]
            per_prompt = [
                SamplingParams(
                    max_tokens=sampling.max_new_tokens,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    top_k=sampling.top_k if sampling.top_k > 0 else -1,
                    seed=None if sampling.greedy else sampling.request_seed(i),
                    ignore_eos=sampling.ignore_eos,
                    logprobs=0 if sampling.logprobs else None,
                    skip_special_tokens=True,
                )
                for i in range(len(prompts))
            ]
            for a in range(len(adapters)):
                inputs.extend(token_prompts)
                params.extend(per_prompt)
                loras.extend([lora_requests[offset + a]] * len(prompts))
            offset += len(adapters)
            shapes.append((len(adapters), len(prompts), sampling.logprobs))
        try:
            outputs = self.llm.generate(inputs, params, lora_request=loras, use_tqdm=False)
        finally:
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)
        t3 = time.perf_counter()
        self.last_timing = {"adapters_s": t1 - t0, "generate_s": t3 - t1}
        tables, start = [], 0
        for num_adapters, num_prompts, logprobs in shapes:
            flat = [_completion_from_vllm(o.outputs[0], logprobs) for o in outputs[start : start + num_adapters * num_prompts]]
            tables.append([flat[i * num_prompts : (i + 1) * num_prompts] for i in range(num_adapters)])
            start += num_adapters * num_prompts
        return tables

    def prompt_logprobs(
        self, prompt_token_ids: Sequence[Sequence[int]], completion_token_ids: Sequence[Sequence[int]], adapter: AdapterWeights | None = None
    ) -> list[list[float]]:
        """Log-prob of each completion token given its prompt, under the base model or an adapter (for KL)."""
        from vllm import SamplingParams

        _check_adapters([adapter], self.model_dir, self.max_lora_rank)
        lora_requests, paths = self._lora_requests([adapter])
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        inputs = [{"prompt_token_ids": list(p) + list(c)} for p, c in zip(prompt_token_ids, completion_token_ids)]
        try:
            with _vllm_cpu_prompt_logprobs_fix():
                outputs = self.llm.generate(inputs, params, lora_request=lora_requests[0], use_tqdm=False)
        finally:
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)
        result = []
        for out, p, c in zip(outputs, prompt_token_ids, completion_token_ids):
            entries = out.prompt_logprobs[len(p) :]
            result.append([entry[token].logprob for entry, token in zip(entries, c)])
        return result

    def encode(self, prompt: PromptLike) -> list[int]:
        """Token ids of a rendered prompt."""
        return self.encoder.encode(prompt)

    def close(self) -> None:
        """Shut the engine down and delete the adapter folder."""
        shutil.rmtree(self._workdir, ignore_errors=True)
        llm = getattr(self, "llm", None)
        if llm is not None:
            VLLMEvaluator._live_engines -= 1
            VLLMEvaluator._retired.append(llm)
            if VLLMEvaluator._live_engines == 0:
                for engine in VLLMEvaluator._retired:
                    try:
                        engine.llm_engine.engine_core.shutdown()
                    except Exception:
                        pass
                VLLMEvaluator._retired.clear()
            self.llm = None
        import gc

        gc.collect()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@contextlib.contextmanager
def _vllm_cpu_prompt_logprobs_fix() -> Iterator[None]:
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


def _base_as_zero_adapter(adapters: list[AdapterWeights | None]) -> list[AdapterWeights | None]:
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


def _completion_from_vllm(output, want_logprobs: bool) -> Completion:
    logprobs = None
    if want_logprobs and output.logprobs is not None:
        logprobs = tuple(step[token].logprob for step, token in zip(output.logprobs, output.token_ids))
    return Completion(
        text=output.text, token_ids=tuple(output.token_ids), finish_reason=str(output.finish_reason), logprobs=logprobs
    )


class HFEvaluator:
    """transformers + peft, batched over prompts, one adapter after another (the paper's reference style)."""

    def __init__(self, model: str | Path, *, dtype: str = "float32", batch_size: int = 16, device: str | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from .models import resolve_model

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model_dir = resolve_model(str(model))
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, dtype)).to(self.device)
        self.model.eval()
        self.batch_size = batch_size
        self.encoder = _PromptEncoder(self.tokenizer)
        self._peft_spec = None
        self.peft_model = None
        self.last_timing: dict[str, float] = {}

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
    ) -> list[list[Completion]]:
        """Completions indexed [adapter][prompt]; each adapter's prompts run in batches."""
        import torch

        adapters = list(adapters)
        _check_adapters(adapters, self.model_dir, None)
        encoded = [self.encoder.encode(p) for p in prompts]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        eos = self.tokenizer.eos_token_id
        result: list[list[Completion]] = []
        t_adapters = t_generate = 0.0
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
                kwargs: dict[str, Any] = dict(max_new_tokens=sampling.max_new_tokens, pad_token_id=pad)
                if sampling.greedy:
                    kwargs.update(do_sample=False)
                else:
                    kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
                    if sampling.seed is not None:
                        torch.manual_seed(sampling.request_seed(start))
                if sampling.ignore_eos:
                    kwargs.update(eos_token_id=None, min_new_tokens=sampling.max_new_tokens)
                with torch.no_grad():
                    out = module.generate(input_ids=input_ids, attention_mask=attention, **kwargs)
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
        self.last_timing = {"adapters_s": t_adapters, "generate_s": t_generate}
        return result

    def encode(self, prompt: PromptLike) -> list[int]:
        """Token ids of a rendered prompt."""
        return self.encoder.encode(prompt)

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


def make_evaluator(config, max_loras: int = 8) -> "Evaluator":
    """The evaluator a run's settings ask for (``config.engine``), sized for ``max_loras`` adapters per call."""
    if config.engine == "hf":
        return HFEvaluator(config.model, dtype=config.dtype)
    return VLLMEvaluator(
        config.model,
        max_lora_rank=config.lora_rank,
        max_loras=max_loras,
        max_model_len=config.max_model_len,
        dtype=config.dtype,
        gpu_memory_utilization=config.gpu_memory_utilization,
        kv_cache_gb=config.kv_cache_gb,
        seed=config.seed,
    )
