"""`HiddenStateBatch`: the packed, fixed-shape batch a target sends to a drafter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class HiddenStateBatch:
    """A packed batch of `token_budget` token slots; slots past `num_tokens` are padding.

    All tensors live on the same device (the target's GPU on the sender side, the drafter's on the
    receiver side); shapes are fixed for a run so buffers can be preallocated and steps compiled.
    """

    job_id: int
    bucket_id: int
    epoch: int
    num_tokens: int
    """Valid (real) tokens, a prefix of the buffer."""
    num_seqs: int
    """Sequences packed in the batch."""
    cu_seqlens: torch.Tensor
    """(max_seqs + 1,) int32: sequence starts; entries past num_seqs repeat num_tokens."""
    input_ids: torch.Tensor
    """(token_budget,) int64: token ids, 0 in padding slots."""
    loss_mask: torch.Tensor
    """(token_budget,) bool: assistant tokens; False in padding."""
    taps: torch.Tensor
    """(token_budget, K*H) target dtype: tap k in columns [k*H, (k+1)*H), outputs of layers tap_layer_ids."""
    last_hidden: Optional[torch.Tensor] = None
    """(token_budget, H) target dtype: the target's last hidden state before its final norm (KD), or None."""
