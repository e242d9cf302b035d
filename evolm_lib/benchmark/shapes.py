"""Qwen2.5's published model shapes (each model's config.json on the Hugging Face Hub), as keyword
arguments of transformers' ``Qwen2Config``: what ``python -m evolm_lib.benchmark plan`` sizes and
what ``scripts/qwen_shape.py`` builds a random-weight model of.

``1.5b`` keeps max_position_embeddings 4096 and tied embeddings, the model every throughput figure
on the Qwen2.5-1.5B shape was measured on; the larger ones carry their configs' context (32768) and
untied embeddings.
"""
from __future__ import annotations

QWEN25_MODEL_TYPE = "qwen2"
"""transformers' model_type of every shape below (``AutoConfig.for_model``)."""

QWEN25_SHAPES: dict[str, dict[str, int | bool]] = {
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, tie_word_embeddings=False),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, max_position_embeddings=32768, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, max_position_embeddings=32768, tie_word_embeddings=False),
    "72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=152064, max_position_embeddings=32768, tie_word_embeddings=False),
}
"""shape name -> Qwen2Config keyword arguments (hidden, MLP, layers, heads, KV heads, vocabulary, context, tying)."""


def qwen_config(shape: str) -> dict[str, int | bool | str]:
    """The config.json dict of one Qwen2.5 shape (its model_type included), for ``memory_plan.model_shapes``."""
    if shape not in QWEN25_SHAPES:
        raise ValueError(f"unknown Qwen2.5 shape {shape!r}; known: {', '.join(QWEN25_SHAPES)}")
    return {"model_type": QWEN25_MODEL_TYPE, **QWEN25_SHAPES[shape]}
