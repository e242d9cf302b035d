"""The labels' log-probabilities and their backward, torch's gather against ``label_logits``:
``python -m evolm_lib.benchmark label-logits``.

The GRPO trainer takes each label's log-probability from a micro-batch's logits (the label's logit
minus the logsumexp) and backpropagates through it once per micro-batch. The gather's own backward
adds the gradient into zeros at the labels; under ``torch.use_deterministic_algorithms`` on CUDA,
torch replaces that atomic scatter with a sorted ``index_put_``. ``label_logits``
(``evolm_lib.grpo.primitives``) gives the same gradient with an elementwise choice instead.

One micro-batch of the trainer's shape (``--micro`` rows x ``--positions`` response positions x
``--vocab``, float32 as the policy trains), on the card when there is one: forward and backward,
``--repeats`` times each way, the two ways alternating, with torch's deterministic algorithms on
(``--not-deterministic`` turns them off), ``label_logits``' backward picked as the trainer picks it
(``--elementwise``: its elementwise choice wherever it runs). Per call: its seconds on the wall (the
card synchronised before and after), the host's seconds to queue it (no synchronisation), and, on a
GPU, the synchronisations it makes (torch.cuda's sync debug mode). Printed: each way's medians,
gather over ``label_logits``, and whether the two gradients are the same bit for bit
(``same_gradient``).

Examples::

    python -m evolm_lib.benchmark label-logits --json results/label_logits.json   # 8 x 64 x 49,152 (SmolLM2)
    python -m evolm_lib.benchmark label-logits --elementwise                        # the choice's cost on a CPU
    python -m evolm_lib.benchmark label-logits --micro 2 --positions 4 --vocab 64 --repeats 3

Speed targets are read from these ratios on a named machine (docs/measurements.md), never asserted by tests.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

WAYS = ("gather", "label_logits")


def _pickers(elementwise: bool | None) -> dict[str, Callable]:
    from ..grpo.primitives import gather_labels, label_logits

    return {"gather": gather_labels,
            "label_logits": lambda logits, labels: label_logits(logits, labels, elementwise)}


def _one_call(pick: Callable, logits, labels, weights, sync: Callable[[], None]) -> tuple[float, float, Any]:
    """(wall seconds, host seconds, gradient) of one forward and backward."""
    import torch

    x = logits.detach().requires_grad_()
    sync()
    started = time.perf_counter()
    log_probs = pick(x, labels) - torch.logsumexp(x, dim=-1)  # (micro, positions)
    (log_probs * weights).sum().backward()
    queued = time.perf_counter()
    sync()
    return time.perf_counter() - started, queued - started, x.grad


def _syncs(pick: Callable, logits, labels, weights) -> int | None:
    """How many times one call waits on the card (None on a CPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _one_call(pick, logits, labels, weights, lambda: None)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchronizing" in str(w.message) for w in caught)


def measure(micro: int, positions: int, vocab: int, repeats: int, deterministic: bool = True,
            elementwise: bool | None = None) -> dict[str, Any]:
    """Each way's per-call medians (wall and host seconds), its synchronisations, and the ratios
    (``elementwise`` as ``label_logits`` takes it: None picks its backward as the trainer does)."""
    import torch

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(micro, positions, vocab, generator=generator).to(device)
    labels = torch.randint(0, vocab, (micro, positions), generator=generator).to(device)
    weights = torch.randn(micro, positions, generator=generator).to(device)
    pickers = _pickers(elementwise)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        gradients = {way: _one_call(pick, logits, labels, weights, sync)[2] for way, pick in pickers.items()}  # warm-up
        times: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
        for _ in range(repeats):
            for way in WAYS:
                times[way].append(_one_call(pickers[way], logits, labels, weights, sync)[:2])
        syncs = {way: _syncs(pickers[way], logits, labels, weights) for way in WAYS}
    finally:
        torch.use_deterministic_algorithms(was)
    ways = {way: {"wall_s": statistics.median(w for w, _ in times[way]), "host_s": statistics.median(h for _, h in times[way]),
                  "syncs": syncs[way]} for way in WAYS}
    same = torch.equal(gradients["gather"].view(-1).view(torch.uint8), gradients["label_logits"].view(-1).view(torch.uint8))
    device_name = torch.cuda.get_device_name(0) if gpu else "cpu"
    return {"device": device_name, "deterministic": deterministic, "elementwise": elementwise,
            "shape": [micro, positions, vocab], "repeats": repeats,
            "ways": ways, "same_gradient": same,
            "gather_over_label_logits": {key: ways["gather"][key] / ways["label_logits"][key]
                                         for key in ("wall_s", "host_s") if ways["label_logits"][key] > 0}}


def format_result(result: dict[str, Any]) -> str:
    """A line per way and one of ratios."""
    backward = {None: "as the trainer picks it", True: "elementwise", False: "scatter"}[result["elementwise"]]
    lines = [f"{result['device']}, deterministic algorithms {'on' if result['deterministic'] else 'off'}, "
             f"label_logits' backward {backward}, micro-batch {' x '.join(map(str, result['shape']))}, "
             f"{result['repeats']} calls each:"]
    for way, entry in result["ways"].items():
        syncs = "" if entry["syncs"] is None else f", {entry['syncs']} synchronisations"
        lines.append(f"  {way:12s} {entry['wall_s'] * 1e3:8.3f} ms a call, host {entry['host_s'] * 1e3:8.3f} ms{syncs}")
    ratios = ", ".join(f"{key} {value:.2f}x" for key, value in result["gather_over_label_logits"].items())
    lines.append(f"  gather / label_logits: {ratios}; same gradient bit for bit: {result['same_gradient']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure both ways, print them, optionally write JSON."""
    parser = argparse.ArgumentParser(prog="python -m evolm_lib.benchmark label-logits",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro", type=int, default=8, help="rows of the micro-batch (the conciseness study: 8)")
    parser.add_argument("--positions", type=int, default=64, help="response positions (the conciseness study: up to 64)")
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary (SmolLM2: 49,152)")
    parser.add_argument("--repeats", type=int, default=50, help="calls each way, after one to warm up")
    parser.add_argument("--not-deterministic", action="store_true", help="without torch's deterministic algorithms")
    parser.add_argument("--elementwise", action="store_true",
                        help="label_logits' elementwise backward wherever it runs (by default only where torch would "
                             "sort the scatter: CUDA with deterministic algorithms; elsewhere it scatters as the gather does)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    for name in ("micro", "positions", "vocab", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    result = measure(args.micro, args.positions, args.vocab, args.repeats, deterministic=not args.not_deterministic,
                     elementwise=True if args.elementwise else None)
    print(format_result(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return result
