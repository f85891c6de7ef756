"""DFlash2's two additions to the DFlash drafter: block-local grouped dynamic convolutions around every sublayer,
and a candidate selector that re-ranks the top-K of each slot's logits given the previous slot's token.

Facts from the reference (`dflash` package, `DFlash2DraftModel`) and the engines that serve it (vLLM
`qwen3_dflash2.py`, SGLang `srt/models/dflash.py`), which the export and the conformance check hold us to:

- **Convolution** (`BlockConv`): before and after each attention and MLP sublayer, a causal K-tap depthwise
  convolution along the block's slots, `y[k] = sum_t (base[t] + delta[k, t]) * x[k - t]` with taps that never reach
  into the previous block (zero past slot 0). `base` (2, K, H) is per channel; `delta` is per group of
  `group_size` channels and per slot, one projection of the sublayer's input giving both the input-side and the
  output-side kernels. It starts as the identity (base[:, 0] = 1, the rest and the projection 0), so a new
  DFlash2 layer computes what its DFlash layer does.
- **Selector** (`CandidateSelector`): for slot k with candidates c (the top-K of the drafter's logits, whose
  logits are the unary scores U), score(c) = U(c) + <A[prev] * P h_k, B[c]>, `prev` the token picked at slot
  k - 1 (the block's first token for slot 1). Decoding walks the slots left to right (`walk`): greedy takes the
  best score, sampling draws from softmax(score / T) over the K candidates (that distribution is what the
  lossless acceptance rule compares with the target's). Tensor names are the engines': the codebooks are bare
  parameters (`candidate_selector.predecessor_codebook`, no `.weight`). One codebook (B) starts at zero, so the
  selector first picks the argmax, as DFlash does, and learns from there.
- **Training** (`selector_targets`, `CandidateSelector.scores`): teacher-forced, `prev` = the true previous
  token, a K-way cross-entropy over the candidates. When the true token is not among the top-K, `inject` puts it
  in place of the K-th candidate (speculators' rule), `ignore` leaves the slot out of the selector's loss
  (SpecForge's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class BlockConv(nn.Module):
    """The grouped dynamic causal convolution around one sublayer (module docstring). Inputs are rows of whole
    blocks: (..., B, H) with B the block's slots."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The identity: the current slot with weight 1, nothing from earlier slots, no dynamic part."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved sublayer input (..., B, H), and the output side's dynamic kernel (..., B, K, G)."""
        delta = self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, self.num_groups))  # (..., B, 2, K, G)
        return self._convolve(x, delta[..., 0, :, :], 0), delta[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The convolved sublayer output (..., B, H), with the kernel `prepare` returned."""
        return self._convolve(y, delta, 1)

    def _convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        groups = x.unflatten(-1, (self.num_groups, self.group_size))  # (..., B, G, gs)
        base = self.base_kernel[side].to(x.dtype).view(self.kernel_size, self.num_groups, self.group_size)
        delta = delta.to(x.dtype)[..., None]  # (..., B, K, G, 1)
        out = (base[0] + delta[..., 0, :, :]) * groups
        for t in range(1, self.kernel_size):
            earlier = F.pad(groups[..., :-t, :, :], (0, 0, 0, 0, t, 0))  # slot k sees slot k - t; zeros before slot 0
            out = out + (base[t] + delta[..., t, :, :]) * earlier
        return out.flatten(-2)  # (..., B, H)


class CandidateSelector(nn.Module):
    """Re-scores a slot's K candidates given the token picked at the slot before (module docstring)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, seed: Optional[int] = None) -> None:
        """Predecessor codebook and projection random (from a generator seeded `seed`, else the global one),
        successor codebook zero: the selector adds nothing at first (DFlash's argmax) and its gradient reaches the
        successor codebook from the first step."""
        gen = None
        if seed is not None:
            gen = torch.Generator(self.successor_codebook.device).manual_seed(seed)
        self.predecessor_codebook.normal_(0.0, std, generator=gen)
        self.hidden_projection.weight.normal_(0.0, std, generator=gen)
        self.successor_codebook.zero_()

    def scores(self, hidden: torch.Tensor, unary: torch.Tensor, previous: torch.Tensor,
               candidates: torch.Tensor) -> torch.Tensor:
        """fp32 scores (..., K): hidden (..., H) the drafter's final hidden states, unary (..., K) the candidates'
        logits, previous (...,) int64 the token before each slot, candidates (..., K) int64."""
        context = self.predecessor_codebook[previous].float() * self.hidden_projection(hidden).float()  # (..., r)
        pairs = self.successor_codebook[candidates].float() * context[..., None, :]  # (..., K, r)
        return unary.float() + pairs.sum(-1)


@dataclass(frozen=True, slots=True, kw_only=True)
class SelectorTargets:
    """The teacher-forced selector problem of R rows (block slots)."""

    candidates: torch.Tensor
    """(R, K) int64: the candidates scored in training (the true token injected where `inject` puts it)."""
    target: torch.Tensor
    """(R,) int64: index of the true token among `candidates` (0 where it is absent and not injected)."""
    contains: torch.Tensor
    """(R,) bool: the true token is among the top-K the drafter's logits give (what decoding can pick)."""
    weight: torch.Tensor
    """(R,) fp32: 1, or 0 where `ignore` leaves a row whose true token is absent out of the selector's loss."""


def selector_targets(top: torch.Tensor, labels: torch.Tensor, missing: str) -> SelectorTargets:
    """Training candidates for rows with top-K ids `top` (R, K) and true tokens `labels` (R,); `missing`:
    inject | ignore (module docstring)."""
    match = top == labels[:, None]  # (R, K)
    contains = match.any(-1)
    target = match.long().argmax(-1)  # (R,) 0 where absent
    candidates = top
    weight = torch.ones_like(labels, dtype=torch.float32)
    if missing == "inject":
        last = top.shape[1] - 1
        candidates = top.clone()
        candidates[:, last] = torch.where(contains, top[:, last], labels)
        target = torch.where(contains, target, torch.full_like(target, last))
    else:
        weight = contains.float()
    return SelectorTargets(candidates=candidates, target=target, contains=contains, weight=weight)


def previous_tokens(block_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(N, B-1) the token before each predicted slot k = 1..B-1 under teacher forcing: the block's first token for
    slot 1, the true token at slot k - 1 after it. block_ids, labels: (N, B)."""
    return torch.cat([block_ids[:, :1], labels[:, 1:-1]], dim=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class WalkedDrafts:
    tokens: torch.Tensor
    """(R, S) int64: the token picked at each of S slots."""
    probs: Optional[torch.Tensor]
    """(R, S, V) fp32: at temperature > 0, the distribution each pick was drawn from (over the K candidates,
    zero elsewhere), given the picks before it; None when greedy."""


def walk(selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor, first: torch.Tensor,
         temperature: float, generator: Optional[torch.Generator]) -> WalkedDrafts:
    """Decoding's pass over S slots left to right: hidden (R, S, H) and logits (R, S, V) of the drafted slots,
    first (R,) the block's first token (the previous token of slot 1)."""
    unary, candidates = logits.topk(selector.top_k, dim=-1)  # (R, S, K) each
    previous = first
    tokens, rows = [], []
    for k in range(hidden.shape[1]):
        scores = selector.scores(hidden[:, k], unary[:, k], previous, candidates[:, k])  # (R, K)
        if temperature <= 0:
            pick = scores.argmax(-1)
        else:
            q = torch.softmax(scores / temperature, dim=-1)  # (R, K)
            pick = torch.multinomial(q, 1, generator=generator)[:, 0]
            rows.append(torch.zeros_like(logits[:, k], dtype=torch.float32).scatter_(-1, candidates[:, k], q))
        previous = candidates[:, k].gather(-1, pick[:, None])[:, 0]
        tokens.append(previous)
    return WalkedDrafts(tokens=torch.stack(tokens, 1), probs=torch.stack(rows, 1) if rows else None)
