"""Start-time checks of a target against the drafter and data settings, and the default tap layers.

Every check raises a `ConfigError` naming the setting and the fix before any batch is run; mistakes
here (an off-by-one tap, a mask id past the embedding) otherwise train a useless drafter silently.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from torch import nn

from dflash_trainer.errors import ConfigError
from dflash_trainer.target.load import find_decoder_layers, text_config

log = logging.getLogger(__name__)

LINEAR_ATTENTION_TYPES = ("linear_attention",)
"""`layer_types` entries of hybrid models whose fast path needs extra kernels (Qwen3-Next-like)."""
FAST_KERNEL_MODULES = ("fla", "causal_conv1d")
"""Modules whose absence makes transformers run a slow pure-torch fallback for linear attention."""


def choose_tap_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """`num_taps` distinct layers spread evenly from 1 to `num_target_layers - 3`, as the released drafters.

    36 layers, 5 taps -> [1, 9, 17, 25, 33]; one tap -> the middle layer. Shallow targets that cannot fit
    the taps in [1, L-3] spread them over [0, L-2] instead (the last layer is never tapped).
    """
    if num_taps < 1:
        raise ConfigError(f"need at least one tap layer, got num_taps={num_taps}")
    if num_taps == 1 and num_target_layers >= 2:
        return [min(num_target_layers // 2, num_target_layers - 2)]
    start, end = 1, num_target_layers - 3
    if end - start + 1 < num_taps:
        start, end = 0, num_target_layers - 2
    if end - start + 1 < num_taps:
        raise ConfigError(
            f"a {num_target_layers}-layer target has only {max(0, end + 1)} tappable layers (not the last); "
            f"cannot choose {num_taps} taps: use fewer taps or set drafter.tap_layer_ids"
        )
    step = (end - start) / (num_taps - 1)  # >= 1, so floor(x + 0.5) keeps the ids distinct
    return [start + int(math.floor(i * step + 0.5)) for i in range(num_taps)]


def check_tap_layer_ids(tap_layer_ids: Sequence[int], num_target_layers: int) -> None:
    """Tap ids exist, are distinct, and are not the last layer (HF's last hidden state is after the norm)."""
    if not tap_layer_ids:
        raise ConfigError("drafter.tap_layer_ids is empty: give at least one target layer (or null to choose)")
    bad = [t for t in tap_layer_ids if not 0 <= t < num_target_layers]
    if bad:
        raise ConfigError(
            f"drafter.tap_layer_ids {list(tap_layer_ids)} has ids {bad} outside the target's "
            f"{num_target_layers} decoder layers (valid: 0..{num_target_layers - 2})"
        )
    if len(set(tap_layer_ids)) != len(tap_layer_ids):
        raise ConfigError(f"drafter.tap_layer_ids {list(tap_layer_ids)} has duplicates")
    if num_target_layers - 1 in tap_layer_ids:
        raise ConfigError(
            f"drafter.tap_layer_ids {list(tap_layer_ids)} taps the target's last layer {num_target_layers - 1}: "
            "refused (in transformers 5 the last hidden state is taken after the final norm, and the released "
            f"drafters never tap it); use layers up to {num_target_layers - 2}"
        )


def check_one_residual_stream(target_config: object) -> None:
    """Refuse a target whose decoder layers pass several residual streams (DeepSeek-V4's hyper-connections,
    `hc_mult` > 1): its hidden state is (streams, H) per token, where a DFlash drafter taps one of H, and no engine
    verifies a drafter for it."""
    streams = getattr(target_config, "hc_mult", None) or 1
    if streams > 1:
        raise ConfigError(
            f"target {type(target_config).__name__} passes {streams} residual streams between its layers "
            f"(hyper-connections, hc_mult={streams}): its hidden state per token is {streams} x hidden_size, where a "
            "DFlash drafter taps one hidden state, and no engine verifies a DFlash drafter for it (vLLM 0.33, "
            "SGLang 0.5.23): this family is not supported as a target yet; train for a target with one stream"
        )


def check_hidden_size(drafter_hidden_size: int, target_hidden_size: int) -> None:
    if drafter_hidden_size != target_hidden_size:
        raise ConfigError(
            f"drafter hidden size {drafter_hidden_size} != target hidden size {target_hidden_size}: the drafter "
            "uses the target's embedding and LM head, so it must be built from this target's config"
        )


def check_mask_token_id(mask_token_id: int, num_embeddings: int) -> None:
    if not 0 <= mask_token_id < num_embeddings:
        raise ConfigError(
            f"drafter.mask_token_id {mask_token_id} is not a row of the target's embedding "
            f"({num_embeddings} rows): choose an id in [0, {num_embeddings}), e.g. a spare row past the "
            "tokenizer's vocabulary"
        )


def check_max_length(max_length: int, max_position_embeddings: Optional[int]) -> None:
    if max_position_embeddings is not None and max_length > max_position_embeddings:
        raise ConfigError(
            f"data.max_length {max_length} exceeds the target's max_position_embeddings "
            f"{max_position_embeddings} (the longest sequence it was trained for): set data.max_length <= "
            f"{max_position_embeddings} (and pipeline.token_budget >= it)"
        )


def slow_path_warnings(model_config: object) -> list[str]:
    """Best-effort: reasons the target forward would run a slow fallback (logged, never fatal).

    Detects hybrid linear-attention models (`layer_types` containing linear attention) without the
    `fla` / `causal_conv1d` kernel packages. Other slow paths (remote code, eager attention) are not seen.
    """
    layer_types = getattr(model_config, "layer_types", None) or ()
    if not any(t in LINEAR_ATTENTION_TYPES for t in layer_types):
        return []
    missing = [m for m in FAST_KERNEL_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return []
    return [
        f"target has linear-attention layers but {missing} are not installed: transformers will run its slow "
        "pure-torch fallback (install flash-linear-attention and causal-conv1d for the fast kernels)"
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetFacts:
    """What the drafter side needs to know about a checked target."""

    num_layers: int
    hidden_size: int
    num_embeddings: int
    tap_layer_ids: tuple[int, ...]
    """Resolved tap ids (chosen when the config left them null)."""


def check_target(
    model: nn.Module,
    *,
    tap_layer_ids: Optional[Sequence[int]],
    num_taps: int = 5,
    drafter_hidden_size: Optional[int] = None,
    mask_token_id: Optional[int] = None,
    max_length: Optional[int] = None,
) -> TargetFacts:
    """Run every start-time check; choose taps when `tap_layer_ids` is None. Logs slow-path warnings."""
    num_layers = len(find_decoder_layers(model))
    hidden_size = int(text_config(model.config).hidden_size)
    taps = list(tap_layer_ids) if tap_layer_ids is not None else choose_tap_layer_ids(num_layers, num_taps)
    check_tap_layer_ids(taps, num_layers)
    if drafter_hidden_size is not None:
        check_hidden_size(drafter_hidden_size, hidden_size)
    num_embeddings = int(model.get_input_embeddings().num_embeddings)
    if mask_token_id is not None:
        check_mask_token_id(mask_token_id, num_embeddings)
    if max_length is not None:
        check_max_length(max_length, getattr(text_config(model.config), "max_position_embeddings", None))
    for warning in slow_path_warnings(text_config(model.config)):
        log.warning(warning)
    return TargetFacts(
        num_layers=num_layers, hidden_size=hidden_size, num_embeddings=num_embeddings, tap_layer_ids=tuple(taps)
    )
