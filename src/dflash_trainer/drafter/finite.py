"""Weights checked for NaN and infinity where they are read (an export, a checkpoint's drafter): a damaged file, or
the weights of a run that diverged, is named when it is loaded, not hours later as a loss that will not fall."""

from __future__ import annotations

import os
from typing import Mapping

import torch

from dflash_trainer.errors import ConfigError


def check_finite(state: Mapping[str, torch.Tensor], path: str | os.PathLike, *, fix: str) -> None:
    """A ConfigError naming `path` (the file the weights `state` were read from), the tensors holding NaN or
    infinity, and `fix`, when any does."""
    # one host sync per tensor: the weights were just read into host memory, so this costs a pass over them
    bad = [name for name, tensor in state.items() if tensor.is_floating_point() and not bool(tensor.isfinite().all())]
    if bad:
        shown = ", ".join(sorted(bad)[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise ConfigError(f"{path} holds NaN or infinite weights ({len(bad)} of its {len(state)} tensors: {shown}): "
                          f"the file is damaged, or the run that wrote it diverged; {fix}")
