"""Load a frozen target: any causal LM (or image-text-to-text model) from a path or hub id, or random weights from a
config."""

from __future__ import annotations

import difflib
import logging
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

from dflash_trainer.errors import ConfigError
from dflash_trainer.target.config import TargetConfig, loading_error, model_source
from dflash_trainer.target.presets import PRESETS, preset_config
from dflash_trainer.target.quantize import (
    materialize_layerwise,
    pretrained_quantization,
    quantize_layer_fp8,
    require_fp8_device,
    warn_weights_left_unquantized,
)

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def auto_model_class(model_config: PretrainedConfig):
    """The transformers auto class that builds the target: for an image-text-to-text architecture (a config with a
    vision tower: Qwen3-VL, Qwen3.5, Gemma 3/4) the image-text-to-text one, whose vision tower makes the image
    tokens of image rows (its language model is tapped), even where the causal-LM class would load the language
    model alone (Qwen3.5); the causal-LM one otherwise."""
    kind = type(model_config)
    image_text = kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING and getattr(model_config, "vision_config", None) is not None
    if image_text or kind not in MODEL_FOR_CAUSAL_LM_MAPPING and kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def target_model_config(cfg: TargetConfig) -> PretrainedConfig:
    """The target's HF config, without loading weights."""
    if cfg.random_init is not None:
        if cfg.random_init in PRESETS:
            return preset_config(cfg.random_init)
        path = Path(cfg.random_init)
        if not path.exists():
            close = difflib.get_close_matches(cfg.random_init, list(PRESETS), n=1)
            hint = f"did you mean {close[0]}? Or give" if close else "give"
            raise ConfigError(
                f"target.random_init {cfg.random_init!r} is neither a preset nor a path: {hint} a preset "
                f"({', '.join(sorted(PRESETS))}) or a folder holding a model's config.json"
            )
        key, name = "target.random_init", cfg.random_init
    else:
        assert cfg.path is not None
        key, name = "target.path", cfg.path
        path = model_source(cfg.path, "target.path", "config.json")  # outside the try: its error is clear
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise loading_error(key, name, "model config", e) from None


_BACKEND_FLAGS = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}


def has_attention_backend(model_config: PretrainedConfig, attn_implementation: str) -> bool:
    """Whether the target's architecture has that attention path (gpt-oss has no sdpa: its attention sinks).
    True for architectures transformers does not know (remote code): transformers checks those itself."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(model_config), None)
    flag = _BACKEND_FLAGS.get(attn_implementation)
    return model_class is None or flag is None or bool(getattr(model_class, flag, True))


def check_attention_backend(model_config: PretrainedConfig, attn_implementation: str) -> None:
    """Refuse, naming the setting, an attention backend the target's architecture lacks."""
    if not has_attention_backend(model_config, attn_implementation):
        raise ConfigError(
            f"target.attn_implementation={attn_implementation!r}: {type(model_config).__name__} targets have no "
            "such attention path; set target.attn_implementation=eager (CPU) or flex_attention (GPU)"
        )


def load_target(cfg: TargetConfig, device: torch.device | str, seed: int = 0) -> PreTrainedModel:
    """The target, frozen and in eval mode, on `device` in `cfg.dtype`.

    Random-init targets are built directly on the device (no host copy of the weights) from `seed`.
    """
    dtype = DTYPES[cfg.dtype]
    device = torch.device(device)
    model_config = target_model_config(cfg)
    check_attention_backend(model_config, cfg.attn_implementation)
    model_config._attn_implementation = cfg.attn_implementation
    if cfg.random_init is not None and cfg.quantize == "fp8":
        model = _random_fp8_target(cfg, model_config, device, seed)
    elif cfg.random_init is not None:
        with torch.device(device):
            torch.manual_seed(seed)
            model = auto_model_class(model_config).from_config(
                model_config, dtype=dtype, trust_remote_code=cfg.trust_remote_code
            )
    else:
        quantization = pretrained_quantization(cfg, model_config, device)
        model = auto_model_class(model_config).from_pretrained(
            model_source(cfg.path, "target.path", "config.json", weights=True),
            dtype=dtype,
            attn_implementation=cfg.attn_implementation,
            trust_remote_code=cfg.trust_remote_code,
            **quantization.kwargs,
        ).to(device)  # never .to(dtype): that would cast FP8 weights without their scales
        if quantization.requantize:
            for layer in find_decoder_layers(model):
                quantize_layer_fp8(layer)
    if cfg.quantize == "fp8":
        warn_weights_left_unquantized(find_decoder_layers(model), cfg.dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def _random_fp8_target(cfg: TargetConfig, model_config: PretrainedConfig, device: torch.device,
                       seed: int) -> PreTrainedModel:
    """Random weights with FP8 decoder layers, built on the meta device and made real one layer at a time."""
    require_fp8_device(device)
    with torch.device("meta"):
        model = auto_model_class(model_config).from_config(
            model_config, dtype=DTYPES[cfg.dtype], trust_remote_code=cfg.trust_remote_code
        )
    torch.manual_seed(seed)
    materialize_layerwise(model, find_decoder_layers(model), device, quantize_layer_fp8)
    return model


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language model's config: an image-text-to-text config nests it (`text_config`); a causal LM's is itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def find_decoder(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM (embeddings + layers + final norm, no LM head).

    Llama/Qwen/Mistral-like models keep it in `model.model` with its layers in `.layers`; image-text-to-text
    models (Gemma 3 4B+) in `model.model.language_model` (Llama 4's in `model.language_model.model`), run on text
    alone. Calling the decoder instead of the
    causal LM never computes logits.
    """
    decoder = getattr(model, "model", None)
    language = getattr(model, "language_model", None)  # Llama 4 image-text: the causal LM itself
    for candidate in (decoder, getattr(decoder, "language_model", None), getattr(language, "model", None)):
        if isinstance(candidate, nn.Module) and isinstance(getattr(candidate, "layers", None), nn.ModuleList):
            return candidate
    arch = type(model).__name__
    archs = getattr(getattr(model, "config", None), "architectures", None)
    raise ConfigError(
        f"cannot find the decoder layers of target {arch} (architectures={archs}): expected "
        "`model.model.layers` (an nn.ModuleList) as in Llama/Qwen/Mistral-like causal LMs, or "
        "`model.model.language_model.layers` as in image-text-to-text ones; "
        "this architecture is not supported as a target yet"
    )


VISION_TOWER_NAMES = ("visual", "vision_tower", "vision_model")
"""What image-text models call their vision tower: Qwen-VL's `visual`, Gemma's `vision_tower`, Llama 4's."""


def image_text_model(model: nn.Module) -> Optional[nn.Module]:
    """The image-text model around the decoder, with a vision tower and the language model, whose forward takes
    pixels (`images.py`): `model.model` (Qwen-VL, Gemma 3/4), or the model itself (Llama 4, whose head is its
    language model's); None for a text target."""
    for inner in (getattr(model, "model", None), model):
        if hasattr(inner, "language_model") and any(hasattr(inner, name) for name in VISION_TOWER_NAMES):
            return inner
    return None


def deepstack_layer_count(model: nn.Module) -> int:
    """Decoder layers 0..n-1 after which an image-text model adds visual features at image positions (Qwen3-VL's
    deepstack); 0 for other models."""
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    return len(getattr(vision, "deepstack_visual_indexes", None) or ())


FINAL_NORM_NAMES = ("norm", "norm_f", "final_layernorm")
"""What decoder stacks call their final norm: Llama/Qwen/Gemma/DeepSeek `norm`, Nemotron-H's `norm_f`."""


def find_final_norm(decoder: nn.Module) -> nn.Module:
    """The final norm of a decoder stack (`find_decoder`), applied to the last layer's output before the LM head."""
    for name in FINAL_NORM_NAMES:
        module = getattr(decoder, name, None)
        if isinstance(module, nn.Module):
            return module
    raise ConfigError(
        f"cannot find the final norm of target decoder {type(decoder).__name__}: expected one of "
        f"{list(FINAL_NORM_NAMES)}; this architecture is not supported as a target yet"
    )


def module_name(root: nn.Module, module: nn.Module) -> str:
    """`module`'s qualified name within `root` (`model.language_model`), its tensors' state-dict prefix."""
    return next(name for name, candidate in root.named_modules() if candidate is module)


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM: layer `l` outputs what HF reports as `hidden_states[l + 1]`."""
    return find_decoder(model).layers
