"""Load the target's tokenizer (a fast one: loss masks need character offsets)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from transformers import AutoImageProcessor, AutoTokenizer, PreTrainedTokenizerFast
from transformers.utils import cached_file

from dflash_trainer.data.templates import TEMPLATE_NAMES, builtin_template
from dflash_trainer.data.tiny_tokenizer import (
    TINY_IMAGE_TOKENS,
    TINY_PROCESSOR_SETTINGS,
    build_tiny_image_processor,
    build_tiny_tokenizer,
)
from dflash_trainer.data.vision import ImageTokens, UnsupportedImages, image_tokens_for
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


def load_image_tokens(target: TargetConfig, tokenizer: PreTrainedTokenizerFast
                      ) -> Optional[ImageTokens | UnsupportedImages]:
    """The image processing of an image-text target (its image processor, from `target.tokenizer` or `target.path`,
    and its processor's settings; `tiny:<family>` builds the test ones), None for a text target (one without an image
    processor), or `UnsupportedImages` naming why an image-text target's images cannot be made into tokens."""
    name = target.tokenizer or target.path
    if name is None:
        return None
    if name.startswith("tiny"):
        family = name.split(":", 1)[1] if ":" in name else ""
        if family not in TINY_IMAGE_TOKENS:
            return None
        processor, settings = build_tiny_image_processor(family), TINY_PROCESSOR_SETTINGS.get(family, {})
        return image_tokens_for(processor, tokenizer, settings)
    try:
        processor = AutoImageProcessor.from_pretrained(name, trust_remote_code=target.trust_remote_code)
    except (OSError, ValueError):  # no preprocessor_config.json: a text model
        return None
    except ImportError as e:  # e.g. an image processor that needs torchvision
        return UnsupportedImages(reason=f"the image processor of {name} cannot be loaded ({e}): install what it "
                                 "names, or remove the image parts of the data to train on its text")
    return image_tokens_for(processor, tokenizer, _processor_settings(name))


def _processor_settings(name: str) -> dict:
    """The processor's own settings (processor_config.json: e.g. Gemma 3's `image_seq_length`), {} when it has none."""
    path = Path(name) / "processor_config.json"
    if not Path(name).is_dir():
        try:
            found = cached_file(name, "processor_config.json", _raise_exceptions_for_missing_entries=False)
        except OSError:
            found = None
        path = Path(found) if found else path
    return json.loads(path.read_text()) if path.is_file() else {}
