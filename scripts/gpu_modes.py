"""es_mode eggroll and full on a GPU, one engine, one process: runs `evolm_lib.throughput`'s
`measure_throughput` (base model against an EGGROLL population: rank-``--rank`` noise on every weight
of the 7 projections, each member in a resident LoRA slot, written from its seed inside the timed
call) and `measure_weight_modes` (EGGROLL's update at that population, and full mode's write of one
member and its restore from the float32 master, as the worker times them), on Qwen2.5-1.5B's shapes
(`scripts/qwen_shape.py`) by default. Prints the tables and writes them to --json.

    python scripts/gpu_modes.py --tiles auto --json out.json   # the LoRA kernel tiles shipped in evolm_lib
    python scripts/gpu_modes.py --tiles none --json out.json   # vLLM's default tiles
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from evolm_lib.env import apply_engine_defaults  # noqa: E402
from evolm_lib.throughput import (ThroughputSpec, machine_info, measure_throughput, measure_weight_modes,  # noqa: E402
                                  ratios, release_eggroll, start_engine)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen-shape", help="qwen-shape (built if missing), or a model name or folder")
    parser.add_argument("--tiles", choices=("auto", "none"), default="auto", help="LoRA kernel tiles: shipped (auto) or vLLM's")
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--population", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    apply_engine_defaults()
    model = args.model
    if model == "qwen-shape":
        from qwen_shape import build_qwen_shape

        model = str(build_qwen_shape())
    spec = ThroughputSpec(model=model, population=args.population, prompts=args.prompts, new_tokens=args.new_tokens,
                          rank=args.rank, repeats=args.repeats, noise_device="cuda", sigma=1e-3)
    started = time.perf_counter()
    engine = start_engine(spec, max_model_len=512, lora_kernel_configs="auto" if args.tiles == "auto" else None)
    start_s = time.perf_counter() - started
    print(f"vLLM engine start {start_s:.0f} s", flush=True)
    rows = measure_throughput(engine, spec, ("base", "eggroll"))
    release_eggroll(engine)
    modes = measure_weight_modes(engine, spec, repeats=args.repeats)
    engine.close()
    report = {"machine": machine_info(), "spec": spec.__dict__, "tiles": args.tiles, "engine_start_s": start_s,
              "rows": [{k: v for k, v in r.items() if k != "calls"} for r in rows], "ratios": ratios(rows), "modes": modes}
    args.json.write_text(json.dumps(report, indent=1))
    for row in rows:
        print(f"{row['name']}: {row['tokens_per_s']:.0f} tok/s (best {row['best_tokens_per_s']:.0f}) "
              f"timing {json.dumps({k: round(v, 4) for k, v in row['timing'].items()})}")
    print("ratios", json.dumps({k: round(v, 3) for k, v in report["ratios"].items()}))
    print("modes", json.dumps(modes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
