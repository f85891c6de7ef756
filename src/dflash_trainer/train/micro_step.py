"""One microbatch on a drafter: sample blocks, forward, chunked loss, backward (no host sync).

When the batch's blocks do not fit in memory at once (`chunking.py`), the step runs them in chunks: the context's
keys and values are computed once and detached into leaves; each chunk of blocks runs its forward, its share of
the loss (a sum: chunks add up) and its backward, which frees its activations and adds its gradients to the
parameters and to the leaves; one backward through the context with the leaves' gradients ends the step. The
loss and gradients are those of one pass over all blocks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Callable, Optional

import torch

from dflash_trainer.config import Config
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.anchors import BlockPlan, plan_blocks
from dflash_trainer.drafter.dspark import MarkovLoss, markov_loss
from dflash_trainer.drafter.lilicorr import LatticeLoss, lattice_loss
from dflash_trainer.drafter.loss import LossOutput, SelectorLoss, Teacher, drafter_loss
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.noise import add_tap_noise
from dflash_trainer.target.context_parallel import ShardGroup
from dflash_trainer.target.head import TargetHead
from dflash_trainer.target.load import DTYPES
from dflash_trainer.train.blocks_step import blocks_forward_backward, step_sums
from dflash_trainer.train.chunking import ChunkPlan, log_plan, plan_chunks
from dflash_trainer.train.context_parallel import shard_forward_backward
from dflash_trainer.train.step_loop import MicroResult
from dflash_trainer.transport.wire import HiddenStateBatch

log = logging.getLogger(__name__)


def compile_forward_train(model: DFlashDrafter, mode: Optional[str] = None) -> None:
    """torch.compile the drafter's training forwards: `forward_train` (one pass), and `train_context` and
    `forward_train_blocks` (the chunked step's), each compiled on its first call (fixed shapes: dynamic=False;
    `mode` is torch.compile's). The attention masks are built eagerly outside the graphs and passed in, so mask
    building stays out of the traced regions."""
    compile = functools.partial(torch.compile, dynamic=False, mode=mode)
    whole, blocks = compile(model.forward_train), compile(model.forward_train_blocks)

    def forward_train(*, taps, cu_seqlens, plan, embed_weight, masks=None):
        if masks is None:
            masks = model.build_masks(plan, cu_seqlens, taps.shape[0])
        return whole(taps=taps, cu_seqlens=cu_seqlens, plan=plan, embed_weight=embed_weight, masks=masks)

    def forward_train_blocks(*, context, plan, cu_seqlens, embed_weight, masks=None):
        if masks is None:
            masks = model.build_masks(plan, cu_seqlens, context.num_slots)
        return blocks(context=context, plan=plan, cu_seqlens=cu_seqlens, embed_weight=embed_weight, masks=masks)

    # instance attributes shadow the methods
    model.forward_train = forward_train
    model.train_context = compile(model.train_context)
    model.forward_train_blocks = forward_train_blocks


def _result(sums: tuple[torch.Tensor, ...], num_tokens: int, counts_batch: bool = True) -> MicroResult:
    loss_sum, weight_sum, slot_correct, slot_count, tau_sum, num_blocks = sums
    return MicroResult(loss_sum=loss_sum, weight_sum=weight_sum, slot_correct=slot_correct, slot_count=slot_count,
                       tau_sum=tau_sum, num_blocks=num_blocks, num_tokens=num_tokens, counts_batch=counts_batch)


def step_loss(dcfg: DrafterConfig, lm_head: torch.Tensor, teacher: Optional[Teacher] = None,
              selector: Optional[SelectorLoss] = None,
              markov: Optional[MarkovLoss] = None,
              lattice: Optional[LatticeLoss] = None) -> Callable[[torch.Tensor, BlockPlan], LossOutput]:
    """The drafter loss of `drafter.*` as `loss_of(hidden (n, B, H), plan)` for the blocks of `plan`."""
    return functools.partial(
        drafter_loss, lm_head_weight=lm_head, gamma=dcfg.loss_gamma, chunk_rows=dcfg.loss_chunk_rows,
        kd_weight=dcfg.kd_weight, teacher=teacher, dpace=dcfg.dpace, dpace_alpha=dcfg.dpace_alpha,
        compiled_ce=dcfg.loss_kernel == "compiled", selector=selector, markov=markov, lattice=lattice,
    )


def selector_loss(dcfg: DrafterConfig, model: DFlashDrafter, progress: float) -> Optional[SelectorLoss]:
    """DFlash2's selector term at `progress` (the fraction of training done: the weight's warm-up ramp); None for
    DFlash."""
    if model.candidate_selector is None:
        return None
    ramp = 1.0 if dcfg.selector_warmup <= 0 else min(1.0, progress / dcfg.selector_warmup)
    return SelectorLoss(selector=model.candidate_selector, weight=dcfg.selector_weight * ramp,
                        missing=dcfg.selector_missing, detach=dcfg.selector_detach)


def plan_step_chunks(config: Config, model: DFlashDrafter, device: torch.device) -> ChunkPlan:
    """How the run's drafter step splits a batch's blocks (`chunking.py`), planned once from the memory free at
    start and logged."""
    chunks = plan_chunks(
        setting=config.train.blocks_per_chunk, spec=model.spec, num_blocks=config.batch.num_blocks,
        token_budget=config.batch.token_budget, compute=DTYPES[config.train.dtype],
        loss_chunk_rows=config.drafter.loss_chunk_rows,
        num_params=sum(p.numel() for p in model.parameters() if p.requires_grad), device=device,
        compiled=config.train.compile and device.type == "cuda",
    )
    log_plan(chunks)
    return chunks


def make_micro_step(
    config: Config, model: DFlashDrafter, head: TargetHead, *, device: torch.device, progress: Callable[[], float],
    shards: Optional[ShardGroup] = None, chunks: Optional[ChunkPlan] = None,
) -> Callable[[HiddenStateBatch], MicroResult]:
    """`progress()` is the fraction of training done (for the noise schedule). `chunks`: the run's chunk plan
    (`plan_step_chunks`; None: planned here). `shards`: this rank's CP group (context parallel): each batch's taps
    are then this rank's shard's, and the step is its share of the group's (`context_parallel.py`)."""
    spec = model.spec
    dcfg = config.drafter
    compute = DTYPES[config.train.dtype]
    if compute == torch.float32:
        autocast = contextlib.nullcontext
        embed = head.embed_weight.float()  # fp32 compute: the frozen head in fp32 too
        lm_head = head.lm_head_weight.float()
    else:
        autocast = lambda: torch.autocast(device_type=device.type, dtype=compute)  # noqa: E731
        embed, lm_head = head.embed_weight, head.lm_head_weight
    chunks = chunks if chunks is not None else plan_step_chunks(config, model, device)

    # Context parallel: a shard's blocks run in chunks of a fixed size (their count varies by batch, their shapes
    # must not: the step is compiled for fixed shapes): the planned chunk, else an even split of the batch's blocks.
    shard_chunk = chunks.blocks_per_chunk if not chunks.one_pass or shards is None else \
        -(-config.batch.num_blocks // shards.size)

    def micro_step(batch: HiddenStateBatch) -> MicroResult:
        plan = plan_blocks(
            input_ids=batch.input_ids, loss_mask=batch.loss_mask, cu_seqlens=batch.cu_seqlens,
            num_blocks=config.batch.num_blocks, block_size=spec.block_size, mask_token_id=spec.mask_token_id,
            seed=config.run.seed, epoch=batch.epoch, job_id=batch.job_id, label_offset=spec.label_offset,
        )
        shard = shards.shard(batch.num_tokens, config.batch.token_budget) if shards is not None else None
        own = batch.taps if shard is None else batch.taps[: shard.length]  # (T or S, K*H)
        taps = add_tap_noise(own, dcfg, progress=progress(), seed=config.run.seed, epoch=batch.epoch,
                             job_id=batch.job_id, batch_rows=batch.taps.shape[0], start=shard.start if shard else 0)
        if compute == torch.float32:
            taps = taps.float()
        teacher = None
        if dcfg.kd_weight > 0:
            teacher = Teacher(last_hidden=batch.last_hidden, final_norm=head.final_norm)
        lattice = lattice_loss(dcfg, model, taps=taps, embed=embed, lm_head=lm_head, last_hidden=batch.last_hidden,
                               final_norm=head.final_norm)
        loss_of = step_loss(dcfg, lm_head, teacher, selector_loss(dcfg, model, progress()),
                            markov_loss(model, dcfg.dspark_divergence, dcfg.loss_kernel == "compiled"), lattice)
        if shard is not None:
            sums = shard_forward_backward(model, taps=taps, shard=shard, group=shards.group, plan=plan,
                                          cu_seqlens=batch.cu_seqlens, embed=embed, autocast=autocast, loss_of=loss_of,
                                          blocks_per_chunk=shard_chunk)
            # the group's ranks together train the batch once: its tokens split by shard, its count on shard 0
            return _result(sums, shard.real_tokens, counts_batch=shard.index == 0)
        if not chunks.one_pass:
            return _result(chunked_forward_backward(model, taps=taps, batch=batch, plan=plan, embed=embed,
                                                    chunks=chunks, autocast=autocast, loss_of=loss_of),
                           batch.num_tokens)
        with autocast():
            hidden = model.forward_train(taps=taps, cu_seqlens=batch.cu_seqlens, plan=plan, embed_weight=embed)  # (N, B, H)
            loss = loss_of(hidden, plan)
        loss.loss_sum.backward()
        return _result(step_sums(loss), batch.num_tokens)

    return micro_step


def chunked_forward_backward(
    model: DFlashDrafter, *, taps: torch.Tensor, batch: HiddenStateBatch, plan: BlockPlan, embed: torch.Tensor,
    chunks: ChunkPlan, autocast: Callable, loss_of: Callable[[torch.Tensor, BlockPlan], LossOutput],
) -> tuple[torch.Tensor, ...]:
    """Forward + backward of the batch's blocks in `chunks`, the context once (module docstring). Returns the
    microbatch's sums (`blocks_step.step_sums`), each the total over the chunks."""
    with autocast():
        context = model.train_context(taps, batch.cu_seqlens)  # per layer (T, nkv, hd) keys and values
    return blocks_forward_backward(model, context=context, plan=plan, cu_seqlens=batch.cu_seqlens, embed=embed,
                                   blocks_per_chunk=chunks.blocks_per_chunk, autocast=autocast, loss_of=loss_of)
