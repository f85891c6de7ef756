"""The one kernel the check replaces: an engine's attention call, by SDPA over [context K/V, block K/V].

vLLM's `Attention` and SGLang's `RadixAttention` attend through paged KV caches and GPU kernels (FlashAttention,
FlashInfer, Triton) that do not run on a CPU. The check gives each engine's attention layer this function instead:
it takes the block's queries, keys and values as the engine's layer computed them (its projections, q/k norms and
RoPE), the context keys and values the engine's own context path wrote into the cache, and attends with exactly the
causality and window that the engine's layer resolved from the export's config. Nothing else of the engines is
replaced, so a wrong config field (a causal flag, a window, a tap offset) shows up as a different forward.

The window rule is the kernels': a window of `left` lets query position q see keys at q - left .. q (FlashAttention's
`window_size=(left, 0)`); vLLM and SGLang both pass `left = sliding_window - 1` (HF's window counts the token
itself). A non-causal windowed layer sees q - left .. q + left (vLLM's `_maybe_symmetrize_window`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool, window_left: Optional[int]) -> torch.Tensor:
    """(Lq, Lk) bool: which keys each query sees. q_pos (Lq,), k_pos (Lk,) absolute positions; window_left: how far
    back (and, when not causal, ahead) a query sees; None for no window."""
    delta = q_pos[:, None] - k_pos[None, :]  # (Lq, Lk) how far key k lies before query q
    mask = torch.ones_like(delta, dtype=torch.bool)
    if causal:
        mask &= delta >= 0
    if window_left is not None:
        mask &= delta <= window_left
        if not causal:
            mask &= -delta <= window_left
    return mask


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    context_k: torch.Tensor,
    context_v: torch.Tensor,
    q_pos: torch.Tensor,
    context_pos: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    causal: bool,
    window_left: Optional[int],
) -> torch.Tensor:
    """Attention of the block over [context, block]: q (Lq, nh*hd), k/v (Lq, nkv*hd) from the engine's layer;
    context_k/v (C, nkv, hd) as the engine wrote them to its cache; positions q_pos (Lq,), context_pos (C,).
    Returns (Lq, nh*hd), the layout both engines' attention layers return."""
    keys = torch.cat([context_k, k.reshape(-1, num_kv_heads, head_dim)]).transpose(0, 1)  # (nkv, C + Lq, hd)
    values = torch.cat([context_v, v.reshape(-1, num_kv_heads, head_dim)]).transpose(0, 1)
    queries = q.reshape(-1, num_heads, head_dim).transpose(0, 1)  # (nh, Lq, hd)
    mask = visible(q_pos, torch.cat([context_pos, q_pos]), causal=causal, window_left=window_left)
    out = F.scaled_dot_product_attention(queries[None], keys[None], values[None], attn_mask=mask, scale=scale,
                                         enable_gqa=True)  # (1, nh, Lq, hd)
    return out[0].transpose(0, 1).reshape(q.shape[0], num_heads * head_dim)
