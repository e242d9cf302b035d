"""Tune vLLM's multi-LoRA Triton kernels (lora_shrink, lora_expand) for one model's shapes.

vLLM 0.26.0 reads tuned tile configs from the folder in VLLM_TUNED_CONFIG_FOLDER (vllm/lora/ops/triton_ops/
utils.py: load_lora_op_config, get_lora_op_configs; without it vLLM logs "Using default LoRA kernel configs"):
{gpu}_SHRINK.json and {gpu}_EXPAND_TRUE.json, gpu = torch.cuda.get_device_name() with ' ' and '-' made '_'
(NVIDIA_H100_80GB_HBM3_SHRINK.json), laid out config[max_loras + 1][num_slices][m][k][n] = {"block_m": ...}:
m = tokens in the call; shrink k, n = input size, rank; expand k, n = rank, widest output slice. A missing
max_loras, m, k or n key falls back to the nearest one; num_slices must be there. EXPAND_FALSE (read only
with VLLM_LORA_ENABLE_DUAL_STREAM=1) is not written.

For each projection vLLM wraps (qkv_proj in 3 slices, o_proj, gate_up_proj in 2, down_proj), rank and token
count, this builds the call as a forward pass does (tokens round-robin over --num-loras of --max-loras slots,
metadata from vLLM's LoRAKernelMeta), times vLLM's default config and a grid of candidates in CUDA graphs
(inputs rotated so weights come from HBM; median of repeats), keeps the fastest candidate whose output
matches the default's, writes --out, reloads it through vLLM's loader and prints default vs tuned times.

  python scripts/tune_lora_kernels.py --model-dir DIR --ranks 1,8 --num-tokens 256,2048 \\
      --num-loras 33 --max-loras 66 --out lora_configs [--quick] [--json summary.json]
  VLLM_TUNED_CONFIG_FOLDER=$PWD/lora_configs <the benchmark>          # the tuned run
  python scripts/tune_lora_kernels.py --model-dir DIR --self-check    # CPU: shapes, files, vLLM's loader
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import torch

ENV = "VLLM_TUNED_CONFIG_FOLDER"
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.26's LoRAConfig.max_lora_rank choices
POOL_BYTES = 128 * 2**20  # inputs rotated through a graph: 2.5x an H100's L2, as cold as in a forward pass
MIN_GAIN = 0.02  # the tuned config must beat the default by 2 % when re-timed side by side, else the default stays
REPEATS = 7
MAX_EXPAND_TILE = 16384  # block_m * block_n: larger fp32 accumulators spill registers and compile slowly
GRID = {  # (quick, full). Stage 1: tiles at the default launch settings; stage 2: launch settings on the top tiles
    "block_m": ((16, 32, 64), (16, 32, 64, 128)),
    "shrink_block_k": ((32, 64, 128, 256), (64, 128, 256)),
    "split_k": ((2, 4, 8, 16), (2, 4, 8, 16, 32)),
    "expand_block_n": ((128, 256, 512), (64, 128, 256, 512)),
    "launch": (((4, 2), (8, 2), (4, 3)), tuple(itertools.product((4, 8), (1, 2, 3)))),  # (num_warps, num_stages)
    "top_tiles": (1, 2),
}


@dataclass(frozen=True)
class Problem:
    """One kernel call of a forward pass."""

    op: str  # "shrink": x @ A per slice -> fp32 (slices, m, rank); "expand": that @ B per slice, added into y
    m: int  # tokens
    rank: int
    in_size: int
    out_sizes: tuple[int, ...]  # one per slice
    layers: str  # the projections that make this call

    @property
    def key(self) -> tuple[int, int, int, int]:
        """(num_slices, m, k, n) as vLLM looks the config up."""
        k, n = (self.in_size, self.rank) if self.op == "shrink" else (self.rank, max(self.out_sizes))
        return len(self.out_sizes), self.m, k, n

    def lookup(self, max_loras: int) -> dict[str, Any]:
        """get_lora_op_configs' arguments as the op passes them (its max_loras is len(lora_ids) = max_loras + 1)."""
        hidden = self.in_size if self.op == "shrink" else max(self.out_sizes)
        return dict(op_type=self.op, max_loras=max_loras + 1, batch=self.m, hidden_size=hidden, rank=self.rank,
                    num_slices=len(self.out_sizes), add_inputs=True if self.op == "expand" else None)


def model_layers(model_dir: Path) -> dict[str, tuple[int, tuple[int, ...]]]:
    """The projections vLLM wraps with LoRA, packed as vLLM packs them: name -> (input size, output size per slice)."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise SystemExit(f"--model-dir: no config.json in {model_dir}")
    config = json.loads(path.read_text())
    config = config.get("text_config", config)  # multimodal wrappers
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads") if k not in config]
    if missing:
        raise SystemExit(f"--model-dir: {path} lacks {', '.join(missing)}")
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, (config.get("num_key_value_heads") or heads) * head_dim
    return {"qkv_proj": (hidden, (q, kv, kv)), "o_proj": (q, (hidden,)),
            "gate_up_proj": (hidden, (inter, inter)), "down_proj": (inter, (hidden,))}


def make_problems(layers: dict[str, tuple[int, tuple[int, ...]]], ranks: list[int], num_tokens: list[int]) -> list[Problem]:
    """One problem per vLLM config key; projections with the same key (o_proj, down_proj expand) share it."""
    found: dict[tuple[Any, ...], Problem] = {}
    for op, rank, m in itertools.product(("shrink", "expand"), ranks, num_tokens):
        for name, (in_size, out_sizes) in layers.items():
            problem = Problem(op, m, rank, in_size, out_sizes, name)
            key = (op, *problem.key)
            found[key] = replace(found[key], layers=f"{found[key].layers},{name}") if key in found else problem
    return list(found.values())


def write_configs(out: Path, gpu_name: str, max_loras: int, chosen: list[tuple[Problem, dict]]) -> list[Path]:
    """Write the files vLLM 0.26's load_lora_op_config opens, laid out as get_lora_op_configs reads them."""
    from evolm_lib.engines.vllm.startup import gpu_file_stem

    gpu, trees = gpu_file_stem(gpu_name), {}
    for problem, config in chosen:
        name = f"{gpu}_SHRINK.json" if problem.op == "shrink" else f"{gpu}_EXPAND_TRUE.json"
        node = trees.setdefault(name, {}).setdefault(str(max_loras + 1), {})
        *levels, n = (str(v) for v in problem.key)
        for level in levels:
            node = node.setdefault(level, {})
        node[n] = config
    out.mkdir(parents=True, exist_ok=True)
    for name, tree in trees.items():
        (out / name).write_text(json.dumps(tree, indent=2, sort_keys=True) + "\n")
    return [out / name for name in trees]


def check_loader(out: Path, max_loras: int, chosen: list[tuple[Problem, dict]]) -> None:
    """Reload the files through vLLM's own loader, with the arguments the ops pass, and compare."""
    from vllm.lora.ops.triton_ops import utils

    os.environ[ENV] = str(out.resolve())
    utils.load_lora_op_config.cache_clear()
    utils.get_lora_op_configs.cache_clear()
    for problem, config in chosen:
        got = utils.get_lora_op_configs(**problem.lookup(max_loras))
        if got != config:
            raise SystemExit(f"vLLM's loader returned {got} for {problem}, expected {config}")
    print(f"vLLM's loader (with {ENV}={out}) returns the written config for all {len(chosen)} shapes")


@contextmanager
def forced(config: dict) -> Iterator[None]:
    """Make vLLM's shrink and expand ops use config, whatever the shape (they look it up on every call)."""
    from vllm.lora.ops.triton_ops import lora_expand_op, lora_shrink_op

    saved = lora_shrink_op.get_lora_op_configs, lora_expand_op.get_lora_op_configs
    lora_shrink_op.get_lora_op_configs = lora_expand_op.get_lora_op_configs = lambda *args, **kwargs: config
    try:
        yield
    finally:
        lora_shrink_op.get_lora_op_configs, lora_expand_op.get_lora_op_configs = saved


@dataclass
class Case:
    """One call's tensors: x, y (written by the op), y's initial value (expand adds into y), weights per slice."""

    x: torch.Tensor
    y: torch.Tensor
    y0: torch.Tensor | None
    weights: list[torch.Tensor]


class Tuner:
    """One problem's inputs on the GPU, built as vLLM's forward pass builds them, run or timed under a config."""

    def __init__(self, problem: Problem, num_loras: int, max_loras: int, dtype: torch.dtype):
        from vllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink, utils

        utils._LORA_A_PTR_DICT.clear()  # keyed by data_ptr: entries of freed tensors would alias new ones
        utils._LORA_B_PTR_DICT.clear()
        self.p, self.dtype, self.max_loras = problem, dtype, max_loras
        self.op = lora_shrink if problem.op == "shrink" else lora_expand
        self.mapping = torch.arange(problem.m, device="cuda") % num_loras  # token -> LoRA slot, round-robin
        meta = LoRAKernelMeta.make(max_loras, problem.m, device="cuda")
        meta.prepare_tensors(self.mapping)
        self.meta_args = meta.meta_args(problem.m, False)  # vLLM's default: no active-LoRA specialization
        first = self.make_case()
        nbytes = sum(t.numel() * t.element_size() for t in (first.x, first.y, *first.weights))
        self.cases = [first] + [self.make_case() for _ in range(min(32, max(4, math.ceil(POOL_BYTES / nbytes))) - 1)]
        self.reference = self.torch_reference(num_loras)

    def make_case(self) -> Case:
        """Random inputs scaled so that outputs are O(1); weights stacked as vLLM does: (max_loras, 1, out, in)."""
        p, dev = self.p, "cuda"
        if p.op == "shrink":
            weights = [torch.randn(self.max_loras, 1, p.rank, p.in_size, device=dev) / p.in_size**0.5
                       for _ in p.out_sizes]
            return Case(torch.randn(p.m, p.in_size, device=dev, dtype=self.dtype),
                        torch.zeros(len(p.out_sizes), p.m, p.rank, device=dev), None, [w.to(self.dtype) for w in weights])
        weights = [torch.randn(self.max_loras, 1, size, p.rank, device=dev) / p.rank**0.5 for size in p.out_sizes]
        y0 = torch.randn(p.m, sum(p.out_sizes), device=dev, dtype=self.dtype)
        return Case(torch.randn(len(p.out_sizes), p.m, p.rank, device=dev), y0.clone(), y0,
                    [w.to(self.dtype) for w in weights])

    def call(self, case: Case) -> None:
        if self.p.op == "shrink":
            self.op(case.x, case.weights, case.y, *self.meta_args, 1.0)
        else:
            self.op(case.x, case.weights, case.y, *self.meta_args, offset_start=0, add_inputs=True)

    def torch_reference(self, num_loras: int) -> torch.Tensor:
        """The first case's expected output in float64, one LoRA at a time (expand rounds its fp32 input first)."""
        case = self.cases[0]
        out = torch.zeros_like(case.y, dtype=torch.float64) if case.y0 is None else case.y0.double()
        starts = list(itertools.accumulate((w.shape[2] for w in case.weights), initial=0))
        for lora in range(num_loras):
            rows = (self.mapping == lora).nonzero().squeeze(1)
            for s, w in enumerate(case.weights):
                if case.y0 is None:
                    out[s, rows] = case.x[rows].double() @ w[lora, 0].double().T
                else:
                    out[rows, starts[s]:starts[s + 1]] += case.x[s, rows].to(self.dtype).double() @ w[lora, 0].double().T
        return out

    def matches_under(self, config: dict, want: torch.Tensor) -> bool:
        """Whether the first case's output under config is allclose to want (fp32 buffer; bf16/fp16 output)."""
        case = self.cases[0]
        if case.y0 is not None:
            case.y.copy_(case.y0)
        with forced(config):
            self.call(case)
        tol = 1e-3 if self.p.op == "shrink" else 5e-2
        return torch.allclose(case.y.double(), want, rtol=tol, atol=tol)

    def time_us(self, config: dict) -> float:
        """Median microseconds per call, from CUDA-graph replays of calls rotating through the cases."""
        with forced(config):
            for case in self.cases:  # compile, and fill vLLM's pointer tables before capture
                self.call(case)
            torch.cuda.synchronize()
            graph, inner = torch.cuda.CUDAGraph(), 2 * len(self.cases)
            with torch.cuda.graph(graph):
                for i in range(inner):
                    self.call(self.cases[i % len(self.cases)])
        graph.replay()  # warm-up
        events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(REPEATS)]
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events) * 1000 / inner


def candidates(problem: Problem, default: dict, quick: bool) -> list[dict]:
    """Stage-1 tiles: tl.dot needs tiles >= 16, wider than the rank only adds masked lanes, split_k * block_k <= K."""
    g = {name: values[0 if quick else 1] for name, values in GRID.items()}
    narrow = [b for b in (16, 32, 64) if b == 16 or b <= problem.rank]
    if problem.op == "shrink":
        tiles = [dict(block_m=bm, block_n=bn, block_k=bk, split_k=sk) for bm, bn, bk, sk in
                 itertools.product(g["block_m"], narrow, g["shrink_block_k"], g["split_k"]) if bk * sk <= problem.in_size]
    else:
        tiles = [dict(block_m=bm, block_n=bn, block_k=bk) for bm, bn, bk in
                 itertools.product(g["block_m"], g["expand_block_n"], narrow) if bm * bn <= MAX_EXPAND_TILE]
    return [{**default, **tile} for tile in tiles]


def tune_problem(tuner: Tuner, default: dict, quick: bool) -> dict[str, Any]:
    """vLLM's default against the fastest correct candidate of two stages, re-timed side by side."""
    if not tuner.matches_under(default, tuner.reference):
        raise SystemExit(f"vLLM's default {tuner.p.op} disagrees with the torch reference for {tuner.p}: setup bug")
    want = tuner.cases[0].y.double().clone()
    timed = {json.dumps(default, sort_keys=True): (tuner.time_us(default), default)}
    counts = {"wrong_output": 0, "failed": 0}

    def trial(config: dict) -> None:
        name = json.dumps(config, sort_keys=True)
        if name in timed:
            return
        try:
            if tuner.matches_under(config, want):
                timed[name] = (tuner.time_us(config), config)
            else:
                counts["wrong_output"] += 1
        except Exception:  # a tile Triton cannot compile or launch (e.g. out of shared memory)
            counts["failed"] += 1

    for config in candidates(tuner.p, default, quick):
        trial(config)
    for _, tile in sorted(timed.values(), key=lambda t: t[0])[:GRID["top_tiles"][0 if quick else 1]]:
        for warps, stages in GRID["launch"][0 if quick else 1]:
            trial({**tile, "num_warps": warps, "num_stages": stages})
    best = min(timed.values(), key=lambda t: t[0])[1]
    rounds = [(tuner.time_us(default), tuner.time_us(best)) for _ in range(3)]
    default_us, tuned_us = (statistics.median(r[i] for r in rounds) for i in (0, 1))
    if tuned_us > default_us * (1 - MIN_GAIN):
        best, tuned_us = default, default_us
    return dict(default_us=default_us, tuned_us=tuned_us, config=best, default_config=default, timed=len(timed), **counts)


def tune(args: argparse.Namespace, problems: list[Problem]) -> None:
    """Tune every problem on the GPU, write --out, check vLLM's loader, print and save the summary."""
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: this script times Triton kernels (on a CPU, use --self-check)")
    try:
        import vllm
        from vllm.lora.ops.triton_ops import utils
        from vllm.triton_utils import HAS_TRITON
    except ImportError as error:
        raise SystemExit(f"vLLM is not importable ({error}): install vLLM 0.26.0 or put it on PYTHONPATH")
    if not HAS_TRITON:
        raise SystemExit("vLLM found no usable Triton: its LoRA kernels cannot run here")
    if utils.is_batch_invariant:
        raise SystemExit("VLLM_BATCH_INVARIANT is set: vLLM ignores tuned LoRA configs then; unset it")
    if vllm.__version__ != "0.26.0":
        print(f"note: vLLM {vllm.__version__}; the file layout was checked against 0.26.0")
    if os.environ.pop(ENV, None):
        print(f"note: {ENV} unset in this process, so that 'default' is vLLM's built-in choice")
    utils.load_lora_op_config.cache_clear()
    utils.get_lora_op_configs.cache_clear()
    gpu, started, rows = torch.cuda.get_device_name(), time.perf_counter(), []
    for problem in problems:
        num_slices, m, k, n = problem.key
        default = dict(utils.get_lora_op_configs(**problem.lookup(args.max_loras)))
        result = tune_problem(Tuner(problem, args.num_loras, args.max_loras, getattr(torch, args.dtype)),
                              default, args.quick)
        rows.append(dict(op=problem.op, layers=problem.layers, num_slices=num_slices, m=m, k=k, n=n, **result))
        print(f"[{time.perf_counter() - started:5.0f} s] {problem.op} {problem.layers} m={m} k={k} n={n}: "
              f"{result['default_us']:.1f} -> {result['tuned_us']:.1f} us ({result['timed']} timed, "
              f"{result['wrong_output']} wrong output, {result['failed']} failed)", flush=True)
        torch.cuda.empty_cache()
    chosen = [(problem, row["config"]) for problem, row in zip(problems, rows)]
    files = write_configs(args.out, gpu, args.max_loras, chosen)
    check_loader(args.out, args.max_loras, chosen)
    print(f"\n{'op':7} {'layers':22} slices {'m':>5} {'k':>5} {'n':>5} default_us tuned_us  ratio")
    for r in rows:
        print(f"{r['op']:7} {r['layers']:22} {r['num_slices']:>6} {r['m']:>5} {r['k']:>5} {r['n']:>5} "
              f"{r['default_us']:>10.1f} {r['tuned_us']:>8.1f} {r['default_us'] / r['tuned_us']:>6.2f}")
    seconds = round(time.perf_counter() - started, 1)
    print(f"wrote {', '.join(f.name for f in files)} in {seconds:.0f} s; use {ENV}={args.out.resolve()}")
    if args.json:
        args.json.write_text(json.dumps(dict(
            gpu=gpu, vllm=vllm.__version__, torch=torch.__version__, out=str(args.out.resolve()),
            files=[f.name for f in files], model_dir=str(args.model_dir), quick=args.quick, num_loras=args.num_loras,
            max_loras=args.max_loras, dtype=args.dtype, seconds=seconds, results=rows), indent=2) + "\n")


def self_check(args: argparse.Namespace, problems: list[Problem]) -> None:
    """CPU check: the derived shapes, then a distinct config per shape written and read back by vLLM's loader."""
    for p in problems:
        print(f"{p.op:7} {p.layers:22} slices={p.key[0]} m={p.m} k={p.key[2]} n={p.key[3]} out_sizes={p.out_sizes}")
    gpu = "NVIDIA H100 80GB HBM3"
    torch.cuda.get_device_name = lambda *args: gpu  # the loader names the file after the GPU
    chosen = [(p, {"block_m": 16, "problem": i}) for i, p in enumerate(problems)]
    with tempfile.TemporaryDirectory() as folder:
        print("files:", ", ".join(f.name for f in write_configs(Path(folder), gpu, args.max_loras, chosen)))
        check_loader(Path(folder), args.max_loras, chosen)


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, required=True, help="HF model folder (its config.json is read)")
    parser.add_argument("--ranks", type=int_list, default=[1, 8], help="vLLM max_lora_rank values (default 1,8)")
    parser.add_argument("--num-loras", type=int, default=33, help="distinct adapters in a batch (default 33)")
    parser.add_argument("--max-loras", type=int, default=66, help="the engine's max_loras (default 66)")
    parser.add_argument("--num-tokens", type=int_list, default=[256, 2048], help="tokens per call (default 256,2048)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--out", type=Path, help="the config folder to write (for VLLM_TUNED_CONFIG_FOLDER)")
    parser.add_argument("--quick", action="store_true", help="a small grid")
    parser.add_argument("--json", type=Path, help="write a summary JSON here")
    parser.add_argument("--self-check", action="store_true", help="no GPU: check shapes, files and vLLM's loader")
    args = parser.parse_args()
    bad = [r for r in args.ranks if r not in VLLM_RANKS]
    if bad:
        parser.error(f"--ranks: {bad} not among vLLM's max_lora_rank values {VLLM_RANKS} (pass the rounded-up rank)")
    if not 1 <= args.num_loras <= args.max_loras:
        parser.error(f"--num-loras must be in 1..--max-loras ({args.max_loras}), got {args.num_loras}")
    if not args.self_check and args.out is None:
        parser.error("--out is required (the config folder to write)")
    problems = make_problems(model_layers(args.model_dir), args.ranks, args.num_tokens)
    if args.self_check:
        self_check(args, problems)
    else:
        tune(args, problems)


if __name__ == "__main__":
    main()
