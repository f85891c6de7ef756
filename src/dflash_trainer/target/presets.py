"""Model configs for targets built with random weights (tests, the demo, benchmarks).

Each preset names its architecture by `model_type` (as a config.json does), so `preset_config` returns that
architecture's config class: `Qwen3Config` for the dense presets, `Qwen3MoeConfig` / `GptOssConfig` for the
MoE ones. The full-size presets copy the published models' config.json values (shapes only: random weights).
"""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

from dflash_trainer.data.tiny_tokenizer import (
    TINY_GEMMA3_TOKENS_PER_IMAGE,
    TINY_LLAMA4_TILE,
    TINY_VISION_TOKENS,
    TINY_VOCAB_SIZE,
    tiny_image_token_ids,
)

TINY_SPARE_ROWS = 64
"""Embedding rows past the tiny tokenizer's vocabulary, as Qwen3 has; the mask token is the first."""

_TINY_SHAPE = dict(
    vocab_size=TINY_VOCAB_SIZE + TINY_SPARE_ROWS,
    hidden_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)

_GEMMA3_TOKENS = tiny_image_token_ids("gemma3")
_GEMMA4_TOKENS = tiny_image_token_ids("gemma4")
_LLAMA4_TOKENS = tiny_image_token_ids("llama4")

_TINY_LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_conv_kernel_dim=4)
_TINY_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

_TINY_GEMMA4_TEXT = dict(  # Gemma 4's language model: sliding / full layers, per-layer input embeddings, scaled
    # embeddings
    model_type="gemma4_text", **_TINY_SHAPE, intermediate_size=128, sliding_window=4,
    layer_types=["sliding_attention", "full_attention"] * 3, vocab_size_per_layer_input=_TINY_SHAPE["vocab_size"],
    hidden_size_per_layer_input=16, pad_token_id=0, bos_token_id=None, eos_token_id=None,
)

_TINY_LLAMA4_TEXT = dict(  # Llama 4's language model: MoE with a shared expert, chunked / NoPE layers
    model_type="llama4_text", **_TINY_SHAPE, intermediate_size=32, intermediate_size_mlp=128, num_local_experts=4,
    num_experts_per_tok=1, attention_chunk_size=8, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)

PRESETS: dict[str, dict] = {
    "tiny": dict(model_type="qwen3", **_TINY_SHAPE, intermediate_size=128, rope_theta=10000.0),
    "tiny-moe": dict(
        # Every layer sparse: 4 experts of width 32, 2 active per token. `intermediate_size` is the dense MLP
        # width a layer listed in `mlp_only_layers` would have (none here); the drafter takes it (drafter/spec.py).
        model_type="qwen3_moe", **_TINY_SHAPE, intermediate_size=128, moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, rope_theta=10000.0,
    ),
    "tiny-gpt-oss": dict(
        # gpt-oss layout in small: alternating sliding (window 4) / full attention, attention sinks and biases,
        # 4 experts of width 32 (gpt-oss's `intermediate_size` is the expert width), 2 active, yarn RoPE.
        model_type="gpt_oss", **_TINY_SHAPE, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4,
    ),
    # ---- the families the engines verify drafters for, in small (issue 63's matrix; docs/targets.md) --------------
    "tiny-qwen3-next": dict(  # hybrid: Gated DeltaNet linear-attention layers between full-attention ones, MoE
        model_type="qwen3_next", **_TINY_SHAPE, intermediate_size=128, rope_theta=10000.0, **_TINY_LINEAR,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2, **_TINY_EXPERTS,
        shared_expert_intermediate_size=32,
    ),
    "tiny-qwen3.5": dict(  # Qwen3.5's language model: the same hybrid layout, dense
        model_type="qwen3_5_text", **_TINY_SHAPE, intermediate_size=128, rope_theta=10000.0, **_TINY_LINEAR,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
    ),
    "tiny-qwen3.5-moe": dict(
        model_type="qwen3_5_moe_text", **_TINY_SHAPE, intermediate_size=128, rope_theta=10000.0, **_TINY_LINEAR,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2, **_TINY_EXPERTS,
        shared_expert_intermediate_size=32,
    ),
    "tiny-deepseek-v3": dict(  # MLA (q and kv low-rank, decoupled RoPE dims; kv heads = heads), MoE after a dense layer
        model_type="deepseek_v3", **{**_TINY_SHAPE, "num_key_value_heads": 4, "head_dim": 8}, intermediate_size=128,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_shared_experts=1, n_group=1,
        topk_group=1,
    ),
    "tiny-gemma4": _TINY_GEMMA4_TEXT,
    "tiny-llama4": _TINY_LLAMA4_TEXT,
    "tiny-glm4-moe": dict(
        model_type="glm4_moe", **_TINY_SHAPE, intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1,
    ),
    "tiny-minimax-m2": dict(
        model_type="minimax_m2", **_TINY_SHAPE, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        bos_token_id=None, eos_token_id=None,
    ),
    "tiny-nemotron-h": dict(  # hybrid Mamba-2: mamba / MoE / attention / MLP blocks, each its own layer
        model_type="nemotron_h", **_TINY_SHAPE, intermediate_size=128,
        layers_block_type=["mamba", "moe", "attention", "mlp", "mamba", "attention"], ssm_state_size=8,
        mamba_num_heads=4, mamba_head_dim=16, n_groups=1, chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    ),
    "tiny-qwen3-vl": dict(  # image-text-to-text: a Qwen3 language model with M-RoPE, a 1-layer vision tower
        model_type="qwen3_vl", tie_word_embeddings=False, image_token_id=TINY_VISION_TOKENS["<|image_pad|>"],
        video_token_id=TINY_VISION_TOKENS["<|video_pad|>"], vision_start_token_id=TINY_VISION_TOKENS["<|vision_start|>"],
        vision_end_token_id=TINY_VISION_TOKENS["<|vision_end|>"],
        text_config=dict(
            **{k: v for k, v in _TINY_SHAPE.items() if k != "tie_word_embeddings"}, intermediate_size=128,
            # interleaved, as the released configs say: HF's Qwen3-VL always interleaves, vLLM reads the flag
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True},
        ),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           deepstack_visual_indexes=[0], patch_size=16, num_position_embeddings=64),
    ),
    "tiny-qwen3.5-vl": dict(  # Qwen3.5 as released: image-text, its language model the hybrid one above
        model_type="qwen3_5", tie_word_embeddings=False, image_token_id=TINY_VOCAB_SIZE + 6,
        video_token_id=TINY_VOCAB_SIZE + 7, vision_start_token_id=TINY_VOCAB_SIZE + 8,
        vision_end_token_id=TINY_VOCAB_SIZE + 9,
        text_config=dict(
            **{k: v for k, v in _TINY_SHAPE.items() if k != "tie_word_embeddings"}, intermediate_size=128, **_TINY_LINEAR,
            layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, num_position_embeddings=64),
    ),
    "tiny-gemma3-vl": dict(  # Gemma 3 image-text (4B and up): sliding / full layers, a 1-layer SigLIP tower whose
        # 32 x 32 image (8 x 8 patches) is pooled to TINY_GEMMA3_TOKENS_PER_IMAGE soft tokens
        model_type="gemma3", tie_word_embeddings=False, mm_tokens_per_image=TINY_GEMMA3_TOKENS_PER_IMAGE,
        **{f"{name}_index": _GEMMA3_TOKENS[token] for name, token in
           (("boi_token", "<start_of_image>"), ("image_token", "<image_soft_token>"), ("eoi_token", "<end_of_image>"))},
        text_config=dict(**{k: v for k, v in _TINY_SHAPE.items() if k != "tie_word_embeddings"}, intermediate_size=128,
                         sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 3),
        vision_config=dict(model_type="siglip_vision_model", image_size=32, patch_size=8, hidden_size=32,
                           intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
    ),
    "tiny-gemma4-vl": dict(  # Gemma 4 image-text: the language model above, its image tokens attending to each
        # other (use_bidirectional_attention="vision"), a 1-layer tower of 4 x 4 patches pooled 2 x 2
        model_type="gemma4", tie_word_embeddings=False, audio_config=None,
        **{f"{name}_id": _GEMMA4_TOKENS[token] for name, token in
           (("boi_token", "<|image>"), ("image_token", "<|image|>"), ("eoi_token", "<image|>"))},
        text_config={**{k: v for k, v in _TINY_GEMMA4_TEXT.items() if k not in ("model_type", "tie_word_embeddings")},
                     "use_bidirectional_attention": "vision"},
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                           position_embedding_size=64),
    ),
    "tiny-llama4-vl": dict(  # Llama 4 image-text: the language model above, a 1-layer tower of 32 x 32 tiles in
        # patches of 8, pixel-shuffled to 4 tokens a tile
        model_type="llama4", tie_word_embeddings=False,
        **{f"{name}_index": _LLAMA4_TOKENS[token] for name, token in
           (("boi_token", "<|image_start|>"), ("image_token", "<|patch|>"), ("eoi_token", "<|image_end|>"))},
        text_config={k: v for k, v in _TINY_LLAMA4_TEXT.items() if k != "model_type"},
        vision_config=dict(hidden_size=32, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                           image_size=TINY_LLAMA4_TILE, patch_size=8, pixel_shuffle_ratio=0.5, vision_output_dim=64,
                           projector_input_dim=64, projector_output_dim=64),
    ),
    "qwen3-1.7b": dict(
        model_type="qwen3",
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
        model_type="qwen3",
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
    "qwen3-30b-a3b": dict(  # Qwen/Qwen3-30B-A3B: 128 experts of width 768, 8 active; every layer sparse
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    "gpt-oss-20b": dict(  # openai/gpt-oss-20b: 32 experts of width 2880, 4 active; the config's default
        # layer_types (sliding window 128 on even layers, full on odd) and yarn RoPE (theta 150000, factor 32)
        model_type="gpt_oss",
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_local_experts=32,
        num_experts_per_tok=4,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        sliding_window=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
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


def preset_config(name: str) -> PretrainedConfig:
    """The HF config of preset `name`, of its architecture's config class."""
    if name not in PRESETS:
        raise ValueError(f"unknown target preset {name!r}; choose one of {sorted(PRESETS)} or a config path")
    fields = dict(PRESETS[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)
