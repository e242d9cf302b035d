"""Full-parameter ES with several engines on one card: ``python -m evolm_lib.benchmark full-pool``.

ES in ``es_mode: full`` at Qiu et al.'s conciseness settings (arXiv 2509.24372: every weight moved,
population 30, sigma 1e-3, learning rate 5e-4, z-score fitness, the task's 2 training prompts per
member, 100 new tokens, greedy; ``deterministic`` on a GPU), run for G generations on one engine
and then on N engines that share one card (``engine_host: ray``, ``num_engines: N``,
``engines_per_gpu: N``), one count after another in this process. Each engine keeps its own copy of
the weights and float32 master and serves a contiguous block of the members; the update reaches
every engine as seeds and shaped fitness.

Per count it prints the median generation time (after the first), the engine's share of it (member
writes and decoding), the speed-up over one engine, and whether the metrics rows (every key but the
``time/`` ones) are those of the one-engine run. A count whose engines do not fit the card is
skipped with the pre-run check's reason. A count stopped before its last generation (SIGTERM, as
a time limit such as `timeout` sends it, or Ctrl-C) is reported from the rows its run wrote: its
generations so far, their times, and whether its rows are the first rows of one engine's
(``cut_short``); then the command exits.

Under CUDA's MPS (the caller points the process at a control daemon), ``--mps-thread-percentage``
gives each engine of a count above 1 a share of the card's SMs (``mps_thread_percentage``; ``auto``:
100 / N, rounded up), one option for every count or one per count (``--engines 1,8,8
--mps-thread-percentage none,none,auto``: eight engines with the whole card, then limited); the one
engine of the reference always has the whole card. A limited engine draws other noise from the same
seeds (torch's CUDA random kernels size their grid from the SMs a process sees), so its rows are
not one engine's: the table says so.

Examples::

    python -m evolm_lib.benchmark full-pool                          # SmolLM2, --engines 1,2,4,8 on a GPU
    python -m evolm_lib.benchmark full-pool --model tiny-random --engines 1,2 --generations 2 --population 4
    python -m evolm_lib.benchmark full-pool --engines 1,8,8 --mps-thread-percentage none,none,auto   # under MPS

On a CPU the engines are Ray CPU slices (one core each) and ``engines_per_gpu`` places nothing.
Speed targets are read from these ratios on a named machine (``docs/measurements.md``), never
asserted by tests.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from ..metrics import without_times
from . import int_list

QIU_CONCISENESS = dict(task="conciseness", es_mode="full", es_weights="all", sigma=1e-3, learning_rate=5e-4,
                       fitness_shaping="z_score", temperature=0.0)
"""Qiu et al.'s conciseness settings for full-parameter ES (papermill_runs/study_conciseness_smollm2_gpu.yaml's
es_modes.full); the task's 2 training prompts are every member's (prompts_per_step None)."""


def pool_config(model: str, engines: int, population: int, generations: int, new_tokens: int, gpu: bool,
                kv_cache_gb: float | None, max_model_len: int = 512, eval_every: int = 0,
                gpu_memory_utilization: float | None = None, mps_thread_percentage: int | None = None):
    """The run's settings on ``engines`` Ray engines sharing one card (a CPU slice each on a CPU)."""
    from ..config import ESConfig

    return ESConfig(model=model, **QIU_CONCISENESS, population_size=population, max_new_tokens=new_tokens,
                    max_model_len=max_model_len, num_generations=generations, eval_every=eval_every,
                    dtype="bfloat16" if gpu else "float32", deterministic=gpu, noise_device="cuda" if gpu else "cpu",
                    kv_cache_gb=kv_cache_gb, gpu_memory_utilization=gpu_memory_utilization, engine_host="ray", num_engines=engines, engines_per_gpu=engines,
                    mps_thread_percentage=mps_thread_percentage)


def thread_percentage(option: str, engines: int) -> int | None:
    """Each engine's share of the card's SMs under MPS for a count of ``engines``: ``none``, ``auto``
    (100 / engines, rounded up) or a percentage; the one engine of the reference is never limited."""
    if engines == 1 or option == "none":
        return None
    return -(-100 // engines) if option == "auto" else int(option)


def summarize(rows: list[dict]) -> dict[str, Any]:
    """Median generation time after the first generation, and the engine's share of it (member
    writes and decoding), from a run's metrics rows (row 0 is the first scoring, row 1 warms up)."""
    timed = rows[2:] or rows[1:]
    generation_s = [row["time/generation_s"] for row in timed]
    engine_s = [row.get("time/adapters_s", 0.0) + row.get("time/generate_s", 0.0) for row in timed]
    median = statistics.median(generation_s)
    return {"generation_s": median, "generation_s_each": generation_s,
            "engine_share": statistics.median(engine_s) / median if median > 0 else None,
            "update_s": statistics.median(row.get("time/update_s", 0.0) for row in timed)}


def measured(result: dict[str, Any]) -> bool:
    """Whether a count has a generation time: not skipped, and not cut short before its second generation."""
    return "generation_s" in result


def same_rows(result: dict[str, Any], reference: dict[str, Any]) -> bool:
    """Whether a count's rows are the reference's (a count cut short: the first rows of the reference's)."""
    return result["rows"] == reference["rows"][:len(result["rows"])]


def speedups(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each measured count with its speed-up over the first (one engine) and whether its rows are the
    first's (a count cut short: whether they are the first rows of the first's)."""
    reference = results[0]
    for result in results:
        if not (measured(result) and measured(reference)):
            continue
        result["speedup"] = reference["generation_s"] / result["generation_s"]
        result["rows_identical"] = same_rows(result, reference)
    return results


def count_result(config, engine, rows: list[dict]) -> dict[str, Any]:
    """A count's measurements from its run's rows (row 0 the first scoring, then one per generation)."""
    info = list(engine.engine_info)
    result = {"engines": config.num_engines, "engines_per_gpu": config.engines_per_gpu,
              "cards": len({i.get("card") for i in info if i.get("card") is not None}), "start_s": engine.start_seconds,
              "engine_start_s": [i.get("start_s") for i in info], "rows": without_times(rows),
              # what each engine's CUDA context reports under MPS: its SMs and its thread percentage
              "mps_thread_percentage": config.mps_thread_percentage, "engine_sm_count": [i.get("sm_count") for i in info]}
    if len(rows) >= 2:  # a generation to time
        result.update(summarize(rows))
    return result


def measure_count(config, folder: Path, on_cut: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """One run of ``config`` (it starts and closes its own engines): what it measured, or why it was
    skipped. Stopped before its last generation (KeyboardInterrupt, SystemExit), it gives ``on_cut``
    what its rows measured so far, before its engines close (a second signal may not wait for
    that), and lets the stop go on."""
    from ..config import ConfigError
    from ..runs import read_metrics
    from ..train.es import ESRun

    try:
        run = ESRun.create(config, folder)  # the pre-run check refuses engines that do not fit the card
    except ConfigError as error:
        return {"engines": config.num_engines, "skipped": str(error)}
    try:
        engine = run.engine
        try:
            run.run()
        except (KeyboardInterrupt, SystemExit):
            if on_cut is not None:
                rows = read_metrics(run.run_dir)
                on_cut({**count_result(config, engine, rows), "cut_short": True, "generations_done": max(len(rows) - 1, 0)})
            raise
        return count_result(config, engine, read_metrics(run.run_dir))
    finally:
        run.close()


def _free_card_memory() -> int:
    """Bytes free on this process's card (nvidia-smi's view: other processes' memory counts)."""
    import torch

    return torch.cuda.mem_get_info()[0]


def _wait_for_card(free_bytes: int, timeout_s: float = 120.0) -> None:
    """Wait until the card has ``free_bytes`` free again (or ``timeout_s`` passed: the pre-run check
    then says what is missing)."""
    deadline = time.monotonic() + timeout_s
    while _free_card_memory() < free_bytes and time.monotonic() < deadline:
        time.sleep(1.0)


def full_pool(model: str, engine_counts: Sequence[int], population: int, generations: int, new_tokens: int,
              gpu: bool, kv_cache_gb: float | None, gpu_memory_utilization: float | None = None,
              workdir: str | Path | None = None, mps_thread_percentage: str | Sequence[str] = "none",
              on_count: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Every count's measurements in turn, the first count (1) the reference (see the module docstring);
    ``mps_thread_percentage``: ``thread_percentage``'s option for every count, or one per count;
    ``on_count`` is given the results so far after each count (a run cut short keeps them). The run
    folders go to a temporary folder, removed at the end, or under ``workdir``, where they are kept."""
    options = [mps_thread_percentage] if isinstance(mps_thread_percentage, str) else list(mps_thread_percentage)
    if len(options) == 1:
        options *= len(engine_counts)
    if len(options) != len(engine_counts):
        raise ValueError(f"mps_thread_percentage: {len(options)} options for {len(engine_counts)} engine counts")
    from ..engines.ray.cluster import import_ray

    ray = import_ray()
    owns_ray = not ray.is_initialized()
    if owns_ray:  # one card: the engines of every count share it
        ray.init(num_gpus=1 if gpu else 0, include_dashboard=False, logging_level=logging.WARNING)
    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="evolm-full-pool-", dir=workdir))
    results = []
    free_at_start = _free_card_memory() if gpu else None

    def keep(cut: dict[str, Any]) -> None:  # a count stopped before its end: what it measured, then the stop goes on
        results.append(cut)
        print(format_row(cut, results[0]), flush=True)
        if on_count is not None:
            on_count(speedups(results))

    try:
        for engines, option in zip(engine_counts, options):
            if free_at_start is not None:  # the last count's engines end with their actors, after close returns
                _wait_for_card(free_at_start - 2 * 2**30)
            config = pool_config(model, engines, population, generations, new_tokens, gpu, kv_cache_gb,
                                 gpu_memory_utilization=gpu_memory_utilization,
                                 mps_thread_percentage=thread_percentage(option, engines))
            share = config.mps_thread_percentage
            results.append(measure_count(config, folder / f"engines_{engines}{f'_sm{share}' if share else ''}", on_cut=keep))
            if "skipped" in results[0]:
                raise SystemExit(f"full-pool: one engine does not fit, nothing to compare with: {results[0]['skipped']}")
            print(format_row(results[-1], results[0]), flush=True)
            if on_count is not None:
                on_count(speedups(results))
    finally:
        if workdir is None:
            shutil.rmtree(folder, ignore_errors=True)
        if owns_ray:
            ray.shutdown()
    return speedups(results)


def format_row(result: dict[str, Any], reference: dict[str, Any]) -> str:
    """One count as a line of the table (its speed-up and rows against ``reference``)."""
    if "skipped" in result:
        return f"{result['engines']:>7}  skipped: {result['skipped']}"
    cut = f"  (cut short after {result['generations_done']} generations)" if result.get("cut_short") else ""
    start = f"{result['start_s']:>9.1f}" if result.get("start_s") is not None else f"{'-':>9}"
    if not (measured(result) and measured(reference)):
        return f"{result['engines']:>7}{result['cards']:>6}{start}  no generation to time{cut}"
    speedup = reference["generation_s"] / result["generation_s"]
    same = "(reference)" if result is reference else ("yes" if same_rows(result, reference) else "NO")
    share = f"  ({result['mps_thread_percentage']} % of the SMs each)" if result.get("mps_thread_percentage") else ""
    return (f"{result['engines']:>7}{result['cards']:>6}{start}{result['generation_s']:>13.3f}"
            f"{100 * (result['engine_share'] or 0):>12.1f}%{speedup:>9.2f}x  {same}{share}{cut}")


HEADER = (f"{'engines':>7}{'cards':>6}{'start s':>9}{'generation s':>13}{'engine share':>13}{'speed-up':>9}  same rows\n"
          "(generation s: median after the first; engine share: member writes and decoding; same rows: every "
          "metrics key but time/ equal to 1 engine's)")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure, print the table, optionally write JSON; returns the results."""
    import torch

    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="python -m evolm_lib.benchmark full-pool", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="known name or model folder")
    parser.add_argument("--engines", default="1,2,4,8" if gpu else "1,2",
                        help="engine counts on the one card, starting with 1 (the reference)")
    parser.add_argument("--generations", type=int, default=10 if gpu else 3, help="ES generations per count (>= 2)")
    parser.add_argument("--population", type=int, default=30 if gpu else 4, help="members (Qiu et al.: 30)")
    parser.add_argument("--new-tokens", type=int, default=100 if gpu else 8, help="tokens per completion (Qiu et al.: 100)")
    parser.add_argument("--kv-cache-gb", type=float, default=None if gpu else 0.0625,
                        help="fixed KV cache per engine (default: from each engine's memory share on a GPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="each engine's share of the card (default: 0.6 / engines on the card)")
    parser.add_argument("--mps-thread-percentage", default="none",
                        help="under CUDA's MPS, each engine's share of the card's SMs for counts above 1: none, auto "
                             "(100 / engines) or a percentage from 1 to 100; one for every count, or one per count")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep each count's run folder under this folder (a count cut short keeps its metrics rows)")
    args = parser.parse_args(argv)
    counts = int_list(parser, args.engines, "engines")
    if counts[0] != 1:
        parser.error(f"--engines must start with 1 (the reference), got {args.engines!r}")
    shares = args.mps_thread_percentage.split(",")
    for share in shares:
        if share not in ("none", "auto") and not (share.isdigit() and 1 <= int(share) <= 100):
            parser.error(f"--mps-thread-percentage must be none, auto or a percentage from 1 to 100, got {share!r}")
    if len(shares) not in (1, len(counts)):
        parser.error(f"--mps-thread-percentage: one option, or one per engine count ({len(counts)}), got {len(shares)}")
    if args.generations < 2:
        parser.error("--generations must be >= 2 (the first warms the engines up)")
    if args.population < max(counts) or args.population % 2:
        parser.error(f"--population must be even and at least the largest engine count ({max(counts)})")
    from ..env import apply_engine_defaults

    apply_engine_defaults()
    settings = {"model": args.model, "population": args.population, "generations": args.generations,
                "new_tokens": args.new_tokens, "gpu": gpu, "device": torch.cuda.get_device_name() if gpu else "cpu",
                "mps_thread_percentage": args.mps_thread_percentage,
                # the engines share the card through CUDA MPS where the caller pointed them at a daemon
                "cuda_mps_pipe_directory": os.environ.get("CUDA_MPS_PIPE_DIRECTORY")}

    def report(results: list[dict[str, Any]]) -> dict[str, Any]:
        result = {"settings": settings, "counts": [{k: v for k, v in r.items() if k != "rows"} for r in results]}
        if args.json:  # written after every count, so a run cut short keeps what it measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1))
        return result

    def stop(signum, frame):  # a time limit (`timeout`) sends SIGTERM: stop as Ctrl-C would, keeping the rows
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    print(HEADER, flush=True)
    try:
        results = full_pool(args.model, counts, args.population, args.generations, args.new_tokens, gpu,
                            args.kv_cache_gb, args.gpu_memory_utilization, workdir=args.workdir,
                            mps_thread_percentage=shares, on_count=report)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print("speed-ups over 1 engine: " + ", ".join(f"{r['engines']}: {r['speedup']:.2f}x" for r in results if "speedup" in r))
    return report(results)
