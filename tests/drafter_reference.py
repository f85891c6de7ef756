"""A slow, obviously-correct drafter forward written from DESIGN.md section 1 (tests only).

One block at a time, explicit keys: the context tokens of the anchor's sequence strictly before the
anchor, then the block's own tokens. Every operation is spelled out (RMSNorm, RoPE, GQA by repeating
heads, softmax attention, SwiGLU); only the weights are read from the drafter.
"""

from __future__ import annotations

import torch

from dflash_trainer.drafter.anchors import BlockPlan


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Standard half-split RoPE on (L, heads, d) at integer positions (L,)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    angle = (positions.double()[:, None] * inv_freq[None]).float()[:, None, :]  # (L, 1, d/2)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], dim=-1)


def reference_block(
    drafter, ctx_taps: torch.Tensor, ctx_positions: torch.Tensor, block_embeds: torch.Tensor,
    block_positions: torch.Tensor,
) -> torch.Tensor:
    """One block: ctx_taps (C, K*H) at ctx_positions (C,), block_embeds (B, H) at block_positions (B,).
    Returns (B, H) after the final norm."""
    spec = drafter.spec
    eps, theta = spec.rms_norm_eps, spec.rope_parameters["rope_theta"]
    nh, nkv, hd = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
    ctx = _rms(ctx_taps @ drafter.fc.weight.T, drafter.hidden_norm.weight, eps)  # (C, H)
    h = block_embeds
    key_positions = torch.cat([ctx_positions, block_positions])
    for i, layer in enumerate(drafter.layers):
        a = layer.self_attn
        x = _rms(h, layer.input_layernorm.weight, eps)
        q = _rms((x @ a.q_proj.weight.T).view(-1, nh, hd), a.q_norm.weight, eps)
        kv_in = torch.cat([ctx, x])  # context is not layer-normed: it enters k/v as is
        k = _rms((kv_in @ a.k_proj.weight.T).view(-1, nkv, hd), a.k_norm.weight, eps)
        v = (kv_in @ a.v_proj.weight.T).view(-1, nkv, hd)
        q, k = _rotate(q, block_positions, theta), _rotate(k, key_positions, theta)
        k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5  # (nh, B, C + B)
        window = spec.layer_window(i)
        if window is not None:  # sliding layers: causal and windowed in absolute positions
            delta = block_positions[:, None] - key_positions[None, :]
            scores = scores.masked_fill(~((delta >= 0) & (delta < window)), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(h), nh * hd)
        h = h + out @ a.o_proj.weight.T
        x = _rms(h, layer.post_attention_layernorm.weight, eps)
        m = layer.mlp
        gate, up = x @ m.gate_proj.weight.T, x @ m.up_proj.weight.T
        h = h + (gate * torch.sigmoid(gate) * up) @ m.down_proj.weight.T
    return _rms(h, drafter.norm.weight, eps)


def reference_train(
    drafter, *, taps: torch.Tensor, cu_seqlens: torch.Tensor, input_ids: torch.Tensor, plan: BlockPlan,
    embed_weight: torch.Tensor,
) -> torch.Tensor:
    """All blocks of a packed batch, one by one. Returns (N, B, H); invalid blocks see only themselves."""
    spec = drafter.spec
    bounds = cu_seqlens.tolist()  # host copy: tests only
    outputs = []
    for j in range(plan.num_blocks):
        anchor = int(plan.anchors[j])
        block_ids = torch.tensor([int(input_ids[anchor])] + [spec.mask_token_id] * (spec.block_size - 1))
        if bool(plan.block_valid[j]):
            seq = max(s for s in range(len(bounds) - 1) if bounds[s] <= anchor < bounds[s + 1])
            start = bounds[seq]
            ctx_taps = taps[start:anchor]  # strictly before the anchor, same sequence
            anchor_pos = anchor - start
        else:
            ctx_taps, anchor_pos = taps[:0], 0
        outputs.append(
            reference_block(
                drafter,
                ctx_taps,
                torch.arange(ctx_taps.shape[0]),
                embed_weight[block_ids],
                anchor_pos + torch.arange(spec.block_size),
            )
        )
    return torch.stack(outputs)
