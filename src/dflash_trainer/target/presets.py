"""Model configs for targets built with random weights (tests, the demo, benchmarks)."""

from __future__ import annotations

from transformers import Qwen3Config

from dflash_trainer.data.tiny_tokenizer import TINY_VOCAB_SIZE

TINY_SPARE_ROWS = 64
"""Embedding rows past the tiny tokenizer's vocabulary, as Qwen3 has; the mask token is the first."""

PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=TINY_VOCAB_SIZE + TINY_SPARE_ROWS,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "qwen3-1.7b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    # ---- dense shapes larger than one GPU in bf16 (FP8 targets: target.quantize=fp8) -------------------------
    "llama3-70b": dict(  # meta-llama/Meta-Llama-3-70B's shape: 70.6B parameters, 141 GB in bf16, ~72 GB in FP8
        model_type="llama",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}


def preset_config(name: str) -> Qwen3Config:
    if name not in PRESETS:
        raise ValueError(f"unknown target preset {name!r}; choose one of {sorted(PRESETS)} or a config path")
    return Qwen3Config(**PRESETS[name])
