"""Training attention masks: which keys each block token sees, as a dense SDPA mask or a flex BlockMask.

Queries are the N*B block tokens (block j owns query rows j*B .. j*B+B-1). Keys are
`[context (T packed slots), block tokens (N*B)]`. One elementwise rule (`visible`) defines both paths:

- full-attention layers: block j sees context slot p iff p is in the anchor's sequence and
  p < anchor_j (strictly); it sees every token of its own block (bidirectional); never other blocks,
  never padding slots, never another packed sequence.
- sliding layers (window W): as above, further restricted to keys with `q_pos - W < k_pos <= q_pos`
  (causal and windowed, in absolute positions), which is what the reference `dflash` package does for
  `sliding_attention` layers when the context starts at position 0.
- invalid (padded) blocks: see only their own block (so their output is finite); their loss weight is 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dflash_trainer.drafter.anchors import BlockPlan, token_seq_ids


@dataclass(frozen=True, slots=True, kw_only=True)
class MaskIndex:
    """Per-query and per-key facts the mask rule reads. All int64 on the batch's device."""

    q_block: torch.Tensor
    """(N*B,) block of each query."""
    q_seq: torch.Tensor
    """(N*B,) sequence of each query's block; -2 for invalid blocks (matches no context key)."""
    q_anchor: torch.Tensor
    """(N*B,) anchor position within its sequence of each query's block."""
    q_pos: torch.Tensor
    """(N*B,) absolute position of the query (anchor_pos + slot)."""
    k_block: torch.Tensor
    """(T + N*B,) block of each key; -1 for context keys."""
    k_seq: torch.Tensor
    """(T + N*B,) sequence of each context key; -1 for padding slots and for block keys."""
    k_pos: torch.Tensor
    """(T + N*B,) absolute position of each key (within its sequence)."""


def mask_index(plan: BlockPlan, cu_seqlens: torch.Tensor, num_slots: int) -> MaskIndex:
    n, b = plan.positions.shape
    device = plan.positions.device
    blocks = torch.arange(n, device=device)
    q_block = blocks.repeat_interleave(b)  # (N*B,)
    q_seq = torch.where(plan.block_valid, plan.seq_id, torch.full_like(plan.seq_id, -2))[q_block]
    seq = token_seq_ids(cu_seqlens, num_slots)  # (T,)
    starts = cu_seqlens.to(torch.int64)[seq.clamp(min=0)]  # (T,)
    ctx_pos = torch.arange(num_slots, device=device) - starts  # (T,)
    return MaskIndex(
        q_block=q_block,
        q_seq=q_seq,
        q_anchor=plan.anchor_pos[q_block],
        q_pos=plan.positions.reshape(-1),
        k_block=torch.cat([torch.full((num_slots,), -1, device=device, dtype=torch.int64), q_block]),
        k_seq=torch.cat([seq, torch.full((n * b,), -1, device=device, dtype=torch.int64)]),
        k_pos=torch.cat([ctx_pos, plan.positions.reshape(-1)]),
    )


def visible(
    index: MaskIndex, q_idx: torch.Tensor, kv_idx: torch.Tensor, sliding_window: Optional[int]
) -> torch.Tensor:
    """The mask rule for query rows `q_idx` and key columns `kv_idx` (broadcasting; True = attend)."""
    same_block = index.k_block[kv_idx] == index.q_block[q_idx]
    context = (index.k_seq[kv_idx] == index.q_seq[q_idx]) & (index.k_pos[kv_idx] < index.q_anchor[q_idx])
    seen = same_block | context
    if sliding_window is not None:
        q_pos, k_pos = index.q_pos[q_idx], index.k_pos[kv_idx]
        seen = seen & (k_pos <= q_pos) & (q_pos - k_pos < sliding_window)
    return seen


def dense_mask(index: MaskIndex, sliding_window: Optional[int] = None) -> torch.Tensor:
    """(N*B, T + N*B) bool mask for `F.scaled_dot_product_attention` (True = attend)."""
    device = index.q_block.device
    q_idx = torch.arange(index.q_block.shape[0], device=device)[:, None]
    kv_idx = torch.arange(index.k_block.shape[0], device=device)[None, :]
    return visible(index, q_idx, kv_idx, sliding_window)


def flex_block_mask(index: MaskIndex, sliding_window: Optional[int] = None):
    """A flex_attention BlockMask with the same rule (built compiled on CUDA: no dense materialisation)."""
    return FlexMaskBuilder().build(index, sliding_window)


class FlexMaskBuilder:
    """Builds BlockMasks whose `mask_mod` is the same function object every batch.

    A compiled forward guards on the mask_mod it traced; a fresh closure per batch would recompile every
    step. The builder keeps one mask_mod per window reading preallocated index buffers, and copies each
    batch's `MaskIndex` into them (fixed shapes). A BlockMask is valid until the next `build` (steps run
    in order on one stream, so the copy lands after the previous step's kernels).
    """

    def __init__(self) -> None:
        self._buffers: Optional[MaskIndex] = None
        self._mods: dict = {}

    def _mask_mod(self, sliding_window: Optional[int]):
        if sliding_window not in self._mods:
            buffers = self._buffers

            def mask_mod(b, h, q_idx, kv_idx):
                return visible(buffers, q_idx, kv_idx, sliding_window)

            self._mods[sliding_window] = mask_mod
        return self._mods[sliding_window]

    def build(self, index: MaskIndex, sliding_window: Optional[int] = None):
        from torch.nn.attention.flex_attention import create_block_mask

        fields = MaskIndex.__slots__
        if self._buffers is None or any(
            getattr(self._buffers, f).shape != getattr(index, f).shape
            or getattr(self._buffers, f).device != getattr(index, f).device
            for f in fields
        ):
            self._buffers = MaskIndex(**{f: getattr(index, f).clone() for f in fields})
            self._mods = {}
        else:
            for f in fields:
                getattr(self._buffers, f).copy_(getattr(index, f))
        device = index.q_block.device
        return create_block_mask(
            self._mask_mod(sliding_window),
            B=None,
            H=None,
            Q_LEN=index.q_block.shape[0],
            KV_LEN=index.k_block.shape[0],
            device=device,
            _compile=device.type == "cuda",
        )
