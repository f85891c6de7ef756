"""Context parallel (CP) for the drafter step: one sequence's blocks trained by the CP group that holds its taps.

Each CP rank has the taps of its own shard of the sequence (`target/context_parallel.py`: tokens [i*S, (i+1)*S)).
It computes its shard's context (fc, hidden_norm, and every layer's keys and values at the slots' positions in the
whole sequence) and all-gathers it over the group with autograd (`torch.distributed.nn.functional.all_gather`):
the backward of the gather sums, on the rank that owns a shard, the gradients that every rank's blocks sent to its
keys and values, and that rank takes them on through its fc and projections.

Blocks are local to their anchors. Every rank samples the blocks of the whole sequence with the same seed (the set
one rank would train), keeps those whose anchor lies in its shard, and runs them against the gathered context with
the masks of the whole sequence, in chunks (`blocks_step.blocks_forward_backward`). A block near the end of a shard
needs no later shard: it sees context strictly before its anchor, and its labels come from the sequence's ids.

Summed over the group, the loss sums and the weights' gradients equal one rank training all the blocks. The
drafters' step sums both over the drafter ranks already (`step_loop.py`, `optim.py`), and CP ranks are drafter
ranks, so a CP step needs no reduction of its own.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_gather

from dflash_trainer.drafter.anchors import BlockPlan
from dflash_trainer.drafter.loss import LossOutput
from dflash_trainer.drafter.model import DFlashDrafter, TrainContext
from dflash_trainer.target.context_parallel import SequenceShard
from dflash_trainer.train.blocks_step import blocks_forward_backward


def gather_context(context: TrainContext, group: dist.ProcessGroup) -> TrainContext:
    """The whole sequence's context from every rank's shard of it: per layer (S, nkv, hd) -> (size*S, nkv, hd),
    shards in group-rank order. Differentiable: the backward sums each shard's gradients on its owner.

    One collective for all layers' keys and values (one in the backward too, so no two ranks can order them
    differently), in the values' dtype: the attention casts the keys to it anyway, so the forward is exact (under
    bf16 autocast the keys' gradients reach their owner rounded to bf16)."""
    dtype = context.values[0].dtype
    local = torch.stack([t.to(dtype) for t in context.tensors()], dim=1)  # (S, 2L, nkv, hd)
    whole = torch.cat(all_gather(local, group=group), dim=0)  # (size*S, 2L, nkv, hd)
    layers = len(context.keys)
    return TrainContext(keys=tuple(whole[:, i] for i in range(layers)),
                        values=tuple(whole[:, layers + i] for i in range(layers)), dtype=context.dtype)


def shard_blocks(plan: BlockPlan, shard: SequenceShard) -> BlockPlan:
    """The blocks of `plan` (the whole sequence's) whose anchors lie in `shard`; one invalid block when none do (the
    rank still runs the step, and the context's backward, with the group)."""
    # valid anchors ascend (invalid blocks last), so a shard's blocks are one run [first, first + count)
    before = plan.block_valid & (plan.anchors < shard.start)  # (N,)
    inside = plan.block_valid & (plan.anchors >= shard.start) & (plan.anchors < shard.stop)  # (N,)
    # host sync, once per batch: how many blocks a shard has varies and sets the length of its chunk loop
    first, count = torch.stack([before.sum(), inside.sum()]).tolist()
    if count == 0:
        return plan.select(plan.num_blocks, plan.num_blocks + 1)
    return plan.select(first, first + count)


def shard_forward_backward(
    model: DFlashDrafter, *, taps: torch.Tensor, shard: SequenceShard, group: dist.ProcessGroup, plan: BlockPlan,
    cu_seqlens: torch.Tensor, embed: torch.Tensor, autocast: Callable,
    loss_of: Callable[[torch.Tensor, BlockPlan], LossOutput], blocks_per_chunk: Optional[int] = None,
) -> tuple[torch.Tensor, ...]:
    """Forward + backward of this CP rank's share of one sequence's drafter step (module docstring); every rank of
    `group` calls it for the same sequence at once.

    taps (S, K*H): the taps of this rank's shard (noise already added); plan: the blocks of the whole sequence,
    the same on every rank; cu_seqlens (2+,) int32: the whole sequence's (one sequence of shard.num_tokens tokens);
    blocks_per_chunk: chunk size of the shard's blocks (None: one chunk). Returns this rank's sums
    (`blocks_step.step_sums` order) and leaves its weights' gradients in `.grad`; both add up over the group to the
    step of one rank over all blocks."""
    if taps.shape[0] != shard.length:
        raise ValueError(f"taps have {taps.shape[0]} rows, the shard {shard.length} slots")
    with autocast():
        local = model.train_context(taps, cu_seqlens, positions=shard.positions(taps.device))  # per layer (S, nkv, hd)
    context = gather_context(local, group)  # per layer (size*S, nkv, hd)
    own = shard_blocks(plan, shard)
    return blocks_forward_backward(model, context=context, plan=own, cu_seqlens=cu_seqlens, embed=embed,
                                   blocks_per_chunk=blocks_per_chunk or own.num_blocks, autocast=autocast,
                                   loss_of=loss_of)
