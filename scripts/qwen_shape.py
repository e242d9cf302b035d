"""A model with Qwen2.5-1.5B's shapes and random bfloat16 weights, for GPU throughput where the real
model cannot be downloaded: Qwen2 architecture, the real model's vocabulary size (151,936 rows of
embedding and output head), SmolLM2's tokenizer. Built once into the model cache
(``EVOLM_CACHE_DIR``); the scripts that measure on it import :func:`build_qwen_shape`.

    python scripts/qwen_shape.py          # builds it if needed, prints its folder
"""
from __future__ import annotations

from pathlib import Path

QWEN25_15B = dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True,
)
FOLDER = "qwen2.5-1.5b-shape"


def build_qwen_shape(out: Path | None = None) -> Path:
    """The model's folder (default: FOLDER in the model cache), built there first if it is missing."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from evolm_lib.models import cache_dir, resolve_model

    out = Path(out) if out is not None else cache_dir() / FOLDER
    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    config = Qwen2Config(**QWEN25_15B, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")  # a run killed mid-write leaves no folder that looks finished
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


if __name__ == "__main__":
    print(build_qwen_shape())
