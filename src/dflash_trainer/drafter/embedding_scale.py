"""The scale of the block embeddings, written where the engines read it.

The drafter embeds its block with the target's input-embedding module (`target/head.py`): the table itself for most
targets, the table times sqrt(hidden) for Gemma-family targets (Gemma 1-4; MiniCPM3 has its own scalar). The engines
do not all do the same (read in their released packages, 2026-12):
- SGLang 0.5.23 embeds with the target's own module, scale included: served as trained, whatever the export says;
- the `dflash` reference and vLLM 0.33's DFlash2 class (`qwen3_dflash2.py`) take the raw table times
  `dflash_config.input_embedding_scale` (default 1): served as trained once the export writes the scale;
- vLLM 0.33's DFlash and DSpark classes (`qwen3_dflash.py`, `qwen3_dspark.py`) share the target's raw table and read
  no scale, and its speculators-format reader rebuilds `dflash_config` from fixed fields, dropping the scale: such a
  drafter would see block embeddings sqrt(hidden) smaller than in training.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch
from transformers import AutoModel
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    MODEL_MAPPING,
)

from dflash_trainer.errors import ConfigError
from dflash_trainer.target.head import embedding_scale
from dflash_trainer.target.load import auto_model_class

log = logging.getLogger(__name__)

SCALE_KEY = "input_embedding_scale"
"""The `dflash_config` field the reference and vLLM's DFlash2 class multiply the raw embedding table by."""

VLLM_READS_SCALE = frozenset({"dflash2"})
"""Variants whose vLLM 0.33 class (dflash format) reads `dflash_config.input_embedding_scale`."""


def _skeleton_class(config: Any):
    """The class whose embedding module is read: the target's own, or for a language model's config with no class
    of its own beside its base model (Qwen3-VL's text config) that base model (it holds the embedding)."""
    kind = type(config)
    own = kind in MODEL_FOR_CAUSAL_LM_MAPPING or kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    return AutoModel if not own and kind in MODEL_MAPPING else auto_model_class(config)


def block_embedding_scale(target_config: Any, dtype: torch.dtype) -> Optional[float]:
    """The scalar the target's input-embedding module multiplies its table by, rounded to `dtype` as the module
    rounds it (1.0 for a plain embedding); None when its class says nothing (a custom module: unknown without
    weights). Read from the target's modules built on the meta device (no memory, no weights)."""
    try:
        with torch.device("meta"):
            skeleton = _skeleton_class(target_config).from_config(target_config)
    except (ValueError, ImportError, OSError) as e:  # a class transformers cannot build without remote code
        log.warning("cannot tell the target's embedding scale (%s: %s): the export records none", type(e).__name__, e)
        return None
    scale = embedding_scale(skeleton.get_input_embeddings())
    if scale is None:
        log.warning("the target's embedding module (%s) has no known scale: the export records none; if it scales "
                    "its table, the engines that read `dflash_config.%s` embed the block unlike training",
                    type(skeleton.get_input_embeddings()).__name__, SCALE_KEY)
        return None
    return float(torch.tensor(scale, dtype=torch.float32).to(dtype))  # as the module: its scale in the weights' dtype


def embedding_scale_fields(scale: Optional[float]) -> dict[str, float]:
    """The `dflash_config` field recording a block-embedding scale other than 1 ({} for 1 or unknown)."""
    return {} if scale is None or scale == 1.0 else {SCALE_KEY: scale}


def warn_if_vllm_unscaled(variant: str, scale: Optional[float]) -> None:
    """A dflash-format export whose block embeddings are scaled: say when vLLM serves them unscaled, and the fix
    (once per process: a training run exports its best drafter again and again)."""
    if scale is None or scale == 1.0 or variant in VLLM_READS_SCALE:
        return
    _warn_vllm_unscaled(variant, scale)


@functools.cache
def _warn_vllm_unscaled(variant: str, scale: float) -> None:
    log.warning(
        "the target scales its embeddings by %g (Gemma-family), as this %s drafter was trained; vLLM 0.33 serves it "
        "with the raw embedding table (its %s class reads no scale), so its block embeddings would be %g times "
        "smaller than in training and it would draft poorly there. SGLang and the `dflash` reference serve it as "
        "trained; to serve with vLLM, train drafter.variant=dflash2 (vLLM's DFlash2 class reads "
        "dflash_config.%s, which this export records)", scale, variant, variant, scale, SCALE_KEY)


def refuse_speculators_scale(scale: Optional[float]) -> None:
    """The speculators format (vLLM's) cannot carry a block-embedding scale: refused, with the fix."""
    if scale is None or scale == 1.0:
        return
    raise ConfigError(
        f"export --format speculators cannot serve this drafter as trained: the target scales its embeddings by "
        f"{scale:g} (Gemma-family) and the drafter was trained on scaled block embeddings, but vLLM (0.33) builds a "
        f"speculators drafter's config from fixed fields, with no embedding scale, and shares the raw table, so the "
        f"blocks would be {scale:g} times smaller. Export a drafter.variant=dflash2 drafter with --format dflash "
        f"(vLLM's DFlash2 class reads dflash_config.{SCALE_KEY}) and serve it with `vllm serve TARGET "
        f"--speculative-config '{{\"method\": \"dflash\", \"model\": \"EXPORT\", ...}}'`, or serve --format dflash "
        f"with SGLang"
    )
