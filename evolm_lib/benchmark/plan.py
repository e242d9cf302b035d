"""The memory each card holds for Qwen2.5-7B, 14B, 32B and 72B in every mode, split over 1, 2, 4
and 8 cards: ``python -m evolm_lib.benchmark plan``.

Nothing is loaded or started: the shapes come from the models' configs (``benchmark.shapes``,
built on the meta device) and the sums from ``engines.memory_plan``. Prints one row per model,
mode and tensor_parallel_size with each term in GiB, the total a card and whether it fits a card of
``--card-gib``, then the smallest tensor_parallel_size that fits per model and mode.

Examples::

    python -m evolm_lib.benchmark plan                             # 80 GiB cards, population 30
    python -m evolm_lib.benchmark plan --card-gib 141 --models 7b,72b --modes full --json plan.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

from ..config import ConfigError
from ..engines.memory_plan import PLAN_MODES, TERMS, ModelShape, PlanSettings, memory_plan, smallest_tensor_parallel_size
from ..preflight import GIB
from . import int_list
from .shapes import QWEN25_SHAPES, qwen_config

MODELS = ("7b", "14b", "32b", "72b")
COLUMNS = {"weights": "weights", "master": "master", "optimizer": "optim", "temporaries": "temps",
           "lora_slots": "slots", "kv_cache": "KV", "allowance": "allow", "trainer": "trainer"}
"""term -> column heading (TERMS, in the same order)."""


def plan_rows(settings: PlanSettings, models: Sequence[str], modes: Sequence[str], sizes: Sequence[int],
              card_bytes: int, cards: int) -> dict[str, Any]:
    """{"rows": one per model, mode and size (terms and total in GiB, fits; or why the size does not
    apply), "smallest": model -> mode -> smallest fitting tensor_parallel_size (None: none up to ``cards``)}."""
    rows: list[dict[str, Any]] = []
    smallest: dict[str, dict[str, int | None]] = {}
    for key in models:
        model = ModelShape.of(qwen_config(key), name=f"Qwen2.5-{key.upper()}")
        smallest[model.name] = {}
        for mode in modes:
            base = dataclasses.replace(settings, mode=mode)
            for tp in sizes:
                row: dict[str, Any] = {"model": model.name, "mode": mode, "tensor_parallel_size": tp}
                try:
                    plan = memory_plan(model, dataclasses.replace(base, tensor_parallel_size=tp))
                except ConfigError as error:  # an attention that does not split over tp, or flat noise at tp > 1
                    rows.append({**row, "skipped": str(error)})
                    continue
                terms = plan.terms()
                rows.append({**row, **{f"{name}_gib": terms[name] / GIB for name in TERMS}, "total_gib": plan.total / GIB,
                             "total_bytes": plan.total, "fits": plan.total <= card_bytes})
            smallest[model.name][mode] = smallest_tensor_parallel_size(model, base, card_bytes, cards)
    return {"rows": rows, "smallest": smallest}


def format_plan(report: dict[str, Any]) -> str:
    """The table, then the smallest tensor_parallel_size per model and mode."""
    spec = report["settings"]
    lines = [f"memory a card (GiB) on {report['card_gib']:g} GiB cards: {spec['dtype']}, population {spec['population']}, "
             f"{spec['sequences']} sequences x max_model_len {spec['max_model_len']}, optimizer {spec['optimizer']}"
             f"{' momentum ' + format(spec['momentum'], 'g') if spec['momentum'] else ''}, noise_scheme "
             f"{spec['noise_scheme']}, moved/trained weights: {spec['target_modules']}"]
    head = f"{'model':<13}{'mode':<10}{'TP':>3}" + "".join(f"{title:>9}" for title in COLUMNS.values())
    lines.append(head + f"{'total':>9}  fits")
    for row in report["rows"]:
        start = f"{row['model']:<13}{row['mode']:<10}{row['tensor_parallel_size']:>3}"
        if "skipped" in row:
            lines.append(f"{start}  - {row['skipped'].split(':')[0]}")
            continue
        cells = "".join(f"{row[name + '_gib']:>9.1f}" for name in COLUMNS)
        lines.append(f"{start}{cells}{row['total_gib']:>9.1f}  {'yes' if row['fits'] else 'no'}")
    lines.append(f"smallest tensor_parallel_size that fits (up to {report['cards']} cards):")
    for model, modes in report["smallest"].items():
        lines.append(f"  {model}: " + ", ".join(f"{mode} {'none' if tp is None else tp}" for mode, tp in modes.items()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Print the plan; optionally write it as JSON; returns it."""
    parser = argparse.ArgumentParser(prog="python -m evolm_lib.benchmark plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--card-gib", type=float, default=80.0, help="memory of one card in GiB (80: H100; 141: H200)")
    parser.add_argument("--population", type=int, default=30, help="ES members of a generation (the engine's LoRA slots)")
    parser.add_argument("--sequences", type=int, default=None, help="sequences an engine decodes at once (default: the population)")
    parser.add_argument("--max-model-len", type=int, default=1024, help="tokens of each sequence's KV cache")
    parser.add_argument("--models", default=",".join(MODELS), help=f"Qwen2.5 shapes, of {', '.join(QWEN25_SHAPES)}")
    parser.add_argument("--modes", default=",".join(PLAN_MODES), help=f"of {', '.join(PLAN_MODES)}")
    parser.add_argument("--tp", default="1,2,4,8", help="tensor_parallel_size values of the table")
    parser.add_argument("--cards", type=int, default=None, help="cards present, for the smallest size (default: the largest --tp)")
    parser.add_argument("--dtype", default="bfloat16", help="the engine's dtype")
    parser.add_argument("--lora-rank", type=int, default=1, help="LoRA rank")
    parser.add_argument("--noise-rank", type=int, default=1, help="eggroll: noise rank")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="ES optimizer")
    parser.add_argument("--momentum", type=float, default=0.0, help="ES sgd momentum")
    parser.add_argument("--noise-scheme", choices=("tiled", "flat", "per_tensor"), default="tiled",
                        help="ES full and eggroll: how noise is drawn")
    parser.add_argument("--es-weights", choices=("projections", "all"), default="projections",
                        help="weights ES full / eggroll move and GRPO full trains: the seven projections of every "
                             "layer (the runs' default) or every parameter")
    parser.add_argument("--engines-per-card", type=int, default=1, help="engines sharing each card")
    parser.add_argument("--beta", type=float, default=0.0, help="GRPO KL coefficient (> 0: a reference model)")
    parser.add_argument("--json", type=Path, default=None, help="also write the plan to this JSON file")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in models if m not in QWEN25_SHAPES] + [m for m in modes if m not in PLAN_MODES]
    if unknown:
        parser.error(f"unknown model or mode {unknown}: models are {', '.join(QWEN25_SHAPES)}, modes {', '.join(PLAN_MODES)}")
    if args.card_gib <= 0:
        parser.error("--card-gib must be > 0")
    sizes = int_list(parser, args.tp, "tp")
    cards = args.cards or max(sizes)
    try:
        settings = PlanSettings(dtype=args.dtype, population=args.population, sequences=args.sequences or args.population,
                                max_model_len=args.max_model_len, lora_rank=args.lora_rank, noise_rank=args.noise_rank,
                                optimizer=args.optimizer, momentum=args.momentum, noise_scheme=args.noise_scheme,
                                engines_per_card=args.engines_per_card, beta=args.beta,
                                **({"target_modules": "all"} if args.es_weights == "all" else {}))
    except ConfigError as error:
        parser.error(str(error))
    card_bytes = int(args.card_gib * GIB)
    spec = {name: value for name, value in dataclasses.asdict(settings).items()
            if name not in ("mode", "tensor_parallel_size")}  # each row has its own
    spec["target_modules"] = args.es_weights
    report = {"card_gib": args.card_gib, "card_bytes": card_bytes, "cards": cards, "settings": spec,
              **plan_rows(settings, models, modes, sizes, card_bytes, cards)}
    print(format_plan(report), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return report
