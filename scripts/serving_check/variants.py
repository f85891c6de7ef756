"""Drafter variants the check covers: how to build one with our code, run our forward, export it, and which
class each engine's loader must build from the export. A new variant is one more `Variant` entry.

DFlash2 (drafter/dflash2.py) adds block convolutions inside each layer and a candidate selector after the final
norm. Both engines score a slot's top-K candidates (from the LM head) against the previous slot's candidates, the
block's first token for slot 1: a lattice (B-1, K, K) of `unary[c] + <A[prev] * P h, B[c]>`. `selector` gives ours
on the engine's inputs; the engines' come from vLLM's `DFlash2Qwen3ForCausalLM.compute_candidates` and
`model.candidate_selector` (what its V2 runner's DFlash2 speculator calls) and SGLang's `_selector_lattice` (its draft
worker's). Config keys both read: `dflash_config.{conv_kernel_size, conv_group_size, selector_rank,
selector_top_k}` (the speculators format: top level, `speculators_model_type: dflash2`); tensors
`layers.N.{attention,mlp}_conv.{base_kernel, kernel_projection.weight}` and
`candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection.weight}`.

DSpark (drafter/dspark.py) keeps DFlash's layers; every slot of its block drafts (the anchor's the next token), and a
Markov head adds W2 W1[the token picked before] to each slot's logits, walked left to right. `walk` gives our greedy
walk as `dflash-train eval` drafts it (`dspark.markov_walk`): the drafts and each slot's biased scores; the engines'
come from vLLM's `DSparkSpeculator._sample_sequential` (over `Qwen3DSparkForCausalLM.compute_draft_logits`,
`markov_embed`, `markov_bias`) and SGLang's `draft_markov_block` (over `compute_base_logits` and its
`markov_head`). Keys both read: `architectures: ["Qwen3DSparkModel"]`, top-level `markov_rank` (SGLang's parser also
`dflash_config.markov_rank`), `block_size` = the drafted tokens (vLLM's `num_speculative_tokens`, SGLang's gamma);
tensors `markov_head.markov_w1.weight` and `markov_head.markov_w2.weight`. It exports in the dflash format only.
LiLiCorr (drafter/lilicorr.py), with and without DFlash2's convolutions, adds a lattice head: each slot's top-K
candidates (by full-vocabulary log-probability) scored as a chain anchored on the last committed context, the
context feature of the last context slot. `lattice` gives ours: the candidates (B-1, K), the scores (B-1, K, K) the
engines' walks read (row p of slot s: after the previous slot's candidate p; slot 0's rows all the anchor's start
scores) and our greedy walk's picks (B-1,). The engines': vLLM's `LiLiCorrForCausalLM.compute_candidates` and
`model.lilicorr` (what its V2 runner's LiLiCorr speculator calls); SGLang's `lilicorr_candidates`, the head's
`score` + `log_factors` and `propose_lilicorr_block` (its draft worker's greedy path, picks included). Config keys
both read: `architectures: ["LiLiCorrDraftModel"]`, `dflash_config.{lilicorr_*, block_size, conv_kernel_size,
conv_group_size}`; tensors under `lilicorr.`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.dspark import markov_walk
from dflash_trainer.drafter.export import export_drafter
from dflash_trainer.drafter.export_speculators import export_speculators
from dflash_trainer.drafter.lilicorr import candidates, walk_lattice
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.spec import drafter_spec


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """A drafter's layer layout."""

    name: str
    num_layers: int
    sliding_layers: tuple[int, ...] = ()
    sliding_window: int | None = None


Exporter = Callable[[torch.nn.Module, str, str, Any], None]
"""export(drafter, out_dir, target_dir, target_config): writes one format."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Variant:
    name: str
    engine_classes: dict[str, str]
    """Engine -> the class its loader must build from our export."""
    build: Callable[[Shape, int, Any], torch.nn.Module]
    """build(shape, block_size, target_config): a drafter with our code, random weights."""
    reference: Callable[[torch.nn.Module, dict, torch.Tensor], torch.Tensor]
    """reference(drafter, inputs, embed_weight): our final hidden states (B, H) of the block."""
    exporters: dict[str, Exporter]
    """Format -> exporter."""
    selector: Optional[Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, int], dict]] = None
    """selector(drafter, hidden (B, H), head (V, H), first_token): our candidates (B-1, K) and lattice
    (B-1, K, K) for slots 1..B-1 (module docstring); None: the variant has no selector."""
    walk: Optional[Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, int], dict]] = None
    """walk(drafter, hidden (B, H), head (V, H), anchor_token): our greedy Markov walk over the block's B slots,
    `drafts` (B,) and `scores` (B, V) (module docstring); None: the variant has no walk."""
    lattice: Optional[Callable[[torch.nn.Module, torch.Tensor, dict, Any], dict]] = None
    """lattice(drafter, hidden (B, H), inputs, target): LiLiCorr's candidates, lattice and picks on the check's
    block (module docstring); None: the variant has no lattice head."""


def _builder(**fields) -> Callable[[Shape, int, Any], DFlashDrafter]:
    return lambda shape, block_size, target_config: _build(shape, block_size, target_config, fields)


def _build(shape: Shape, block_size: int, target_config: Any, fields: dict) -> DFlashDrafter:
    config = DrafterConfig(num_layers=shape.num_layers, block_size=block_size,
                           sliding_layers=list(shape.sliding_layers), sliding_window=shape.sliding_window, **fields)
    # the tiny target's last embedding row is a spare one (past its tokenizer), as Qwen3's 151669
    spec = drafter_spec(target_config, config, mask_token_id=target_config.vocab_size - 1)
    return DFlashDrafter(spec, attention="sdpa")


def _reference(drafter: DFlashDrafter, inputs: dict, embed_weight: torch.Tensor) -> torch.Tensor:
    return drafter.forward_block(block_embeds=embed_weight[inputs["block_ids"]],
                                 block_positions=inputs["block_positions"], context_taps=inputs["taps"],
                                 context_positions=inputs["context_positions"]).hidden


def _export_dflash(drafter, out_dir: str, target_dir: str, target_config: Any) -> None:
    export_drafter(drafter, out_dir, target_config=target_config)


def _export_speculators(drafter, out_dir: str, target_dir: str, target_config: Any) -> None:
    # the verifier is the local target folder: vLLM 0.32 (the CPU build) reads it; 0.33 wants a hub id there
    export_speculators(drafter, out_dir, verifier=os.path.abspath(target_dir), target_config=target_config)


@torch.no_grad()
def _lattice(drafter: DFlashDrafter, hidden: torch.Tensor, head: torch.Tensor, first_token: int) -> dict:
    """Our selector's scores of each slot's top-K candidates after each of the previous slot's (module docstring)."""
    selector = drafter.candidate_selector
    k = selector.top_k
    unary, candidates = (hidden[1:] @ head.T).topk(k, dim=-1)  # (B-1, K) each
    previous = torch.cat([torch.full((1, k), first_token), candidates[:-1]])  # (B-1, K): slot e's predecessors
    lattice = selector.scores(hidden[1:, None].expand(-1, k, -1), unary[:, None].expand(-1, k, -1), previous,
                              candidates[:, None].expand(-1, k, -1))  # (B-1, K prev, K cand)
    return {"candidates": candidates, "lattice": lattice}


@torch.no_grad()
def _markov_walk(drafter: DFlashDrafter, hidden: torch.Tensor, head: torch.Tensor, anchor: int) -> dict:
    """Our greedy walk of the block's slots (module docstring), and the scores each pick was the argmax of."""
    logits = hidden @ head.T  # (B, V)
    walked = markov_walk(drafter.markov_w1, drafter.markov_w2, logits[None], torch.tensor([anchor]), 0.0, None)
    previous = torch.cat([torch.tensor([anchor]), walked.tokens[0, :-1]])  # (B,) the token before each slot
    return {"drafts": walked.tokens[0], "scores": logits + drafter.markov_head.bias(previous)}
def _lilicorr_lattice(drafter: DFlashDrafter, hidden: torch.Tensor, inputs: dict, target: Any) -> dict:
    """Our lattice head's scores and walk on the block (module docstring), anchored on the last context slot."""
    head = drafter.lilicorr
    ids, log_probs = candidates(hidden[None, 1:] @ target.head.float().T, head.top_k)  # (1, B-1, K) each
    anchor = drafter.context(inputs["taps"][-1:])  # (1, H)
    start, pair = head(target.embed.float()[ids], log_probs, hidden[None, 1:], anchor, torch.tensor([True]))
    lattice = torch.cat([start[:, None, None, :].expand(-1, 1, head.top_k, -1), pair], dim=1)  # (1, B-1, K, K)
    picks = walk_lattice(start, pair, ids, 0.0, None, target.head.shape[0]).tokens
    return {"candidates": ids[0], "lattice": lattice[0], "picks": picks[0]}


EXPORTERS = {"dflash": _export_dflash, "speculators": _export_speculators}

DFLASH = Variant(
    name="dflash",
    engine_classes={"vllm": "DFlashQwen3ForCausalLM", "sglang": "DFlashDraftModel"},
    build=_builder(),
    reference=_reference,
    exporters=EXPORTERS,
)

DFLASH2 = Variant(
    name="dflash2",
    engine_classes={"vllm": "DFlash2Qwen3ForCausalLM", "sglang": "DFlash2DraftModel"},
    # 16-channel groups of the tiny target's 64; 3 taps reach two slots back; 4 candidates of rank-8 codebooks
    build=_builder(variant="dflash2", conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=4),
    reference=_reference,
    exporters=EXPORTERS,
    selector=_lattice,
)

DSPARK = Variant(
    name="dspark",
    engine_classes={"vllm": "Qwen3DSparkForCausalLM", "sglang": "Qwen3DSparkModel"},
    build=_builder(variant="dspark", markov_rank=8),
    reference=_reference,
    exporters=EXPORTERS,  # its speculators export is refused (a REFUSED row)
    walk=_markov_walk,
)

# 4 candidates, a 32-wide 2-head lattice head (narrower than the tiny target's 64: token_proj is exported)
_LATTICE = dict(variant="lilicorr", lilicorr_candidate_topk=4, lilicorr_hidden_size=32, lilicorr_num_heads=2,
                lilicorr_factor_dim=16)

LILICORR = Variant(
    name="lilicorr",
    engine_classes={"vllm": "LiLiCorrForCausalLM", "sglang": "LiLiCorrDraftModel"},
    build=_builder(**_LATTICE),
    reference=_reference,
    exporters=EXPORTERS,  # our speculators exporter refuses LiLiCorr (no such format): a REFUSED row
    lattice=_lilicorr_lattice,
)

LILICORR_CONV = Variant(
    name="lilicorr-conv",
    engine_classes=LILICORR.engine_classes,
    build=_builder(**_LATTICE, lilicorr_conv=True, conv_kernel_size=3, conv_group_size=16),
    reference=_reference,
    exporters=LILICORR.exporters,
    lattice=_lilicorr_lattice,
)

VARIANTS = {v.name: v for v in (DFLASH, DFLASH2, DSPARK, LILICORR, LILICORR_CONV)}
