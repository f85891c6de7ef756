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


NOISE_BLOCK_ROWS = 4096
"""Rows per noise draw: each block of a batch's rows has its own generator, so a draw never holds more than one
block's fp32 values and a context-parallel shard draws only the blocks its rows lie in."""


def add_tap_noise(
    taps: torch.Tensor, config: DrafterConfig, *, progress: float, seed: int, epoch: int, job_id: int,
    batch_rows: Optional[int] = None, start: int = 0,
) -> torch.Tensor:
    """taps (T, K*H) plus the configured noise (the same noise for the same job); taps if noise is off.

    A context-parallel shard's taps are rows [start, start + T) of a batch of `batch_rows` rows (None: the taps are
    the whole batch): the noise is keyed by the batch's row blocks (`NOISE_BLOCK_ROWS`), so each row gets the noise
    it gets at CP=1."""
    std = noise_std_at(config, progress)
    if config.noise == "none" or std == 0.0:
        return taps
    rows = taps.shape[0] if batch_rows is None else batch_rows
    end = start + taps.shape[0]
    if not 0 <= start <= end <= rows:
        raise ValueError(f"taps of {taps.shape[0]} rows at row {start} do not lie in a batch of {rows} rows")
    noisy = taps.clone()
    for block in range(start // NOISE_BLOCK_ROWS, -(-end // NOISE_BLOCK_ROWS)):
        first = block * NOISE_BLOCK_ROWS
        shape = (min(NOISE_BLOCK_ROWS, rows - first), taps.shape[1])  # the block's rows of the whole batch
        generator = job_generator(seed, epoch, job_id, f"noise/{block}", taps.device)
        if config.noise == "gaussian":
            noise = torch.randn(shape, generator=generator, device=taps.device, dtype=torch.float32) * std
        else:
            half_width = std * math.sqrt(3.0)
            noise = (torch.rand(shape, generator=generator, device=taps.device) * 2.0 - 1.0) * half_width
        lo, hi = max(first, start), min(first + shape[0], end)  # this shard's rows in the block
        noisy[lo - start : hi - start] += noise[lo - first : hi - first].to(taps.dtype)  # (rows, K*H)
    return noisy
