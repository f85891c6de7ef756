"""Block sampling for training: anchors, block inputs and same-position labels, all fixed-shape.

A packed batch of `T` token slots (sequences back to back, `cu_seqlens` marks their starts, slots past
`cu_seqlens[-1]` are padding) gets exactly `num_blocks` (N) blocks. An anchor is a position `i` with
`loss_mask[i]` and `loss_mask[i + 1]` both set and `i + 1` in the same sequence. N anchors are drawn
uniformly without replacement among the valid ones (so each sequence gets a share proportional to its
supervised tokens) and sorted; with fewer than N valid anchors the remaining blocks are *invalid*
(`block_valid` False: they see only themselves and carry zero loss weight).

Randomness is keyed by `(seed, epoch, job_id)`: the same job gives the same blocks whoever trains it
(on the same device type: CPU and CUDA generators give different streams). No host sync: random keys
for all T slots, invalid slots pushed below every valid key, `topk(N)`, sort.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields

import torch

from dflash_trainer.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockPlan:
    """The N blocks of one packed batch. All tensors on the batch's device; N and B fixed per run."""

    anchors: torch.Tensor
    """(N,) int64: anchor index into the packed batch, ascending over valid blocks; 0 for invalid blocks
    (which come last)."""
    block_valid: torch.Tensor
    """(N,) bool: False for padded blocks (fewer valid anchors than N)."""
    seq_id: torch.Tensor
    """(N,) int64: sequence of the anchor (index into cu_seqlens); -1 for invalid blocks."""
    anchor_pos: torch.Tensor
    """(N,) int64: anchor position within its sequence (anchor - cu_seqlens[seq]); 0 for invalid blocks."""
    positions: torch.Tensor
    """(N, B) int64: RoPE position of block slot k = anchor_pos + k."""
    block_ids: torch.Tensor
    """(N, B) int64: block input ids [token at anchor, MASK x (B-1)]."""
    labels: torch.Tensor
    """(N, B) int64: labels[:, k] = token at anchor + k (same position, no shift); 0 where not valid.
    Slot 0 is never a label. With `label_offset` 1 (DSpark), the token at anchor + k + 1, slot 0's included."""
    label_valid: torch.Tensor
    """(N, B) bool: slot k >= 1 of a valid block whose position anchor + k is inside the same sequence
    and has loss_mask set; always False at slot 0. With `label_offset` 1: slot k >= 0, position anchor + k + 1."""

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[0]

    @property
    def block_size(self) -> int:
        return self.positions.shape[1]

    def select(self, start: int, stop: int) -> "BlockPlan":
        """Blocks start .. stop-1 as a plan of their own (a chunk of a chunked step). Blocks past the last one are
        padding, invalid as `plan_from_anchors` makes them (zero loss weight), so every chunk of a step can have
        the same number of blocks (fixed shapes)."""
        if not 0 <= start < stop:
            raise ValueError(f"select({start}, {stop}): need 0 <= start < stop")
        part = {f.name: getattr(self, f.name)[start:stop] for f in fields(self)}  # views, no copy
        pad = stop - max(start, self.num_blocks)
        if pad <= 0:
            return BlockPlan(**part)
        device, b = self.anchors.device, self.block_size
        zeros = torch.zeros(pad, dtype=torch.int64, device=device)  # (P,)
        filler = {
            "anchors": zeros, "block_valid": zeros.bool(), "seq_id": zeros - 1, "anchor_pos": zeros,
            "positions": torch.arange(b, device=device).expand(pad, b),  # (P, B) anchor_pos 0 + k
            "block_ids": self.block_ids[:1].expand(pad, b),  # (P, B) any ids: nothing reads an invalid block's
            "labels": zeros[:, None].expand(pad, b), "label_valid": zeros[:, None].expand(pad, b).bool(),
        }
        return BlockPlan(**{name: torch.cat([t, filler[name]]) for name, t in part.items()})


def derive_seed(seed: int, epoch: int, job_id: int, stream: str) -> int:
    """A 63-bit generator seed for one job and one random stream (`anchors`, `noise`)."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{job_id}/{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def job_generator(seed: int, epoch: int, job_id: int, stream: str, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(derive_seed(seed, epoch, job_id, stream))
    return generator


def token_seq_ids(cu_seqlens: torch.Tensor, num_slots: int) -> torch.Tensor:
    """(T,) int64 sequence index of every slot; -1 for padding slots past cu_seqlens[-1]."""
    slots = torch.arange(num_slots, device=cu_seqlens.device)
    ends = cu_seqlens[1:].to(torch.int64)  # (S,)
    seq = torch.searchsorted(ends, slots, right=True)  # (T,) first sequence whose end is past the slot
    return torch.where(slots < cu_seqlens[-1].to(torch.int64), seq, torch.full_like(seq, -1))


def valid_anchor_mask(loss_mask: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """(T,) bool: loss_mask[i] and loss_mask[i+1] set and i+1 in the same (real) sequence."""
    nxt_mask = torch.cat([loss_mask[1:], loss_mask.new_zeros(1)])  # (T,)
    nxt_seq = torch.cat([seq_ids[1:], seq_ids.new_full((1,), -1)])  # (T,)
    return loss_mask & nxt_mask & (seq_ids >= 0) & (nxt_seq == seq_ids)


def sample_anchors(
    *,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_blocks: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors (N,) int64, block_valid (N,) bool): N distinct valid anchors, sorted; invalid ones last."""
    num_slots = loss_mask.shape[0]
    if num_blocks > num_slots:
        raise ConfigError(f"drafter.num_blocks={num_blocks} exceeds the batch's {num_slots} token slots")
    valid = valid_anchor_mask(loss_mask.bool(), token_seq_ids(cu_seqlens, num_slots))  # (T,)
    keys = torch.rand(num_slots, generator=generator, device=loss_mask.device)  # (T,) in [0, 1)
    keys = torch.where(valid, keys, torch.full_like(keys, -1.0))
    top_keys, idx = torch.topk(keys, num_blocks)  # (N,)
    block_valid = top_keys >= 0
    order_key = torch.where(block_valid, idx, idx + num_slots)  # valid first, ascending
    order = torch.argsort(order_key)
    idx, block_valid = idx[order], block_valid[order]
    return torch.where(block_valid, idx, torch.zeros_like(idx)), block_valid


def plan_from_anchors(
    *,
    anchors: torch.Tensor,
    block_valid: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    label_offset: int = 0,
) -> BlockPlan:
    """The block inputs, positions and labels for given anchors (tests pass hand-picked anchors). `label_offset`:
    the drafter's (`DrafterSpec.label_offset`); with 1 (DSpark) the anchor rule still holds the first label, at
    anchor + 1, in the anchor's sequence and supervised, as it holds DFlash's slot 1."""
    num_slots = input_ids.shape[0]
    device = input_ids.device
    seq_ids = token_seq_ids(cu_seqlens, num_slots)  # (T,)
    anchors = torch.where(block_valid, anchors, torch.zeros_like(anchors)).to(torch.int64)  # (N,)
    seq = torch.where(block_valid, seq_ids[anchors], torch.full_like(anchors, -1))  # (N,)
    seq_start = cu_seqlens.to(torch.int64)[seq.clamp(min=0)]  # (N,)
    seq_end = cu_seqlens.to(torch.int64)[seq.clamp(min=0) + 1]  # (N,)
    anchor_pos = torch.where(block_valid, anchors - seq_start, torch.zeros_like(anchors))  # (N,)
    slot = torch.arange(block_size, device=device)  # (B,)
    positions = anchor_pos[:, None] + slot  # (N, B)
    target_idx = anchors[:, None] + slot + label_offset  # (N, B) packed index of slot k's label
    inside = target_idx < seq_end[:, None]  # (N, B)
    safe_idx = target_idx.clamp(max=num_slots - 1)
    label_valid = block_valid[:, None] & inside & loss_mask.bool()[safe_idx] & (slot + label_offset >= 1)  # (N, B)
    labels = torch.where(label_valid, input_ids[safe_idx], torch.zeros_like(safe_idx))  # (N, B)
    block_ids = torch.full_like(labels, mask_token_id)  # (N, B)
    block_ids[:, 0] = input_ids[anchors]
    return BlockPlan(
        anchors=anchors,
        block_valid=block_valid,
        seq_id=seq,
        anchor_pos=anchor_pos,
        positions=positions,
        block_ids=block_ids,
        labels=labels,
        label_valid=label_valid,
    )


def plan_blocks(
    *,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_blocks: int,
    block_size: int,
    mask_token_id: int,
    seed: int,
    epoch: int,
    job_id: int,
    label_offset: int = 0,
) -> BlockPlan:
    """Sample the N blocks of a packed batch (keyed by seed, epoch, job_id) and build their inputs/labels
    (`label_offset`: `plan_from_anchors`'s)."""
    generator = job_generator(seed, epoch, job_id, "anchors", input_ids.device)
    anchors, block_valid = sample_anchors(
        loss_mask=loss_mask, cu_seqlens=cu_seqlens, num_blocks=num_blocks, generator=generator
    )
    return plan_from_anchors(
        anchors=anchors,
        block_valid=block_valid,
        input_ids=input_ids,
        loss_mask=loss_mask,
        cu_seqlens=cu_seqlens,
        block_size=block_size,
        mask_token_id=mask_token_id,
        label_offset=label_offset,
    )
