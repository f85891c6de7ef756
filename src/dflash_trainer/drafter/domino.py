"""Domino (ModelOpt's `projector_type: domino`): a DFlash backbone whose slots predict one position further on, plus
a small causal correction head. Read from ModelOpt's exports for evaluation (`dflash-train eval`); not trained here.

Facts from ModelOpt 0.47's trainer and export of it (`modeling_domino.py`, `hf_domino.py`, `DominoExporter`) and the
engine that serves it (SGLang 0.5.23: `speculative/domino_utils.py` `domino_greedy_rollout`, `models/dflash.py`), which
this file holds us to:

- **Slots.** `shift_label: true`: block slot k predicts the token at anchor + k + 1. A verified block of B tokens runs
  the backbone over B slots (the anchor and B - 1 mask tokens) and drafts B - 1 tokens from slots 0..B-2.
- **Head.** `prefix_gru`: a one-layer GRU without biases from the hidden size to `gru_hidden_dim`, over the target's
  embeddings of the block's tokens so far; `embed_proj`: Linear(hidden + gru_hidden_dim -> emb_dim), SiLU,
  Linear(emb_dim -> vocab), no biases. Slot 0 (`pure_draft_prefix_len` 1, the only value SGLang serves) drafts from
  the backbone's logits alone; slot k >= 1 adds `embed_proj([h_k ; g_k])` to them, g_k the GRU's state after the
  anchor and the k tokens drafted before it.
- **Decoding** is greedy (SGLang's rollout; its default `--speculative-domino-candidate-pool-size 2048` takes each
  argmax among a block's 2,048 best base candidates, 0 scores the whole vocabulary as here), so an evaluation at a
  temperature above 0 is refused.
- **Names.** `prefix_gru.weight_ih_l0`, `prefix_gru.weight_hh_l0`, `embed_proj.0.weight`, `embed_proj.2.weight` beside
  DFlash's tensors; `dflash_config` holds `projector_type: domino`, `shift_label`, `pure_draft_prefix_len`,
  `gru_hidden_dim`, `emb_dim` (also at the top level).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trainer.errors import ConfigError

DOMINO_KEYS = ("prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight")
"""The correction head's tensors, as ModelOpt exports them and SGLang loads them."""


def correction_head(hidden_size: int, vocab_size: int, gru_hidden: int, emb_dim: int) -> tuple[nn.GRU, nn.Sequential]:
    """(prefix_gru, embed_proj) of the shapes a Domino export holds."""
    gru = nn.GRU(input_size=hidden_size, hidden_size=gru_hidden, num_layers=1, batch_first=True, bias=False)
    proj = nn.Sequential(nn.Linear(hidden_size + gru_hidden, emb_dim, bias=False), nn.SiLU(),
                         nn.Linear(emb_dim, vocab_size, bias=False))
    return gru, proj


def domino_fields(dflash: dict, config: dict) -> dict:
    """The DrafterSpec fields of a Domino export's config (`dflash_config` and the whole), after checking that it is
    a head this file runs."""
    if dflash.get("shift_label") is not True:
        raise ConfigError("a Domino export (dflash_config.projector_type domino) without dflash_config.shift_label "
                          "true: dflash-train runs Domino drafters whose slots predict the next position only")
    if dflash.get("pure_draft_prefix_len", 1) != 1:
        raise ConfigError(f"a Domino export with pure_draft_prefix_len {dflash.get('pure_draft_prefix_len')!r}: "
                          "dflash-train (as SGLang) runs pure_draft_prefix_len 1 only")
    gru, emb = dflash.get("gru_hidden_dim"), dflash.get("emb_dim", config.get("emb_dim"))
    if not (isinstance(gru, int) and isinstance(emb, int) and gru > 0 and emb > 0):
        raise ConfigError("a Domino export needs positive integers dflash_config.gru_hidden_dim and emb_dim, got "
                          f"{gru!r} and {emb!r}")
    return {"variant": "domino", "domino_gru_hidden": gru, "domino_emb_dim": emb}


@dataclass(frozen=True, slots=True, kw_only=True)
class DominoDrafts:
    """One block's greedy drafts per row."""

    tokens: torch.Tensor
    """(R, S) int64: the drafted tokens, on the hidden states' device."""


@torch.no_grad()
def domino_walk(gru: nn.GRU, proj: nn.Sequential, hidden: torch.Tensor, lm_head: torch.Tensor,
                embed_weight: torch.Tensor, anchors: torch.Tensor, temperature: float) -> DominoDrafts:
    """Greedy drafts of the drafting slots' hidden states (R, S, H) (slots 0..S-1 of the block, the anchor's first):
    slot 0 from the backbone's logits, slot k from them plus the correction of its hidden state and the GRU's state
    after the anchor's token (R,) and the k drafts before it; lm_head and embed_weight (V, H) the target's."""
    if temperature > 0:
        raise ConfigError("a Domino drafter drafts greedily (SGLang serves it so): evaluate it with "
                          "eval.temperature=0")
    dtype = gru.weight_ih_l0.dtype
    # in the weights' dtype, as SGLang sums them: in bf16 the sum's rounding decides near-ties
    base = F.linear(hidden.to(lm_head.dtype), lm_head)  # (R, S, V)
    drafted = base[:, 0].argmax(-1)  # (R,): slot 0 keeps the backbone's logits
    tokens = [drafted]
    if hidden.shape[1] == 1:
        return DominoDrafts(tokens=drafted[:, None])
    _, state = gru(F.embedding(torch.stack([anchors, drafted], dim=1), embed_weight).to(dtype))  # (1, R, G)
    state = state[0]  # (R, G): the GRU's state after the anchor's token and slot 0's draft
    for k in range(1, hidden.shape[1]):  # each slot's correction reads the drafts before it: a sequential walk
        correction = proj(torch.cat([hidden[:, k].to(dtype), state], dim=-1))  # (R, V)
        drafted = (base[:, k] + correction).argmax(-1)
        tokens.append(drafted)
        if k + 1 < hidden.shape[1]:  # one GRU step per draft, the cell SGLang steps (not cuDNN's packed GRU)
            state = torch.ops.aten.gru_cell.default(F.embedding(drafted, embed_weight).to(dtype), state,
                                                    gru.weight_ih_l0, gru.weight_hh_l0, None, None)
    return DominoDrafts(tokens=torch.stack(tokens, dim=1))
