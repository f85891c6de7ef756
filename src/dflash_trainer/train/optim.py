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


def scale_and_sync_gradients(
    params: Iterable[nn.Parameter], scale: torch.Tensor, group: Optional[dist.ProcessGroup], *, sharded: bool = False
) -> None:
    """Sum gradients over the drafter group, then multiply by `scale` (a device scalar, no host sync).

    A manual all-reduce rather than DDP hooks: a rank with no batch in the partial last step still joins
    with zero gradients, and the loss is normalised by the whole step's weight sum, known only afterwards.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if sharded:  # FSDP2 already reduce-scattered (averaged) them in the last backward
        world = dist.get_world_size(group) if group is not None else 1
        for g in grads:
            g.mul_(scale * world)
        return
    if group is not None and dist.get_world_size(group) > 1:
        works = [dist.all_reduce(g, group=group, async_op=True) for g in grads]
        for w in works:
            w.wait()
    torch._foreach_mul_(grads, scale)


def clip_gradients(params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Total gradient norm as a device scalar (0-d); clipped in place when max_norm > 0."""
    params = [p for p in params if p.grad is not None]
    if max_norm > 0:
        return global_norm(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True))
    return global_norm(torch.nn.utils.get_total_norm([p.grad for p in params]))
