"""The optimizer over fp32 master weights (compute runs under autocast): AdamW, or Muon beside AdamW; gradient
sync and clipping."""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from dflash_trainer.train.config import TrainConfig
from dflash_trainer.train.muon import MuonAdamW, route_parameters
from dflash_trainer.train.parallel import global_norm

log = logging.getLogger(__name__)


def build_optimizer(model: nn.Module, cfg: TrainConfig, *, vocab_size: int,
                    group: Optional[dist.ProcessGroup] = None) -> torch.optim.Optimizer:
    """`train.optimizer`: AdamW over everything, or Muon over the weight matrices beside AdamW over the rest
    (`muon.py`); weight decay on parameters of 2 or more dimensions only; fused AdamW on CUDA. Which parameters
    go where is logged once. `vocab_size`: the drafter's vocabulary, which marks the vocabulary tables; `group`: the
    data-parallel ranks whose gradients are averaged, which split Muon's orthogonalisations."""
    fused = next(model.parameters()).is_cuda or None
    if cfg.optimizer == "adamw":
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(_by_decay(params, cfg.lr, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas),
                                 fused=fused)
    routes = route_parameters(model, vocab_size)
    adamw = _by_decay([p for _, p in routes["adamw"]], cfg.lr, cfg.weight_decay)
    tables = _by_decay([p for _, p in routes["tables"]], cfg.muon_table_peak_lr, cfg.weight_decay)
    muon = [{"params": [p for _, p in routes["muon"]], "lr": cfg.muon_peak_lr, "weight_decay": cfg.weight_decay}]
    log.info("train.optimizer=muon: Muon at lr %.3g: %s; AdamW at Muon's lr %.3g: %s; AdamW at lr %.3g: %s",
             cfg.muon_peak_lr, _count(routes["muon"], "matrices"), cfg.muon_table_peak_lr,
             _count(routes["tables"], "vocabulary tables", names=True), cfg.lr, _count(routes["adamw"], "others"))
    world = dist.get_world_size(group) if group is not None else 1
    if world > 1:
        log.info("train.optimizer=muon: each of the %d drafter ranks orthogonalises its share of the matrices and "
                 "broadcasts it (muon.py)", world)
    return MuonAdamW([g for g in adamw + tables if g["params"]], [g for g in muon if g["params"]],
                     betas=tuple(cfg.betas), fused=fused, momentum=cfg.muon_momentum, group=group)


def _by_decay(params: list[nn.Parameter], lr: float, weight_decay: float) -> list[dict]:
    """AdamW groups at `lr`: weight decay on the parameters of 2 or more dimensions, none on the others."""
    return [
        {"params": [p for p in params if p.ndim >= 2], "lr": lr, "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "lr": lr, "weight_decay": 0.0},
    ]


def _count(named: list[tuple[str, nn.Parameter]], what: str, names: bool = False) -> str:
    """'N what (M parameters)', with the names when asked."""
    listed = f": {', '.join(n for n, _ in named)}" if names and named else ""
    return f"{len(named)} {what} ({sum(p.numel() for _, p in named):,} parameters{listed})"


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
