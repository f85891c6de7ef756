"""Learning-rate schedule over the planned steps or, with a time budget (`train.max_minutes`), over whichever
runs out first: linear warmup, then either cosine decay to `min_lr_ratio * lr` (`cosine`), or the peak held and
a linear decay to it over the last `decay_ratio` of the steps (`wsd`: warmup, stable, decay)."""

from __future__ import annotations

import math
from typing import Callable

import torch


def lr_factor(step: int, *, total_steps: int, warmup_ratio: float, min_lr_ratio: float, schedule: str = "cosine",
              decay_ratio: float = 0.2) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based)."""
    warmup = max(1, int(round(total_steps * warmup_ratio))) if warmup_ratio > 0 else 0
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "wsd":
        decay = max(1, int(round(total_steps * decay_ratio)))
        left = total_steps - step  # steps still to take, this one included
        return 1.0 if left > decay else min_lr_ratio + (1 - min_lr_ratio) * max(0, left - 1) / decay
    span = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, *, total_steps: int, warmup_ratio: float, min_lr_ratio: float,
                    schedule: str = "cosine", decay_ratio: float = 0.2,
                    time_fraction: Callable[[], float] = lambda: 0.0):
    """`time_fraction()`: the fraction of the time budget spent, the same on every rank; the schedule is at
    step max(step, time_fraction * total_steps)."""
    def factor(step: int) -> float:
        step = max(step, int(time_fraction() * total_steps))
        return lr_factor(step, total_steps=total_steps, warmup_ratio=warmup_ratio, min_lr_ratio=min_lr_ratio,
                         schedule=schedule, decay_ratio=decay_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
