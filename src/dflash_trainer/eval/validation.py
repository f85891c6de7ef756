"""Held-out validation: teacher-forced metrics on held-out conversations, and walk tau.

Cheap next to real decoding, so it can run often during training. The held-out conversations are packed and
run through the target exactly as training batches are (same shapes, so a compiled drafter forward is
reused); then a block is drafted at *every* anchor of every reply and scored against the reply's tokens:

- `loss`, `accuracy`, `slot_accuracy`, `sim_tau`: the training objective and metrics over all anchors
  (what the training log shows, on data the drafter never saw);
- `walk_tau`: the acceptance at each anchor walked as greedy decoding walks. A reply's walk starts at its
  first token (the one the prefill commits), moves on by the acceptance length and so restarts right after
  each rejection, and stops at the reply's end or after `max_new_tokens` tokens. On replies that are the
  target's own greedy output, this is the tau that real decoding of the same prompts measures, up to
  numerics; averaging over all anchors instead (`sim_tau`) counts easy runs many times and overstates it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from dflash_trainer.config import Config
from dflash_trainer.data.plan import build_epoch_plan
from dflash_trainer.data.tokenized import TokenizedDataset
from dflash_trainer.drafter.anchors import plan_from_anchors, token_seq_ids, valid_anchor_mask
from dflash_trainer.drafter.dspark import markov_loss
from dflash_trainer.drafter.lilicorr import lattice_loss
from dflash_trainer.drafter.loss import SelectorLoss, drafter_loss
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.target.capture import TapCapture
from dflash_trainer.target.head import TargetHead
from dflash_trainer.target.worker import forward_job
from dflash_trainer.transport.wire import WireBatch, wire_spec


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidationReport:
    """Held-out metrics of one drafter (logged as `val_*`)."""

    loss: float
    """Weighted CE over every held-out anchor, as the training loss weighs it."""
    accuracy: float
    slot_accuracy: tuple[float, ...]
    """Per block slot k = 1..B-1."""
    sim_tau: float
    """Simulated acceptance averaged over every anchor."""
    walk_tau: float
    """Simulated acceptance walked as greedy decoding walks (see the module docstring)."""
    anchors: int
    walk_steps: int
    replies: int
    seconds: float


def reply_spans(loss_mask: Sequence[bool]) -> list[tuple[int, int]]:
    """(first, last) index of every maximal run of supervised tokens: one assistant reply each (its end-of-
    turn token included)."""
    spans, start = [], None
    for i, m in enumerate(loss_mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i - 1))
            start = None
    if start is not None:
        spans.append((start, len(loss_mask) - 1))
    return spans


def walk(acceptance: Sequence[int], first: int, last: int, max_new_tokens: int) -> list[int]:
    """Acceptance lengths of decoding one reply: `acceptance[i]` is the simulated acceptance of the block
    anchored at index i; the walk starts at `first` and commits up to index min(last, first + max_new - 1)."""
    end = min(last, first + max_new_tokens - 1)
    steps, i = [], first
    while i < end:
        a = min(acceptance[i], end - i)
        steps.append(a)
        i += a
    return steps


class HeldOutValidator:
    """Validation on fixed held-out sequences: target taps and drafter blocks in training-shaped batches."""

    def __init__(self, *, capture: TapCapture, dataset: TokenizedDataset, buffers: WireBatch, head: TargetHead,
                 num_blocks: int, gamma: float, max_new_tokens: int, compute_dtype: torch.dtype,
                 chunk_rows: int) -> None:
        """`buffers`: one wire batch of the run's shape (taps land there); `num_blocks`: the training batches'
        blocks (anchors beyond it take several drafter forwards over the same taps)."""
        token_budget, max_seqs = buffers.input_ids.numel(), buffers.cu_seqlens.numel() - 1
        self.capture, self.dataset, self.buffers, self.head = capture, dataset, buffers, head
        self.jobs = build_epoch_plan(dataset.lengths, epoch=0, seed=0, num_buckets=1, token_budget=token_budget,
                                     max_seqs=max_seqs).jobs
        self.num_blocks, self.gamma, self.max_new_tokens = num_blocks, gamma, max_new_tokens
        self.compute_dtype, self.chunk_rows = compute_dtype, chunk_rows

    def run(self, model: DFlashDrafter, *, blocks_per_chunk: Optional[int] = None) -> ValidationReport:
        """`blocks_per_chunk`: the training step's chunk size when it runs a batch's blocks in chunks (long
        sequences): the context's keys and values are then computed once per batch and the anchors drafted that
        many at a time, the memory of a training chunk; None: `num_blocks` at a time through the one-pass
        forward."""
        start = time.perf_counter()
        size = self.num_blocks if blocks_per_chunk is None else min(blocks_per_chunk, self.num_blocks)
        chunked = size < self.num_blocks
        device = self.buffers.input_ids.device
        fp32 = self.compute_dtype == torch.float32
        embed = self.head.embed_weight.float() if fp32 else self.head.embed_weight
        lm_head = self.head.lm_head_weight.float() if fp32 else self.head.lm_head_weight
        autocast = contextlib.nullcontext() if fp32 else torch.autocast(device.type, dtype=self.compute_dtype)
        spec = model.spec
        # DFlash2: the selector's picks score the blocks; its loss is left out (weight 0), so `loss` compares with
        # a DFlash drafter's
        selector = None if model.candidate_selector is None else SelectorLoss(
            selector=model.candidate_selector, weight=0.0, missing="inject", detach=False)
        markov = markov_loss(model, "l1")  # DSpark: its CE (kd_weight 0 here, so no divergence is computed)
        # The drafter's mode and the grad mode are left as training has them (the drafter has no mode-dependent
        # layer, and nothing is back-propagated): a compiled training forward would compile again for others.
        sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, weight, accept, blocks
        slots = torch.zeros(2, spec.draft_length, dtype=torch.float64, device=device)  # correct, count
        steps: list[int] = []
        replies = 0
        for job in self.jobs:
            with torch.no_grad():
                batch, _ = forward_job(self.capture, self.dataset, job, self.buffers)
            taps = batch.taps.float() if fp32 else batch.taps
            accept = self._score_blocks(model, batch, taps, size=size, chunked=chunked, embed=embed, lm_head=lm_head,
                                        autocast=autocast, selector=selector, sums=sums, slots=slots, markov=markov)
            # host sync: the walk follows each reply's acceptance on the host
            mask = batch.loss_mask[: batch.num_tokens].tolist()
            acceptance = accept[: batch.num_tokens].round().long().tolist()
            bounds = batch.cu_seqlens[: batch.num_seqs + 1].tolist()
            for s in range(batch.num_seqs):
                lo, hi = bounds[s], bounds[s + 1]
                for first, last in reply_spans(mask[lo:hi]):
                    replies += 1
                    steps += walk(acceptance[lo:hi], first, last, self.max_new_tokens)
        loss, weight, accepted, blocks = sums.tolist()  # host sync: the report
        correct, count = slots.tolist()
        return ValidationReport(
            loss=loss / max(weight, 1e-12),
            accuracy=sum(correct) / max(sum(count), 1.0),
            slot_accuracy=tuple(c / max(k, 1.0) for c, k in zip(correct, count)),
            sim_tau=accepted / max(blocks, 1.0),
            walk_tau=sum(steps) / len(steps) if steps else 0.0,
            anchors=int(blocks),
            walk_steps=len(steps),
            replies=replies,
            seconds=time.perf_counter() - start,
        )


    def _score_blocks(self, model: DFlashDrafter, batch, taps: torch.Tensor, *, size: int, chunked: bool,
                      embed: torch.Tensor, lm_head: torch.Tensor, autocast, selector, sums: torch.Tensor,
                      slots: torch.Tensor, markov=None) -> torch.Tensor:
        """One batch's every valid anchor drafted, `size` blocks at a time: adds its loss, weight, acceptance and
        block count to `sums` (4,) and its slot hits and counts to `slots` (2, drafting slots); returns each anchor's accepted
        length, (T,) fp32 (0 where no block starts)."""
        spec, device = model.spec, taps.device
        seq = token_seq_ids(batch.cu_seqlens, batch.input_ids.shape[0])  # (T,)
        anchors = torch.nonzero(valid_anchor_mask(batch.loss_mask.bool(), seq)).flatten()  # (A,)
        accept = torch.zeros(batch.input_ids.shape[0], dtype=torch.float32, device=device)  # (T,)
        context = None
        if chunked:
            with autocast:
                context = model.train_context(taps, batch.cu_seqlens)  # per layer (T, nkv, hd), once a batch
        # LiLiCorr: the lattice walk's picks score the blocks; its terms are left out (weights 0), as DFlash2's
        lattice = lattice_loss(None, model, taps=taps, embed=embed, lm_head=lm_head, last_hidden=None, final_norm=None)
        for lo in range(0, anchors.numel(), size):
            chunk = anchors[lo : lo + size]
            n = chunk.numel()
            padded = torch.zeros(size, dtype=torch.int64, device=device)  # (C,)
            padded[:n] = chunk
            plan = plan_from_anchors(
                anchors=padded, block_valid=torch.arange(size, device=device) < n,
                input_ids=batch.input_ids, loss_mask=batch.loss_mask, cu_seqlens=batch.cu_seqlens,
                block_size=spec.block_size, mask_token_id=spec.mask_token_id, label_offset=spec.label_offset,
            )
            with autocast:
                if context is None:
                    hidden = model.forward_train(taps=taps, cu_seqlens=batch.cu_seqlens, plan=plan,
                                                 embed_weight=embed)  # (C, B, H)
                else:
                    hidden = model.forward_train_blocks(context=context, plan=plan, cu_seqlens=batch.cu_seqlens,
                                                        embed_weight=embed)  # (C, B, H)
                out = drafter_loss(hidden, plan, lm_head_weight=lm_head, gamma=self.gamma,
                                   chunk_rows=self.chunk_rows, selector=selector, markov=markov, lattice=lattice)
            sums += torch.stack([out.loss_sum.detach(), out.weight_sum, out.accept_sum, out.block_count]).double()
            slots += torch.stack([out.slot_correct, out.slot_count]).double()
            accept[chunk] = out.block_accept[:n].float()
            del hidden, out  # this chunk's graph (grad mode is training's) goes before the next forward
        return accept


def build_validator(config: Config, *, capture: TapCapture, head: TargetHead, tokenizer, conversations_path,
                    device: torch.device) -> "HeldOutValidator | None":
    """A validator over the first `eval.num_prompts` conversations with a reply in `conversations_path` (a
    JSONL of `{"messages": [...]}` rows: `plan/eval.jsonl` or `eval.prompts`), the same conversations whose
    prompts real tau decodes; None when none has a reply."""
    from dflash_trainer.data.config import DataSourceConfig
    from dflash_trainer.data.sources import load_source
    from dflash_trainer.data.tokenized import tokenize_all
    from dflash_trainer.data.tokenizer import load_image_tokens
    from dflash_trainer.data.vision import ImageTokens
    from dflash_trainer.target.load import DTYPES
    from dflash_trainer.transport.wire import allocate

    images = load_image_tokens(config.target, tokenizer)  # an image-text target validates with the images
    images = images if isinstance(images, ImageTokens) else None  # one whose images are refused: its text rows
    loaded = load_source(DataSourceConfig(path=str(conversations_path), format="messages"),
                         limit=config.eval.num_prompts, max_record_bytes=config.data.max_record_bytes,
                         images=images is not None)
    dataset = tokenize_all(list(loaded.conversations), tokenizer, thinking=config.data.thinking,
                           max_length=config.data.max_length, min_supervised=2,
                           escape_special_tokens=config.data.escape_special_tokens,
                           images=images).dataset  # as the training set
    if len(dataset) == 0:
        return None
    wire = wire_spec(config, hidden=capture.hidden, num_taps=len(capture.tap_layer_ids))
    return HeldOutValidator(
        capture=capture, dataset=dataset, buffers=allocate(wire, device), head=head, num_blocks=config.batch.num_blocks,
        gamma=config.drafter.loss_gamma, max_new_tokens=config.eval.max_new_tokens,
        compute_dtype=DTYPES[config.train.dtype], chunk_rows=config.drafter.loss_chunk_rows,
    )
