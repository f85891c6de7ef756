"""The drafter loss: per-slot weighted CE (optionally mixed with distillation), computed in row chunks.

Rows are the block slots k = 1..B-1 of all N blocks. Slot k's label is the token at anchor + k. Weight:

- decay (default): exp(-(k-1)/gamma) x label_valid (loss mask at anchor + k, inside the sequence, valid block);
- D-PACE (`dpace`): from the drafter's own detached confidence q_k = exp(-CE_k) (0 for an invalid label),
  smoothed q~_k = (1-alpha) q_k + alpha, weight w_k = sum_{m>=k} prod_{i<=m} q~_i (the suffix sum of the
  prefix products: how much the expected accepted length depends on slot k), times label_valid.

Per-row loss = (1 - kd_weight) * CE + kd_weight * KL(teacher || drafter), the teacher for slot k being the
target's distribution at anchor + k - 1 (its last hidden state through its final norm and lm_head).

DSpark (`markov`): its own rows, labels, Markov bias and distance (`dspark.MarkovLoss.loss`).

DFlash2 (`selector`): plus `selector.weight` x the selector's K-way cross-entropy over each slot's top-K candidates
(`dflash2.py`), teacher-forced, with the same per-slot weights; the slot hits (accuracy, simulated tau) are then
the selector's greedy picks, as decoding makes them.

LiLiCorr (`lattice`): plus the lattice head's terms (`lilicorr.lattice_term`), a mean over the supervised slots,
scaled by this call's (detached) weight sum so that the trainer's one division adds that mean to the DFlash loss, as
ModelOpt's `dflash_loss + lilicorr_loss` (a chunked step averages its chunks' means, weighted by their DFlash
weights). The slot hits are the lattice walk's greedy picks, as decoding makes them.

The trainer divides the summed `loss_sum` by the `weight_sum` of the whole optimizer step (all microbatches,
all ranks), so both are returned as device tensors. The vocab projection runs in chunks of `chunk_rows`
rows under activation checkpointing: fp32 logits of one chunk exist at a time, forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_trainer.drafter.anchors import BlockPlan
from dflash_trainer.drafter.dflash2 import CandidateSelector, previous_tokens, selector_targets
from dflash_trainer.drafter.lilicorr import LatticeLoss, lattice_term

if TYPE_CHECKING:  # dspark.py builds on this module
    from dflash_trainer.drafter.dspark import MarkovLoss


@dataclass(frozen=True, slots=True, kw_only=True)
class LossOutput:
    """Sums over one microbatch; all 0-dim or (B-1,) fp32 tensors on the hidden states' device."""

    loss_sum: torch.Tensor
    """() sum over rows of weight * per-row loss (differentiable)."""
    weight_sum: torch.Tensor
    """() sum of the weights (detached)."""
    ce_sum: torch.Tensor
    """() weighted CE sum (detached; equals loss_sum when kd_weight is 0)."""
    slot_correct: torch.Tensor
    """(B-1,) argmax hits among valid labels, per slot k = 1..B-1."""
    slot_count: torch.Tensor
    """(B-1,) valid labels per slot."""
    accept_sum: torch.Tensor
    """() simulated acceptance summed over valid blocks: per block, 1 + the number of leading slots
    k = 1, 2, ... whose argmax equals a valid label (a greedy verifier accepting the longest correct
    prefix, plus its bonus token; a block near its sequence end is capped by its valid labels)."""
    block_count: torch.Tensor
    """() valid blocks (simulated tau = accept_sum / block_count)."""
    block_accept: torch.Tensor
    """(N,) simulated acceptance of each block (0 for invalid blocks); `accept_sum` is its sum."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Teacher:
    """What distillation needs from the frozen target."""

    last_hidden: torch.Tensor
    """(T, H) target's last hidden state before its final norm, per packed slot."""
    final_norm: Callable[[torch.Tensor], torch.Tensor]
    """The target's final norm (frozen)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SelectorLoss:
    """DFlash2's selector term of the loss (`drafter.selector_*`)."""

    selector: CandidateSelector
    weight: float
    """Its weight next to the DFlash loss (after the warm-up ramp)."""
    missing: str
    """inject | ignore: a slot whose true token is not among the top-K (`dflash2.selector_targets`)."""
    detach: bool
    """Stop its gradient at the backbone (the drafter's hidden states and logits)."""


def decay_weights(block_size: int, gamma: float, device: torch.device) -> torch.Tensor:
    """(B-1,) exp(-(k-1)/gamma) for slots k = 1..B-1."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def dpace_weights(ce: torch.Tensor, label_valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """(N, B-1) D-PACE weights from detached per-slot CE (N, B-1) and validity (N, B-1)."""
    q = torch.exp(-ce.detach()) * label_valid  # (N, B-1)
    q_smooth = (1.0 - alpha) * q + alpha
    prefix = torch.cumprod(q_smooth, dim=1)
    return torch.flip(torch.cumsum(torch.flip(prefix, [1]), dim=1), [1])


def _chunk_losses(
    hidden: torch.Tensor, labels: torch.Tensor, teacher_hidden: Optional[torch.Tensor],
    head: torch.Tensor, final_norm: Optional[Callable], top_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ce (r,), kl (r,), hit (r,) bool, top (r, top_k) int64 ids of the largest logits) for r rows: hidden (r, H),
    labels (r,), teacher_hidden (r, H)."""
    logits = F.linear(hidden.to(head.dtype), head).float()  # (r, V) fp32
    logp = torch.log_softmax(logits, dim=-1)
    ce = -logp.gather(1, labels[:, None])[:, 0]  # (r,)
    hit = logits.argmax(dim=-1) == labels
    top = logits.topk(top_k, dim=-1).indices  # (r, top_k)
    if teacher_hidden is None:
        return ce, torch.zeros_like(ce), hit, top
    with torch.no_grad():
        t_logits = F.linear(final_norm(teacher_hidden).to(head.dtype), head).float()  # (r, V)
        t_logp = torch.log_softmax(t_logits, dim=-1)
    kl = (t_logp.exp() * (t_logp - logp)).sum(-1)  # (r,)
    return ce, kl, hit, top


def _ce_and_logit_grad(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For logits (r, V) in the head dtype and labels (r,): CE (r,) fp32, argmax hit (r,) bool, and the CE's
    gradient w.r.t. the logits, softmax - onehot (r, V) in the logits dtype. Softmax math in fp32."""
    x = logits.float()  # (r, V)
    lse = torch.logsumexp(x, dim=-1)  # (r,)
    ce = lse - x.gather(1, labels[:, None])[:, 0]
    hit = x.argmax(dim=-1) == labels
    onehot = torch.arange(x.shape[1], device=x.device)[None, :] == labels[:, None]  # (r, V)
    return ce, hit, (torch.exp(x - lse[:, None]) - onehot.to(x.dtype)).to(logits.dtype)


_compiled_ce = None


def _ce_kernel(device: torch.device, compiled: bool) -> Callable:
    """`_ce_and_logit_grad`, compiled on CUDA unless `compiled` is False: one fused pass over the logits for
    the reductions and one for the gradient, instead of an fp32 copy and several separate passes over
    memory-bound logits."""
    global _compiled_ce
    if device.type != "cuda" or not compiled:
        return _ce_and_logit_grad
    if _compiled_ce is None:
        _compiled_ce = torch.compile(_ce_and_logit_grad, dynamic=False)
    return _compiled_ce


class _FrozenHeadCE(torch.autograd.Function):
    """Chunked CE through a frozen LM head whose gradient is computed in the forward pass.

    The head needs no gradient, so per chunk the forward computes the logits, the CE, and at once the
    CE's gradient w.r.t. the hidden rows, (softmax - onehot) @ head; backward only scales the stored
    gradient by the incoming one. Two vocab-sized matmuls per row instead of three (forward, the
    checkpoint's recompute, backward), and only one chunk of logits alive at a time.
    """

    @staticmethod
    def forward(ctx, rows: torch.Tensor, labels: torch.Tensor, head: torch.Tensor, chunk_rows: int, kernel: Callable,
                top_k: int):
        ce = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)  # (R,)
        hit = torch.empty(rows.shape[0], dtype=torch.bool, device=rows.device)  # (R,)
        top = torch.empty(rows.shape[0], top_k, dtype=torch.int64, device=rows.device)  # (R, top_k)
        grad = torch.empty_like(rows)  # (R, H): dCE_r / d rows_r
        for start in range(0, rows.shape[0], chunk_rows):
            stop = min(start + chunk_rows, rows.shape[0])
            logits = F.linear(rows[start:stop].to(head.dtype), head)  # (r, V) head dtype
            ce[start:stop], hit[start:stop], logit_grad = kernel(logits, labels[start:stop])
            grad[start:stop] = (logit_grad @ head).to(rows.dtype)  # (r, H)
            if top_k:
                top[start:stop] = logits.topk(top_k, dim=-1).indices
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(hit, top)
        return ce, hit, top

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor, grad_hit, grad_top):
        (grad,) = ctx.saved_tensors
        return grad * grad_ce[:, None].to(grad.dtype), None, None, None, None, None


def drafter_loss(
    hidden: torch.Tensor,
    plan: BlockPlan,
    *,
    lm_head_weight: torch.Tensor,
    gamma: float,
    chunk_rows: int,
    kd_weight: float = 0.0,
    teacher: Optional[Teacher] = None,
    dpace: bool = False,
    dpace_alpha: float = 0.5,
    compiled_ce: bool = True,
    selector: Optional[SelectorLoss] = None,
    markov: Optional["MarkovLoss"] = None,
    lattice: Optional[LatticeLoss] = None,
) -> LossOutput:
    """Loss sums for hidden (N, B, H) from `forward_train` with labels from `plan`; lm_head_weight (V, H).
    `compiled_ce` False keeps the frozen-head CE kernel eager on CUDA (`drafter.loss_kernel`); `selector`: DFlash2's
    selector term; `markov`: a DSpark drafter's loss, which replaces this one; `lattice`: LiLiCorr's lattice terms
    (module docstring)."""
    if markov is not None:
        return markov.loss(hidden, plan, lm_head_weight=lm_head_weight, gamma=gamma, chunk_rows=chunk_rows,
                           kd_weight=kd_weight, teacher=teacher, dpace=dpace, dpace_alpha=dpace_alpha)
    n, b, h = hidden.shape
    rows = hidden[:, 1:].reshape(-1, h)  # (N*(B-1), H)
    labels = plan.labels[:, 1:].reshape(-1)  # (N*(B-1),)
    valid = plan.label_valid[:, 1:]  # (N, B-1)
    teacher_rows = None
    if kd_weight > 0:
        if teacher is None:
            raise ValueError("drafter.kd_weight > 0 needs the target's last hidden state (a Teacher)")
        # slot k's teacher is the target at anchor + k - 1, i.e. positions anchor + 0 .. anchor + B-2
        idx = (plan.anchors[:, None] + torch.arange(b - 1, device=hidden.device)).clamp(max=teacher.last_hidden.shape[0] - 1)
        teacher_rows = teacher.last_hidden[idx.reshape(-1)]  # (N*(B-1), H)
    top_k = max(0 if selector is None else selector.selector.top_k, 0 if lattice is None else lattice.head.top_k)
    ce_parts, kl_parts, hit_parts, top_parts = [], [], [], []
    grad = torch.is_grad_enabled() and rows.requires_grad
    if grad and teacher_rows is None and not lm_head_weight.requires_grad:
        ce_all, hit_all, top_all = _FrozenHeadCE.apply(rows, labels, lm_head_weight, chunk_rows,
                                                       _ce_kernel(rows.device, compiled_ce), top_k)
        ce_parts, kl_parts, hit_parts, top_parts = [ce_all], [torch.zeros_like(ce_all)], [hit_all], [top_all]
    for start in range(0, rows.shape[0] if not ce_parts else 0, chunk_rows):
        stop = min(start + chunk_rows, rows.shape[0])
        t_chunk = None if teacher_rows is None else teacher_rows[start:stop]
        args = (rows[start:stop], labels[start:stop], t_chunk, lm_head_weight,
                None if teacher is None else teacher.final_norm, top_k)
        out = checkpoint(_chunk_losses, *args, use_reentrant=False) if grad else _chunk_losses(*args)
        for parts, part in zip((ce_parts, kl_parts, hit_parts, top_parts), out):
            parts.append(part)
    ce = torch.cat(ce_parts).view(n, b - 1)  # (N, B-1)
    kl = torch.cat(kl_parts).view(n, b - 1)
    hit = torch.cat(hit_parts).view(n, b - 1) & valid
    if dpace:
        weights = dpace_weights(ce, valid, dpace_alpha) * valid
    else:
        weights = decay_weights(b, gamma, hidden.device)[None, :] * valid  # (N, B-1)
    per_row = ce if kd_weight == 0 else (1.0 - kd_weight) * ce + kd_weight * kl
    if selector is not None:
        picked = _selector_term(rows, labels, torch.cat(top_parts), plan, lm_head_weight, selector, chunk_rows)
        per_row = per_row + selector.weight * picked.weight.view(n, b - 1) * picked.ce.view(n, b - 1)
        hit = picked.hit.view(n, b - 1) & valid  # decoding's picks are the selector's
    extra = weights.new_zeros(())
    if lattice is not None:
        term = _lattice_term(rows, labels, ce.reshape(-1), torch.cat(top_parts), plan, lm_head_weight, lattice,
                             chunk_rows)
        extra = term.mean * weights.sum().detach()
        hit = term.hit & valid  # decoding's picks are the lattice walk's
    accepted = torch.cumprod(hit.to(torch.float32), dim=1).sum(1) + 1.0  # (N,)
    block_valid = plan.block_valid.to(torch.float32)
    block_accept = accepted * block_valid  # (N,)
    return LossOutput(
        loss_sum=(weights * per_row).sum() + extra,
        weight_sum=weights.sum().detach(),
        ce_sum=(weights * ce).sum().detach(),
        slot_correct=hit.to(torch.float32).sum(0),
        slot_count=valid.to(torch.float32).sum(0),
        accept_sum=block_accept.sum(),
        block_count=block_valid.sum(),
        block_accept=block_accept,
    )



@dataclass(frozen=True, slots=True, kw_only=True)
class _SelectorTerm:
    ce: torch.Tensor
    """(R,) fp32 the selector's K-way cross-entropy per row."""
    weight: torch.Tensor
    """(R,) fp32 1, or 0 for a row `ignore` leaves out."""
    hit: torch.Tensor
    """(R,) bool the selector's greedy pick (teacher-forced) is the true token."""


def _selector_term(rows: torch.Tensor, labels: torch.Tensor, top: torch.Tensor, plan: BlockPlan, head: torch.Tensor,
                   loss: SelectorLoss, chunk_rows: int) -> _SelectorTerm:
    """The selector's loss on rows (R, H) (the block slots 1..B-1 of `plan`) with true tokens labels (R,) and the
    top-K ids of their logits, top (R, K)."""
    targets = selector_targets(top, labels, loss.missing)
    previous = previous_tokens(plan.block_ids, plan.labels).reshape(-1)  # (R,)
    hidden = rows.detach() if loss.detach else rows
    unary = candidate_logits(hidden, head, targets.candidates, chunk_rows)  # (R, K)
    scores = loss.selector.scores(hidden, unary, previous, targets.candidates)  # (R, K) fp32
    ce = F.cross_entropy(scores, targets.target, reduction="none")  # (R,)
    return _SelectorTerm(ce=ce, weight=targets.weight, hit=targets.contains & (scores.argmax(-1) == targets.target))


def _lattice_term(rows: torch.Tensor, labels: torch.Tensor, ce: torch.Tensor, top: torch.Tensor, plan: BlockPlan,
                  head: torch.Tensor, loss: LatticeLoss, chunk_rows: int):
    """LiLiCorr's lattice terms on rows (R, H) (the block slots 1..B-1 of `plan`) with true tokens labels (R,), their
    CE (R,) (differentiable) and the top ids of their logits (R, >= K). The candidates' log-probabilities come without
    another vocabulary pass: log p(c) = logit(c) - logsumexp = logit(c) - logit(label) - CE. The head runs in chunks
    of about chunk_rows x H / h candidates (h its width): a chunk holds about as many head-wide states as a logits
    chunk holds drafter-wide rows."""
    n, b = plan.labels.shape
    k = loss.head.top_k
    ids = top[:, :k]  # (R, K)
    picked = candidate_logits(rows, head, torch.cat([ids, labels[:, None]], dim=1), chunk_rows)  # (R, K+1)
    log_probs = picked[:, :-1] - (picked[:, -1:] + ce[:, None])  # (R, K)
    return lattice_term(loss, ids=ids.view(n, b - 1, -1), log_probs=log_probs.view(n, b - 1, -1),
                        hidden=rows.view(n, b - 1, -1), labels=labels.view(n, b - 1),
                        label_valid=plan.label_valid[:, 1:], anchors=plan.anchors, anchor_pos=plan.anchor_pos,
                        chunk_blocks=chunk_rows * rows.shape[-1] // ((b - 1) * k * loss.head.width))


def candidate_logits(rows: torch.Tensor, head: torch.Tensor, candidates: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """(R, K) fp32 logits of the candidates (R, K) of rows (R, H) through the frozen head (V, H), differentiable in
    the rows. The gathered head rows (r, K, H) exist one chunk at a time, forward and backward."""
    parts = []
    for start in range(0, rows.shape[0], chunk_rows):
        stop = min(start + chunk_rows, rows.shape[0])
        args = (rows[start:stop], candidates[start:stop])
        parts.append(checkpoint(_candidate_chunk, *args, head, use_reentrant=False) if rows.requires_grad
                     else _candidate_chunk(*args, head))
    return torch.cat(parts)


def _candidate_chunk(rows: torch.Tensor, candidates: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    return torch.einsum("rh,rkh->rk", rows.to(head.dtype), head[candidates]).float()  # (r, K)
