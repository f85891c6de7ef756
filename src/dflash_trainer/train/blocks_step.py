"""Forward + backward of a batch's blocks against a context computed once, in chunks of blocks: the part of the
drafter step that the one-rank chunked step (`micro_step.py`) and the context-parallel step (`context_parallel.py`)
share, each with the context it computed (its own, or gathered over the CP group)."""

from __future__ import annotations

import functools
from typing import Callable

import torch

from dflash_trainer.drafter.anchors import BlockPlan
from dflash_trainer.drafter.loss import LossOutput
from dflash_trainer.drafter.model import DFlashDrafter, TrainContext


def step_sums(loss: LossOutput) -> tuple[torch.Tensor, ...]:
    """What a microbatch reports, in `micro_step._result`'s order (detached device tensors)."""
    return (loss.loss_sum.detach().float(), loss.weight_sum.float(), loss.slot_correct.float(),
            loss.slot_count.float(), loss.accept_sum.float(), loss.block_count.float())


def blocks_forward_backward(
    model: DFlashDrafter, *, context: TrainContext, plan: BlockPlan, cu_seqlens: torch.Tensor, embed: torch.Tensor,
    blocks_per_chunk: int, autocast: Callable, loss_of: Callable[[torch.Tensor, BlockPlan], LossOutput],
) -> tuple[torch.Tensor, ...]:
    """Forward + backward of `plan`'s blocks against `context` (still attached to the graph that made it), in chunks
    of `blocks_per_chunk` blocks (the last padded), then the backward of whatever made the context, once. Returns
    the sums (`step_sums`), each the total over the chunks."""
    leaves = context.detached()
    # The leaves' gradients add up over the chunks in fp32 (bf16 values would round at every chunk): each chunk's
    # gradient moves from `.grad` into its sum as soon as it is written.
    grads = [torch.zeros_like(leaf, dtype=torch.float32) for leaf in leaves.tensors()]  # per leaf (T, nkv, hd)
    for leaf, grad in zip(leaves.tensors(), grads):
        leaf.register_post_accumulate_grad_hook(functools.partial(_move_grad, grad))
    totals = None
    size = blocks_per_chunk
    for start in range(0, plan.num_blocks, size):
        part = plan.select(start, start + size)  # the last chunk padded with invalid blocks: fixed shapes
        with autocast():
            hidden = model.forward_train_blocks(context=leaves, plan=part, cu_seqlens=cu_seqlens,
                                                embed_weight=embed)  # (C, B, H)
            loss = loss_of(hidden, part)
        loss.loss_sum.backward()  # frees this chunk's activations; adds to the weights' and the leaves' .grad
        sums = step_sums(loss)
        totals = sums if totals is None else tuple(a + b for a, b in zip(totals, sums))
        del hidden, loss  # before the next chunk's forward
    outputs = context.tensors()
    # the context's own backward (fc, hidden_norm, each layer's k/v projections), once
    torch.autograd.backward(outputs, [g.to(t.dtype) for t, g in zip(outputs, grads)])
    return totals


def _move_grad(total: torch.Tensor, leaf: torch.Tensor) -> None:
    total.add_(leaf.grad)
    leaf.grad = None
