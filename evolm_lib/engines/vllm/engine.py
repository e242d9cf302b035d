"""vLLM as the engine: a whole population (N adapters x M prompts) in ONE batched call.

``VLLMEngine`` puts the package's pieces together behind the ``Engine`` protocol: the engine
started by ``startup``, every call through the request loop of ``requests``, adapters handed over as
files (``adapters``) or, for a population, written into resident LoRA slots (``slots``), the model's
own weights as the ES mean written in place (``weights``), and the engine bugs worked around
(``workarounds``).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ...lora import AdapterWeights, LoraSpec
from ...types import PromptLike
from ..base import (AdapterList, CompletionTable, GridsInOneCall, Population, PromptEncoder, SamplingSettings,
                   check_adapters, materialize)
from ..weights.resident import MembersInPlace
from ..sizing import ADAPTER_TRANSFERS, EngineSizing
from .adapters import AdapterFiles
from .requests import RequestGrid, requests_aborted_if_cut, run_requests
from .slots import EXTENSION, LOWRANK_SLOT_ID, PopulationSlots, ResidentSlots
from .startup import start_llm
from ..weights.vllm import EngineWeights
from .workarounds import base_as_zero_adapter, fresh_cuda_graph_pool, one_collection, vllm_cpu_prompt_logprobs_fix


@dataclass
class _PlannedGrid:
    """One grid of a call: its prompts and sampling, and either adapters (files) or resident slots' requests."""

    prompts: Sequence[PromptLike]
    sampling: SamplingSettings
    adapters: list | None = None
    slot_requests: list | None = None


# ----------------------------------------------------------------------------- the engine


class VLLMEngine(GridsInOneCall, MembersInPlace):
    """One vLLM engine with LoRA enabled; every (adapter x prompt) request of a call goes into ONE generate."""

    # vLLM keeps process-wide state (parallel groups) that shutting one engine down tears down for
    # every other engine in the process, and an engine that is garbage-collected shuts down by
    # itself: closed engines are kept (not collected) until the last live one closes.
    _live_engines = 0
    _retired: list = []

    def __init__(self, model: str | Path, sizing: EngineSizing | None = None, *, enforce_eager: bool | None = None,
                 max_num_seqs: int | None = None, adapter_root: str | Path | None = None,
                 lora_kernel_configs: str | Path | None = "auto", engine_kwargs: dict | None = None, **sizes: Any):
        """An engine of ``sizing`` (``EngineSizing.from_config(config)`` for a run; keyword ``sizes``
        such as ``max_loras=8`` change single fields; the rest keep ``EngineSizing``'s defaults).
        ``adapter_transfer`` "in_place" writes a population's members into resident LoRA slots inside
        the engine (files, with a warning, where the engine cannot host them); "files" writes every
        member to an adapter file with a new LoRA id each call. ``enforce_eager``, ``max_num_seqs``,
        ``engine_kwargs``: see ``startup.llm_arguments``. ``lora_kernel_configs``: tuned tiles for
        vLLM's LoRA kernels on a GPU (see ``startup.lora_kernel_folder``; "auto" uses those shipped
        for the H100 in LoRA population engines, the sizing's ``es_mode`` lora; one choice per process:
        ``startup.lora_kernel_tiles``)."""
        from ...models import resolve_model

        self.sizing = (sizing or EngineSizing()).replace(**sizes)
        self.model_dir = resolve_model(str(model))
        started = start_llm(self.model_dir, self.sizing, enforce_eager=enforce_eager, max_num_seqs=max_num_seqs,
                            lora_kernel_configs=lora_kernel_configs, engine_kwargs=engine_kwargs)
        self.llm, self.deterministic = started.llm, started.deterministic
        # resident weights (es_mode full / eggroll, GRPO on the model's own weights) are written by the
        # worker extension, which only an in-place sizing (or the caller's engine_kwargs) installs
        self.hosts_weights = (self.sizing.adapter_transfer == "in_place"
                              or (engine_kwargs or {}).get("worker_extension_cls") == EXTENSION)
        self.lora_kernel_configs, self.start_seconds = started.lora_kernel_configs, started.start_seconds
        self.cudagraph_capture_sizes = started.cudagraph_capture_sizes
        VLLMEngine._live_engines += 1
        self.encoder = PromptEncoder(self.llm.get_tokenizer())
        self.files = AdapterFiles(self.model_dir, self.dtype, adapter_root)
        self.slots = PopulationSlots(self.llm, self.model_dir, self.dtype, self.max_loras, self.files.workdir,
                                     enabled=self.sizing.adapter_transfer == "in_place")

    @property
    def max_loras(self) -> int:
        """Adapters one call may hold."""
        return self.sizing.max_loras

    @property
    def max_lora_rank(self) -> int:
        """The largest adapter rank the engine serves."""
        return self.sizing.max_lora_rank

    @property
    def dtype(self) -> str:
        """The engine's dtype (adapter files are written in it)."""
        return self.sizing.dtype

    @property
    def adapter_transfer(self) -> str:
        """How populations reach the engine now: "in_place" (resident slots) or "files"."""
        return "in_place" if self.slots.enabled else "files"

    @adapter_transfer.setter
    def adapter_transfer(self, value: str) -> None:
        if value not in ADAPTER_TRANSFERS:
            raise ValueError(f"adapter_transfer must be one of {', '.join(ADAPTER_TRANSFERS)}, got {value!r}")
        self.slots.enabled = value == "in_place"

    def prepare_population(self, spec: LoraSpec, population_size: int) -> None:
        """Set the resident slots up for populations of ``population_size`` adapters of ``spec``
        (a run calls it when it opens): each generation's call then only writes and serves them.
        Nothing to do where populations travel as files."""
        self.slots.prepare(spec, population_size)

    def _plan(self, grids, timing: dict[str, float]):
        """Each grid as files or resident slots (the first population the slots can serve is written
        now, into the slots ``prepare_population`` set up); returns the planned grids, the slots used
        and the mean served from them, if any."""
        resident, resident_mean, planned = None, None, []
        # The population's own mean, listed in another grid (its greedy scoring riding along), is
        # served from the slot after the members' instead of an adapter file.
        listed_elsewhere = {id(a) for _, adapters, _ in grids if not isinstance(adapters, Population)
                            for a in adapters if a is not None}
        for prompts, adapters, sampling in grids:
            slots = self.slots.for_population(adapters) if isinstance(adapters, Population) and resident is None else None
            if slots is None:
                planned.append(_PlannedGrid(prompts, sampling, adapters=materialize(adapters)))
                continue
            with_mean = id(adapters.mean) in listed_elsewhere and len(adapters) < slots.num_slots
            timing.update(slots.write(adapters.mean, adapters.members, adapters.sigmas, noise_device=adapters.noise_device,
                                      noise_scheme=adapters.noise_scheme, with_mean=with_mean))
            resident, resident_mean = slots, adapters.mean if with_mean else None
            planned.append(_PlannedGrid(prompts, sampling, slot_requests=slots.lora_requests()))
        return planned, resident, resident_mean

    def generate_grids(self, grids: Sequence[tuple[Sequence[PromptLike], AdapterList, SamplingSettings]]) -> list[CompletionTable]:
        """Several (prompts x adapters, sampling) grids in ONE engine call, e.g. a population and the
        greedy scoring of its mean adapter; returns one ``[adapter][prompt]`` table per grid. A
        :class:`Population` goes into the resident slots (written in place from its seeds) when the
        engine hosts them; every other adapter travels as a file."""
        started = time.perf_counter()
        timing: dict[str, float] = {}
        planned, resident, resident_mean = self._plan(grids, timing)
        file_adapters = [a for grid in planned if grid.adapters is not None for a in grid.adapters
                         if a is None or a is not resident_mean]
        distinct = len({id(a) for a in file_adapters if a is not None})
        if distinct > self.max_loras:
            raise ValueError(
                f"{distinct} adapters in one call but the engine holds max_loras={self.max_loras}: "
                "start the engine with max_loras >= the population size"
            )
        check_adapters(file_adapters, self.model_dir, self.max_lora_rank)
        # base requests beside adapters: the resident zero slot, else a zero adapter (see base_as_zero_adapter)
        to_write = file_adapters if resident is not None else base_as_zero_adapter(file_adapters)
        # a population and its riding mean all in resident slots: no adapter file to write
        with self.files.written(to_write) if to_write else contextlib.nullcontext([]) as written:
            if resident is not None:
                written = [resident.base_request() if r is None else r for r in written]
            by_file = iter(written)
            requests = []
            for grid in planned:
                if grid.slot_requests is not None:
                    requests.append(grid.slot_requests)
                else:
                    requests.append([resident.mean_request() if resident_mean is not None and a is resident_mean
                                     else next(by_file) for a in grid.adapters])
            timing["adapters_s"] = time.perf_counter() - started
            request_grids = [RequestGrid([self.encoder.encode(p) for p in grid.prompts], lora_requests, grid.sampling)
                             for grid, lora_requests in zip(planned, requests)]
            return run_requests(self.llm, request_grids, timing)

    def prompt_logprobs(
        self, prompt_token_ids: Sequence[Sequence[int]], completion_token_ids: Sequence[Sequence[int]], adapter: AdapterWeights | None = None
    ) -> list[list[float]]:
        """Log-prob of each completion token given its prompt, under the base model or an adapter (for KL)."""
        from vllm import SamplingParams

        check_adapters([adapter], self.model_dir, self.max_lora_rank)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        inputs = [{"prompt_token_ids": list(p) + list(c)} for p, c in zip(prompt_token_ids, completion_token_ids)]
        with self.files.written([adapter]) as (lora_request,), vllm_cpu_prompt_logprobs_fix(), \
                requests_aborted_if_cut(self.llm):
            outputs = self.llm.generate(inputs, params, lora_request=lora_request, use_tqdm=False)
        result = []
        for out, p, c in zip(outputs, prompt_token_ids, completion_token_ids):
            entries = out.prompt_logprobs[len(p) :]
            result.append([entry[token].logprob for entry, token in zip(entries, c)])
        return result

    def encode(self, prompt: PromptLike) -> list[int]:
        """Token ids of a rendered prompt."""
        return self.encoder.encode(prompt)

    # --- the model's own weights as the ES mean (es_mode full / eggroll) ----------------------------
    def resident_weights(self, target_modules, *, noise: str = "full", noise_rank: int = 1, noise_scheme: str = "flat",
                         layers_to_transform=None):
        """The engine's targeted weights, written in place (``weights.EngineWeights``)."""
        if not self.hosts_weights:
            raise ValueError("this engine cannot write the model's weights in place: it was started with adapter_transfer "
                             f"{self.sizing.adapter_transfer!r}, without the worker extension; start it with adapter_transfer "
                             "'in_place' (EngineSizing.from_config sizes a run of policy_weights full or es_mode full so)")
        return EngineWeights(self.llm, self.model_dir, target_modules, noise=noise, noise_rank=noise_rank,
                             noise_scheme=noise_scheme, layers_to_transform=layers_to_transform)

    def lowrank_slots(self, spec, num_slots: int):
        """Resident LoRA slots for EGGROLL's members (rank = noise rank, alpha = rank), beside the
        population slots, and a zero slot for base requests (the mean) in the same call."""
        if spec.rank > self.max_lora_rank:
            raise ValueError(f"noise_rank {spec.rank} exceeds the engine's max_lora_rank {self.max_lora_rank}: "
                             "start the engine with a larger max_lora_rank")
        return ResidentSlots(self.llm, spec, num_slots, self.model_dir, self.dtype, first_id=LOWRANK_SLOT_ID)

    def run_lowrank(self, slots, grids: Sequence[tuple[Sequence[PromptLike], str, SamplingSettings]]) -> list[CompletionTable]:
        """Grids served from EGGROLL's slots in ONE engine call: ``"members"`` (every written slot) or
        ``"base"`` (the zero slot: the mean, which lives in the base weights)."""
        requests = {"members": slots.lora_requests(), "base": [slots.base_request()]}
        request_grids = [RequestGrid([self.encoder.encode(p) for p in prompts], requests[which], sampling)
                         for prompts, which, sampling in grids]
        return run_requests(self.llm, request_grids, {"adapters_s": 0.0})

    def run_members(self, weights, members, sigma: float, prompts: Sequence[PromptLike], sampling: SamplingSettings,
                    score: tuple[Sequence[PromptLike], SamplingSettings] | None = None, slots=None,
                    ) -> tuple[CompletionTable, CompletionTable | None, dict[str, float]]:
        """ES members of ``weights`` (from ``resident_weights``) on ``prompts``, and ``score``'s
        prompts under the mean: one member after another (``full``; see
        ``weights.resident.MembersInPlace``), or, given EGGROLL's ``slots``, every member
        written into its slot and served with the mean's base requests in ONE engine call. Returns
        (``[member][prompt]`` table, the mean's table or None, timing in seconds)."""
        if slots is None:
            return self.run_members_one_by_one(weights, members, sigma, prompts, sampling, score)
        members = list(members)
        write_s = weights.write_slots(slots, members, sigma) if members else 0.0
        grids = [(prompts, "members", sampling)] if members else []
        if score is not None:
            grids.append((score[0], "base", score[1]))
        started = time.perf_counter()
        tables = self.run_lowrank(slots, grids) if grids else []
        timing = {"adapters_s": write_s, "generate_s": time.perf_counter() - started}
        return (tables[0] if members else CompletionTable()), (tables[-1] if score is not None else None), timing

    def close(self) -> None:
        """Shut the engine down and delete the adapter folder."""
        if getattr(self, "slots", None) is not None:
            self.slots.forget()  # the engine goes with its slots: nothing to release inside it
        if getattr(self, "files", None) is not None:
            self.files.close()
        if getattr(self, "llm", None) is None:
            return
        # An engine is set aside, not shut down, while another of the process is live (its shutdown
        # would tear down the parallel state they share); the last one to close shuts them all down,
        # with one garbage collection for all of them after.
        VLLMEngine._retired.append(self.llm)
        self.llm = None
        VLLMEngine._live_engines -= 1
        if VLLMEngine._live_engines == 0:
            with one_collection():
                while VLLMEngine._retired:
                    try:
                        VLLMEngine._retired.pop(0).llm_engine.engine_core.shutdown()
                    except Exception:
                        pass
                fresh_cuda_graph_pool()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
