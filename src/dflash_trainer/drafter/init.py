"""`drafter.init_from: target`: start the drafter's layers from the target's own decoder layers.

Drafter layer j copies target layer `source_layers(L, T)[j]` (spread evenly, the first and the last target
layer included), whole: attention with its q/k norms, MLP, both layer norms. The context path starts as the
last target layer sees its input: `fc` passes the last tap through (zero weight on the other taps) and
`hidden_norm` takes the input norm of the layer after that tap, and the final norm is the target's. Shapes
must match (the drafter's MLP width is the target's by default).
"""

from __future__ import annotations

from typing import Sequence

import torch

from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.errors import ConfigError


def source_layers(num_layers: int, num_target_layers: int) -> list[int]:
    """The target layer each drafter layer starts from."""
    if num_layers == 1:
        return [num_target_layers - 1]
    step = (num_target_layers - 1) / (num_layers - 1)
    return [int(j * step + 0.5) for j in range(num_layers)]


def target_tensor_names(model: DFlashDrafter, decoder: str = "model") -> dict[str, str]:
    """Drafter parameter name -> target tensor name, for every parameter the initialisation copies; `decoder`: the
    target's decoder stack's state-dict name (`DecoderLayout.prefix`)."""
    spec = model.spec
    names = {}
    for j, t in enumerate(source_layers(spec.num_layers, spec.num_target_layers)):
        for name in _qwen3_layer_names(model, j):
            names[f"layers.{j}.{name}"] = f"{decoder}.layers.{t}.{name}"
    names["norm.weight"] = f"{decoder}.norm.weight"
    after_tap = max(spec.tap_layer_ids) + 1  # < num_target_layers: the last layer is never tapped
    names["hidden_norm.weight"] = f"{decoder}.layers.{after_tap}.input_layernorm.weight"
    return names


def _qwen3_layer_names(model: DFlashDrafter, layer: int) -> set[str]:
    """The parameters of drafter layer `layer` that a Qwen3 decoder layer has: all but DFlash2's convolutions, which
    keep their initialisation (the identity)."""
    return {name for name, _ in model.layers[layer].named_parameters() if "_conv." not in name}


def check_target_layers(model: DFlashDrafter, target_layer_names: Sequence[set[str]]) -> None:
    """Refuse, with the fix, a target whose source layers are not Qwen3-style layers of the drafter's parameters:
    a copy would leave parts out (Gemma's extra feed-forward norms, which also scale by 1 + weight) or miss some
    (Llama has no q/k norms). `target_layer_names[t]`: the parameter names within target layer t."""
    spec = model.spec
    for j, t in enumerate(source_layers(spec.num_layers, spec.num_target_layers)):
        mine = _qwen3_layer_names(model, j)
        theirs = target_layer_names[t]
        if mine != theirs:
            raise ConfigError(
                f"drafter.init_from=target copies whole Qwen3-style layers, but target layer {t} has "
                f"{sorted(theirs - mine)[:4] or 'nothing'} beyond them and lacks {sorted(mine - theirs)[:4] or 'nothing'}: "
                "set drafter.init_from=null (random weights)"
            )


@torch.no_grad()
def init_from_target(model: DFlashDrafter, tensors: dict[str, torch.Tensor]) -> None:
    """Copy `tensors` (target name -> tensor, from `target_tensor_names`) into `model`, and set `fc` to pass the
    last tap through."""
    own = dict(model.named_parameters())
    wrong = []
    for mine, theirs in target_tensor_names(model).items():
        if own[mine].shape != tensors[theirs].shape:
            wrong.append(f"{mine} {tuple(own[mine].shape)} vs {theirs} {tuple(tensors[theirs].shape)}")
            continue
        own[mine].copy_(tensors[theirs])
    if wrong:
        raise ConfigError(f"drafter.init_from=target: shapes differ (set drafter.intermediate_size to the "
                          f"target's): {wrong[:3]}")
    h, k = model.spec.hidden_size, model.spec.num_taps
    last = max(range(k), key=lambda i: model.spec.tap_layer_ids[i])
    model.fc.weight.zero_()
    model.fc.weight[:, last * h : (last + 1) * h] = torch.eye(h)
