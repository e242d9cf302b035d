"""Tokens per second of a LoRA population on an engine: the one measurement behind `evolm bench`,
`python -m evolm_lib.benchmark` (its subcommands) and the GPU scripts (`scripts/bench_slots.py`,
`scripts/gpu_modes.py`, `scripts/gpu_deterministic.py`).

A measurement times whole engine calls of N members x M prompts x T new tokens, EOS ignored (so
every call makes N*M*T tokens), one path after the other on the same engine:

- ``base``: the same N*M requests without an adapter;
- ``in_place``: a :class:`Population` (the mean adapter and the members' seeds), as an ES generation
  hands it over: a vLLM engine with ``adapter_transfer="in_place"`` writes the members into its
  resident LoRA slots, Ray actors each make their block of members;
- ``files``: the same members made on the host (``Population.adapters``, inside the timed call) and
  sent as N adapters, which vLLM loads from adapter files; on the HF engine, member by member;
- ``eggroll``: es_mode eggroll's population on a vLLM engine: each member's rank-``rank`` noise on
  every weight of the 7 projections, written from its seed into a resident LoRA slot (inside the
  timed call), the mean in the base weights;
- ``full``: es_mode full's population: each member's full-rank noise written into the weights of the
  7 projections, its M prompts served, the mean restored, member after member (as ES runs it).

Each path is warmed up by one short call with the same requests (it also sets the resident slots
up), then timed ``repeats`` times, every call with a new generation's seeds as ES does. A row keeps
every call; its ``tokens_per_s`` is the median call's, and ratios between rows (:func:`ratios`)
are computed from those rows only.

:func:`measure_es_overhead` times what ES adds around such a call when members travel as files:
noise and perturbation, writing the adapters, the gradient estimate and the update.
"""
from __future__ import annotations

import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from .engines import Engine, Population, SamplingSettings
from .types import Prompt

PATHS = ("base", "in_place", "files")
"""The paths a measurement takes unless told otherwise; ``eggroll`` is asked for by name (it moves the
engine's weights of the 7 projections to a path of its own on a CPU engine)."""
KNOWN_PATHS = (*PATHS, "eggroll", "full")
PATH_LABELS = {"base": "base model", "in_place": "population, in place", "files": "population, adapter files",
               "eggroll": "EGGROLL population (rank-r noise in slots)",
               "full": "full-ES population (one at a time)",
               "hf files": "population, member by member"}  # by path, or by row name where it differs
BENCH_PROMPTS = (
    "What is 17 + 25? Explain briefly.",
    "Name three colours of the rainbow.",
    "Write a haiku about the sea.",
    "Give one tip for learning to cook.",
    "What is the capital of France?",
    "Describe a cat in one sentence.",
    "Why is the sky blue?",
    "List two prime numbers above 10.",
)
# the ratios every report shows, where both rows were measured: (numerator, denominator) row names
RATIOS = (("vllm eggroll", "vllm base"), ("vllm full", "vllm base"), ("vllm in_place", "vllm base"), ("vllm files", "vllm base"), ("vllm in_place", "hf files"),
          ("vllm files", "hf files"), ("hf base", "hf files"), ("ray in_place", "ray base"), ("ray files", "ray base"))


@dataclass(frozen=True)
class ThroughputSpec:
    """What one throughput measurement generates, and how often."""

    model: str = "smollm2-135m-instruct"
    """Known model name, model folder or hub name."""
    population: int = 8
    """Members (adapters) per call."""
    prompts: int = 4
    """Prompts per member."""
    new_tokens: int = 32
    """Tokens generated per request (EOS ignored)."""
    rank: int = 1
    """LoRA rank of every member, on all 7 projections."""
    alpha: float | None = None
    """LoRA alpha; None: the rank (scale 1)."""
    init_scheme: str = "peft_default"
    """The mean adapter's init (``lora.init_adapter``): ``peft_default`` (B = 0) or ``random_ab``."""
    init_scale: float = 0.1
    """``random_ab`` only: std of A and B as a share of the base weight's mean |W|."""
    sigma: float = 1e-3
    """Noise std of the members around the mean."""
    noise_device: str = "cpu"
    """Where the members' noise is drawn (``cuda``: on the engine's GPU)."""
    repeats: int = 1
    """Timed calls per path, after one short warm-up call."""
    warmup_tokens: int = 4
    """New tokens of the warm-up call (at most ``new_tokens``)."""

    def __post_init__(self) -> None:
        for name in ("population", "prompts", "new_tokens", "rank", "repeats", "warmup_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"throughput setting {name} must be an integer >= 1, got {value!r}")
        if not self.sigma > 0:
            raise ValueError(f"throughput setting sigma must be > 0, got {self.sigma}")
        if self.noise_device not in ("cpu", "cuda"):
            raise ValueError(f"throughput setting noise_device must be 'cpu' or 'cuda', got {self.noise_device!r}")

    @property
    def requests(self) -> int:
        """Requests per call: members x prompts."""
        return self.population * self.prompts


def bench_prompts(count: int) -> list[Prompt]:
    """``count`` short chat prompts (the texts cycle when more are asked for)."""
    return [Prompt.user(BENCH_PROMPTS[i % len(BENCH_PROMPTS)]) for i in range(count)]


def mean_adapter(spec: ThroughputSpec):
    """The mean adapter every member is drawn around, on the spec's model."""
    from .lora import LoraSpec, adapter_shapes, base_weight_magnitudes, init_adapter
    from .models import resolve_model

    model_dir = resolve_model(spec.model)
    lora = LoraSpec(rank=spec.rank, alpha=float(spec.alpha if spec.alpha is not None else spec.rank))
    magnitudes = base_weight_magnitudes(model_dir, lora) if spec.init_scheme == "random_ab" else None
    return init_adapter(lora, adapter_shapes(model_dir, lora), spec.init_scheme, 0, magnitudes, spec.init_scale)


def members_of(spec: ThroughputSpec, generation: int) -> list:
    """One generation's members (seeds and signs) as ES derives them (antithetic where even)."""
    from . import es

    return es.population(0, generation, spec.population, antithetic=spec.population % 2 == 0)


def population_of(spec: ThroughputSpec, mean, generation: int) -> Population:
    """One generation's members around ``mean``."""
    return Population(mean, tuple(members_of(spec, generation)), spec.sigma, spec.noise_device)


def start_engine(spec: ThroughputSpec, where: str = "local", *, num_engines: int = 1, ray_address: str | None = None,
                 dtype: str | None = None, max_model_len: int = 512, kv_cache_gb: float | None = None,
                 adapter_transfer: str = "in_place", **vllm_options) -> Engine:
    """A vLLM engine sized for the spec's population: in this process (``where="local"``) or
    ``num_engines`` Ray actors (``where="ray"``). ``dtype`` None: bfloat16 with a GPU, float32
    without; ``vllm_options``: other ``VLLMEngine`` arguments (``enforce_eager``,
    ``lora_kernel_configs``, ...). Prefix caching is off, so repeated base prompts get no prefill
    discount that the population lacks."""
    import torch

    if where not in ("local", "ray"):
        raise ValueError(f"where must be 'local' or 'ray', got {where!r}")
    dtype = dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    vllm_options = {**vllm_options, "engine_kwargs": {"enable_prefix_caching": False, **vllm_options.get("engine_kwargs", {})}}
    common = dict(max_lora_rank=spec.rank, max_loras=spec.population, max_model_len=max_model_len, dtype=dtype,
                  kv_cache_gb=kv_cache_gb, adapter_transfer=adapter_transfer)
    if where == "ray":
        from .engines.ray.engines import RayEngines

        return RayEngines(spec.model, num_engines=num_engines, ray_address=ray_address, vllm_options=vllm_options,
                            **common)
    from .engines.vllm.engine import VLLMEngine

    return VLLMEngine(spec.model, **common, **vllm_options)


# engine -> (its EGGROLL weights, its slots), made by the first call; an engine that is gone takes
# its entry with it (an id could be reused by the next engine)
_EGGROLL: "weakref.WeakKeyDictionary[Engine, tuple]" = weakref.WeakKeyDictionary()


def eggroll_of(engine: Engine, spec: ThroughputSpec) -> tuple:
    """(resident weights, low-rank slots) of es_mode eggroll on a vLLM engine, made once per engine."""
    from .lora import ALL_PROJECTIONS, LoraSpec

    if engine not in _EGGROLL:
        weights = engine.resident_weights(ALL_PROJECTIONS, noise="lowrank", noise_rank=spec.rank)
        slots = engine.lowrank_slots(LoraSpec(rank=spec.rank, alpha=float(spec.rank)), spec.population)
        _EGGROLL[engine] = (weights, slots)
    return _EGGROLL[engine]


def release_eggroll(engine: Engine) -> None:
    """Give back an engine's EGGROLL slots and master, and es_mode full's master (before it measures
    something else)."""
    weights, slots = _EGGROLL.pop(engine, (None, None))
    if slots is not None:
        slots.close()
        weights.close()
    full = _FULL.pop(engine, None)
    if full is not None:
        full.close()


_FULL: "weakref.WeakKeyDictionary[Engine, Any]" = weakref.WeakKeyDictionary()  # engine -> es_mode full's weights


def full_weights_of(engine: Engine):
    """es_mode full's resident weights of the 7 projections on an engine, made once per engine."""
    from .lora import ALL_PROJECTIONS

    if engine not in _FULL:
        release_eggroll(engine)  # one master on the engine at a time
        _FULL[engine] = engine.resident_weights(ALL_PROJECTIONS, noise="full")
    return _FULL[engine]


def _call(engine: Engine, spec: ThroughputSpec, path: str, prompts: list[Prompt], mean, generation: int,
          sampling: SamplingSettings):
    """One engine call of a path; returns the table and the seconds spent making host adapters."""
    if path == "base":
        return engine.generate([p for _ in range(spec.population) for p in prompts], [None], sampling), 0.0
    if path == "full":
        table, _, timing = engine.run_members_one_by_one(full_weights_of(engine), members_of(spec, generation),
                                                            spec.sigma, prompts, sampling)
        table.timing.update(timing)
        return table, 0.0
    if path == "eggroll":
        full = _FULL.pop(engine, None)
        if full is not None:  # one master on the engine at a time
            full.close()
        weights, slots = eggroll_of(engine, spec)
        write_s = weights.write_slots(slots, members_of(spec, generation), spec.sigma)
        (table,) = engine.run_lowrank(slots, [(prompts, "members", sampling)])
        table.timing["slots_write_s"] = write_s
        return table, 0.0
    population = population_of(spec, mean, generation)
    if path == "in_place":
        return engine.generate(prompts, population, sampling), 0.0
    started = time.perf_counter()
    adapters = population.adapters()
    host = time.perf_counter() - started
    return engine.generate(prompts, adapters, sampling), host


def measure_throughput(engine: Engine, spec: ThroughputSpec, paths: Sequence[str] = PATHS,
                       label: str = "vllm", profile: Callable[[Callable[[], Any]], dict] | None = None,
                       interleave: bool = False) -> list[dict[str, Any]]:
    """One row per path (see the module docstring), measured on ``engine`` in the order given;
    ``label`` names the rows ("vllm base", ...); a line per row goes to stderr as it is measured.
    ``profile`` (``benchmark.kernels.profile``): one more call of each path, after the timed ones, run
    through it; what it returns is the row's ``profile``. ``interleave``: every path warmed up first,
    then one call of each path a round, ``spec.repeats`` rounds, so that a host whose speed drifts
    during the measurement slows every path alike (``paired_ratios`` compares them round by round);
    otherwise each path's calls run together."""
    unknown = [p for p in paths if p not in KNOWN_PATHS]
    if unknown:
        raise ValueError(f"unknown throughput paths {unknown}; choose from {list(KNOWN_PATHS)}")
    prompts = bench_prompts(spec.prompts)
    mean = mean_adapter(spec)
    sampling = SamplingSettings(max_new_tokens=spec.new_tokens, ignore_eos=True)
    warmup = SamplingSettings(max_new_tokens=min(spec.warmup_tokens, spec.new_tokens), ignore_eos=True)

    def timed(path: str, generation: int) -> dict[str, Any]:
        started = time.perf_counter()
        table, host_s = _call(engine, spec, path, prompts, mean, generation, sampling)
        seconds = time.perf_counter() - started
        timing = {**({"host_adapters_s": host_s} if path == "files" else {}),
                  **getattr(table, "timing", {})}  # the engine's own split, where it reports one
        return {"seconds": seconds, "tokens": table.num_tokens, "tokens_per_s": table.num_tokens / seconds,
                "timing": timing}

    def row_of(path: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        shared = set.intersection(*(set(c["timing"]) for c in calls))
        row = {"name": f"{label} {path}", "engine": label, "path": path, "requests": spec.requests,
               "tokens": statistics.median_low(c["tokens"] for c in calls),
               "seconds": statistics.median(c["seconds"] for c in calls),
               "tokens_per_s": statistics.median(c["tokens_per_s"] for c in calls),
               "best_tokens_per_s": max(c["tokens_per_s"] for c in calls),
               "timing": {key: statistics.median(c["timing"][key] for c in calls) for key in sorted(shared)},
               "calls": calls}
        if profile is not None:
            row["profile"] = profile(lambda: _call(engine, spec, path, prompts, mean, spec.repeats + 1, sampling))
        print(f"  {row['name']}: {row['tokens']} tokens a call, {row['tokens_per_s']:.1f} tok/s "
              f"(median of {len(calls)}{', interleaved' if interleave else ''})", file=sys.stderr, flush=True)
        return row

    generations = range(1, spec.repeats + 1)
    if not interleave:
        rows = []
        for path in paths:
            _call(engine, spec, path, prompts, mean, 0, warmup)
            rows.append(row_of(path, [timed(path, generation) for generation in generations]))
        return rows
    for path in paths:
        _call(engine, spec, path, prompts, mean, 0, warmup)
    calls: dict[str, list[dict[str, Any]]] = {path: [] for path in paths}
    for generation in generations:
        for path in paths:
            calls[path].append(timed(path, generation))
    return [row_of(path, calls[path]) for path in paths]


def paired_ratios(calls: Sequence[dict[str, Any]], base_calls: Sequence[dict[str, Any]]) -> list[float]:
    """Each round's tokens/s of a path over the base model's in the same round (``measure_throughput``
    with ``interleave``): the calls of one round ran back to back, so the host's drift between rounds
    cancels out of each ratio."""
    if len(calls) != len(base_calls):
        raise ValueError(f"paired_ratios: {len(calls)} calls against {len(base_calls)} of the base model")
    return [call["tokens_per_s"] / base["tokens_per_s"] for call, base in zip(calls, base_calls)]


def ratios(rows: Sequence[dict[str, Any]], pairs: Sequence[tuple[str, str]] = RATIOS) -> dict[str, float]:
    """``"a / b"``: row a's tokens/s over row b's, for every pair of names both measured."""
    rate = {row["name"]: row["tokens_per_s"] for row in rows}
    return {f"{a} / {b}": rate[a] / rate[b] for a, b in pairs if a in rate and b in rate}


def machine_info() -> dict[str, Any]:
    """CPU model, core count, vector extensions, GPU and library versions, for the record next to the numbers."""
    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = text.splitlines()
        info["cpu"] = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
        flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
        info["avx2"], info["avx512"] = "avx2" in flags, "avx512f" in flags
    except OSError:
        info["cpu"] = platform.processor()
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        import vllm

        info["vllm"] = vllm.__version__
    except Exception:  # the record is best effort
        pass
    info["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    return info


def load_average() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages (empty where the system has none)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


def throughput_report(spec: ThroughputSpec, paths: Sequence[str] = PATHS, where: str = "local",
                      engine: Engine | None = None, weight_modes: bool = False, **engine_options) -> dict[str, Any]:
    """Measure the paths on an engine started for the spec (:func:`start_engine`, closed at the end)
    or on ``engine`` (left open); returns the rows, their ratios, the engine's start time and the
    machine it ran on; with ``weight_modes`` also es_mode full's and EGGROLL's own costs on that
    engine (:func:`measure_weight_modes`). ``eggroll`` is measured after the other paths (on a CPU
    engine it moves the projections' weights to plain kernels), then ``full``."""
    paths = [p for p in paths if p not in ("eggroll", "full")] + [p for p in ("eggroll", "full") if p in paths]
    report: dict[str, Any] = {"mode": "throughput", **asdict(spec), "machine": machine_info(), "load_before": load_average(),
                              "engine": where}
    own = engine is None
    if own:
        started = time.perf_counter()
        engine = start_engine(spec, where, **engine_options)
        report["engine_start_s"] = time.perf_counter() - started
    else:
        report["engine_start_s"] = engine.start_seconds
    try:
        report["rows"] = measure_throughput(engine, spec, paths, "ray" if where == "ray" else "vllm")
        report["adapter_transfer"] = engine.adapter_transfer  # after any fall-back to files
        report["lora_kernel_configs"] = engine.lora_kernel_configs  # tuned tiles a GPU engine uses
        report["cudagraph_capture_sizes"] = engine.cudagraph_capture_sizes
        if weight_modes:
            release_eggroll(engine)
            report["weight_modes"] = measure_weight_modes(engine, spec, repeats=max(spec.repeats, 1))
    finally:
        if own:
            engine.close()
    report["ratios"] = ratios(report["rows"])
    report["load_after"] = load_average()
    return report


def format_throughput(report: dict[str, Any]) -> str:
    """A small text table of a report's rows and ratios."""
    machine = report["machine"]
    lines = [
        f"model {report['model']}: {report['population']} members (rank {report['rank']}) x {report['prompts']} prompts "
        f"x {report['new_tokens']} new tokens (EOS ignored), median of {report['repeats']} call(s) a path",
        f"machine: {machine.get('cpu', '?')}, {machine.get('cpus')} cores, AVX2 {machine.get('avx2')}, "
        f"AVX-512 {machine.get('avx512')}, GPU {machine.get('gpu')}; load average before {report['load_before']} "
        f"after {report['load_after']}",
        f"vLLM engine start ({report['engine']}) {report['engine_start_s']:.1f} s"
        + (f", HF model load {report['hf_load_s']:.1f} s" if "hf_load_s" in report else ""),
        "",
        f"{'engine':<7}{'path':<28}{'requests':>9}{'tokens':>8}{'seconds':>9}{'tok/s':>10}",
    ]
    for row in report["rows"]:
        label = PATH_LABELS.get(f"{row['engine']} {row['path']}", PATH_LABELS[row["path"]])
        lines.append(f"{row['engine']:<7}{label:<28}{row['requests']:>9}{row['tokens']:>8}"
                     f"{row['seconds']:>9.2f}{row['tokens_per_s']:>10.1f}")
    lines.append("")
    width = max((len(name) for name in report["ratios"]), default=0)
    lines.extend(f"{name:<{width}}  {value:.2f}" for name, value in report["ratios"].items())
    modes = report.get("weight_modes")
    if modes:
        lines += ["", f"the model's own weights ({modes['weights_values']:,} values of the 7 projections): EGGROLL update at "
                      f"population {modes['population']} {modes['eggroll_update_s'] * 1e3:.1f} ms; es_mode full: write a "
                      f"member {modes['full_write_s'] * 1e3:.1f} ms, restore the mean {modes['full_restore_s'] * 1e3:.1f} ms"
                      f" ({'exactly' if modes['full_restored_exactly'] else 'NOT exactly'})"]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- ES overhead


def _median_seconds(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_es_overhead(spec: ThroughputSpec, device: str = "cpu", adapter_dtype: str = "float32",
                        repeats: int = 3) -> dict[str, Any]:
    """Median seconds of what ES adds around one population call of the spec when members travel as
    files: noise + perturbation of every member, writing their adapters (to /dev/shm where it
    exists, in ``adapter_dtype``), and the gradient estimate + Adam update; the mean lives on ``device``."""
    import torch

    from . import es
    from .lora import AdapterWeights, save_adapter
    from .models import resolve_model

    model_dir = resolve_model(spec.model)
    mean = mean_adapter(spec)
    params = {name: tensor.to(device) for name, tensor in mean.tensors.items()}
    shapes = {name: tuple(t.shape) for name, t in params.items()}
    members = population_of(spec, mean, 1).members
    optimizer = es.AdamConfig(learning_rate=1e-3)
    state = es.init_optimizer_state(optimizer, params)
    rewards = torch.rand(spec.population, spec.prompts, generator=torch.Generator().manual_seed(0))  # (population, prompts)
    shm = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())

    def sync() -> None:
        if device != "cpu" or spec.noise_device != "cpu":
            torch.cuda.synchronize()

    def noise_and_perturb():
        adapters = [AdapterWeights(mean.spec, es.perturb(params, m, spec.sigma, spec.noise_device)) for m in members]
        sync()
        return adapters

    adapters = noise_and_perturb()

    def write_adapters():
        folder = Path(tempfile.mkdtemp(prefix="evolm-bench-", dir=shm))
        try:
            for i, adapter in enumerate(adapters):
                save_adapter(adapter, folder / f"a{i}", base_model=str(model_dir), dtype=getattr(torch, adapter_dtype))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def update():
        weights = es.shape_fitness("z_score", rewards)
        gradient = es.es_gradient(members, weights, shapes, spec.sigma, noise_device=spec.noise_device)
        result = es.apply_update(optimizer, state, params, gradient)  # moves the gradient to the mean's device
        sync()
        return result

    write_adapters(), update()  # warm-up
    parts = {"noise_perturb_s": _median_seconds(noise_and_perturb, repeats),
             "write_adapters_s": _median_seconds(write_adapters, repeats),
             "es_update_s": _median_seconds(update, repeats)}
    return {"mode": "es_overhead", **asdict(spec), "device": device, "num_adapter_parameters": mean.num_parameters(),
            **parts, "overhead_s": sum(parts.values())}


def measure_weight_modes(engine: Engine, spec: ThroughputSpec, repeats: int = 3) -> dict[str, Any]:
    """What es_mode full and eggroll add on the engine's own weights of the 7 projections (medians):
    EGGROLL's update from ``spec.population`` rank-``rank`` members; full mode's write of one member
    and its restore from the float32 master; each as the worker times it (the GPU synchronised)."""
    from . import es
    from .lora import ALL_PROJECTIONS

    release_eggroll(engine)
    optimizer = es.SGDConfig(learning_rate=1e-4)
    out: dict[str, Any] = {"population": spec.population, "rank": spec.rank, "repeats": repeats}
    lowrank = engine.resident_weights(ALL_PROJECTIONS, noise="lowrank", noise_rank=spec.rank)
    try:
        updates = [lowrank.step(optimizer, members_of(spec, g), [1.0] * spec.population, spec.sigma)
                   for g in range(1, repeats + 2)][1:]  # the first warms the kernels up
        out["eggroll_update_s"] = statistics.median(u["update_s"] for u in updates)
        out["weights_values"] = int(lowrank.info.get("values", 0))
    finally:
        lowrank.close()
    full = engine.resident_weights(ALL_PROJECTIONS, noise="full")
    try:
        writes, restores = [], []
        for g in range(repeats + 1):
            member = members_of(spec, g + 1)[0]
            writes.append(full.write_member(member, spec.sigma))
            restores.append(full.restore())
        out["full_write_s"] = statistics.median(writes[1:])
        out["full_restore_s"] = statistics.median(restores[1:])
        out["full_restored_exactly"] = bool(full.checksum()["restored"])
    finally:
        full.close()
    return out
