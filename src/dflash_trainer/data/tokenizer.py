"""Load the target's tokenizer (a fast one: loss masks need character offsets)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from transformers import AutoImageProcessor, AutoTokenizer, PreTrainedTokenizerFast

from dflash_trainer.data.templates import TEMPLATE_NAMES, builtin_template
from dflash_trainer.data.tiny_tokenizer import build_tiny_image_processor, build_tiny_tokenizer
from dflash_trainer.data.vision import ImageTokens
from dflash_trainer.errors import ConfigError
from dflash_trainer.target.config import TargetConfig, loading_error, model_source


def load_tokenizer(target: TargetConfig, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer named by `target.tokenizer` (default `target.path`); `tiny` builds the test tokenizer.

    `chat_template` overrides the tokenizer's template: a builtin name or a .jinja file.
    """
    name = target.tokenizer or target.path
    if name is None:
        raise ConfigError("target.tokenizer is required when the target is built from target.random_init")
    if name == "tiny" or name.startswith("tiny:"):
        family = name.split(":", 1)[1] if ":" in name else "qwen3"
        tok = build_tiny_tokenizer(family)
    else:
        key = "target.tokenizer" if target.tokenizer else "target.path"
        reference = model_source(name, key, "tokenizer_config.json")
        try:
            tok = AutoTokenizer.from_pretrained(reference, trust_remote_code=target.trust_remote_code)
        except (OSError, ValueError) as e:
            raise loading_error(key, name, "tokenizer", e) from None
        if not isinstance(tok, PreTrainedTokenizerFast) or not tok.is_fast:
            raise ConfigError(
                f"target.tokenizer {name!r} has no fast tokenizer; loss masks need character offsets. "
                "Use a model that ships tokenizer.json."
            )
    if chat_template is not None:
        if chat_template in TEMPLATE_NAMES:
            tok.chat_template = builtin_template(chat_template)
        elif Path(chat_template).is_file():
            tok.chat_template = Path(chat_template).read_text()
        else:
            raise ConfigError(
                f"data.chat_template {chat_template!r} is neither a builtin ({TEMPLATE_NAMES}) nor a file"
            )
    if not tok.chat_template:
        raise ConfigError(f"tokenizer {name!r} has no chat template; set data.chat_template")
    return tok


def ordinary_token(tokenizer: PreTrainedTokenizerFast, token_id: int) -> str | None:
    """The token `token_id` stands for when the tokenizer produces it from text (an ordinary vocabulary
    token); None for ids past the vocabulary and for special or added tokens (reserved ones included)."""
    if token_id >= len(tokenizer) or token_id in tokenizer.added_tokens_decoder or token_id in tokenizer.all_special_ids:
        return None
    return tokenizer.convert_ids_to_tokens(token_id)


IMAGE_PAD = "<|image_pad|>"
"""Qwen-VL's image pad token, where a tokenizer names none (`tokenizer.image_token`)."""


def load_image_tokens(target: TargetConfig, tokenizer: PreTrainedTokenizerFast) -> Optional[ImageTokens]:
    """The image processing of an image-text target (its image processor, from `target.tokenizer` or `target.path`;
    `tiny:qwen3-vl` builds the test one), or None for a text target: one without an image processor, or whose
    tokenizer has no image token."""
    name = target.tokenizer or target.path
    if name is None:
        return None
    if name.startswith("tiny"):
        if name != "tiny:qwen3-vl":
            return None
        processor = build_tiny_image_processor()
    else:
        try:
            processor = AutoImageProcessor.from_pretrained(name, trust_remote_code=target.trust_remote_code)
        except (OSError, ValueError, ImportError):  # no preprocessor_config.json: a text model
            return None
    token = getattr(tokenizer, "image_token", None) or IMAGE_PAD
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id or token not in tokenizer.get_vocab():
        return None
    return ImageTokens(image_processor=processor, image_token_id=token_id)
