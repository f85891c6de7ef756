"""Image tokens of a conversation for an image-text target (Qwen3-VL's processor, step by step).

The chat template writes each image part as `<|vision_start|><|image_pad|><|vision_end|>` (`masks.render`); the
text is tokenized and masked as any conversation (`masks.tokenize_conversation`: image pads are in user turns, so
never supervised). Then, as the target's processor does, the image processor turns the images into patches
(`pixel_values`, one row a patch) and grids (`image_grid_thw`), and each image's one pad token becomes
`t*h*w / merge_size**2` pad tokens: one per vision-tower output, which the target's forward puts in their place.
A tokenized sequence keeps its images' references and grids, not their patches: `image_inputs` makes the patches
from the references whenever they are needed (the tokenized cache stores references: `stored_images.py`).

Truncation at `data.max_length` never cuts an image: the sequence ends before the first image that does not fit
whole, and that image and those after it are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from dflash_trainer.data.images import UnreadableImage, decode_image
from dflash_trainer.data.masks import Unmaskable
from dflash_trainer.data.types import Conversation, ImageRef, TokenizedSequence


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageTokens:
    """How the target's processor makes image tokens (sent once to each tokenizer worker)."""

    image_processor: Any
    """A transformers image processor of the Qwen2-VL kind: images -> `pixel_values` (P, D), `image_grid_thw` (I, 3),
    with `merge_size`."""
    image_token_id: int
    """The image pad token (`<|image_pad|>`), the target config's `image_token_id`."""

    def __post_init__(self) -> None:
        if not isinstance(getattr(self.image_processor, "merge_size", None), int):
            raise ValueError(f"{type(self.image_processor).__name__} has no merge_size: not a Qwen2-VL-kind image "
                             "processor, which image-text training supports so far")

    def fingerprint(self) -> str:
        """What decides the pixels and grids (the tokenized cache's key)."""
        return f"{self.image_processor.to_json_string()} image_token_id={self.image_token_id}"


def image_inputs(images: ImageTokens, refs: Sequence[ImageRef]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(pixel_values (P, D) float32, image_grid_thw (I, 3) int64)` of the images `refs`, as the target's image
    processor makes them from the decoded images (what the target's forward takes), each image's bytes checked
    against its `sha256` where it has one. Each image is processed on its own, so the patches of some of a sequence's
    images are those rows of the patches of all of them. Raises `UnreadableImage`, and the processor's ValueError or
    TypeError for an image it refuses."""
    out = images.image_processor(images=[decode_image(r.url, r.sha256) for r in refs], return_tensors="pt")
    return out["pixel_values"].to(torch.float32), out["image_grid_thw"].to(torch.int64)


def add_image_tokens(sequence: TokenizedSequence, conversation: Conversation, images: ImageTokens, *,
                     max_length: int, min_supervised: int) -> TokenizedSequence:
    """`sequence` (the tokenized text of `conversation`, one pad per image) with each image's pad repeated to its
    token count, the references and grids of the images it keeps (`image_inputs` makes their pixels), cut at
    `max_length` before an image that would not fit. Raises `Unmaskable` for an image that cannot be read or
    processed, or too few supervised tokens left."""
    pad = images.image_token_id
    refs = [image for message in conversation.messages for image in message.images]
    at = torch.nonzero(sequence.input_ids == pad).flatten()  # (pads,) positions of the one pad of each image
    if len(at) > len(refs) or (len(at) < len(refs) and not sequence.truncated_tokens):
        raise Unmaskable("image_tokens_mismatch", f"the chat template wrote {len(at)} image pad tokens (id {pad}) for "
                         f"{len(refs)} images: set data.chat_template to the target's image-text template")
    refs = refs[: len(at)]  # images whose pad the text truncation cut are left out
    if not refs:
        return sequence
    try:
        _, grid = image_inputs(images, refs)  # (I, 3); the patches are made again where they are needed
    except UnreadableImage as e:
        raise Unmaskable("unreadable_image", str(e)) from None
    except (ValueError, TypeError) as e:  # e.g. an extreme aspect ratio the processor refuses
        raise Unmaskable("image_processor_error", f"{refs[0].url[:80]}...: {e}") from None
    counts = grid.prod(-1) // images.image_processor.merge_size**2  # (I,) image tokens of each image
    repeats = torch.ones_like(sequence.input_ids)  # (n,)
    repeats[at] = counts
    ids = torch.repeat_interleave(sequence.input_ids, repeats)  # (n + sum(counts) - I,)
    mask = torch.repeat_interleave(sequence.loss_mask, repeats) & (ids != pad)
    starts = at + torch.cumsum(counts, 0) - counts - torch.arange(len(at))  # (I,) first token of each image
    kept = int(((starts + counts) <= max_length).sum())  # images are in order: those that fit are a prefix
    cut = min(max_length, len(ids), *([int(starts[kept])] if kept < len(refs) else []))
    result = replace(sequence, input_ids=ids[:cut], loss_mask=mask[:cut],
                     truncated_tokens=sequence.truncated_tokens + len(ids) - cut, images=tuple(refs[:kept]),
                     image_grid_thw=grid[:kept] if kept else None)
    if int(result.loss_mask.sum()) < min_supervised:
        raise Unmaskable("too_few_supervised_tokens")
    return result
