"""DSpark's Markov head, for evaluating DSpark drafters that other trainers export (dflash-train does not train them).

Facts from the DSpark paper (deepseek-ai/DeepSpec) and ModelOpt 0.47's export of it (`projector_type: dspark` in
`dflash_config`), which this file holds us to:

- **Slots.** The backbone is a DFlash drafter, but a block's slot k predicts the token at anchor + k + 1 (the
  export's `shift_label: true`): the anchor's own slot drafts too, so a block of B slots drafts B tokens and a
  verification step checks B + 1 (DFlash: B - 1 and B).
- **Markov head** (`vanilla`, the only kind read here): a low-rank bias from the previous token,
  `bias(prev) = W2 W1[prev]` with `markov_w1` an embedding (V, r) and `markov_w2` a linear map r -> V (no bias),
  added to each slot's logits: slot k's distribution is softmax(U_k + bias(x_{k-1})), `x_{-1}` the anchor.
  Decoding walks the slots left to right (`markov_walk`); greedy takes each slot's argmax, sampling draws from that
  softmax at the temperature (the distribution the lossless acceptance rule compares with the target's).
- The `gated` and `rnn` heads, which also read the backbone's hidden state, and the confidence head (for a serving
  engine's scheduler, not for chain verification) are not read: an export with them is refused, or its confidence
  weights left out with a log line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

MARKOV_KEYS = ("markov_w1.weight", "markov_w2.weight")
"""The Markov head's tensors, named as the export names them."""

CONFIDENCE_KEYS = ("confidence_proj.weight", "confidence_proj.bias")
"""The confidence head's tensors (`use_confidence_head: true`), not used by chain verification."""


def markov_modules(vocab_size: int, rank: int) -> tuple[nn.Embedding, nn.Linear]:
    """`markov_w1` (V, r) and `markov_w2` (r -> V), initialised as the export's trainer does (normal, std 0.02)."""
    w1, w2 = nn.Embedding(vocab_size, rank), nn.Linear(rank, vocab_size, bias=False)
    with torch.no_grad():
        w1.weight.normal_(0.0, 0.02)
        w2.weight.normal_(0.0, 0.02)
    return w1, w2


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
