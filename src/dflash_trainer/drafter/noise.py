"""Optional noise on the target taps before `fc` (`drafter.noise`), keyed by (seed, epoch, job_id).

`std` is the noise's true standard deviation for both kinds: gaussian N(0, std^2), uniform on
[-std*sqrt(3), std*sqrt(3)]. The std follows a linear schedule from `noise_std` to `noise_std_final`
over training progress in [0, 1] (constant when `noise_std_final` is None).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from dflash_trainer.drafter.anchors import job_generator
from dflash_trainer.drafter.config import DrafterConfig


def noise_std_at(config: DrafterConfig, progress: float) -> float:
    """The noise std at training progress in [0, 1] (fraction of optimizer steps done)."""
    if config.noise_std_final is None:
        return config.noise_std
    progress = min(max(progress, 0.0), 1.0)
    return config.noise_std + (config.noise_std_final - config.noise_std) * progress


def add_tap_noise(
    taps: torch.Tensor, config: DrafterConfig, *, progress: float, seed: int, epoch: int, job_id: int,
    batch_rows: Optional[int] = None, start: int = 0,
) -> torch.Tensor:
    """taps (T, K*H) plus the configured noise (the same noise for the same job); taps if noise is off.

    A context-parallel shard's taps are rows [start, start + T) of a batch of `batch_rows` rows (None: the taps are
    the whole batch): the noise is drawn on the whole batch's shape and sliced, so each row gets the noise it gets
    at CP=1. NOTE: that draws batch_rows x K*H fp32 values on every rank of the group (21 GB at 256K tokens and
    K*H = 5 x 4096, the 8B shape); a draw keyed by row block would bound it, and change the noise of CP=1 runs."""
    std = noise_std_at(config, progress)
    if config.noise == "none" or std == 0.0:
        return taps
    rows = taps.shape[0] if batch_rows is None else batch_rows
    if not 0 <= start <= rows - taps.shape[0]:
        raise ValueError(f"taps of {taps.shape[0]} rows at row {start} do not lie in a batch of {rows} rows")
    shape = (rows, taps.shape[1])
    generator = job_generator(seed, epoch, job_id, "noise", taps.device)
    if config.noise == "gaussian":
        noise = torch.randn(shape, generator=generator, device=taps.device, dtype=torch.float32) * std
    else:
        half_width = std * math.sqrt(3.0)
        noise = (torch.rand(shape, generator=generator, device=taps.device) * 2.0 - 1.0) * half_width
    return taps + noise[start : start + taps.shape[0]].to(taps.dtype)  # (T, K*H)
