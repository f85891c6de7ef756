"""Model FLOPs of one training step: the target forward up to its last tap and the drafter forward + backward.

The single place for the FLOP formulas of the benchmarks. "Model FLOPs" count the useful matrix work
only: real tokens (padding excluded), visible (query, key) pairs only, no activation-checkpoint
recomputation, no norms / RoPE / softmax / optimizer. MFU = FLOPs / seconds / PEAK_TFLOPS.

Target forward (frozen, no backward), per sequence of n real tokens, per decoder layer that runs:
  linear      2 * n * (H*(q + 2*kv) + q*H + 3*H*I)        q = heads*hd, kv = kv_heads*hd (q/k/v/o, SwiGLU)
  attention   2 * 2 * q * n*(n+1)/2                        QK^T and PV over the causal half
  lm head     2 * n * H * V                                only when the LM head runs (the naive baseline)
A sparse (MoE) layer counts the experts a token runs, not a dense MLP: its 3*H*I term is
              H*E + k*3*H*I_e + 3*H*I_s                    router over E experts, k active experts of width I_e
                                                           (moe_intermediate_size, else intermediate_size as
                                                           gpt-oss), shared experts of total width I_s if any
Which layers are sparse follows the config (mlp_only_layers, decoder_sparse_step, first_k_dense_replace /
moe_layer_freq); the others are dense with intermediate_size. A sliding-attention layer (layer_types, window
W) counts min(t + 1, W) keys for token t instead of t + 1.
The fast path runs layers 0..last tap (last tap + 1 layers); the LM head never.

Drafter step, with N_v valid blocks of B slots, Q = N_v*B block queries, T real context tokens:
  fc          2 * T * (K*H) * H                            x2: forward + weight grad (taps need no grad)
  per layer   2*Q*H*q [q_proj] + 2*2*(Q + T)*H*kv [k, v of block and context] + 2*Q*q*H [o]
              + 3*2*Q*H*I [SwiGLU]                         x3: forward + input grad + weight grad
  attention   4 * hd * heads * P                           x3; P = visible (query, key) pairs
  lm head     2 * N_v*(B-1) * H * V                        x2: forward + input grad (the head is frozen)
DFlash2's convolutions and selector: dflash2_step_flops; LiLiCorr's lattice head: lilicorr_step_flops (by part).
P is counted exactly from the mask rule (drafter/attention_mask.py): a query of valid block j at slot k
sees the anchor_pos_j context tokens strictly before its anchor plus the B tokens of its own block, so
full-attention layers have P = sum_j B * (anchor_pos_j + B); a sliding layer (window W) sees context
positions p with q_pos - W < p < anchor and block slots s <= k with k - s < W. Invalid (padding) blocks
and the context K/V of padding slots are not useful work and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

PEAK_TFLOPS = 789.0
"""Dense bf16 matmul rate of one H200 measured on random 8192^3 products (the MFU denominator)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerShape:
    """Matrix sizes of one Qwen3-style decoder layer."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: Any) -> "LayerShape":
        """From an HF config or a DrafterSpec (same field names, `intermediate_size`)."""
        heads = getattr(config, "num_attention_heads")
        return cls(
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class MoeShape:
    """The sparse MLP of a MoE config: what one token runs in a sparse layer."""

    experts: int
    active: int
    expert_intermediate: int
    shared_intermediate: int
    """Total width of the shared experts every token runs (0: none)."""

    @classmethod
    def of(cls, config: Any) -> Optional["MoeShape"]:
        """From an HF config; None for a dense model."""
        experts = next((n for n in (getattr(config, k, None) for k in _EXPERT_COUNT_KEYS) if n), 0)
        if not experts:
            return None
        expert_intermediate = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        shared = getattr(config, "shared_expert_intermediate_size", None) or (
            (getattr(config, "n_shared_experts", None) or 0) * expert_intermediate)
        return cls(experts=experts, active=config.num_experts_per_tok, expert_intermediate=expert_intermediate,
                   shared_intermediate=shared)

    def mlp_weights(self, hidden: int) -> int:
        """Multiply-adds per token of the router, the active experts and the shared experts."""
        return hidden * self.experts + 3 * hidden * (self.active * self.expert_intermediate + self.shared_intermediate)


_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def is_sparse_layer(config: Any, layer: int) -> bool:
    """Whether decoder layer `layer` of a MoE config runs experts (Qwen-MoE and DeepSeek-style layouts)."""
    if layer in (getattr(config, "mlp_only_layers", None) or ()):
        return False
    if (layer + 1) % (getattr(config, "decoder_sparse_step", None) or 1):
        return False
    return layer >= (getattr(config, "first_k_dense_replace", None) or 0) and not (
        layer % (getattr(config, "moe_layer_freq", None) or 1))


def causal_pairs(n: int, window: Optional[int]) -> int:
    """Visible (query, key) pairs of an n-token causal sequence, all keys or the last `window` (self included)."""
    if window is None or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def target_forward_flops(config: Any, lengths: Sequence[int], *, num_layers: int, lm_head: bool) -> float:
    """Forward FLOPs of `num_layers` decoder layers (and the LM head if `lm_head`) over sequences `lengths`."""
    s, moe = LayerShape.of(config), MoeShape.of(config)
    q, kv, h = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden
    if num_layers > config.num_hidden_layers:
        raise ValueError(f"num_layers={num_layers} > the target's {config.num_hidden_layers} decoder layers")
    tokens = sum(lengths)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
    total = 0
    for layer in range(num_layers):
        sparse = moe is not None and is_sparse_layer(config, layer)
        mlp = moe.mlp_weights(h) if sparse else 3 * h * s.intermediate
        window = config.sliding_window if layer_types[layer] == "sliding_attention" else None
        total += 2 * tokens * (h * (q + 2 * kv) + q * h + mlp)
        total += sum(2 * 2 * q * causal_pairs(n, window) for n in lengths)
    head = 2 * tokens * h * config.vocab_size if lm_head else 0
    return float(total + head)


def visible_pairs(anchor_pos: torch.Tensor, block_size: int, window: Optional[int] = None) -> float:
    """Visible (query, key) pairs of the valid blocks whose anchor positions are `anchor_pos` (N_v,).

    Full attention: B * (anchor_pos + B) per block. Window W: per query slot k at q_pos = anchor_pos + k,
    context keys max(0, anchor_pos - max(0, q_pos - W + 1)) plus block keys min(k + 1, W).
    """
    a = anchor_pos.to(torch.float64).cpu()  # host copy: FLOP accounting runs after the timed loop
    if window is None:
        return float((block_size * (a + block_size)).sum())
    k = torch.arange(block_size, dtype=torch.float64)  # (B,)
    q_pos = a[:, None] + k  # (N_v, B)
    first_ctx = (q_pos - window + 1).clamp(min=0)
    ctx = (a[:, None] - first_ctx).clamp(min=0)
    blk = (k + 1).clamp(max=window)
    return float((ctx + blk).sum())


def drafter_step_flops(spec: Any, *, anchor_pos: torch.Tensor, context_tokens: int) -> float:
    """Forward + backward FLOPs of one drafter step; `spec` a DrafterSpec, `anchor_pos` (N_v,) the anchor
    positions of the valid blocks, `context_tokens` the real tokens of the packed batch."""
    s = LayerShape.of(spec)
    q_dim, kv_dim, h = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden
    b, t, n_valid = spec.block_size, context_tokens, int(anchor_pos.numel())
    queries = n_valid * b
    fc = 2 * t * spec.num_taps * h * h * 2
    layer = (2 * queries * h * q_dim + 2 * 2 * (queries + t) * h * kv_dim + 2 * queries * q_dim * h
             + 3 * 2 * queries * h * s.intermediate) * 3
    attention = sum(4 * s.head_dim * s.heads * visible_pairs(anchor_pos, b, spec.layer_window(i)) * 3
                    for i in range(spec.num_layers))
    head = 2 * n_valid * (b - 1) * h * spec.vocab_size * 2
    return float(fc + spec.num_layers * layer + attention + head + dflash2_step_flops(spec, queries, n_valid * (b - 1))
                 + sum(lilicorr_step_flops(spec, n_valid).values()))


def dflash2_step_flops(spec: Any, queries: int, rows: int) -> float:
    """DFlash2's matmuls beyond DFlash's, forward + backward (0 for DFlash): each layer's two convolutions' kernel
    projections (H -> 2 x taps x groups) over the block's `queries` (LiLiCorr's too when its convolutions are on),
    and the selector over the `rows` predicted slots (its hidden projection, the K candidates' logits, their codebook
    scores; 0 without a selector)."""
    if not getattr(spec, "block_conv", False):
        return 0.0
    h, k = spec.hidden_size, spec.selector_top_k
    convs = spec.num_layers * 2 * 2 * queries * h * (2 * spec.conv_kernel_size * h // spec.conv_group_size)
    selector = 2 * rows * h * spec.selector_rank + 2 * rows * k * h + 2 * rows * k * spec.selector_rank
    return float((convs + selector) * 3)


def lilicorr_step_flops(spec: Any, blocks: int) -> dict[str, float]:
    """LiLiCorr's lattice head over `blocks` valid blocks, forward + backward, by part (empty for the others). Each
    block's S = B-1 slots keep K candidates: C = blocks * S * K lattice nodes, each a head-wide state (width h, the
    drafter's Hm when lilicorr_hidden_size is 0) through every head layer. x3 (forward, input and weight gradients)
    except token_proj (x2: the target's embeddings need no gradient); the teacher's logits for the penalty x1
    (no gradient); the activation-checkpoint recompute of the head's chunks is not counted (hardware does +1 forward
    of the head).
      token_proj     2*C*Hm*h                        only when h != Hm
      inputs         2*R*Hm*h [pass_hidden_proj of the R = blocks*S slots] + 2*C*(5*h + h*h) [feature_mlp]
                     + 2*blocks*Hm*h [context_proj of the anchor]
      layers         per layer 2*C*(3h*h + h*h + 2*h*m) [q/k/v, o, MLP of width m = h * mlp_ratio]
                     + 4*h*C*S*K [attention over each block's S*K nodes]
      factors        2*C*3h*h [factor_input_proj] + 2*C*2*h*f [out/in heads] + 2*blocks*h*f [anchor_out_head]
                     + 2*blocks*(S-1)*K*K*f [pair cosines]
      candidates     2*R*(K+1)*Hm [the candidates' and label's logits through the LM head]
      teacher        2*R*K*Hm [the target's logits of the candidates] (x1)
    """
    lattice = getattr(spec, "lattice", None)
    if lattice is None:
        return {}
    hm, s, k = spec.hidden_size, spec.block_size - 1, lattice.candidate_topk
    h, f = lattice.width(hm), lattice.factor_dim
    m = int(h * lattice.mlp_ratio)
    rows = blocks * s
    c = rows * k
    layers = lattice.num_layers * (2 * c * (4 * h * h + 2 * h * m) + 4 * h * c * s * k)
    return {
        "token_proj": float(2 * c * hm * h * 2 if h != hm else 0),
        "inputs": float((2 * rows * hm * h + 2 * c * (5 * h + h * h) + 2 * blocks * hm * h) * 3),
        "layers": float(layers * 3),
        "factors": float((2 * c * 3 * h * h + 2 * c * 2 * h * f + 2 * blocks * h * f + 2 * blocks * (s - 1) * k * k * f)
                         * 3),
        "candidates": float(2 * rows * (k + 1) * hm * 2),
        "teacher": float(2 * rows * k * hm),
    }


def mfu(flops: float, seconds: float, peak_tflops: float = PEAK_TFLOPS) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak."""
    return flops / seconds / (peak_tflops * 1e12) if seconds > 0 else float("nan")
