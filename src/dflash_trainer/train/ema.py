"""An exponential moving average of the drafter's weights (`train.ema_decay`): evaluated, exported and chosen as
the best drafter in place of the raw weights, and kept in checkpoints beside them (`ema.` + the parameter name)."""

from __future__ import annotations

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn

PREFIX = "ema."
"""Checkpoint key prefix of the averaged weights in `drafter.safetensors`."""


class WeightAverage:
    """fp32 copies of the trainable parameters, moved towards them after every optimizer step:
    avg <- decay * avg + (1 - decay) * param (on the parameters' device, no host sync)."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in trained]
        self.params = [p for _, p in trained]
        """The model's own parameter tensors (updated in place by the optimizer; not sharded: FSDP2 is refused)."""
        self.average = [p.detach().float().clone() for p in self.params]
        self._update = get_ema_multi_avg_fn(decay)

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step: one foreach lerp over all parameters (fp32 parameters are not copied)."""
        self._update(self.average, [p.detach().float() for p in self.params], None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights under checkpoint keys (`ema.<name>`)."""
        return {PREFIX + n: t for n, t in zip(self.names, self.average)}

    def load_state_dict(self, saved: dict[str, torch.Tensor]) -> bool:
        """Take the averages from checkpoint `saved` (keys `ema.<name>`); False when it has none (a run that
        turned the average on at resume starts it from the current weights)."""
        if not any(k.startswith(PREFIX) for k in saved):
            return False
        missing = [n for n in self.names if PREFIX + n not in saved]
        if missing:
            raise ValueError(f"the checkpoint's averaged weights lack {missing[:4]}")
        for n, t in zip(self.names, self.average):
            t.copy_(saved[PREFIX + n])
        return True

    def averaged_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """`model`'s state dict with the averaged weights in place of the parameters (in their dtypes)."""
        state = dict(model.state_dict())
        for n, t in zip(self.names, self.average):
            state[n] = t.to(state[n].dtype)
        return state


def split_averaged(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the raw weights, the averaged ones under their `ema.` keys) of a checkpoint's `drafter.safetensors`."""
    raw = {k: v for k, v in weights.items() if not k.startswith(PREFIX)}
    return raw, {k: v for k, v in weights.items() if k.startswith(PREFIX)}
