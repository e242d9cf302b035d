"""How one call is shared out over K engines, and put back together (pure: no Ray here).

A :class:`Population` is split into balanced blocks of members; its mean adapter travels once per call
(an ``AdapterRef`` into the call's shared adapters) and each engine makes its members' weights from
their seeds and signs (a ``PopulationBlock``). A list of adapters is split by adapters when it has at
least K of them, otherwise by prompts, each block keeping its requests' global prompt indices
(``ShardSampling``), so seeded sampling draws exactly what one engine would."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

from ...es import Member, Sigma
from ...lora import AdapterWeights
from ...types import PromptLike
from ..base import AdapterList, CompletionTable, Population, SamplingSettings, balanced_blocks


def plan_grid(num_adapters: int, num_prompts: int, num_engines: int, engine_max_loras: int) -> list[tuple[slice, slice]]:
    """How one (adapters x prompts) grid is shared out: ``(adapter block, prompt block)`` per engine,
    in engine order. By adapters when there are at least ``num_engines`` of them (or more than one
    engine holds); else by prompts, every engine serving all the adapters on its prompts."""
    if num_adapters == 0 or num_prompts == 0:
        return []
    if num_adapters >= num_engines or num_adapters > engine_max_loras:
        return [(block, slice(0, num_prompts)) for block in balanced_blocks(num_adapters, min(num_engines, num_adapters))]
    return [(slice(0, num_adapters), block) for block in balanced_blocks(num_prompts, min(num_engines, num_prompts))]


def plan_members(num_members: int, num_score_prompts: int, num_engines: int) -> list[tuple[int, slice, slice | None]]:
    """How ``RayEngines.run_members`` shares out members (es_mode full / eggroll) and the mean's
    scoring prompts: ``(engine, its contiguous block of members, its block of scoring prompts or
    None)`` for every engine with work, in engine order."""
    members = balanced_blocks(num_members, min(num_engines, num_members)) if num_members else []
    scores = balanced_blocks(num_score_prompts, min(num_engines, num_score_prompts)) if num_score_prompts else []
    plan = []
    for engine in range(max(len(members), len(scores))):
        block = members[engine] if engine < len(members) else slice(num_members, num_members)
        plan.append((engine, block, scores[engine] if engine < len(scores) else None))
    return plan


@dataclass(frozen=True)
class ShardSampling(SamplingSettings):
    """Sampling settings of a block of prompts that starts at global prompt index ``prompt_offset``:
    every request keeps the seed it has in the whole call."""

    prompt_offset: int = 0

    def request_seed(self, prompt_index: int) -> int | None:
        return super().request_seed(prompt_index + self.prompt_offset)


def shard_sampling(sampling: SamplingSettings, prompt_offset: int) -> SamplingSettings:
    """``sampling`` for a block of prompts starting at ``prompt_offset``."""
    if prompt_offset == 0:
        return sampling
    values = {f.name: getattr(sampling, f.name) for f in fields(SamplingSettings)}
    return ShardSampling(**values, prompt_offset=prompt_offset)


# ----------------------------------------------------------------------------- what travels


@dataclass(frozen=True)
class AdapterRef:
    """An adapter that travels once per call through the object store: index into the call's adapters."""

    index: int


@dataclass(frozen=True)
class PopulationBlock:
    """A population's block of members as it travels: its mean by reference, its seeds and signs by value."""

    mean: AdapterRef
    members: tuple[Member, ...]
    sigmas: Sigma
    noise_device: str
    noise_scheme: str


def unwire(adapters, shared: Sequence[AdapterWeights]):
    """A grid's adapters as an engine serves them: a ``PopulationBlock`` back to a ``Population``,
    references back to the call's ``shared`` adapters."""
    if isinstance(adapters, PopulationBlock):
        return Population(shared[adapters.mean.index], adapters.members, adapters.sigmas, adapters.noise_device,
                          adapters.noise_scheme)
    return [None if a is None else shared[a.index] for a in adapters]


@dataclass
class ShardPlan:
    """How one call's grids are shared out over the engines, and how their answers are put back."""

    work: list[list]
    "per engine: its (prompts, adapters by reference or a PopulationBlock, sampling) grids, run in one engine call"
    placements: list[list[tuple[int, int, slice, slice]]]
    "per grid: (engine, position in that engine's work, adapter rows, prompt columns) of each of its blocks"
    shapes: list[tuple[int, int]]
    "per grid: (adapters, prompts)"
    shared: list[AdapterWeights]
    "every distinct adapter of the call (a population's mean included), sent once through the object store"

    @classmethod
    def of(cls, grids: Sequence[tuple[Sequence[PromptLike], AdapterList, SamplingSettings]], num_engines: int,
           engine_max_loras: int) -> "ShardPlan":
        """Each grid split by ``plan_grid``: a population into blocks of members (each engine makes its
        members from their seeds), other adapters by adapters or by prompts."""
        plan = cls([[] for _ in range(num_engines)], [], [], [])
        index_of: dict[int, int] = {}

        def ref(adapter: AdapterWeights | None) -> AdapterRef | None:
            if adapter is None:
                return None
            if id(adapter) not in index_of:
                index_of[id(adapter)] = len(plan.shared)
                plan.shared.append(adapter)
            return AdapterRef(index_of[id(adapter)])

        for prompts, adapters, sampling in grids:
            prompts = list(prompts)
            population = adapters if isinstance(adapters, Population) else None
            adapters = None if population is not None else list(adapters)
            num_adapters = len(population) if population is not None else len(adapters)
            plan.shapes.append((num_adapters, len(prompts)))
            blocks = plan_grid(num_adapters, len(prompts), num_engines, engine_max_loras)
            if population is not None:
                mean = ref(population.mean)
                wired = [PopulationBlock(mean, population.members[rows], population.sigmas, population.noise_device,
                                         population.noise_scheme) for rows, _ in blocks]
            else:
                wired = [[ref(a) for a in adapters[rows]] for rows, _ in blocks]
            places = []
            for engine, ((rows, cols), wire) in enumerate(zip(blocks, wired)):
                places.append((engine, len(plan.work[engine]), rows, cols))
                plan.work[engine].append((prompts[cols], wire, shard_sampling(sampling, cols.start)))
            plan.placements.append(places)
        return plan

    def assemble(self, results: dict[int, list], timing: dict[str, float]) -> list[CompletionTable]:
        """One complete ``[adapter][prompt]`` table per grid from each engine's tables (``results[engine]``)."""
        tables = []
        for (num_adapters, num_prompts), places in zip(self.shapes, self.placements):
            rows: list[list] = [[None] * num_prompts for _ in range(num_adapters)]
            for engine, position, adapter_block, prompt_block in places:
                for row, completions in zip(range(num_adapters)[adapter_block], results[engine][position]):
                    rows[row][prompt_block] = completions
            tables.append(CompletionTable(rows, timing))
        return tables
