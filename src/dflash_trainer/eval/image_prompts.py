"""Prompts with images for an image-text target (Qwen3-VL): encoding, and what batched decoding's prefill needs.

Encoding is the training's (`data/vision.py`): the chat template writes one image pad per image, the image processor
makes the patches and grids, and each pad becomes one token per vision-tower output. A prompt longer than its budget
keeps its last tokens, as a text prompt does, but never half an image: an image the cut reaches is left out whole.

Decoding. The prefill runs the image-text model's own forward (vision tower, its embeddings in place of the pads, its
deepstack features added after the first decoder layers) at the M-RoPE positions `get_rope_index` gives each
left-padded row. Text after an image continues from the image's largest position, so a row's text position is its
slot position (what the loop and the drafter count) plus the row's `rope_delta` (<= 0); every later step feeds text,
at those positions on all 3 M-RoPE axes, as the model's own decoding does. The drafter's context gets the taps the
training captured (`TapCapture`): after a layer where the model adds visual features, the next layer's input.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from dflash_trainer.data.images import UnreadableImage
from dflash_trainer.data.masks import Unmaskable, render
from dflash_trainer.data.types import Conversation, Message, TokenizedSequence
from dflash_trainer.data.vision import ImageTokens, add_image_tokens, image_inputs
from dflash_trainer.errors import ConfigError, DataError
from dflash_trainer.target.load import deepstack_layer_count, find_decoder_layers, image_text_model

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptImages:
    """The images of one prompt, as the target's image processor made them."""

    pixel_values: torch.Tensor
    """(P, D) float32 on CPU: the patches of the prompt's images, image after image (the order of their tokens)."""
    image_grid_thw: torch.Tensor
    """(I, 3) int64 on CPU: each image's patch grid; its tokens in the prompt number t*h*w / merge_size**2."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ImagePrefill:
    """What the prefill of a batch with images feeds the image-text model besides the ids."""

    pixel_values: torch.Tensor
    """(P, D) on the target device: every row's patches, row after row."""
    image_grid_thw: torch.Tensor
    """(I, 3) int64 on the target device: every row's image grids, row after row."""
    positions: torch.Tensor
    """(3, R, S) int64: M-RoPE positions (time, height, width) of the left-padded prompt slots (padding 0)."""
    rope_deltas: torch.Tensor
    """(R,) int64: a row's text after its prompt sits at M-RoPE position slot position + delta."""


def message_rows(messages: Sequence[dict], image_dir: Path) -> tuple[Message, ...]:
    """Chat messages (content a string, or OpenAI-style text and `image_url` parts; relative image paths start at
    `image_dir`), each image read once; a DataError naming why a message cannot be read."""
    from dflash_trainer.data.json_records import Drop
    from dflash_trainer.data.sources import normalize_row

    try:
        return normalize_row({"messages": list(messages)}, source="prompt", index=0, purpose=None,
                             image_dir=image_dir).messages
    except Drop as e:
        raise DataError(f"a prompt's messages cannot be read ({e.reason}{': ' + e.detail if e.detail else ''})") from None


def encode_image_prompt(tokenizer, messages: tuple[Message, ...], images: ImageTokens, *, thinking: bool,
                        max_prompt_tokens: int) -> tuple[torch.Tensor, Optional[PromptImages]]:
    """(ids (L,) int64, its images or None) of a prompt with image parts, rendered with the generation prompt; the
    last `max_prompt_tokens` tokens, cut before an image rather than through it."""
    text = render(tokenizer, messages, thinking=thinking, add_generation_prompt=True)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)  # (n,)
    sequence = TokenizedSequence(input_ids=ids, loss_mask=torch.zeros_like(ids, dtype=torch.bool))
    try:
        sequence = add_image_tokens(sequence, Conversation(messages=messages, source="prompt", source_index=0),
                                    images, max_length=1 << 62, min_supervised=0)
    except Unmaskable as e:
        raise DataError(f"a prompt's images cannot be made into tokens ({e.reason}: {e.detail})") from None
    ids, grid = sequence.input_ids, sequence.image_grid_thw  # (L,), (I, 3) or None
    cut = max(0, len(ids) - max_prompt_tokens)
    if grid is None:
        return ids[cut:], None
    counts = grid.prod(-1) // images.image_processor.merge_size**2  # (I,) tokens of each image
    ends = torch.nonzero(ids == images.image_token_id).flatten()  # (sum(counts),) image token slots
    ends = ends[torch.cumsum(counts, 0) - 1] + 1  # (I,) one past each image's last token
    dropped = int((ends - counts < cut).sum())  # images the cut reaches: a prefix, left out whole
    if dropped:
        cut = max(cut, int(ends[dropped - 1]))
        log.warning("an image prompt of %d tokens is cut to its last %d: %d of its %d images left out whole (the "
                    "first ones); raise the prompt budget (data.max_length) to keep them", len(ids), len(ids) - cut,
                    dropped, len(grid))
    if dropped == len(grid):
        return ids[cut:], None
    try:
        pixel_values, kept = image_inputs(images, sequence.images[dropped:])  # (P, D), (I - dropped, 3)
    except (UnreadableImage, ValueError, TypeError) as e:  # read a moment ago: changed or gone since
        raise DataError(f"a prompt's image cannot be read as it was ({e})") from None
    return ids[cut:], PromptImages(pixel_values=pixel_values, image_grid_thw=kept)


def image_prefill(target, ids: torch.Tensor, valid: torch.Tensor,
                  images: Sequence[Optional[PromptImages]]) -> Optional[ImagePrefill]:
    """The prefill's image inputs for left-padded `ids` (R, S) with `valid` (R, S) bool, or None when no row has an
    image. A ConfigError when rows have images and the target is a text model."""
    with_images = [i for i in images if i is not None]
    if not with_images:
        return None
    model = image_text_model(target)
    if model is None:
        raise ConfigError(f"{len(with_images)} prompts have images, and the target ({type(target).__name__}) is not an "
                          "image-text model: evaluate them with the image-text target they were made for, or give "
                          "text prompts")
    device = ids.device
    grid = torch.cat([i.image_grid_thw for i in with_images]).to(device)  # (I, 3)
    token_types = ((ids == model.config.image_token_id) & valid).int()  # (R, S): 1 at image tokens
    # host sync: get_rope_index walks each row's token types on the host, once per prefill
    positions, deltas = model.get_rope_index(input_ids=ids, mm_token_type_ids=token_types, image_grid_thw=grid,
                                             attention_mask=valid.long())  # (3, R, S), (R, 1)
    return ImagePrefill(pixel_values=torch.cat([i.pixel_values for i in with_images]).to(device),
                        image_grid_thw=grid, positions=positions, rope_deltas=deltas[:, 0].to(device))


def mrope_position_ids(positions: torch.Tensor, rope_deltas: torch.Tensor) -> torch.Tensor:
    """(4, R, n) position ids of text slots at `positions` (R, n) of rows with `rope_deltas` (R,): the slot positions
    (the model's mask reads them), then the 3 M-RoPE axes, each slot position + delta."""
    mrope = (positions + rope_deltas[:, None])[None].expand(3, -1, -1)  # (3, R, n)
    return torch.cat([positions[None], mrope])


def prefill_position_ids(positions: torch.Tensor, prefill: ImagePrefill) -> torch.Tensor:
    """(4, R, S) position ids of the prefill: the slot positions (R, S), then the M-RoPE ones."""
    return torch.cat([positions[None], prefill.positions])


@contextmanager
def deepstack_tap_inputs(target, tap_layer_ids: Sequence[int], active: bool) -> Iterator[dict[int, torch.Tensor]]:
    """Inside: the taps on layers after which the model adds visual features, read at the next layer's input
    (tap id -> (R, S, H)), when `active` (a forward with images whose taps are needed); otherwise records nothing."""
    found: dict[int, torch.Tensor] = {}
    layers = find_decoder_layers(target)
    added = deepstack_layer_count(target) if active else 0
    handles = [layers[l + 1].register_forward_pre_hook(
        lambda module, args, kwargs, l=l: found.__setitem__(l, args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True) for l in sorted(set(tap_layer_ids)) if l < added]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()
