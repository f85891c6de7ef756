"""Load the target's tokenizer (a fast one: loss masks need character offsets)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dflash_trainer.data.templates import TEMPLATE_NAMES, builtin_template
from dflash_trainer.data.tiny_tokenizer import build_tiny_tokenizer
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
