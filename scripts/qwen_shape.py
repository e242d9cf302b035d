"""A model with one of Qwen2.5's shapes and random bfloat16 weights, for GPU measurements where the
real model cannot be downloaded: Qwen2 architecture, the real model's sizes and vocabulary
(``evolm_lib.benchmark.shapes.QWEN25_SHAPES``), SmolLM2's tokenizer. Built once into the model
cache (``EVOLM_CACHE_DIR``) as ``qwen2.5-<shape>-shape``; the scripts that measure on it import
:func:`build_qwen_shape`.

    python scripts/qwen_shape.py              # Qwen2.5-1.5B's shape: builds it if needed, prints its folder
    python scripts/qwen_shape.py --shape 7b   # Qwen2.5-7B's (15 GB of weights, built in bfloat16)
"""
from __future__ import annotations

import argparse
from pathlib import Path

from evolm_lib.benchmark.shapes import QWEN25_SHAPES

QWEN25_15B = QWEN25_SHAPES["1.5b"]
FOLDER = "qwen2.5-1.5b-shape"


def folder_name(shape: str) -> str:
    """The cache folder of a shape: ``qwen2.5-7b-shape``."""
    return f"qwen2.5-{shape}-shape"


def build_qwen_shape(out: Path | None = None, shape: str = "1.5b") -> Path:
    """The model's folder (default: ``folder_name(shape)`` in the model cache), built there first if it is missing."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from evolm_lib.models import cache_dir, resolve_model

    if shape not in QWEN25_SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(QWEN25_SHAPES)}")
    out = Path(out) if out is not None else cache_dir() / folder_name(shape)
    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    config = Qwen2Config(**QWEN25_SHAPES[shape], bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        if shape == "1.5b":  # float32 initialised, then cast: the weights every 1.5B measurement was taken on
            model = Qwen2ForCausalLM(config).to(torch.bfloat16)
        else:  # initialised in bfloat16: half the memory of a float32 model while it is built
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")  # a run killed mid-write leaves no folder that looks finished
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build (if needed) a random-weight model of a Qwen2.5 shape; print its folder.")
    parser.add_argument("--shape", choices=tuple(QWEN25_SHAPES), default="1.5b", help="which Qwen2.5 model's shape")
    parser.add_argument("--out", type=Path, default=None, help="folder to build it in (default: the model cache)")
    args = parser.parse_args()
    print(build_qwen_shape(args.out, args.shape))
