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
    q_ctx_lo: torch.Tensor
    """(N*B,) first context key (packed slot) a query may see: its sequence's start; 0 for invalid blocks."""
    q_ctx_hi: torch.Tensor
    """(N*B,) one past the last context key a query may see: its anchor (packed slot); 0 for invalid blocks.
    Full-attention layers: the query sees exactly keys [q_ctx_lo, q_ctx_hi) and [q_own_lo, q_own_hi)."""
    q_own_lo: torch.Tensor
    """(N*B,) first key of the query's own block: T + block * B."""
    q_own_hi: torch.Tensor
    """(N*B,) one past the last key of the query's own block: T + (block + 1) * B."""


def mask_index(plan: BlockPlan, cu_seqlens: torch.Tensor, num_slots: int) -> MaskIndex:
    n, b = plan.positions.shape
    device = plan.positions.device
    blocks = torch.arange(n, device=device)
    q_block = blocks.repeat_interleave(b)  # (N*B,)
    q_seq = torch.where(plan.block_valid, plan.seq_id, torch.full_like(plan.seq_id, -2))[q_block]
    seq = token_seq_ids(cu_seqlens, num_slots)  # (T,)
    starts = cu_seqlens.to(torch.int64)[seq.clamp(min=0)]  # (T,)
    ctx_pos = torch.arange(num_slots, device=device) - starts  # (T,)
    seq_start = torch.where(plan.block_valid, cu_seqlens.to(torch.int64)[plan.seq_id.clamp(min=0)], 0)  # (N,)
    anchor = torch.where(plan.block_valid, plan.anchors, 0)  # (N,) packed slot of the anchor
    return MaskIndex(
        q_block=q_block,
        q_seq=q_seq,
        q_anchor=plan.anchor_pos[q_block],
        q_pos=plan.positions.reshape(-1),
        k_block=torch.cat([torch.full((num_slots,), -1, device=device, dtype=torch.int64), q_block]),
        k_seq=torch.cat([seq, torch.full((n * b,), -1, device=device, dtype=torch.int64)]),
        k_pos=torch.cat([ctx_pos, plan.positions.reshape(-1)]),
        q_ctx_lo=seq_start[q_block],
        q_ctx_hi=anchor[q_block],
        q_own_lo=num_slots + q_block * b,
        q_own_hi=num_slots + (q_block + 1) * b,
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


def dense_step_bytes(*, num_blocks: int, block_size: int, token_budget: int, num_layers: int) -> int:
    """A low estimate of one training step's memory on the dense-mask path (`dense_mask`, the CPU's): the masks
    and every layer's fp32 (queries x keys) attention, kept for the backward, each ~4 bytes a (query, key) pair."""
    queries = num_blocks * block_size
    return queries * (token_budget + queries) * 4 * (num_layers + 1)


def dense_mask(index: MaskIndex, sliding_window: Optional[int] = None) -> torch.Tensor:
    """(N*B, T + N*B) bool mask for `F.scaled_dot_product_attention` (True = attend)."""
    device = index.q_block.device
    q_idx = torch.arange(index.q_block.shape[0], device=device)[:, None]
    kv_idx = torch.arange(index.k_block.shape[0], device=device)[None, :]
    return visible(index, q_idx, kv_idx, sliding_window)


def tile_blocks(index: MaskIndex, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full), each (Q tiles, KV tiles) bool: which `tile` x `tile` tiles of the full-attention mask
    have some visible pair, and which have only visible pairs (tiles past the end are padded with masked
    pairs, as `create_block_mask` does). From the per-query key intervals, at row granularity: ~1/tile of
    the work of evaluating every (query, key) pair, which is what `create_block_mask` does."""
    q_len, kv_len = index.q_block.shape[0], index.k_block.shape[0]
    q_tiles, kv_tiles = -(-q_len // tile), -(-kv_len // tile)
    pad = q_tiles * tile - q_len  # padded query rows see nothing: [0, 0) intervals

    def rows(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, pad))[:, None]  # (Q tiles * tile, 1)

    start = torch.arange(kv_tiles, device=index.q_block.device, dtype=torch.int64)[None, :] * tile  # (1, KV tiles)
    stop = (start + tile).clamp(max=kv_len)
    seen = torch.zeros(q_tiles * tile, kv_tiles, dtype=torch.bool, device=start.device)
    whole = torch.zeros_like(seen)
    for lo, hi in ((index.q_ctx_lo, index.q_ctx_hi), (index.q_own_lo, index.q_own_hi)):
        lo, hi = rows(lo), rows(hi)
        seen |= torch.maximum(lo, start) < torch.minimum(hi, stop)  # the interval meets the tile
        whole |= (lo <= start) & (start + tile <= hi)  # the interval covers the whole (unpadded) tile
    seen = seen.view(q_tiles, tile, kv_tiles).any(dim=1)  # (Q tiles, KV tiles)
    full = whole.view(q_tiles, tile, kv_tiles).all(dim=1)
    return seen & ~full, full


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count (1, 1, Q tiles), indices (1, 1, Q tiles, KV tiles)) int32: per query tile, the set tiles first,
    ascending (BlockMask's kv_num_blocks / kv_indices layout)."""
    count = blocks.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count[None, None], order[None, None]


def flex_block_mask(index: MaskIndex, sliding_window: Optional[int] = None):
    """A flex_attention BlockMask with the same rule (built compiled on CUDA: no dense materialisation)."""
    return FlexMaskBuilder().build(index, sliding_window)


class FlexMaskBuilder:
    """Builds BlockMasks whose `mask_mod` is the same function object every batch.

    A compiled forward guards on the mask_mod it traced; a fresh closure per batch would recompile every
    step. The builder keeps one mask_mod per (mask shape, window) reading preallocated index buffers of that
    shape, and copies each batch's `MaskIndex` into them (fixed shapes). Masks of several shapes (a chunked step's
    chunks, the held-out validation's whole batches) keep their own buffers, so alternating between them
    recompiles nothing. A BlockMask is valid until the next `build` of its shape (steps, and a chunked step's
    chunks, run in order on one stream, so the copy lands after the previous user's kernels).
    """

    tile = 128
    """BlockMask tile size (flex's default sparse block size)."""

    def __init__(self, from_intervals: bool = True) -> None:
        self.from_intervals = from_intervals
        """Full-attention masks from the key intervals (`tile_blocks`); False: `create_block_mask` (every pair)."""
        self._buffers: dict[tuple, MaskIndex] = {}
        """(queries, keys, device) -> the index buffers that shape's mask_mods read."""
        self._mods: dict[tuple, object] = {}
        """(queries, keys, device, window) -> mask_mod."""
        self._last: Optional[tuple] = None
        """The shape of the latest `build`."""

    def _mask_mod(self, sliding_window: Optional[int], shape: Optional[tuple] = None):
        """The mask_mod of `shape` (default: the latest build's) and `sliding_window`."""
        shape = shape or self._last
        key = (*shape, sliding_window)
        if key not in self._mods:
            buffers = self._buffers[shape]

            def mask_mod(b, h, q_idx, kv_idx):
                return visible(buffers, q_idx, kv_idx, sliding_window)

            self._mods[key] = mask_mod
        return self._mods[key]

    def build(self, index: MaskIndex, sliding_window: Optional[int] = None):
        from torch.nn.attention.flex_attention import BlockMask, create_block_mask

        fields = MaskIndex.__slots__
        device = index.q_block.device
        shape = (index.q_block.shape[0], index.k_block.shape[0], device)  # every field's length follows from these
        self._last = shape
        buffers = self._buffers.get(shape)
        if buffers is None:
            self._buffers[shape] = MaskIndex(**{f: getattr(index, f).clone() for f in fields})
        else:
            for f in fields:
                getattr(buffers, f).copy_(getattr(index, f))
        if sliding_window is None and self.from_intervals:  # tiles from the key intervals, not every (q, k) pair
            partial, full = tile_blocks(index, self.tile)
            return BlockMask.from_kv_blocks(
                *_ordered(partial), *_ordered(full), BLOCK_SIZE=self.tile, mask_mod=self._mask_mod(None, shape),
                seq_lengths=(index.q_block.shape[0], index.k_block.shape[0]),
            )
        return create_block_mask(
            self._mask_mod(sliding_window, shape),
            B=None,
            H=None,
            Q_LEN=index.q_block.shape[0],
            KV_LEN=index.k_block.shape[0],
            device=device,
            _compile=device.type == "cuda",
        )
