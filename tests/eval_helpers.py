"""A tiny drafter partly fitted to a tiny target's own greedy continuations (CPU, fp32), for tau tests.

An untrained drafter is rejected at nearly every step (tau 1), which tests little of the acceptance
accounting. A few dozen steps of the real training objective (`forward_train` + `drafter_loss`) on the
target's greedy continuations of the eval prompts give a drafter that is right for some slots and wrong
for others, so steps accept 1, 2, ... B tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dflash_trainer.drafter.anchors import plan_blocks
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.lilicorr import lattice_loss
from dflash_trainer.drafter.loss import SelectorLoss, drafter_loss
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.eval.proposers import DFlashBatchProposer
from dflash_trainer.eval.speculative import DFlashProposer, target_generate
from dflash_trainer.target.presets import preset_config
from tests.drafter_helpers import tiny_drafter


def proposer_for(drafter: DFlashDrafter, target) -> DFlashProposer:
    """The single-sequence proposer of the reference loop (`speculative_generate`)."""
    return DFlashProposer(drafter, target.get_input_embeddings().weight, target.lm_head.weight,
                          drafter.spec.mask_token_id)


def batch_proposer_for(drafter: DFlashDrafter, target) -> DFlashBatchProposer:
    """The batched proposer (`decode_batch`)."""
    return DFlashBatchProposer(drafter, target.get_input_embeddings().weight, target.lm_head.weight)


@torch.no_grad()
def target_taps(target, ids: torch.Tensor, tap_layer_ids) -> torch.Tensor:
    """The target's taps of `ids` (L,): the outputs of the tapped decoder layers, concatenated."""
    out = target(ids[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[l + 1][0] for l in tap_layer_ids], dim=-1)  # (T, K*H)


@dataclass(frozen=True)
class BlockCase:
    """The reference proposer's greedy drafts after the first fitted prompt, and the block's hidden states."""

    anchor: int
    drafted: torch.Tensor
    """(draft_length,) the reference proposer's drafts."""
    hidden: torch.Tensor
    """(slots, H) the drafter's block (the anchor, then mask tokens) after the prompt's taps."""


def block_case(setup, drafter: DFlashDrafter, slots: int) -> BlockCase:
    """Draft after `setup.prompts[0]` with the reference proposer, and run the block of `slots` slots as its
    definition says: the target's taps as context, the anchor's and mask tokens' embeddings."""
    prompt = setup.prompts[0]
    taps = target_taps(setup.target, prompt, drafter.spec.tap_layer_ids)  # (T, K*H)
    reference = proposer_for(drafter, setup.target)
    reference.add_context(taps, torch.arange(prompt.shape[0]))
    anchor = int(prompt[-1]) + 1
    drafted = reference.propose(anchor, prompt.shape[0], drafter.spec.draft_length + 1, 0.0, None).tokens
    ids = torch.tensor([anchor] + [drafter.spec.mask_token_id] * (slots - 1))
    embed = setup.target.get_input_embeddings().weight
    hidden = drafter.forward_block(block_embeds=torch.nn.functional.embedding(ids, embed),
                                   block_positions=prompt.shape[0] + torch.arange(slots), context_taps=taps,
                                   context_positions=torch.arange(prompt.shape[0])).hidden  # (slots, H)
    return BlockCase(anchor=anchor, drafted=drafted, hidden=hidden)


def decoded_alike(setup, drafter: DFlashDrafter, max_new: int) -> list[int]:
    """Decode `setup.prompts` together (`decode_batch`), each alone with the reference loop, and with the target
    alone; assert the three give the same tokens (lossless) and the first two the same acceptance lengths, which
    are returned (every step's, every prompt's)."""
    from dflash_trainer.eval.batched import decode_batch
    from dflash_trainer.eval.speculative import speculative_generate

    width, taps = drafter.spec.draft_length + 1, drafter.spec.tap_layer_ids
    results = decode_batch(setup.target, setup.prompts, proposer=batch_proposer_for(drafter, setup.target),
                           block_size=width, tap_layer_ids=taps, max_new_tokens=max_new, stop_token_ids=[])
    lengths = []
    for prompt, result in zip(setup.prompts, results):
        ref = speculative_generate(setup.target, proposer_for(drafter, setup.target), prompt, block_size=width,
                                   tap_layer_ids=taps, max_new_tokens=max_new, stop_token_ids=[])
        plain = target_generate(setup.target, prompt, max_new_tokens=max_new, stop_token_ids=[])
        assert result.output_ids == ref.output_ids == plain.output_ids
        assert result.acceptance_lengths == ref.acceptance_lengths
        lengths += result.acceptance_lengths
    return lengths


LATTICE_FIT = DrafterConfig(variant="lilicorr", block_size=4, gamma=2.0, lilicorr_w_ce=1.0, lilicorr_w_pen=0.0)
"""A LiLiCorr drafter's lattice terms when fitting (no penalty: it needs the target's last hidden state)."""

LATTICE_SIZES = dict(lilicorr_candidate_topk=4, lilicorr_num_heads=2, lilicorr_hidden_size=32,
                     lilicorr_factor_dim=16)
"""A tiny lattice head."""


def fit_drafter(drafter: DFlashDrafter, target, prompts: list[torch.Tensor], *, new_tokens: int = 40,
                steps: int = 30, lr: float = 3e-3, num_blocks: int = 64) -> None:
    """Train `drafter` in place for `steps` Adam steps on the target's greedy continuations of `prompts`."""
    spec = drafter.spec
    ids, masks, taps = [], [], []
    for prompt in prompts:
        cont = target_generate(target, prompt, max_new_tokens=new_tokens, stop_token_ids=[]).output_ids
        seq = torch.cat([prompt, torch.tensor(cont)])  # (L,)
        ids.append(seq)
        mask = torch.zeros(seq.shape[0], dtype=torch.bool)
        mask[prompt.shape[0] - 1:] = True  # the last prompt token anchors the first block, as in decoding
        masks.append(mask)
        taps.append(target_taps(target, seq, spec.tap_layer_ids))
    lengths = torch.tensor([0] + [s.shape[0] for s in ids])
    cu_seqlens = lengths.cumsum(0).to(torch.int32)  # (S+1,)
    input_ids, loss_mask, all_taps = torch.cat(ids), torch.cat(masks), torch.cat(taps)
    embed, head = target.get_input_embeddings().weight, target.lm_head.weight
    optimizer = torch.optim.Adam(drafter.parameters(), lr=lr)
    for step in range(steps):
        plan = plan_blocks(input_ids=input_ids, loss_mask=loss_mask, cu_seqlens=cu_seqlens, num_blocks=num_blocks,
                           block_size=spec.block_size, mask_token_id=spec.mask_token_id, seed=0, epoch=0, job_id=step)
        hidden = drafter.forward_train(taps=all_taps, cu_seqlens=cu_seqlens, plan=plan, embed_weight=embed)
        selector = None if drafter.candidate_selector is None else SelectorLoss(
            selector=drafter.candidate_selector, weight=1.0, missing="inject", detach=False)
        lattice = lattice_loss(LATTICE_FIT, drafter, taps=all_taps, embed=embed, lm_head=head, last_hidden=None,
                               final_norm=None)
        loss = drafter_loss(hidden, plan, lm_head_weight=head, gamma=2.0, chunk_rows=4096, selector=selector,
                            lattice=lattice)
        optimizer.zero_grad()
        (loss.loss_sum / loss.weight_sum).backward()
        optimizer.step()
    drafter.requires_grad_(False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Fitted:
    """A tiny fp32 target, prompts, and a drafter fitted on the target's continuations of them (read-only)."""

    target: torch.nn.Module
    prompts: list[torch.Tensor]
    """(L,) int64 token ids each, on CPU."""
    drafter: DFlashDrafter


def tiny_target_model(seed: int = 1234):
    """The tiny preset with random weights, fp32, frozen (as the shared `tiny_target` fixture builds it)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(preset_config("tiny")).eval()
    model.requires_grad_(False)
    return model


@functools.lru_cache(maxsize=None)
def fitted(block_size: int = 4, variant: str = "dflash") -> Fitted:
    """Built once per test session (fitting takes ~2 s on one CPU thread); tests must not modify it. `variant`:
    dflash2 fits a DFlash2 drafter (small selector) with its selector's loss."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = tiny_target_model()
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 1000, (n,), generator=generator) for n in (9, 14, 20, 11)]
        sizes = dict(conv_group_size=16, selector_rank=16, selector_top_k=4) if variant == "dflash2" else {}
        sizes = LATTICE_SIZES if variant == "lilicorr" else sizes
        drafter, _ = tiny_drafter(block_size=block_size, variant=variant, **sizes)  # 2 layers, taps [1, 3]
        fit_drafter(drafter, target, prompts, steps=40)
    finally:
        torch.set_num_threads(threads)
    return Fitted(target=target, prompts=prompts, drafter=drafter)
