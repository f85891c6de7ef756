"""Where a forward hook reads a tap.

Tap id `l` is the output of decoder layer `l`, but for one case: an image-text model that adds visual features at the
image positions after its first decoder layers (Qwen3-VL's deepstack) hands the next layer the sum, and a tap on such a
layer, in a forward with images, is read at the next layer's input, after the addition. That is what the serving
engines hand the drafter: vLLM's `Qwen3LLMModel.forward` adds the features before it records the aux hidden state of
the layer, and SGLang captures the next layer's input. HF's `output_hidden_states` reports the layer's output before
the addition. Training's capture (`capture.py`) and evaluation's prefill (`eval/image_prompts.py`) both read taps here.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dflash_trainer.target.load import deepstack_layer_count


def visual_feature_layers(model: nn.Module, *, with_images: bool) -> int:
    """n: the forward adds visual features after decoder layers 0..n-1 (Qwen3-VL's deepstack layers in a forward with
    images; 0 without images or for a model that adds none)."""
    return deepstack_layer_count(model) if with_images else 0


def read_at_next_input(tap: int, added_after: int) -> bool:
    """Whether tap `tap` is read at the next layer's input: the forward adds visual features after layers
    0..added_after-1 (`visual_feature_layers`)."""
    return tap < added_after


def hook_tap(layers: nn.ModuleList, tap: int, added_after: int,
             read: Callable[[torch.Tensor], None]) -> RemovableHandle:
    """Calls `read(hidden)` with tap `tap`, (B, S, H), in each forward until the handle is removed: the output of
    `layers[tap]`, or the input of `layers[tap + 1]` where `read_at_next_input`."""
    if read_at_next_input(tap, added_after):
        return layers[tap + 1].register_forward_pre_hook(
            lambda module, args, kwargs: read(args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
    return layers[tap].register_forward_hook(
        lambda module, args, output: read(output[0] if isinstance(output, tuple) else output))
