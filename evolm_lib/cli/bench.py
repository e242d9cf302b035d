"""Throughput of a LoRA population on one machine: vLLM multi-LoRA vs the base model vs HF + peft.

Measures, in one process and one run, tokens per second for

(a) vLLM population: N adapters x M prompts in ONE engine call (fixed output length, EOS ignored);
(b) vLLM base model: the same N*M requests without adapters, on the same engine;
(c) HF + peft member by member: one adapter at a time, its M prompts batched (the paper's reference
    code does this);
(d) HF batched base model: the N*M requests in one batch (optional).

Each path is warmed up once (a short call with the same requests) before it is timed; engine start
and model load are reported separately. Adapters are rank-``--rank`` LoRAs on all 7 projections:
a PEFT-default init (B = 0) perturbed with seeded noise (``es.member_noise`` via ``es.perturb``).
Prefix caching is off, so repeated base prompts do not get a prefill discount the population lacks.

``--es-overhead`` instead measures, for one ES generation at population 30: noise generation +
perturbation, writing every adapter (``save_adapter`` to /dev/shm), and an ES update
(``es.es_gradient`` + ``es.apply_update``), against the generation time of one population call.

Examples::

    evolm bench                         # SmolLM2, 8 adapters x 4 prompts x 32 tokens
    evolm bench --model tiny-random --population 4 --prompts 2 --new-tokens 8 --no-hf
    evolm bench --es-overhead           # population 30 on SmolLM2
    evolm bench --json results/throughput.json

On a busy machine OpenMP threads that spin while waiting slow HF generation down many times over,
so the command makes them sleep (``OMP_WAIT_POLICY=PASSIVE``, ``evolm_lib.env``) unless the environment
says otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from ..env import apply_engine_defaults

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
WARMUP_TOKENS = 4


def machine_info() -> dict[str, Any]:
    """CPU model, core count, vector extensions and load, for the record next to the numbers."""
    info: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
        flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
        info["cpu"] = model
        info["avx2"] = "avx2" in flags
        info["avx512"] = "avx512f" in flags
    except OSError:
        info["cpu"] = platform.processor()
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # the record is best effort
        pass
    info["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    return info


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


def make_prompts(count: int):
    """`count` short chat prompts (cycled if more are asked than there are texts)."""
    from ..types import Prompt

    return [Prompt.user(BENCH_PROMPTS[i % len(BENCH_PROMPTS)]) for i in range(count)]


def make_population(model_dir: Path, population_size: int, rank: int, sigma: float = 1e-3, antithetic: bool = False):
    """Members, the mean adapter and the perturbed member adapters (rank-`rank` on all 7 projections)."""
    from .. import es
    from ..lora import AdapterWeights, LoraSpec, adapter_shapes, init_adapter

    spec = LoraSpec(rank=rank)
    mean = init_adapter(spec, adapter_shapes(model_dir, spec), "peft_default", seed=0)
    members = es.population(0, 0, population_size, antithetic=antithetic)
    adapters = [AdapterWeights(spec, es.perturb(dict(mean.tensors), member, sigma)) for member in members]
    return members, mean, adapters


def _count_tokens(rows) -> int:
    return sum(c.num_tokens for row in rows for c in row)


def _timed(label: str, call, requests: int) -> dict[str, Any]:
    """Run `call` once, return seconds, generated tokens and tokens/s."""
    started = time.perf_counter()
    rows = call()
    seconds = time.perf_counter() - started
    tokens = _count_tokens(rows)
    print(f"  {label}: {tokens} tokens in {seconds:.1f} s", file=sys.stderr, flush=True)
    return {"path": label, "requests": requests, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            **getattr(rows, "timing", {})}  # the engine's own split, where it reports one


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Measure paths (a)-(d) and return a flat result dict."""
    from ..engines import Population, SamplingSettings
    from ..engines.hf_engine import HFEvaluator
    from ..engines.vllm_engine import VLLMEvaluator
    from ..models import resolve_model

    model_dir = resolve_model(args.model)
    n, m = args.population, args.prompts
    prompts = make_prompts(m)
    members, mean, adapters = make_population(model_dir, n, args.rank)
    population = Population(mean, tuple(members), 1e-3)  # the same members, made inside the engine
    sampling = SamplingSettings(max_new_tokens=args.new_tokens, ignore_eos=True)
    warmup = SamplingSettings(max_new_tokens=min(WARMUP_TOKENS, args.new_tokens), ignore_eos=True)
    result: dict[str, Any] = {
        "mode": "throughput", "model": args.model, "population": n, "prompts": m, "new_tokens": args.new_tokens,
        "rank": args.rank, "machine": machine_info(), "load_before": _load(), "rows": [],
    }
    rows = result["rows"]

    started = time.perf_counter()
    vllm = VLLMEvaluator(
        model_dir, max_loras=n, max_lora_rank=args.rank, max_model_len=args.max_model_len,
        engine_kwargs={"enable_prefix_caching": False},
    )
    result["vllm_engine_start_s"] = time.perf_counter() - started
    try:
        vllm.generate(prompts, adapters, warmup)
        rows.append(_timed("vllm_population", lambda: vllm.generate(prompts, adapters, sampling), n * m))
        vllm.generate(prompts, population, warmup)  # sets the resident slots up
        rows.append(_timed("vllm_population_in_place", lambda: vllm.generate(prompts, population, sampling), n * m))
        base_prompts = [p for _ in range(n) for p in prompts]
        vllm.generate(base_prompts, [None], warmup)
        rows.append(_timed("vllm_base", lambda: vllm.generate(base_prompts, [None], sampling), n * m))
    finally:
        vllm.close()

    if args.hf:
        started = time.perf_counter()
        hf = HFEvaluator(model_dir, batch_size=m)
        result["hf_load_s"] = time.perf_counter() - started
        try:
            if args.hf_batched_base:  # before any adapter, while the model is not wrapped by peft
                hf.batch_size = n * m
                base_prompts = [p for _ in range(n) for p in prompts]
                hf.generate(base_prompts, [None], warmup)
                rows.append(_timed("hf_batched_base", lambda: hf.generate(base_prompts, [None], sampling), n * m))
            if args.hf_member_by_member:
                hf.batch_size = m
                hf.generate(prompts, adapters[:1], warmup)
                rows.append(_timed("hf_member_by_member", lambda: hf.generate(prompts, adapters, sampling), n * m))
        finally:
            hf.close()

    by_path = {r["path"]: r["tokens_per_s"] for r in rows}
    result["ratio_population_over_base_vllm"] = by_path["vllm_population"] / by_path["vllm_base"]
    result["ratio_in_place_over_base_vllm"] = by_path["vllm_population_in_place"] / by_path["vllm_base"]
    if "hf_member_by_member" in by_path:
        result["ratio_vllm_population_over_hf_member_by_member"] = by_path["vllm_population"] / by_path["hf_member_by_member"]
    result["load_after"] = _load()
    return result


def _median_seconds(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run_es_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Time one generation's ES bookkeeping against its population generate call."""
    import torch

    from .. import es
    from ..engines import SamplingSettings
    from ..engines.vllm_engine import VLLMEvaluator
    from ..lora import AdapterWeights, save_adapter
    from ..models import resolve_model

    model_dir = resolve_model(args.model)
    n, m, sigma = args.population, args.prompts, 1e-3
    members, mean, adapters = make_population(model_dir, n, args.rank, sigma, antithetic=n % 2 == 0)
    shapes = {name: tuple(t.shape) for name, t in mean.tensors.items()}
    params = dict(mean.tensors)
    optimizer = es.AdamConfig(learning_rate=1e-3)
    state = es.init_optimizer_state(optimizer, params)
    rewards = torch.rand(n, m, generator=torch.Generator().manual_seed(0))  # (population, prompts)
    shm = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())

    def noise_and_perturb():
        return [AdapterWeights(mean.spec, es.perturb(params, member, sigma)) for member in members]

    def write_adapters():
        folder = Path(tempfile.mkdtemp(prefix="evolm-bench-", dir=shm))
        try:
            for i, adapter in enumerate(adapters):
                save_adapter(adapter, folder / f"a{i}", base_model=str(model_dir))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def update():
        weights = es.shape_fitness("z_score", rewards)
        gradient = es.es_gradient(members, weights, shapes, sigma)
        return es.apply_update(optimizer, state, params, gradient)

    repeats = 3
    noise_and_perturb(), write_adapters(), update()  # warm-up
    parts = {
        "noise_perturb_s": _median_seconds(noise_and_perturb, repeats),
        "write_adapters_s": _median_seconds(write_adapters, repeats),
        "es_update_s": _median_seconds(update, repeats),
    }
    overhead = sum(parts.values())

    prompts = make_prompts(m)
    sampling = SamplingSettings(max_new_tokens=args.new_tokens, ignore_eos=True)
    started = time.perf_counter()
    vllm = VLLMEvaluator(
        model_dir, max_loras=n, max_lora_rank=args.rank, max_model_len=args.max_model_len,
        engine_kwargs={"enable_prefix_caching": False},
    )
    engine_start = time.perf_counter() - started
    try:
        vllm.generate(prompts, adapters, SamplingSettings(max_new_tokens=min(WARMUP_TOKENS, args.new_tokens), ignore_eos=True))
        row = _timed("vllm_population", lambda: vllm.generate(prompts, adapters, sampling), n * m)
        generation = row["generate_s"]
    finally:
        vllm.close()
    return {
        "mode": "es_overhead", "model": args.model, "population": n, "prompts": m, "new_tokens": args.new_tokens,
        "rank": args.rank, "num_adapter_parameters": mean.num_parameters(), "machine": machine_info(),
        "vllm_engine_start_s": engine_start, **parts, "overhead_s": overhead, "generation_s": generation,
        "generation_tokens_per_s": row["tokens"] / generation, "overhead_percent": 100 * overhead / generation,
        "load_after": _load(),
    }


def format_throughput(result: dict[str, Any]) -> str:
    """A small text table of the throughput rows and the two ratios."""
    mach = result["machine"]
    lines = [
        f"model {result['model']}: {result['population']} adapters (rank {result['rank']}) x {result['prompts']} prompts "
        f"x {result['new_tokens']} new tokens (EOS ignored)",
        f"machine: {mach.get('cpu', '?')}, {mach.get('cpus')} cores, AVX2 {mach.get('avx2')}, AVX-512 {mach.get('avx512')}; "
        f"load average before {result['load_before']} after {result['load_after']}",
        f"vLLM engine start {result['vllm_engine_start_s']:.1f} s"
        + (f", HF model load {result['hf_load_s']:.1f} s" if "hf_load_s" in result else ""),
        "",
        f"{'path':<26}{'requests':>9}{'tokens':>8}{'seconds':>9}{'tok/s':>8}",
    ]
    for row in result["rows"]:
        lines.append(f"{row['path']:<26}{row['requests']:>9}{row['tokens']:>8}{row['seconds']:>9.1f}{row['tokens_per_s']:>8.1f}")
    lines.append("")
    lines.append(f"vLLM population (files) / vLLM base:  {result['ratio_population_over_base_vllm']:.2f}")
    lines.append(f"vLLM population (in place) / base:    {result['ratio_in_place_over_base_vllm']:.2f}")
    if "ratio_vllm_population_over_hf_member_by_member" in result:
        lines.append(f"vLLM population / HF member by member: {result['ratio_vllm_population_over_hf_member_by_member']:.2f}")
    return "\n".join(lines)


def format_es_overhead(result: dict[str, Any]) -> str:
    """The ES bookkeeping times next to the generation time."""
    mach = result["machine"]
    return "\n".join(
        [
            f"model {result['model']}: population {result['population']} (rank {result['rank']}, "
            f"{result['num_adapter_parameters']} adapter parameters) x {result['prompts']} prompts x {result['new_tokens']} tokens",
            f"machine: {mach.get('cpu', '?')}, {mach.get('cpus')} cores; load average after {result['load_after']}",
            f"noise + perturbation     {result['noise_perturb_s']:8.3f} s",
            f"write adapters (/dev/shm){result['write_adapters_s']:8.3f} s",
            f"ES update (grad + Adam)  {result['es_update_s']:8.3f} s",
            f"overhead total           {result['overhead_s']:8.3f} s",
            f"generation (one call)    {result['generation_s']:8.3f} s  ({result['generation_tokens_per_s']:.1f} tok/s)",
            f"overhead / generation    {result['overhead_percent']:8.2f} %",
        ]
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="evolm bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="known name, model folder or hub name")
    parser.add_argument("--population", type=int, default=None, help="adapters per call (default 8; 30 with --es-overhead)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per adapter")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per request (EOS ignored)")
    parser.add_argument("--rank", type=int, default=1, help="LoRA rank of every adapter")
    parser.add_argument("--max-model-len", type=int, default=512, help="vLLM context length")
    parser.add_argument("--hf-member-by-member", action=argparse.BooleanOptionalAction, default=True,
                        help="time HF + peft one adapter at a time")
    parser.add_argument("--hf-batched-base", action=argparse.BooleanOptionalAction, default=True,
                        help="time HF on the base model with all requests in one batch")
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip every HF path")
    parser.add_argument("--es-overhead", action="store_true", help="measure ES bookkeeping vs one generation instead")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.population is None:
        args.population = 30 if args.es_overhead else 8
    for name in ("population", "prompts", "new_tokens", "rank"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the table, optionally write JSON; returns the result dict."""
    args = parse_args(argv)
    apply_engine_defaults()
    if args.es_overhead:
        result = run_es_overhead(args)
        print(format_es_overhead(result))
    else:
        result = run_throughput(args)
        print(format_throughput(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return result
