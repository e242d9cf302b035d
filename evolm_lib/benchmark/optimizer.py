"""SGD and Adam on one flat float32 master: the library's updates against ``torch.optim``'s functional
forms and the textbook formulas: ``python -m evolm_lib.benchmark optimizer``.

For each size (``--sizes``: a LoRA mean of SmolLM2 at rank 8 is 4.9M values, SmolLM2-135M's weights
135M, EGGROLL's 7 projections of a 1.5B model 1.31B) and each optimizer (plain SGD, SGD with
momentum 0.9, Adam, Adam with decoupled weight decay), the median seconds of one ascent step by:

``textbook-whole``     the formulas term by term in plain tensor operations, on the whole vector,
                       into new tensors (a new master and moments, as ``apply_update`` returns);
``textbook-in-place``  the same, chunk by chunk, written back into the state's buffers, with the L2
                       norm of the master's change (``apply_update_in_place``'s contract; the
                       reference of the ratios);
``whole``              ``es.apply_update``;
``in_place``           ``es.apply_update_in_place``;
``torch``, ``torch-foreach``, ``torch-fused``
                       ``torch.optim.sgd.sgd`` / ``torch.optim.adam.adam`` with ``foreach=False``,
                       ``foreach=True`` or ``fused=True`` (where torch has fused kernels for the
                       device) on the same chunks of the same buffers, with the same norm (the
                       chunk's old values kept aside, subtracted after).

torch.optim descends: it is handed the ascent gradient and the negated learning rate, so its moment
buffers hold averages of the ascent gradient (the form checkpoints keep) and no negated copy of the
gradient is made (``maximize=True`` makes one outside the fused kernels); decoupled weight decay is
the master's ``mul_(1 - learning_rate * weight_decay)`` before the step, as ``torch.optim.AdamW``
does it. Paths are timed round by round, one call of each a round (``--repeats`` rounds after one
to warm up), all on one state per optimizer, so a machine whose speed drifts slows every path
alike. A size whose buffers do not fit in the device's free memory is skipped (the whole-vector
paths alone where only their temporaries do not fit).

Each path is also checked on a small master (3 steps): whether it gives the same bits with the
gradient cut into chunks of 1,000 and of 7 values as in one chunk (``apply_update_in_parts``
promises this), and its largest difference from ``textbook-in-place`` over the largest change.

Examples::

    python -m evolm_lib.benchmark optimizer --device cpu --sizes 4.9M,135M
    python -m evolm_lib.benchmark optimizer --device cuda --json optimizer.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any, Callable, Sequence

import torch

from .. import es
from ..es.optimizers import IN_PLACE_CHUNK

OPTIMIZERS = {"sgd": es.SGDConfig(1e-3), "sgd-momentum": es.SGDConfig(1e-3, momentum=0.9),
              "adam": es.AdamConfig(1e-3), "adamw": es.AdamConfig(1e-3, weight_decay=0.01)}
"""name -> the optimizer it times (the learning rate only scales the step)."""
TORCH_FORMS = {"torch": {"foreach": False, "fused": False}, "torch-foreach": {"foreach": True, "fused": False},
               "torch-fused": {"foreach": False, "fused": True}}
"""torch path -> the keyword arguments of torch.optim's functional form."""
REFERENCE = "textbook-in-place"
SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9}
Step = Callable[[es.OptimizerConfig, int, torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"], None]


def parse_size(text: str) -> int:
    """'4.9M' -> 4,900,000; '1.31B' -> 1,310,000,000; '135000000' as it is."""
    text = text.strip().lower().replace("_", "").replace(",", "")
    scale = SUFFIXES.get(text[-1:], 1)
    value = float(text[:-1] if scale > 1 else text)
    if not value >= 1:
        raise ValueError(f"a size must be >= 1 value, got {text!r}")
    return int(round(value * scale))


def fused_devices() -> list[str]:
    """Device types torch.optim has fused kernels for in the installed torch."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return list(_get_fused_kernels_supported_devices())


def textbook_in_place(config: es.OptimizerConfig, step: int, theta: torch.Tensor, g: torch.Tensor,
                      first: torch.Tensor | None, second: torch.Tensor | None) -> torch.Tensor:
    """``es.formulas_step`` on one chunk, written back into its buffers; the float64 norm of the change."""
    new, m, v = es.formulas_step(config, step, theta, g, first, second)
    norm = torch.linalg.vector_norm(new.sub(theta), dtype=torch.float64)
    theta.copy_(new)
    for buffer, value in ((first, m), (second, v)):
        if value is not None:
            buffer.copy_(value)
    return norm


def torch_step(form: dict[str, bool]) -> Step:
    """One ascent step of torch.optim's functional form ``form`` on chunk tensors, in place."""
    from torch.optim.adam import adam
    from torch.optim.sgd import sgd

    def step_(config, step, theta, g, first, second) -> None:
        if config.weight_decay:  # decoupled, from the pre-step master (torch.optim.AdamW's order)
            theta.mul_(1 - config.learning_rate * config.weight_decay)
        if isinstance(config, es.AdamConfig):
            # torch counts the step up before using it; fused kernels read it on the device
            steps = [torch.full((), step - 1, dtype=torch.float32, device=theta.device if form["fused"] else "cpu")]
            adam([theta], [g], [first], [second], [], steps, amsgrad=False, beta1=config.beta1, beta2=config.beta2,
                 lr=-config.learning_rate, weight_decay=0.0, eps=config.eps, maximize=False, **form)
        else:
            sgd([theta], [g], [first], weight_decay=0.0, momentum=config.momentum, lr=-config.learning_rate,
                dampening=0.0, nesterov=False, maximize=False, **form)

    return step_


def in_chunks(chunk_step: Callable, own_norm: bool = False) -> Callable:
    """``(config, state, gradient, chunk) -> state``: ``chunk_step`` over the state's flat
    buffers ``chunk`` values at a time; the norm of a chunk's change is the step's own
    (``own_norm``) or from the chunk's old values kept aside."""
    def update(config, state, gradient, chunk=IN_PLACE_CHUNK):
        theta = state.master.flat
        first = state.first_moment.flat if state.first_moment else None
        second = state.second_moment.flat if state.second_moment else None
        old = torch.empty(0 if own_norm else min(chunk, theta.numel()), dtype=torch.float32, device=theta.device)
        norms = []
        for start in range(0, theta.numel(), chunk):
            part = slice(start, min(start + chunk, theta.numel()))
            kept = old[:part.stop - start]
            if not own_norm:
                kept.copy_(theta[part])
            norm = chunk_step(config, state.step + 1, theta[part], gradient[part],
                              first[part] if first is not None else None, second[part] if second is not None else None)
            norms.append(norm if own_norm else torch.linalg.vector_norm(kept.sub_(theta[part]), dtype=torch.float64))
        advanced = es.OptimizerState(state.step + 1, state.master, state.first_moment, state.second_moment)
        float(torch.linalg.vector_norm(torch.stack(norms)))  # the norm is part of the contract timed
        return advanced

    return update


def paths(device: str) -> dict[str, Callable]:
    """path name -> ``(config, state, gradient, chunk) -> state``."""
    def textbook_whole(config, state, gradient, chunk=None):
        flat = lambda buffers: buffers.flat if buffers else None  # noqa: E731
        new, m, v = es.formulas_step(config, state.step + 1, state.master.flat, gradient, flat(state.first_moment),
                             flat(state.second_moment))
        layout = state.master.layout
        return es.OptimizerState(state.step + 1, es.FlatParams(new, layout), es.FlatParams(m, layout) if m is not None
                                 else {}, es.FlatParams(v, layout) if v is not None else {})

    def whole(config, state, gradient, chunk=None):
        return es.apply_update(config, state, state.master, es.FlatParams(gradient, state.master.layout))[1]

    def in_place(config, state, gradient, chunk=IN_PLACE_CHUNK):
        return es.apply_update_in_place(config, state, gradient, chunk)[0]

    table = {"textbook-whole": textbook_whole, REFERENCE: in_chunks(textbook_in_place, own_norm=True), "whole": whole,
             "in_place": in_place}
    for name, form in TORCH_FORMS.items():
        if not form["fused"] or device in fused_devices():
            table[name] = in_chunks(torch_step(form))
    return table


def check_bits(config: es.OptimizerConfig, device: str, size: int = 10_007) -> dict[str, dict[str, Any]]:
    """Per path: the same bits with the gradient in chunks of 1,000 and of 7 as in one chunk (the
    whole-vector paths have one), and the largest difference of the master from the reference's
    over the master's largest change."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(size, generator=generator).to(device)
    gradients = [torch.randn(size, generator=generator).to(device) for _ in range(3)]
    layout = es.FlatParams.of({"w": start}).layout

    def run(path: Callable, chunk: int) -> torch.Tensor:
        state = es.init_optimizer_state(config, es.FlatParams(start.clone(), layout))
        for gradient in gradients:
            state = path(config, state, gradient, chunk)
        return torch.cat([state.master.flat, *(b.flat for b in (state.first_moment, state.second_moment) if b)])

    table = paths(device)
    reference = run(table[REFERENCE], size)
    change = float((reference[:size] - start).abs().max())
    result = {}
    for name, path in table.items():
        whole = run(path, size)
        same = None if name.endswith("whole") else all(torch.equal(whole, run(path, chunk)) for chunk in (1000, 7))
        result[name] = {"same_bits_however_cut": same,
                        "max_difference_over_change": float((whole[:size] - reference[:size]).abs().max()) / change}
    return result


def fits(size: int, buffers: int, device: str) -> bool:
    """Whether ``buffers`` float32 vectors of ``size`` values fit in 90% of the device's free memory."""
    if device == "cuda":
        free = torch.cuda.mem_get_info()[0]
    else:
        import psutil

        free = psutil.virtual_memory().available
    return 4 * size * buffers <= 0.9 * free


def measure(config: es.OptimizerConfig, size: int, device: str, repeats: int) -> dict[str, Any]:
    """Median seconds of each path at ``size`` values, round by round on one state."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    moments = 2 if isinstance(config, es.AdamConfig) else int(config.momentum > 0)
    if not fits(size, 2 + moments, device):  # master, moments, gradient; a chunk besides
        return {"skipped": "the buffers do not fit"}
    generator = torch.Generator(device=device).manual_seed(0)
    master = torch.randn(size, generator=generator, device=device).mul_(0.02)
    gradient = torch.randn(size, generator=generator, device=device)
    state = es.init_optimizer_state(config, es.FlatParams(master, es.FlatParams.of({"w": master}).layout), copy=False)
    del master
    table = paths(device)
    if not fits(size, 2 * (2 + moments) + 4, device):  # a new master and moments and ~4 temporaries besides
        table = {name: path for name, path in table.items() if not name.endswith("whole")}
    seconds: dict[str, list[float]] = {name: [] for name in table}
    for _ in range(repeats + 1):  # the first round warms the allocator and the kernels up
        for name, path in table.items():
            sync()
            started = time.perf_counter()
            state = path(config, state, gradient)
            sync()
            seconds[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(values[1:]) for name, values in seconds.items()}
    return {"median_s": medians, "ratio_to_reference": {name: value / medians[REFERENCE] for name, value in medians.items()},
            "finite": bool(torch.isfinite(state.master.flat).all())}


def machine(device: str) -> dict[str, Any]:
    """The record beside the numbers: device, torch, CPU count, load average."""
    info = {"device": device, "torch": torch.__version__, "cpus": os.cpu_count(), "platform": platform.platform(),
            "load_average": list(os.getloadavg()), "torch_threads": torch.get_num_threads()}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse the options, time every path, print the medians and ratios; returns the results."""
    parser = argparse.ArgumentParser(prog="python -m evolm_lib.benchmark optimizer",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (the default where a card is visible)")
    parser.add_argument("--sizes", default="4.9M,135M,1.31B", help="comma-separated master sizes (K, M, B suffixes)")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"comma-separated, of {', '.join(OPTIMIZERS)}")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds after the warm-up round")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    try:
        sizes = [parse_size(part) for part in args.sizes.split(",") if part.strip()]
    except ValueError as error:
        parser.error(f"--sizes: {error}")
    names = [part.strip() for part in args.optimizers.split(",") if part.strip()]
    unknown = sorted(set(names) - set(OPTIMIZERS))
    if unknown or not names:
        parser.error(f"--optimizers: unknown {unknown}; choose from {', '.join(OPTIMIZERS)}")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    device = torch.device(args.device).type
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA card is visible")

    results: dict[str, Any] = {"machine": machine(device), "bits": {}, "timings": {}}
    print(json.dumps(results["machine"]))
    for name in names:
        results["bits"][name] = check_bits(OPTIMIZERS[name], device)
        print(f"{name} bits (same however cut; off {REFERENCE} over the change): " + ", ".join(
            f"{path} {row['same_bits_however_cut']} {row['max_difference_over_change']:.1e}"
            for path, row in results["bits"][name].items()))
    for size in sizes:
        for name in names:
            row = measure(OPTIMIZERS[name], size, device, args.repeats)
            results["timings"][f"{name}/{size}"] = {"optimizer": name, "size": size, **row}
            if "skipped" in row:
                print(f"{name} {size:,}: skipped ({row['skipped']})")
                continue
            print(f"{name} {size:,}: " + ", ".join(f"{path} {row['median_s'][path] * 1e3:.1f} ms "
                                                    f"({row['ratio_to_reference'][path]:.2f}x)" for path in row["median_s"]))
            if device == "cuda":
                torch.cuda.empty_cache()
    results["machine"]["load_average_after"] = list(os.getloadavg())
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return results
