"""Draft proposers for batched decoding (`batched.py`): the DFlash drafter, and prompt lookup.

Prompt lookup is the training-free baseline a drafter must beat: it copies the tokens that followed the
latest earlier occurrence of the context's last n tokens (prompt + generated so far), trying n from
`max_ngram` down to `min_ngram`, and proposes nothing when no n-gram recurs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from dflash_trainer.drafter.dflash2 import walk
from dflash_trainer.drafter.domino import domino_walk
from dflash_trainer.drafter.dspark import markov_walk
from dflash_trainer.drafter.lilicorr import AnchorTracker, draft_block
from dflash_trainer.drafter.model import DFlashDrafter, DraftContext
from dflash_trainer.errors import ConfigError
from dflash_trainer.eval.batched import BlockDrafts, ContextUpdate


class DFlashBatchProposer:
    """Drafts every row's block in one drafter forward, over the target's frozen embedding and LM head; a DFlash2
    drafter's selector then walks the slots (`dflash2.walk`), a DSpark drafter's Markov head too
    (`dspark.markov_walk`, every slot drafting: its blocks are one slot shorter than the verified block), a LiLiCorr
    drafter's lattice head too (`lilicorr.draft_block`, anchored on each row's newest committed context), a Domino
    drafter's correction head too (`domino.domino_walk`, from the anchor's slot on)."""

    needs_taps = True

    def __init__(self, drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, *,
                 lattice_head: bool = True) -> None:
        if not lattice_head and drafter.lilicorr is None:
            raise ConfigError("eval.lattice_head=false reads only a LiLiCorr drafter's lattice head; this drafter has "
                              "none (drop the setting)")
        self.drafter = drafter
        self.lattice = drafter.lilicorr if lattice_head else None
        """LiLiCorr's lattice head when it drafts (`eval.lattice_head`), else None: each slot's top-1."""
        self.embed_weight = embed_weight
        self.lm_head_weight = lm_head_weight
        self.mask_token_id = drafter.spec.mask_token_id
        self.dtype = next(drafter.parameters()).dtype
        self.context: Optional[DraftContext] = None
        self.anchors = AnchorTracker()
        """LiLiCorr's anchor context per row (unused by the other variants)."""

    def observe(self, update: ContextUpdate) -> None:
        if self.context is None:
            self.context = self.drafter.empty_context(update.tokens.shape[0], update.tokens.device, self.dtype)
        self.context = self.drafter.extend_context(self.context, update.taps.to(self.dtype), update.positions,
                                                   update.valid)
        if self.lattice is not None:
            self.anchors.observe(self.drafter.context, update.taps.to(self.dtype), update.valid)

    def propose(self, last_tokens: torch.Tensor, starts: torch.Tensor, max_lengths: torch.Tensor, block_size: int,
                temperature: float, generator: Optional[torch.Generator]) -> BlockDrafts:
        rows = last_tokens.shape[0]
        device = last_tokens.device
        dspark = self.drafter.markov_w1 is not None
        slots = block_size - 1 if dspark else block_size  # DSpark: the anchor's slot drafts too
        ids = torch.full((rows, slots), self.mask_token_id, dtype=torch.int64, device=device)  # (R, S)
        ids[:, 0] = last_tokens
        hidden = self.drafter.forward_blocks(
            block_embeds=F.embedding(ids, self.embed_weight).to(self.dtype),
            block_positions=starts[:, None] + torch.arange(slots, device=device),
            cache=self.context,
            # a block cut near max_new_tokens to the slots that can still be committed, as the reference loop cuts it
            block_lengths=max_lengths.clamp(min=1) if dspark else max_lengths + 1,
        )  # (R, S, H)
        if dspark:
            logits = F.linear(hidden.to(self.lm_head_weight.dtype), self.lm_head_weight).float()  # (R, B-1, V)
            walked = markov_walk(self.drafter.markov_w1, self.drafter.markov_w2, logits, last_tokens, temperature,
                                 generator)
            return BlockDrafts(tokens=walked.tokens, lengths=max_lengths, probs=walked.probs)
        if self.drafter.prefix_gru is not None:  # Domino: slots 0..B-2 draft, its correction head walks them
            walked = domino_walk(self.drafter.prefix_gru, self.drafter.embed_proj, hidden[:, :-1], self.lm_head_weight,
                                 self.embed_weight, last_tokens, temperature)
            return BlockDrafts(tokens=walked.tokens, lengths=max_lengths)
        logits = F.linear(hidden[:, 1:].to(self.lm_head_weight.dtype), self.lm_head_weight).float()  # (R, B-1, V)
        if self.lattice is not None:  # LiLiCorr: the lattice head walks each slot's top-K candidates
            walked = draft_block(self.lattice, hidden[:, 1:], self.lm_head_weight, self.embed_weight,
                                 self.anchors.context, self.anchors.valid, temperature, generator)
            return BlockDrafts(tokens=walked.tokens, lengths=max_lengths, probs=walked.probs)
        selector = self.drafter.candidate_selector
        if selector is not None:  # DFlash2: the selector walks each slot's top-K candidates
            walked = walk(selector, hidden[:, 1:], logits, last_tokens, temperature, generator)
            return BlockDrafts(tokens=walked.tokens, lengths=max_lengths, probs=walked.probs)
        if temperature <= 0:
            return BlockDrafts(tokens=logits.argmax(-1), lengths=max_lengths)
        probs = torch.softmax(logits / temperature, dim=-1)
        tokens = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).reshape(rows, -1)
        return BlockDrafts(tokens=tokens, lengths=max_lengths, probs=probs)

    def keep(self, rows: torch.Tensor) -> None:
        self.context = self.context.select(rows)
        if self.lattice is not None:
            self.anchors.keep(rows)


class _NgramIndex:
    """One row's committed tokens, and for each n the start of the latest occurrence of every n-gram that
    is followed by at least one token."""

    def __init__(self, max_ngram: int, min_ngram: int) -> None:
        self.tokens: list[int] = []
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}

    def append(self, token: int) -> None:
        self.tokens.append(token)
        end = len(self.tokens) - 1  # the n-grams ending just before the new token now have a follower
        for n in self.sizes:
            if end >= n:
                self.latest[n][tuple(self.tokens[end - n : end])] = end - n

    def lookup(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest recurring suffix."""
        for n in self.sizes:
            if len(self.tokens) <= n:
                continue
            start = self.latest[n].get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start + n : start + n + limit]
        return []


class PromptLookupProposer:
    """Prompt lookup (n-gram copying from the context), deterministic: the baseline proposer."""

    needs_taps = False

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.rows: list[_NgramIndex] = []
        self.pending_last: list[bool] = []
        """Per row: `propose` appended the last committed token, so the next block's slot 0 is known."""

    def observe(self, update: ContextUpdate) -> None:
        tokens, valid = update.tokens.tolist(), update.valid.tolist()  # host sync: the index lives on the host
        if not self.rows:
            self.rows = [_NgramIndex(self.max_ngram, self.min_ngram) for _ in tokens]
            self.pending_last = [False] * len(tokens)
        for r, (row_tokens, row_valid) in enumerate(zip(tokens, valid)):
            skip = 1 if self.pending_last[r] else 0
            for t, ok in zip(row_tokens[skip:], row_valid[skip:]):
                if ok:
                    self.rows[r].append(t)
            self.pending_last[r] = False

    def propose(self, last_tokens: torch.Tensor, starts: torch.Tensor, max_lengths: torch.Tensor, block_size: int,
                temperature: float, generator: Optional[torch.Generator]) -> BlockDrafts:
        drafts = torch.zeros(len(self.rows), block_size - 1, dtype=torch.int64)
        lengths = torch.zeros(len(self.rows), dtype=torch.int64)
        for r, (last, limit) in enumerate(zip(last_tokens.tolist(), max_lengths.tolist())):  # host sync, as above
            index = self.rows[r]
            if not self.pending_last[r]:
                index.append(last)
                self.pending_last[r] = True
            copied = index.lookup(limit)
            drafts[r, : len(copied)] = torch.tensor(copied, dtype=torch.int64)
            lengths[r] = len(copied)
        device = last_tokens.device
        return BlockDrafts(tokens=drafts.to(device), lengths=lengths.to(device))

    def keep(self, rows: torch.Tensor) -> None:
        kept = rows.tolist()
        self.rows = [self.rows[r] for r in kept]
        self.pending_last = [self.pending_last[r] for r in kept]
