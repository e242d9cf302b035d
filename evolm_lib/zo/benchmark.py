"""Time one step of every zeroth-order estimator on the CPU, beside the cmaes library's own loop.

    python -m evolm_lib.zo.benchmark [--dimension 10000] [--num-queries 100] [--repeats 3]
                                     [--function quadratic] [--estimators es,zoar,...]

A step is what one generation costs in the testbed: drawing the seeded directions, the queries
(batched function evaluations), the estimate and the update rule (radazo). Estimators that keep a
history are warmed up until their buffer is full, so the time is the steady state. The cmaes row
runs the library's documented loop (ask one point, evaluate it in numpy, tell the population).
Both wall-clock and CPU (process) time are given: on a shared machine the CPU time is the steadier.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from typing import Callable

import numpy as np
import torch

from evolm_lib.zo.estimators import ESTIMATORS, EstimatorConfig, get_estimator, make_searcher, queries_per_step
from evolm_lib.zo.functions import check_dimension, get_function, start_point
from evolm_lib.zo.run import CountingObjective
from evolm_lib.zo.updates import UpdateConfig, apply_update, init_update_state


def _median_seconds(step: Callable[[], None], repeats: int) -> tuple[float, float]:
    """Median wall-clock and median CPU seconds of `repeats` calls."""
    wall, cpu = [], []
    for _ in range(repeats):
        started, started_cpu = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    return statistics.median(wall), statistics.median(cpu)


def time_estimator(name: str, function: str, dimension: int, num_queries: int, repeats: int = 3) -> dict[str, float | str]:
    """Median seconds of one step of `name` (after warm-up), with its queries per step."""
    config = EstimatorConfig(name, num_queries=num_queries)
    update = UpdateConfig()
    test_function = get_function(function)
    objective = CountingObjective(test_function, dimension, gradient_cost=num_queries)
    searcher = make_searcher(config, seed=0)
    x = start_point(dimension, 0)
    holder = {"x": x, "state": searcher.init(x), "update": init_update_state(update, x)}

    def step() -> None:
        outcome = searcher.step(objective, holder["x"], holder["state"])
        holder["state"] = outcome.state
        if outcome.x is not None:
            holder["x"] = outcome.x
        else:
            holder["x"], holder["update"] = apply_update(update, holder["update"], holder["x"], outcome.gradient)

    warm_up = 1 + (config.num_histories if get_estimator(name).uses_history else 0)
    for _ in range(warm_up):
        step()
    seconds, cpu_seconds = _median_seconds(step, repeats)
    return {"estimator": name, "seconds": seconds, "cpu_seconds": cpu_seconds, "queries": queries_per_step(config),
            "note": get_estimator(name).summary}


def time_cmaes_loop(dimension: int, population_size: int, repeats: int = 3) -> dict[str, float | str]:
    """Median seconds of one generation of cmaes.SepCMA's own ask/evaluate/tell loop on 0.5 |x|^2 in numpy."""
    from cmaes import SepCMA

    optimizer = SepCMA(mean=start_point(dimension, 0).numpy(), sigma=0.05, population_size=population_size, seed=0)

    def step() -> None:
        solutions = []
        for _ in range(optimizer.population_size):
            x = optimizer.ask()
            solutions.append((x, 0.5 * float(np.dot(x, x))))
        optimizer.tell(solutions)

    step()
    seconds, cpu_seconds = _median_seconds(step, repeats)
    return {"estimator": "cmaes.SepCMA loop", "seconds": seconds, "cpu_seconds": cpu_seconds, "queries": population_size,
            "note": "the cmaes library alone: ask, numpy quadratic per point, tell"}


def format_table(rows: list[dict[str, float | str]]) -> str:
    """Plain-text table: estimator, wall and CPU ms per step, queries per step, CPU microseconds per query, note."""
    lines = [f"{'estimator':<18} {'wall ms':>9} {'cpu ms':>9} {'queries':>8} {'cpu us/query':>13}  note"]
    for row in rows:
        wall, cpu = float(row["seconds"]), float(row["cpu_seconds"])
        lines.append(f"{row['estimator']:<18} {wall * 1e3:>9.1f} {cpu * 1e3:>9.1f} {row['queries']:>8} "
                     f"{cpu * 1e6 / float(row['queries']):>13.1f}  {row['note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: print the table."""
    parser = argparse.ArgumentParser(prog="python -m evolm_lib.zo.benchmark", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dimension", type=int, default=10_000)
    parser.add_argument("--num-queries", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--function", default="quadratic")
    parser.add_argument("--estimators", default=",".join(ESTIMATORS), help="comma-separated names")
    args = parser.parse_args(argv)
    try:
        check_dimension(args.dimension, get_function(args.function))
        names = [name.strip() for name in args.estimators.split(",") if name.strip()]
        for name in names:
            get_estimator(name)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"one step at d = {args.dimension:,}, {args.num_queries} queries, {args.function}, float64, "
          f"median of {args.repeats}; torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{platform.processor() or platform.machine()}")
    rows = []
    for name in names:
        rows.append(time_estimator(name, args.function, args.dimension, args.num_queries, args.repeats))
        print(format_table(rows[-1:]).splitlines()[1], flush=True)
    rows.append(time_cmaes_loop(args.dimension, args.num_queries, args.repeats))
    print()
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
