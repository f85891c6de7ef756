"""Optional noise on the target taps before `fc` (`drafter.noise`), keyed by (seed, epoch, job_id).

`std` is the noise's true standard deviation for both kinds: gaussian N(0, std^2), uniform on
[-std*sqrt(3), std*sqrt(3)]. The std follows a linear schedule from `noise_std` to `noise_std_final`
over training progress in [0, 1] (constant when `noise_std_final` is None).
"""

from __future__ import annotations

import math

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
    taps: torch.Tensor, config: DrafterConfig, *, progress: float, seed: int, epoch: int, job_id: int
) -> torch.Tensor:
    """taps (T, K*H) plus the configured noise (the same noise for the same job); taps if noise is off."""
    std = noise_std_at(config, progress)
    if config.noise == "none" or std == 0.0:
        return taps
    generator = job_generator(seed, epoch, job_id, "noise", taps.device)
    if config.noise == "gaussian":
        noise = torch.randn(taps.shape, generator=generator, device=taps.device, dtype=torch.float32) * std
    else:
        half_width = std * math.sqrt(3.0)
        noise = (torch.rand(taps.shape, generator=generator, device=taps.device) * 2.0 - 1.0) * half_width
    return taps + noise.to(taps.dtype)  # (T, K*H)
