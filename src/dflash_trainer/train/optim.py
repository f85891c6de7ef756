"""AdamW over fp32 master weights (compute runs under autocast), gradient sync and clipping."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from dflash_trainer.train.config import TrainConfig
from dflash_trainer.train.parallel import global_norm


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """Norm weights get no weight decay; fused AdamW on CUDA."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    on_cuda = next(model.parameters()).is_cuda
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), fused=on_cuda or None)


def sync_scale_and_clip(
    params: Iterable[nn.Parameter],
    weight_sum: torch.Tensor,
    *,
    max_norm: float,
    group: Optional[dist.ProcessGroup],
    sharded: bool = False,
) -> torch.Tensor:
    """Sum gradients over the drafter group, divide them by `weight_sum` (the step's total loss weight, a
    device scalar) and clip them to `max_norm` (0: no clipping), in one multiply; no host sync. Returns
    the gradient norm after the division and before clipping (0-d device tensor; non-finite if any
    gradient is).

    A manual all-reduce rather than DDP hooks: a rank with no batch in the partial last step still joins
    (with zero gradients), and the loss is normalised by the whole step's weight sum, known only now.
    Sharded (FSDP2) gradients were already reduce-scattered and averaged over the group by the backward.
    """
    params = list(params)
    for p in params:
        if p.grad is None:  # no backward reached it this step (a dry rank): it joins the sum with zeros
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    scale = 1.0 / weight_sum.to(torch.float32).clamp(min=1e-12)  # (), device
    world = dist.get_world_size(group) if group is not None else 1
    if sharded:
        scale = scale * world  # undo the reduce-scatter's average: the loss is a sum over ranks
    elif world > 1:
        works = [dist.all_reduce(g, group=group, async_op=True) for g in grads]
        for w in works:
            w.wait()
    norm = global_norm(torch.nn.utils.get_total_norm(grads)) * scale  # (), norm of the scaled gradients
    if max_norm > 0:
        scale = scale * (max_norm / (norm + 1e-6)).clamp(max=1.0)  # clip_grad_norm_'s coefficient
    if sharded:  # DTensor gradients: one in-place multiply each
        for g in grads:
            g.mul_(scale)
    else:
        torch._foreach_mul_(grads, scale)
    return norm
