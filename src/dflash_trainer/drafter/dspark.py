"""DSpark (`drafter.variant: dspark`): a DFlash backbone whose anchor slot drafts too, plus a Markov head that biases
each slot's logits by the token before it. Trained by dflash-train, and read from other trainers' exports (ModelOpt's
`projector_type: dspark`) for evaluation.

Facts from the DSpark paper (deepseek-ai/DeepSpec), ModelOpt 0.47's trainer and export of it, and the engines that
serve it (vLLM `qwen3_dspark.py` + `v1/worker/gpu/spec_decode/dspark/`, SGLang `srt/models/dspark.py`), which this
file holds us to:

- **Slots.** A block's slot k predicts the token at anchor + k + 1 (the export's `shift_label: true`): the anchor's
  own slot drafts too, so a block of B slots drafts B tokens and a verification step checks B + 1 (DFlash: B - 1
  and B). vLLM serves it with `num_speculative_tokens` = B, SGLang with `speculative_num_draft_tokens` = B + 1.
- **Markov head** (`vanilla`, the only kind run here): a low-rank bias from the previous token,
  `bias(prev) = W2 W1[prev]` with `markov_w1` an embedding (V, r) and `markov_w2` a linear map r -> V (no bias),
  added to each slot's logits: slot k's distribution is softmax(U_k + bias(x_{k-1})), `x_{-1}` the anchor.
  Decoding walks the slots left to right (`markov_walk`); greedy takes each slot's argmax, sampling draws from that
  softmax at the temperature (the distribution the lossless acceptance rule compares with the target's).
- **Training** (`dspark_loss`): teacher-forced (slot k's previous token is the true token at anchor + k), every
  slot a loss row, weights exp(-k/gamma) for k = 0..B-1 (the first drafting slot weighs 1, as DFlash's slot 1), or
  D-PACE's. Per row (1 - kd_weight) CE + kd_weight D(target, draft), the target's distribution at anchor + k (its
  last hidden state through its final norm and LM head: the `vlh` taps), D the L1 distance sum |p - q| (=
  2 TV; ModelOpt's and DeepSpec's "TVD" term, `drafter.dspark_divergence: l1`) or KL (`kl`, DFlash's KD). DSpark's
  recipe is kd_weight 0.9 with l1 (0.1 CE + 0.9 L1, gamma 4); the default, kd_weight 0, is CE with decay, which
  needs no target logits in the data path. A row after a slot without a label is left out: its teacher-forced
  previous token would not be the text's (and decoding never reaches past a rejected slot).
- **Names.** The engines read `markov_head.markov_w1.weight` and `markov_head.markov_w2.weight` (ModelOpt's own
  loader takes them too, and writes them flat, `markov_w1.weight`, which `engine_names` maps on reading), the config
  `architectures: ["Qwen3DSparkModel"]` and `markov_rank` at the top level (SGLang's head and vLLM's model read it
  there; SGLang's config parser and ModelOpt read `dflash_config.markov_rank`: both are written).
- The `gated` and `rnn` heads, which also read the backbone's hidden state, and the confidence head (for a serving
  engine's scheduler, not for chain verification; SGLang builds it only outside its default static verify mode, vLLM
  only with `enable_confidence_head`) are not trained or read: an export with another head is refused, a confidence
  head's weights left out with a log line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_trainer.drafter.anchors import BlockPlan
from dflash_trainer.drafter.loss import LossOutput, Teacher, decay_weights, dpace_weights

MARKOV_KEYS = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")
"""The Markov head's tensors, named as the engines load them (and as the drafter's state dict has them)."""

FLAT_MARKOV_KEYS = ("markov_w1.weight", "markov_w2.weight")
"""The same tensors as ModelOpt's export names them."""

CONFIDENCE_KEYS = ("confidence_proj.weight", "confidence_proj.bias", "confidence_head.proj.weight",
                   "confidence_head.proj.bias")
"""The confidence head's tensors (ModelOpt's names, the engines'), not used by chain verification."""


class MarkovHead(nn.Module):
    """`markov_w1` (V, r) and `markov_w2` (r -> V, no bias): bias(prev) = W2 W1[prev] (module docstring)."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, seed: Optional[int] = None) -> None:
        """Both factors ~ N(0, std^2), as ModelOpt's trainer starts them, from a generator seeded `seed` (else the
        global one): the backbone's draws stay those of the DFlash drafter of the same seed."""
        gen = None if seed is None else torch.Generator(self.markov_w1.weight.device).manual_seed(seed)
        self.markov_w1.weight.normal_(0.0, std, generator=gen)
        self.markov_w2.weight.normal_(0.0, std, generator=gen)

    def bias(self, previous: torch.Tensor) -> torch.Tensor:
        """(..., V) fp32 logit bias of the previous tokens (...,) int64."""
        return self.markov_w2(self.markov_w1(previous)).float()


def engine_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with ModelOpt's flat Markov names (`markov_w1.weight`) renamed to the engines' (`markov_head.`)."""
    flat = dict(zip(FLAT_MARKOV_KEYS, MARKOV_KEYS))
    return {flat.get(k, k): v for k, v in state.items()}


@dataclass(frozen=True, slots=True, kw_only=True)
class MarkovDrafts:
    """One block's drafts per row, walked slot by slot."""

    tokens: torch.Tensor
    """(R, B) int64: the drafted tokens, on the logits' device."""
    probs: Optional[torch.Tensor]
    """(R, B, V) float32: the distribution each token was drawn from (sampling), else None (greedy)."""


def markov_walk(w1: nn.Embedding, w2: nn.Linear, logits: torch.Tensor, anchors: torch.Tensor, temperature: float,
                generator: Optional[torch.Generator]) -> MarkovDrafts:
    """Walk a block's slots left to right: slot k's logits (R, B, V) plus the bias of the token picked at slot k - 1
    (`anchors` (R,) for slot 0); greedy at temperature <= 0, else sampled from softmax(. / temperature)."""
    prev = anchors
    tokens, probs = [], []
    for k in range(logits.shape[1]):  # each slot's bias depends on the previous slot's pick: a sequential walk
        scores = logits[:, k] + w2(w1(prev)).float()  # (R, V)
        if temperature <= 0:
            prev = scores.argmax(-1)
        else:
            p = F.softmax(scores / temperature, dim=-1)
            prev = torch.multinomial(p, 1, generator=generator).squeeze(-1)
            probs.append(p)
        tokens.append(prev)
    return MarkovDrafts(tokens=torch.stack(tokens, dim=1), probs=torch.stack(probs, dim=1) if probs else None)


def previous_tokens(plan: BlockPlan) -> torch.Tensor:
    """(N, B) the teacher-forced token before each slot: the anchor's token for slot 0, the label of slot k - 1
    (the true token at anchor + k) after it. `plan` has DSpark's labels (`label_offset` 1)."""
    return torch.cat([plan.block_ids[:, :1], plan.labels[:, :-1]], dim=1)


def _chunk_losses(rows: torch.Tensor, labels: torch.Tensor, previous: torch.Tensor,
                  teacher_rows: Optional[torch.Tensor], head: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  final_norm, divergence: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ce (r,), distance (r,), hit (r,) bool) of r rows (r, H) with labels and previous tokens (r,) int64; head
    (V, H) the frozen LM head, w1 (V, r) and w2 (V, r) the Markov factors; teacher_rows (r, H) or None."""
    logits = F.linear(rows.to(head.dtype), head).float() + F.linear(w1[previous], w2).float()  # (r, V) fp32
    logp = torch.log_softmax(logits, dim=-1)
    ce = -logp.gather(1, labels[:, None])[:, 0]  # (r,)
    hit = logits.argmax(dim=-1) == labels
    if teacher_rows is None:
        return ce, torch.zeros_like(ce), hit
    with torch.no_grad():
        t_logp = torch.log_softmax(F.linear(final_norm(teacher_rows).to(head.dtype), head).float(), dim=-1)  # (r, V)
    if divergence == "l1":
        distance = (logp.exp() - t_logp.exp()).abs().sum(-1)  # (r,)
    else:
        distance = (t_logp.exp() * (t_logp - logp)).sum(-1)
    return ce, distance, hit


_compiled_chunk_losses = None


def compiled_chunk_losses() -> Callable:
    """`_chunk_losses` torch.compile'd for fixed shapes (a run's chunks have one size, its last another): the
    softmax, its gathers, argmax and distance over each fp32 logits chunk fused into few passes, where eager makes
    one pass over memory per operation, forward, recompute and backward."""
    global _compiled_chunk_losses
    if _compiled_chunk_losses is None:
        _compiled_chunk_losses = torch.compile(_chunk_losses, dynamic=False)
    return _compiled_chunk_losses


@dataclass(frozen=True, slots=True, kw_only=True)
class MarkovLoss:
    """DSpark's loss (module docstring): `drafter_loss` hands a DSpark drafter's blocks to `loss`."""

    head: MarkovHead
    divergence: str
    """l1 | kl: the distance to the target's distribution that kd_weight weighs."""
    chunk_kernel: Callable = _chunk_losses
    """The loss of one chunk of rows: `_chunk_losses`, or the same compiled (`compiled_chunk_losses`)."""

    def loss(self, hidden: torch.Tensor, plan: BlockPlan, *, lm_head_weight: torch.Tensor, gamma: float,
             chunk_rows: int, kd_weight: float = 0.0, teacher: Optional[Teacher] = None, dpace: bool = False,
             dpace_alpha: float = 0.5) -> LossOutput:
        """Loss sums of hidden (N, B, H) from `forward_train` with DSpark's labels in `plan` (every slot a row; the
        per-slot outputs (B,)); lm_head_weight (V, H)."""
        n, b, h = hidden.shape
        rows = hidden.reshape(-1, h)  # (N*B, H)
        labels = plan.labels.reshape(-1)  # (N*B,)
        valid = torch.cumprod(plan.label_valid.to(torch.int64), dim=1).bool()  # (N, B) a labelled prefix only
        previous = previous_tokens(plan).reshape(-1)  # (N*B,)
        teacher_rows = None
        if kd_weight > 0:
            if teacher is None:
                raise ValueError("drafter.kd_weight > 0 needs the target's last hidden state (a Teacher)")
            # slot k predicts anchor + k + 1: the target's distribution for it is the one at anchor + k
            idx = (plan.anchors[:, None] + torch.arange(b, device=hidden.device)).clamp(
                max=teacher.last_hidden.shape[0] - 1)  # (N, B)
            teacher_rows = teacher.last_hidden[idx.reshape(-1)]  # (N*B, H)
        grad = torch.is_grad_enabled() and rows.requires_grad
        parts: list[tuple[torch.Tensor, ...]] = []
        for start in range(0, rows.shape[0], chunk_rows):
            stop = min(start + chunk_rows, rows.shape[0])
            args = (rows[start:stop], labels[start:stop], previous[start:stop],
                    None if teacher_rows is None else teacher_rows[start:stop], lm_head_weight,
                    self.head.markov_w1.weight, self.head.markov_w2.weight,
                    None if teacher is None else teacher.final_norm, self.divergence)
            # fp32 logits of one chunk at a time, forward and backward
            kernel = self.chunk_kernel
            parts.append(checkpoint(kernel, *args, use_reentrant=False) if grad else kernel(*args))
        ce, distance, hit = (torch.cat(t).view(n, b) for t in zip(*parts))  # (N, B) each
        hit = hit & valid
        if dpace:
            weights = dpace_weights(ce, valid, dpace_alpha) * valid
        else:
            weights = decay_weights(b + 1, gamma, hidden.device)[None, :] * valid  # exp(-k/gamma), k = 0..B-1
        per_row = ce if kd_weight == 0 else (1.0 - kd_weight) * ce + kd_weight * distance
        accepted = torch.cumprod(hit.to(torch.float32), dim=1).sum(1) + 1.0  # (N,) leading hits + the bonus token
        block_valid = plan.block_valid.to(torch.float32)
        block_accept = accepted * block_valid
        return LossOutput(
            loss_sum=(weights * per_row).sum(), weight_sum=weights.sum().detach(), ce_sum=(weights * ce).sum().detach(),
            slot_correct=hit.to(torch.float32).sum(0), slot_count=valid.to(torch.float32).sum(0),
            accept_sum=block_accept.sum(), block_count=block_valid.sum(), block_accept=block_accept,
        )


def markov_loss(model: nn.Module, divergence: str, compiled: bool = False) -> Optional[MarkovLoss]:
    """The DSpark loss of `model` (a `DFlashDrafter`), None unless it is a DSpark drafter; `compiled`
    (`drafter.loss_kernel`) computes its chunks compiled on CUDA."""
    head = getattr(model, "markov_head", None)
    if head is None:
        return None
    on_cuda = head.markov_w2.weight.device.type == "cuda"
    kernel = compiled_chunk_losses() if compiled and on_cuda else _chunk_losses
    return MarkovLoss(head=head, divergence=divergence, chunk_kernel=kernel)
