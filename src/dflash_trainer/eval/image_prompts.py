"""Prompts with images for an image-text target: encoding, and what batched decoding's prefill needs.

Encoding is the training's (`data/vision.py`): the chat template writes a placeholder per image, the image processor
makes the pixels, and the processor's text of each image (its image tokens) takes the placeholder's place. A prompt
longer than its budget keeps its last tokens, as a text prompt does, but never half an image: an image the cut reaches
is left out whole.

Decoding. The prefill runs the image-text model's own forward (`target/images.py`: vision tower, its embeddings in
place of the image tokens, the family's positions and masks). Qwen-VL: Qwen3-VL's deepstack features are added after
the first decoder layers, at the M-RoPE positions `get_rope_index` gives each left-padded row. Text after an image
continues from the image's largest position, so a row's text position is its slot position (what the loop and the
drafter count) plus the row's `rope_delta` (<= 0); every later step feeds text, at those positions on all 3 M-RoPE
axes, as the model's own decoding does. The other families decode at the slot positions. The drafter's context gets
the taps the training captured (`TapCapture`): after a layer where the model adds visual features, the next layer's
input.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from dflash_trainer.data.masks import Unmaskable, render
from dflash_trainer.data.types import Message
from dflash_trainer.data.vision import ImageTokens, image_text, images_of
from dflash_trainer.errors import ConfigError, DataError
from dflash_trainer.target.images import image_forward
from dflash_trainer.target.load import find_decoder_layers, image_text_model
from dflash_trainer.target.tap_points import hook_tap, read_at_next_input, visual_feature_layers

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptImages:
    """The images of one prompt, as the target's image processor made them."""

    pixel_values: torch.Tensor
    """(P, D) float32 on CPU: the pixel rows of the prompt's images as stored (`data/vision.py`: Qwen-VL's patches, a
    row per Gemma 3 image), image after image (the order of their tokens)."""
    image_grid_thw: torch.Tensor
    """(I, 3) int64 on CPU: each image's grid; its product is the image's rows."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ImagePrefill:
    """What the prefill of a batch with images feeds the image-text model besides the ids."""

    kwargs: dict[str, torch.Tensor]
    """The forward's image keywords in the family's shapes (`target/images.py`): every row's pixels, row after row,
    its grids or token types, on the target device."""
    positions: Optional[torch.Tensor] = None
    """(3, R, S) int64: M-RoPE positions (time, height, width) of the left-padded prompt slots (padding 0), for a
    Qwen-VL target; None: the slot positions."""
    rope_deltas: Optional[torch.Tensor] = None
    """(R,) int64 (Qwen-VL): a row's text after its prompt sits at M-RoPE position slot position + delta."""


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
    """(ids (L,) int64, its images or None) of a prompt with image parts, rendered with the generation prompt and the
    processor's text of each image; the last `max_prompt_tokens` tokens, cut before an image rather than through it."""
    refs = images_of(messages)
    try:
        processed = images.process(refs) if refs else None
        text = render(tokenizer, messages, thinking=thinking, add_generation_prompt=True,
                      images=None if processed is None else image_text(images, processed))
    except Unmaskable as e:
        raise DataError(f"a prompt's images cannot be made into tokens ({e.reason}: {e.detail})") from None
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)  # (n,)
    cut = max(0, len(ids) - max_prompt_tokens)
    if processed is None:
        return ids[cut:], None
    at = torch.nonzero(ids == images.image_token_id).flatten()  # (n_image_tokens,) image token slots
    counts, grid = processed.token_counts, processed.image_grid_thw  # (I,), (I, 3)
    if len(at) != int(counts.sum()):
        raise DataError(f"a prompt has {len(at)} image tokens where its {len(refs)} images make {int(counts.sum())}: "
                        "its text holds image tokens")
    ends = torch.cumsum(counts, 0)  # (I,)
    dropped = int((at[ends - counts] < cut).sum())  # images the cut reaches: a prefix, left out whole
    if dropped:
        cut = max(cut, int(at[ends[dropped - 1] - 1]) + 1)
        log.warning("an image prompt of %d tokens is cut to its last %d: %d of its %d images left out whole (the "
                    "first ones); raise the prompt budget (data.max_length) to keep them", len(ids), len(ids) - cut,
                    dropped, len(grid))
    if dropped == len(grid):
        return ids[cut:], None
    first_row = int(grid[:dropped].prod(-1).sum())
    return ids[cut:], PromptImages(pixel_values=processed.pixel_values[first_row:], image_grid_thw=grid[dropped:])


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
    images = image_forward(model, ids, valid, torch.cat([i.pixel_values for i in with_images]).to(device),
                           torch.cat([i.image_grid_thw for i in with_images]).to(device))
    return ImagePrefill(kwargs=images.kwargs, positions=images.mrope_positions, rope_deltas=images.rope_deltas)


def mrope_position_ids(positions: torch.Tensor, rope_deltas: torch.Tensor) -> torch.Tensor:
    """(4, R, n) position ids of text slots at `positions` (R, n) of rows with `rope_deltas` (R,): the slot positions
    (the model's mask reads them), then the 3 M-RoPE axes, each slot position + delta."""
    mrope = (positions + rope_deltas[:, None])[None].expand(3, -1, -1)  # (3, R, n)
    return torch.cat([positions[None], mrope])


def prefill_position_ids(positions: torch.Tensor, prefill: ImagePrefill) -> torch.Tensor:
    """Position ids of the prefill: (4, R, S) the slot positions (R, S), then the M-RoPE ones, for a Qwen-VL target;
    the slot positions for the others."""
    return positions if prefill.positions is None else torch.cat([positions[None], prefill.positions])


@contextmanager
def deepstack_tap_inputs(target, tap_layer_ids: Sequence[int], active: bool) -> Iterator[dict[int, torch.Tensor]]:
    """Inside: the taps read at the next layer's input, after the visual features the model adds (tap id -> (R, S,
    H); `target/tap_points.py`), when `active` (a forward with images whose taps are needed); otherwise records
    nothing. The other taps are the layers' outputs, HF's `output_hidden_states`."""
    found: dict[int, torch.Tensor] = {}
    layers = find_decoder_layers(target)
    added_after = visual_feature_layers(target, with_images=active)
    handles = [hook_tap(layers, l, added_after, lambda hidden, l=l: found.__setitem__(l, hidden))
               for l in sorted(set(tap_layer_ids)) if read_at_next_input(l, added_after)]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()
