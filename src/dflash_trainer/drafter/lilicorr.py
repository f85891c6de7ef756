"""LiLiCorr (arXiv 2608.20530): a DFlash backbone (DFlash2's block convolutions optional) plus a lattice head that
re-scores the backbone's per-slot top-K candidates as a chain, for `drafter.variant: lilicorr`.

Facts from the paper, ModelOpt's trainer (PR #2342, `hf_lilicorr.py`, `modeling_lilicorr.py`) and the engines that
serve it (vLLM `models/lilicorr.py` + `spec_decode/lilicorr/`, SGLang `models/lilicorr.py` + `lilicorr_utils.py`),
which the export and the conformance check hold us to:

- **Lattice.** Slots 1..B-1 of a block each keep the top-K (a power of two <= 16) of the drafter's logits, in rank
  order, with their full-vocabulary log-probabilities. Each candidate's state is token_proj(target embedding) +
  pass_hidden_proj(the slot's drafter hidden state) + feature_mlp(feature_norm([logp, p, logp - max logp, rank/(K-1),
  rank == 0])) + slot_embedding[slot] + rank_embedding[rank] (`token_proj` only when the head is narrower than the
  drafter). A stack of pre-norm layers (attention over all S*K candidates with a per-head additive bias
  relative_slot_bias[slot_q - slot_k + B - 1] + same_slot_bias [slot_q == slot_k], then a SiLU MLP, both with biases)
  and `output_norm` give one state x per candidate.
- **Anchor.** The last committed target context, hidden_norm(fc(taps)) at the position before the block's first
  token (zero for a block at a sequence's start): a = anchor_norm(context_proj(ctx) * valid).
- **Factors.** f = silu(factor_input_proj([x, a, x * a])); out = normalize(out_head(f)), in = normalize(in_head(f)),
  anchor_out = normalize(anchor_out_head(a)) (L2, `vector_eps`); start[j] = logit_scale * <anchor_out, in[0, j]>,
  pair[s, i, j] = logit_scale * <out[s, i], in[s + 1, j]>. No unary term: the backbone's scores enter as features.
- **Walk** (`walk_lattice`). Left to right: slot 0 scores its candidates by `start`, slot s by pair[s - 1, pick].
  Greedy takes the best; at temperature T > 0 a pick is drawn from softmax(scores / T) over the K candidates, and
  that distribution is what the lossless acceptance rule compares with the target's (both engines do this).
- **Training** (`lattice_term`), ModelOpt's objective: teacher-forced (slot s scored from the true token's candidate
  at slot s - 1), on the slots of a fully supervised block up to its first slot whose true token is not among the
  candidates: w_ce * CE over the K scores + w_margin * relu(margin - (score of the true token - best other)) +
  w_pen * E_softmax(scores)[relu(target logit of the true token - target logit of the candidate)] (the target's
  logits at the slot: the penalty needs the target's last hidden state). The candidate log-probabilities keep their
  gradient, so the lattice terms train the backbone too. The terms are a mean over the supervised slots, added to
  the DFlash loss (ModelOpt: `loss = dflash_loss + lilicorr_loss`).
- **Export names** are the engines': everything under `lilicorr.` (attention weights `attn.in_proj_weight` /
  `attn.in_proj_bias` as nn.MultiheadAttention lays them out; MLPs `up_proj` / `down_proj`); config
  `architectures: ["LiLiCorrDraftModel"]`, `dflash_config.lilicorr_*`, and `conv_kernel_size` / `conv_group_size`
  when the convolutions are on.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from dflash_trainer.errors import ConfigError

NUM_FEATURES = 5
"""Per-candidate features: log-probability, probability, gap to the slot's best, rank fraction, is-top-1."""

MAX_TOP_K = 16
"""The engines' widest lattice (one Triton lane group in their walk kernels)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LatticeSpec:
    """The lattice head's geometry: `dflash_config.lilicorr_<field>` of the export, `drafter.lilicorr_<field>`."""

    hidden_size: int
    """Width of the head; 0: the drafter's (no `token_proj` then)."""
    candidate_topk: int
    num_layers: int
    num_heads: int
    mlp_ratio: float
    factor_dim: int
    vector_eps: float
    logit_scale: float

    def __post_init__(self) -> None:
        k = self.candidate_topk
        if not 1 <= k <= MAX_TOP_K or k & (k - 1):
            raise ConfigError(f"lilicorr_candidate_topk must be a power of two <= {MAX_TOP_K} (the engines' lattice "
                              f"walk kernels), got {k}")
        if self.hidden_size < 0 or min(self.num_layers, self.num_heads, self.factor_dim) < 1:
            raise ConfigError(f"lilicorr_hidden_size must be >= 0 and lilicorr_num_layers, lilicorr_num_heads, "
                              f"lilicorr_factor_dim >= 1, got {self.hidden_size}, {self.num_layers}, "
                              f"{self.num_heads}, {self.factor_dim}")
        if self.mlp_ratio <= 0 or self.logit_scale <= 0 or not 0.0 < self.vector_eps < 0.5:
            raise ConfigError(f"lilicorr_mlp_ratio and lilicorr_logit_scale must be > 0 and lilicorr_vector_eps in "
                              f"(0, 0.5), got {self.mlp_ratio}, {self.logit_scale}, {self.vector_eps}")

    def width(self, model_hidden: int) -> int:
        return self.hidden_size or model_hidden

    def check(self, model_hidden: int, vocab_size: int) -> None:
        """What depends on the drafter: the heads divide the head's width, K fits the vocabulary."""
        if self.width(model_hidden) % self.num_heads:
            raise ConfigError(f"lilicorr_num_heads={self.num_heads} must divide the lattice head's width "
                              f"{self.width(model_hidden)} (lilicorr_hidden_size, 0: the drafter's hidden size)")
        if self.candidate_topk > vocab_size:
            raise ConfigError(f"lilicorr_candidate_topk={self.candidate_topk} exceeds the vocabulary ({vocab_size})")

    def export_fields(self) -> dict:
        """`dflash_config` fields, as ModelOpt writes them and the engines read them."""
        return {"lilicorr_enabled": True, **{f"lilicorr_{k}": v for k, v in asdict(self).items()}}

    @classmethod
    def from_export(cls, dflash: dict) -> "LatticeSpec":
        keys = [f"lilicorr_{name}" for name in cls.__dataclass_fields__]
        missing = [k for k in keys if k not in dflash]
        if missing:
            raise ConfigError(f"a LiLiCorrDraftModel config needs dflash_config.{{{', '.join(keys)}}}; it lacks "
                              f"{missing}")
        kinds = {"mlp_ratio": float, "vector_eps": float, "logit_scale": float}
        return cls(**{k: kinds.get(k, int)(dflash[f"lilicorr_{k}"]) for k in cls.__dataclass_fields__})


class _MLP(nn.Module):
    """up_proj -> SiLU -> down_proj, both with biases (the engines' `NemotronHMLP` / `LiLiCorrMLP` layout)."""

    def __init__(self, inner: int, mid: int, outer: int):
        super().__init__()
        self.up_proj = nn.Linear(inner, mid)
        self.down_proj = nn.Linear(mid, outer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class _LatticeAttention(nn.Module):
    """Bidirectional multi-head attention over a lattice with an additive per-head bias; the parameters are laid out
    as nn.MultiheadAttention's (`in_proj_weight` = [q; k; v])."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x (R, L, h), bias (nh, L, L) -> (R, L, h)."""
        q, k, v = (t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # (R, nh, L, hd) each
                   for t in F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None].to(q.dtype))  # (R, nh, L, hd)
        return self.out_proj(out.transpose(1, 2).flatten(-2))


class _LatticeLayer(nn.Module):
    def __init__(self, width: int, num_heads: int, mlp_ratio: float, eps: float):
        super().__init__()
        self.attn_norm = Qwen3RMSNorm(width, eps=eps)
        self.attn = _LatticeAttention(width, num_heads)
        self.mlp_norm = Qwen3RMSNorm(width, eps=eps)
        self.mlp = _MLP(width, int(width * mlp_ratio), width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class LatticeHead(nn.Module):
    """The lattice scorer (module docstring); parameter names are the export's (under `lilicorr.`)."""

    def __init__(self, lattice: LatticeSpec, *, model_hidden: int, block_size: int, rms_norm_eps: float):
        super().__init__()
        self.lattice, self.block_size = lattice, block_size
        slots, k, h = block_size - 1, lattice.candidate_topk, lattice.width(model_hidden)
        if h != model_hidden:
            self.token_proj = nn.Linear(model_hidden, h)
        self.pass_hidden_proj = nn.Linear(model_hidden, h)
        self.feature_norm = nn.LayerNorm(NUM_FEATURES)
        self.feature_mlp = _MLP(NUM_FEATURES, h, h)
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, slots, 1, h))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, k, h))
        self.relative_slot_bias = nn.Parameter(torch.zeros(lattice.num_heads, 2 * block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(lattice.num_heads))
        self.context_proj = nn.Linear(model_hidden, h)
        self.layers = nn.ModuleList(_LatticeLayer(h, lattice.num_heads, lattice.mlp_ratio, rms_norm_eps)
                                    for _ in range(lattice.num_layers))
        self.output_norm = Qwen3RMSNorm(h, eps=rms_norm_eps)
        self.anchor_norm = Qwen3RMSNorm(h, eps=rms_norm_eps)
        self.factor_input_proj = nn.Linear(3 * h, h)
        self.out_head = nn.Linear(h, lattice.factor_dim)
        self.in_head = nn.Linear(h, lattice.factor_dim)
        self.anchor_out_head = nn.Linear(h, lattice.factor_dim)

    @property
    def top_k(self) -> int:
        return self.lattice.candidate_topk

    @property
    def width(self) -> int:
        return self.pass_hidden_proj.out_features

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, seed: Optional[int] = None) -> None:
        """ModelOpt's start: linear weights normal(0, std) and biases zero, the attention's packed projection Xavier
        (nn.MultiheadAttention's), norms 1, the slot/rank embeddings and attention biases zero. The factor heads are
        random on both sides (zero on either would stall the product's gradient). Drawn from a generator seeded `seed`
        (else the global one)."""
        gen = None if seed is None else torch.Generator(self.slot_embedding.device).manual_seed(seed)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std, generator=gen)
                module.bias.zero_()
            elif isinstance(module, (Qwen3RMSNorm, nn.LayerNorm)):
                module.weight.fill_(1.0)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, _LatticeAttention):
                bound = (6.0 / (module.in_proj_weight.shape[0] / 3 + module.in_proj_weight.shape[1])) ** 0.5
                module.in_proj_weight.uniform_(-bound, bound, generator=gen)
                module.in_proj_bias.zero_()
        for p in (self.slot_embedding, self.rank_embedding, self.relative_slot_bias, self.same_slot_bias):
            p.zero_()

    def attention_bias(self, slots: int) -> torch.Tensor:
        """(nh, S*K, S*K): relative-slot bias plus the same-slot bias, for the first `slots` slots."""
        slot = torch.arange(slots, device=self.same_slot_bias.device).repeat_interleave(self.top_k)  # (L,)
        rel = slot[:, None] - slot[None, :]  # (L, L)
        same = (rel == 0).to(self.same_slot_bias.dtype)
        return self.relative_slot_bias[:, rel + self.block_size - 1] + same * self.same_slot_bias[:, None, None]

    def forward(self, token_embeds: torch.Tensor, log_probs: torch.Tensor, pass_hidden: torch.Tensor,
                anchor: torch.Tensor, anchor_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chain's log-factors, fp32: start (R, K) and pair (R, S-1, K, K). token_embeds (R, S, K, Hm) the
        candidates' target embeddings, log_probs (R, S, K) their log-probabilities (rank order), pass_hidden (R, S, Hm)
        the slots' drafter hidden states, anchor (R, Hm) the anchor context, anchor_valid (R,) bool; S <= B - 1."""
        slots, k = log_probs.shape[1], log_probs.shape[2]
        dtype = self.pass_hidden_proj.weight.dtype
        tokens = token_embeds.to(dtype)
        if hasattr(self, "token_proj"):
            tokens = self.token_proj(tokens)
        lp = log_probs.float()
        rank = torch.arange(k, device=lp.device, dtype=lp.dtype) / max(k - 1, 1)  # (K,) 0 at top-1, 1 at the K-th
        features = torch.stack([lp, lp.exp(), lp - lp.max(-1, keepdim=True).values, rank.expand_as(lp),
                                (rank == 0).to(lp.dtype).expand_as(lp)], dim=-1)  # (R, S, K, 5)
        x = tokens + self.pass_hidden_proj(pass_hidden.to(dtype))[:, :, None]  # (R, S, K, h)
        x = x + self.feature_mlp(self.feature_norm(features.to(x.dtype)))
        x = x + self.slot_embedding[0, :, :slots] + self.rank_embedding[0, 0]
        x = x.flatten(1, 2)  # (R, S*K, h)
        bias = self.attention_bias(slots)
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x).unflatten(1, (slots, k))  # (R, S, K, h)
        a = self.context_proj(anchor.to(dtype)) * anchor_valid[:, None].to(dtype)  # (R, h)
        a = self.anchor_norm(a).to(x.dtype)
        a_row = a[:, None, None, :]  # (R, 1, 1, h)
        f = F.silu(self.factor_input_proj(torch.cat([x, a_row.expand_as(x), x * a_row], dim=-1)))  # (R, S, K, h)
        eps = self.lattice.vector_eps
        out_vec = F.normalize(self.out_head(f).float(), dim=-1, eps=eps)  # (R, S, K, f)
        in_vec = F.normalize(self.in_head(f).float(), dim=-1, eps=eps)
        anchor_out = F.normalize(self.anchor_out_head(a).float(), dim=-1, eps=eps)  # (R, f)
        scale = self.lattice.logit_scale
        start = scale * (anchor_out[:, None, :] * in_vec[:, 0]).sum(-1)  # (R, K)
        pair = scale * out_vec[:, :-1] @ in_vec[:, 1:].transpose(-1, -2)  # (R, S-1, K, K)
        return start, pair


def lattice_key_names(lattice: LatticeSpec, *, model_hidden: int, block_size: int) -> set[str]:
    """The head's tensor names in an export (prefixed `lilicorr.`), from a shape-only (meta) build."""
    with torch.device("meta"):
        head = LatticeHead(lattice, model_hidden=model_hidden, block_size=block_size, rms_norm_eps=1e-6)
    return {f"lilicorr.{k}" for k in head.state_dict()}


def candidates(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (..., K) int64 in rank order, log-probabilities (..., K) fp32 over the full vocabulary) of logits (..., V),
    as the engines take them."""
    values, ids = logits.float().topk(top_k, dim=-1)
    return ids, values - logits.float().logsumexp(-1, keepdim=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class LatticeDrafts:
    tokens: torch.Tensor
    """(R, S) int64: the token picked at each slot."""
    probs: Optional[torch.Tensor]
    """(R, S, V) fp32: at temperature > 0, the distribution each pick was drawn from (over the K candidates, zero
    elsewhere), given the picks before it; None when greedy."""


def walk_lattice(start: torch.Tensor, pair: torch.Tensor, ids: torch.Tensor, temperature: float,
                 generator: Optional[torch.Generator], vocab_size: int) -> LatticeDrafts:
    """Decoding's left-to-right walk (module docstring): start (R, K), pair (R, S-1, K, K), ids (R, S, K)."""
    scores, picks, rows = start, [], []
    for s in range(ids.shape[1]):  # each slot's scores depend on the pick before: a sequential walk
        if s:
            scores = pair[:, s - 1].gather(1, pick[:, None, None].expand(-1, 1, pair.shape[-1]))[:, 0]  # (R, K)
        if temperature <= 0:
            pick = scores.argmax(-1)
        else:
            q = torch.softmax(scores / temperature, dim=-1)  # (R, K)
            pick = torch.multinomial(q, 1, generator=generator)[:, 0]
            rows.append(torch.zeros(ids.shape[0], vocab_size, device=q.device).scatter_(-1, ids[:, s], q))
        picks.append(pick)
    tokens = ids.gather(-1, torch.stack(picks, 1)[..., None])[..., 0]  # (R, S)
    return LatticeDrafts(tokens=tokens, probs=torch.stack(rows, 1) if rows else None)


def draft_block(head: LatticeHead, hidden: torch.Tensor, lm_head: torch.Tensor, embed: torch.Tensor,
                anchor: torch.Tensor, anchor_valid: torch.Tensor, temperature: float,
                generator: Optional[torch.Generator]) -> LatticeDrafts:
    """A block's drafts from the drafter's hidden states of its predicted slots, hidden (R, S, H), through the
    target's LM head (V, H) and embedding (V, H), with each row's anchor context (R, H) and validity (R,)."""
    logits = F.linear(hidden.to(lm_head.dtype), lm_head)  # (R, S, V)
    ids, log_probs = candidates(logits, head.top_k)
    start, pair = head(F.embedding(ids, embed), log_probs, hidden, anchor, anchor_valid)
    return walk_lattice(start, pair, ids, temperature, generator, lm_head.shape[0])


@dataclass(frozen=True, slots=True, kw_only=True)
class LatticeLoss:
    """LiLiCorr's lattice terms of one microbatch (`drafter.lilicorr_w_*`)."""

    head: LatticeHead
    w_ce: float
    w_margin: float
    w_pen: float
    margin: float
    """Hinge width of the margin term."""
    embed_weight: torch.Tensor
    """(V, H) the target's frozen embedding (the candidates' token features)."""
    anchor_context: Callable[[torch.Tensor], torch.Tensor]
    """Packed indices (n,) int64 -> the drafter's context features there (n, H) (hidden_norm(fc(taps)))."""
    teacher_logits: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
    """(positions (n, S) packed indices, candidate ids (n, S, K)) -> the target's logits (n, S, K) there, detached;
    needed when w_pen > 0."""
    compiled: bool = False
    """On CUDA, run the head and its terms torch.compile'd (`drafter.loss_kernel`): one graph fuses the norms, the
    residual adds, the feature stack and the terms between the matmuls. The values are the same."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LatticeTerm:
    mean: torch.Tensor
    """() the weighted lattice terms averaged over the supervised slots (differentiable)."""
    hit: torch.Tensor
    """(n, S) bool: the greedy walk's pick (as decoding walks it, on its own picks) is the true token."""


def lattice_term(loss: LatticeLoss, *, ids: torch.Tensor, log_probs: torch.Tensor, hidden: torch.Tensor,
                 labels: torch.Tensor, label_valid: torch.Tensor, anchors: torch.Tensor, anchor_pos: torch.Tensor,
                 chunk_blocks: Optional[int] = None) -> LatticeTerm:
    """ModelOpt's objective (module docstring) on n blocks: ids (n, S, K) the top-K of the slots' logits, log_probs
    (n, S, K) their log-probabilities (differentiable), hidden (n, S, H) the slots' hidden states, labels and
    label_valid (n, S) the true tokens, anchors (n,) the blocks' anchor indices, anchor_pos (n,) their positions in
    their sequences (0: no context before the block, the anchor context is zero). The head runs `chunk_blocks` blocks
    at a time (None: all), each chunk's activations recomputed in the backward (its lattice is S*K candidates a
    block, each a head-wide state through every head layer). The greedy walk (sequential over the slots) runs once
    over all blocks, on the chunks' detached factors."""
    n = ids.shape[0]
    size = n if chunk_blocks is None else max(1, chunk_blocks)
    kernel = _compiled_terms() if loss.compiled and ids.device.type == "cuda" else chunk_terms
    run = functools.partial(_lattice_chunk, loss, kernel)
    totals, counts, starts, pairs = [], [], [], []
    for lo in range(0, n, size):
        args = tuple(t[lo:lo + size] for t in (ids, log_probs, hidden, labels, label_valid, anchors, anchor_pos))
        total, count, start, pair = checkpoint(run, *args, use_reentrant=False) if torch.is_grad_enabled() \
            else run(*args)
        totals.append(total)
        counts.append(count)
        starts.append(start.detach())
        pairs.append(pair.detach())
    mean = torch.stack(totals).sum() / torch.stack(counts).sum().clamp_min(1.0)
    with torch.no_grad():
        hit = walk_lattice(torch.cat(starts), torch.cat(pairs), ids, 0.0, None, 0).tokens == labels  # (n, S)
    return LatticeTerm(mean=mean, hit=hit)


def _lattice_chunk(loss: LatticeLoss, kernel: Callable, ids: torch.Tensor, log_probs: torch.Tensor,
                   hidden: torch.Tensor, labels: torch.Tensor, label_valid: torch.Tensor, anchors: torch.Tensor,
                   anchor_pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`lattice_term` on one chunk of blocks: what `chunk_terms` returns. Gathers the inputs the kernel reads (the
    anchor context, the candidates' embeddings, the target's logits) and runs it."""
    anchor_valid = anchor_pos > 0  # (n,)
    anchor = loss.anchor_context((anchors - 1).clamp(min=0)) * anchor_valid[:, None]  # (n, H) the row before the block
    target = None
    if loss.w_pen > 0:
        if loss.teacher_logits is None:
            raise ConfigError("drafter.lilicorr_w_pen > 0 needs the target's logits (its last hidden state); set "
                              "drafter.lilicorr_w_pen=0 where the target's last hidden state is not captured")
        # slot s (block position s + 1) is predicted by the target at anchor + s
        where = anchors[:, None] + torch.arange(ids.shape[1], device=ids.device)  # (n, S)
        target = loss.teacher_logits(where, ids)  # (n, S, K)
    tokens = F.embedding(ids, loss.embed_weight).detach()  # (n, S, K, H)
    return kernel(loss.head, tokens, log_probs, hidden, anchor, anchor_valid, ids, labels, label_valid, target,
                  (loss.w_ce, loss.w_margin, loss.w_pen, loss.margin))


def chunk_terms(head: LatticeHead, tokens: torch.Tensor, log_probs: torch.Tensor, hidden: torch.Tensor,
                anchor: torch.Tensor, anchor_valid: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor,
                label_valid: torch.Tensor, target: Optional[torch.Tensor],
                weights: tuple[float, float, float, float]) -> tuple[torch.Tensor, ...]:
    """The head and its terms on n blocks, tensors in and out (one graph under torch.compile): tokens (n, S, K, H)
    the candidates' embeddings, log_probs (n, S, K), hidden (n, S, H), anchor (n, H), anchor_valid (n,), ids,
    labels, label_valid as `lattice_term`'s, target (n, S, K) the target's logits of the candidates (None when w_pen
    is 0), weights (w_ce, w_margin, w_pen, margin). Returns (the weighted terms summed over the supervised slots (),
    their count (), start (n, K), pair (n, S-1, K, K))."""
    w_ce, w_margin, w_pen, margin = weights
    start, pair = head(tokens, log_probs, hidden, anchor, anchor_valid)
    match = ids == labels[..., None]  # (n, S, K)
    present = match.any(-1)
    truth = match.long().argmax(-1)  # (n, S) 0 where absent (those slots are not supervised)
    k = ids.shape[-1]
    # teacher-forced: slot s scored by the row of pair[s - 1] of slot s - 1's true candidate
    after = pair.gather(2, truth[:, :-1, None, None].expand(-1, -1, 1, k))[:, :, 0]  # (n, S-1, K)
    scores = torch.cat([start[:, None], after], 1)  # (n, S, K)
    supervised = (present.long().cumprod(-1).bool() & label_valid.all(-1, keepdim=True)).float()  # (n, S)
    per_slot = w_ce * F.cross_entropy(scores.flatten(0, 1), truth.flatten(), reduction="none").view_as(truth)
    if w_margin > 0 and k > 1:
        true_score = scores.gather(-1, truth[..., None])[..., 0]
        best_other = scores.scatter(-1, truth[..., None], float("-inf")).max(-1).values
        per_slot = per_slot + w_margin * torch.relu(margin - (true_score - best_other))
    if target is not None:
        rejection = (target.gather(-1, truth[..., None]) - target).clamp_min(0.0)
        per_slot = per_slot + w_pen * (torch.softmax(scores, -1) * rejection).sum(-1)
    return (per_slot * supervised).sum(), supervised.sum(), start, pair


_compiled_chunk_terms = None


def _compiled_terms() -> Callable:
    """`chunk_terms` compiled for fixed shapes (a run's chunks have one size, its last another)."""
    global _compiled_chunk_terms
    if _compiled_chunk_terms is None:
        _compiled_chunk_terms = torch.compile(chunk_terms, dynamic=False)
    return _compiled_chunk_terms


def lattice_loss(dcfg, model: nn.Module, *, taps: torch.Tensor, embed: torch.Tensor, lm_head: torch.Tensor,
                 last_hidden: Optional[torch.Tensor], final_norm: Optional[Callable]) -> Optional[LatticeLoss]:
    """The lattice terms of a microbatch (`drafter.lilicorr_*`; dcfg a DrafterConfig, or None for the walk's picks
    alone, every weight 0) for a drafter `model` trained on the packed taps (T, K*H); None for a drafter without a
    lattice head. The distractor penalty reads the target's logits from its last hidden state (T, H) through its
    final norm and LM head (V, H)."""
    head = getattr(model, "lilicorr", None)
    if head is None:
        return None
    weights = (0.0, 0.0, 0.0, 1.0) if dcfg is None else (dcfg.lilicorr_w_ce, dcfg.lilicorr_w_margin,
                                                         dcfg.lilicorr_w_pen, dcfg.lilicorr_margin)
    teacher = None
    if last_hidden is not None:
        def teacher(where: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                rows = final_norm(last_hidden[where.clamp(max=last_hidden.shape[0] - 1)])  # (n, S, H)
                return torch.einsum("nsh,nskh->nsk", rows.to(lm_head.dtype), lm_head[ids]).float()
    return LatticeLoss(head=head, w_ce=weights[0], w_margin=weights[1], w_pen=weights[2], margin=weights[3],
                       embed_weight=embed,
                       anchor_context=lambda rows: model.anchor_context(taps[rows]), teacher_logits=teacher,
                       compiled=dcfg is not None and dcfg.loss_kernel == "compiled")


class AnchorTracker:
    """Each decoding row's anchor context: the drafter's context feature (hidden_norm(fc(taps))) of its newest
    committed slot, which is the slot before the row's next block (zero, not valid, before any)."""

    def __init__(self) -> None:
        self.context: Optional[torch.Tensor] = None
        """(R, H) the anchor contexts."""
        self.valid: Optional[torch.Tensor] = None
        """(R,) bool: the row has committed a slot."""

    def observe(self, context: Callable[[torch.Tensor], torch.Tensor], taps: torch.Tensor, valid: torch.Tensor) -> None:
        """New slots of every row: taps (R, n, K*H), valid (R, n) bool; `context` maps taps rows to features."""
        rows, n = valid.shape
        last = (valid.long() * torch.arange(1, n + 1, device=valid.device)).argmax(-1)  # (R,) newest valid slot
        new = context(taps[torch.arange(rows, device=taps.device), last])  # (R, H)
        has = valid.any(-1)  # (R,)
        if self.context is None:
            self.context, self.valid = torch.zeros_like(new), torch.zeros_like(has)
        self.context = torch.where(has[:, None], new, self.context)
        self.valid = self.valid | has

    def keep(self, rows: torch.Tensor) -> None:
        self.context, self.valid = self.context[rows], self.valid[rows]
