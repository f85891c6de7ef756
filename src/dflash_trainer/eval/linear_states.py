"""Rejected drafts out of a hybrid target's recurrent states (Gated DeltaNet, Mamba-2 layers), row by row.

Batched verification feeds every row a whole block and keeps each row's committed prefix. Attention layers keep
the rejected slots masked (`batched.py`); a recurrent layer has no slots to mask: its conv window and recurrent state
have taken every fed token. transformers' caches can record the state after each token of a forward
(`activate_past_recording`, as its assisted generation does); this module puts each row back to the state after its
own last committed token. Layers without recurrent states are left alone.

Layout while recording (a block of n tokens fed at once): a layer's conv state is (R, C, K + n), the window before
the block then the block's inputs (K: the conv kernel); its recurrent history holds the states before the block and
after each of its first n - 1 tokens, the state after all n in `recurrent_states`.
"""

from __future__ import annotations

import torch
from transformers import cache_utils

from dflash_trainer.errors import ConfigError

_LINEAR = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
"""transformers' base of recurrent cache layers (absent before transformers 5.x's hybrid caches)."""


def linear_layers(cache) -> list:
    """The cache layers with recurrent states (an attention+recurrent layer counts)."""
    if _LINEAR is None:
        return []
    return [layer for layer in getattr(cache, "layers", []) if isinstance(layer, _LINEAR)]


def record_linear_states(cache, block_width: int) -> None:
    """After the prefill: have the recurrent layers keep the state after each of a block's tokens."""
    layers = linear_layers(cache)
    if layers:
        cache.activate_past_recording(recurrent_states_to_keep=block_width)
    for layer in layers:  # one history per state (transformers' activation shares one list between a layer's states)
        layer.recurrent_states_history = {i: [] for i in range(layer.number_of_states)}


def keep_committed_states(cache, kept: torch.Tensor, fed: int) -> None:
    """Set each row's recurrent states to those after its first kept[r] tokens of the `fed` just fed.

    kept: (R,) int64 on the cache's device, 1 <= kept[r] <= fed (the fed token before the drafts is always kept)."""
    for layer in linear_layers(cache):
        for i in range(layer.number_of_states):
            if layer.is_conv_states_initialized[i]:
                _keep_conv(layer, i, kept)
            if layer.is_recurrent_states_initialized[i]:
                _keep_recurrent(layer, i, kept, fed)


def _keep_conv(layer, i: int, kept: torch.Tensor) -> None:
    full, k = layer.conv_states[i], layer.conv_kernel_size[i]  # (R, C, K + n)
    offsets = kept[:, None] + torch.arange(k, device=full.device)  # (R, K): the window ending at each row's last kept
    layer.conv_states[i] = full.gather(-1, offsets[:, None, :].expand(full.shape[0], full.shape[1], k)).contiguous()


def _keep_recurrent(layer, i: int, kept: torch.Tensor, fed: int) -> None:
    history = layer.recurrent_states_history[i]
    if len(history) != fed:
        raise ConfigError(
            f"the target's recurrent layer {type(layer).__name__} kept {len(history)} states for a block of {fed} "
            "tokens: this transformers cannot roll back the rejected drafts of this target; evaluate with a "
            "transformers whose hybrid models honour `activate_past_recording`"
        )
    states = torch.stack([*history, layer.recurrent_states[i]])  # (fed + 1, R, ...): before, after 1, ..., after all
    chosen = states[kept, torch.arange(kept.shape[0], device=kept.device)]  # (R, ...)
    layer.recurrent_states[i].copy_(chosen)
    history.clear()


def select_rows(cache, rows: torch.Tensor) -> None:
    """Keep the batch rows `rows` of every cache layer (attention, recurrent or both)."""
    for layer in cache.layers:
        if _LINEAR is not None and isinstance(layer, _LINEAR):
            _LINEAR.reorder_cache(layer, rows)
        if hasattr(layer, "batch_select_indices"):
            layer.batch_select_indices(rows)
