"""Where one engine call's time goes: the call under ``torch.profiler``, its kernels grouped by what
they do (``modes --profile``).

On a GPU the events are the call's CUDA kernels, each with its time on the card (kernels replayed
from CUDA graphs included, as CUPTI reports them); on a CPU, the call's operators with their own
(self) time. ``busy_s`` is their sum, and ``busy_share`` that sum over the call's wall seconds: a
call whose card is busy for a small share of it is bound by the host, not by its kernels. The
categories are read from the kernels' names (:data:`CATEGORIES`, the first that matches); what
matches none is ``other``.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable, Iterable

CATEGORIES = (
    ("lora", ("lora", "sgmv", "bgmv", "punica")),
    ("attention", ("attn", "attention", "flash", "paged", "mla")),
    ("matmul", ("gemm", "matmul", "cutlass", "nvjet", "xmma", "cublas", "onednn_mm", "aten::mm", "aten::addmm",
                "aten::bmm", "aten::linear", "aten::einsum")),
    ("sampling", ("sample", "topk", "top_k", "argmax", "softmax", "multinomial")),
)
"""category -> substrings of a kernel's or operator's name (lower case) that put it there."""


def category(name: str) -> str:
    """The category of a kernel or operator name (``other`` where none matches)."""
    lower = name.lower()
    return next((label for label, parts in CATEGORIES if any(part in lower for part in parts)), "other")


def breakdown(events: Iterable[tuple[str, float]], wall_s: float, top: int = 12) -> dict[str, Any]:
    """(name, seconds) events of one call of ``wall_s`` seconds: their sum (``busy_s``), its share of
    the wall time, seconds and share of the sum by category, and the ``top`` names by seconds with
    their counts."""
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, seconds in events:
        by_name[name][0] += seconds
        by_name[name][1] += 1
    busy = sum(seconds for seconds, _ in by_name.values())
    by_category: dict[str, float] = defaultdict(float)
    for name, (seconds, _) in by_name.items():
        by_category[category(name)] += seconds
    ranked = sorted(by_name.items(), key=lambda item: (-item[1][0], item[0]))[:top]
    return {"wall_s": wall_s, "busy_s": busy, "busy_share": busy / wall_s if wall_s > 0 else None,
            "by_category": {label: {"s": seconds, "share": seconds / busy if busy else None}
                            for label, seconds in sorted(by_category.items(), key=lambda item: -item[1])},
            "top": [{"name": name, "s": seconds, "count": count} for name, (seconds, count) in ranked]}


def profile(call: Callable[[], Any]) -> dict[str, Any]:
    """Run ``call`` once under ``torch.profiler`` and return its :func:`breakdown`."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    gpu = torch.cuda.is_available()
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if gpu else [])]
    sync()
    with torch_profile(activities=activities) as trace:
        started = time.perf_counter()
        call()
        sync()
        wall = time.perf_counter() - started
    if gpu:
        events = [(e.name, e.time_range.elapsed_us() / 1e6) for e in trace.events() if e.device_type == DeviceType.CUDA]
    else:
        events = [(e.name, e.self_cpu_time_total / 1e6) for e in trace.events() if e.device_type == DeviceType.CPU]
    return {**breakdown(events, wall), "device": "cuda" if gpu else "cpu"}


def format_breakdown(label: str, result: dict[str, Any], top: int = 5) -> str:
    """Two lines: the call's busy share and categories, then its ``top`` names."""
    categories = ", ".join(f"{name} {entry['s'] * 1e3:.1f} ms ({entry['share']:.0%})"
                           for name, entry in result["by_category"].items() if entry["share"] is not None)
    names = "; ".join(f"{entry['name'][:60]} {entry['s'] * 1e3:.1f} ms x{entry['count']}" for entry in result["top"][:top])
    share = "" if result["busy_share"] is None else f" ({result['busy_share']:.0%} of it)"
    return (f"{label}: {result['wall_s']:.3f} s, {result['device']} busy {result['busy_s']:.3f} s{share}: {categories}\n"
            f"    top: {names}")
