"""Image tokens of a conversation for an image-text target: what each family's processor makes of an image.

The chat template writes a placeholder for each image part (`ImageTokens.placeholder`); the family's processor turns
each image into pixels for the vision tower and a text that takes the placeholder's place in the rendered conversation.
`masks.render` puts that text in before tokenizing, as the processor does, so the tokens around an image are the
processor's (Gemma 3's newlines merge with the template's). The families, as transformers' processors make them:
- Qwen-VL (Qwen2-VL to Qwen3-VL, Qwen3.5): `<|image_pad|>` (inside the template's vision start/end) becomes
  t*h*w / merge_size**2 pads, one per vision-tower output; pixels: the patches (t*h*w rows), grid (t, h, w).
- Gemma 3: `<start_of_image>` becomes "\\n\\n<start_of_image>" + `image_seq_length` soft tokens + "<end_of_image>\\n\\n"
  (with pan-and-scan, the original's run and one per crop, in the processor's words); pixels: one row of C*S*S per
  image and crop, grid (1 + crops, 1, 1).
- Gemma 4: `<|image|>` becomes boi + one soft token per pooled group of patches + eoi; pixels: the image's h*w real
  patches (the processor's padding left out), grid (1, h, w), from which the patches' positions are rebuilt.
- Llama 4: `<|image|>` becomes `<|image_start|>`, each tile's `<|patch|>` tokens (one per pixel-shuffled group of
  patches) row by row between tile separators when the image spans several tiles, `<|image|>` and the global tile's
  patch tokens, `<|image_end|>`; pixels: a row of C*S*S per tile, grid (tiles, 1, 1).
Every family gives its pixels as rows `(P, D)` and a grid `(I, 3)` whose product is each image's rows; the target's
forward rebuilds its own shapes (`target/images.py`). A tokenized sequence keeps its images' references and grids, not
their pixels: `image_inputs` makes the pixels again from the references whenever they are needed (the tokenized cache
stores references: `stored_images.py`).

Image tokens (`image_token_id`, the ones the vision tower's outputs replace) are in user turns: never supervised.
Truncation at `data.max_length` never cuts an image: the sequence ends before the first image token of the first
image that does not fit whole, and that image and those after it are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Mapping, Optional, Sequence

import torch

from dflash_trainer.data.images import UnreadableImage, decode_image
from dflash_trainer.data.masks import Unmaskable
from dflash_trainer.data.types import ImageRef, ImageText, TokenizedSequence
from dflash_trainer.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessedImages:
    """The images of one conversation as the target's processor makes them."""

    refs: tuple[ImageRef, ...]
    """The images, in order: what a tokenized sequence keeps of those it holds (`fit_images`)."""
    pixel_values: torch.Tensor
    """(P, D) float32 on CPU: every image's pixel rows, image after image (the family's rows: module docstring)."""
    image_grid_thw: torch.Tensor
    """(I, 3) int64 on CPU: each image's grid; its product is the image's rows of `pixel_values`."""
    texts: tuple[str, ...]
    """What takes each image's placeholder's place in the rendered text."""
    token_counts: torch.Tensor
    """(I,) int64: the image tokens (`image_token_id`) each image's text holds."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageTokens:
    """How an image-text target's processor makes image tokens (sent once to each tokenizer worker). This base class
    is the Qwen-VL family's; the others override `_layout`."""

    family: ClassVar[str] = "Qwen-VL"
    image_processor: Any
    """The target's transformers image processor: images -> the family's pixel inputs."""
    image_token: str
    """The text of `image_token_id`."""
    image_token_id: int
    """The token the vision tower's outputs replace (the target config's `image_token_id`)."""
    placeholder: str
    """What the chat template writes for one image (the processor's `image_token`)."""

    def process(self, refs: Sequence[ImageRef]) -> ProcessedImages:
        """The processor's output for the images at `refs`, each image's bytes checked against its `sha256` where it
        has one; `Unmaskable` when one cannot be read as it was, or processed. Every family's processor makes each
        image's pixels from that image alone, so the rows of some of a conversation's images are those of all of
        them (tests/test_stored_images.py checks it per family)."""
        try:
            out = self.image_processor(images=[decode_image(r.url, r.sha256) for r in refs], return_tensors="pt")
        except UnreadableImage as e:
            raise Unmaskable("unreadable_image", str(e)) from None
        except (ValueError, TypeError) as e:  # e.g. an extreme aspect ratio the processor refuses
            raise Unmaskable("image_processor_error", f"{refs[0].url[:80]}...: {e}") from None
        return self._layout(tuple(refs), out)

    @classmethod
    def build(cls, image_processor: Any, tokenizer: Any, settings: Mapping[str, Any]) -> ImageTokens | UnsupportedImages:
        """The family's image tokens for a target with this image processor, tokenizer and processor settings
        (processor_config.json), or why they cannot be made."""
        tokens = _tokens_named(tokenizer, cls.family, image_token=getattr(tokenizer, "image_token", None) or "<|image_pad|>")
        if isinstance(tokens, UnsupportedImages):
            return tokens
        return cls(image_processor=image_processor, image_token_id=tokens.pop("image_token_id"),
                   placeholder=tokens["image_token"], **tokens)

    def _layout(self, refs: tuple[ImageRef, ...], out: Mapping[str, torch.Tensor]) -> ProcessedImages:
        grid = out["image_grid_thw"].to(torch.int64)  # (I, 3)
        counts = grid.prod(-1) // self.image_processor.merge_size**2  # (I,) one pad per vision-tower output
        return ProcessedImages(refs=refs, pixel_values=out["pixel_values"].to(torch.float32), image_grid_thw=grid,
                               texts=tuple(self.image_token * int(n) for n in counts), token_counts=counts)

    def fingerprint(self) -> str:
        """What decides the pixels and the image tokens (the tokenized cache's key)."""
        return (f"{self.family} {self.image_processor.to_json_string()} "
                f"{ {k: getattr(self, k) for k in self.__dataclass_fields__ if k != 'image_processor'} }")


@dataclass(frozen=True, slots=True, kw_only=True)
class _GemmaImageTokens(ImageTokens):
    """Gemma's families: the tokenizer names the soft token (`image_token`), begin and end of image."""

    placeholder_field: ClassVar[str] = "image_token"
    """Which of the three the chat template writes for an image."""
    boi_token: str
    eoi_token: str

    @classmethod
    def build(cls, image_processor: Any, tokenizer: Any, settings: Mapping[str, Any]) -> ImageTokens | UnsupportedImages:
        tokens = _tokens_named(tokenizer, cls.family, **{n: getattr(tokenizer, n, None) for n in _GEMMA_TOKENS})
        if isinstance(tokens, UnsupportedImages):
            return tokens
        return cls(image_processor=image_processor, image_token_id=tokens.pop("image_token_id"),
                   placeholder=tokens[cls.placeholder_field], **cls._from_settings(settings), **tokens)

    @staticmethod
    def _from_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
        """The family's fields read from the processor's settings."""
        return {}


@dataclass(frozen=True, slots=True, kw_only=True)
class Gemma3ImageTokens(_GemmaImageTokens):
    family: ClassVar[str] = "Gemma 3"
    placeholder_field: ClassVar[str] = "boi_token"
    tokens_per_image: int
    """The processor's `image_seq_length` (the model's `mm_tokens_per_image`): soft tokens per image and crop."""

    @staticmethod
    def _from_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
        return {"tokens_per_image": int(settings.get("image_seq_length", 256))}

    def _layout(self, refs: tuple[ImageRef, ...], out: Mapping[str, torch.Tensor]) -> ProcessedImages:
        pixels = out["pixel_values"].to(torch.float32)  # (N, C, S, S): each image, then its crops
        crops = out["num_crops"].to(torch.int64).reshape(-1)  # (I,)
        run = f"\n\n{self.boi_token}{self.image_token * self.tokens_per_image}{self.eoi_token}\n\n"
        texts = tuple(run if not n else
                      f"Here is the original image {run} and here are some crops to help you see better "
                      + " ".join([run] * int(n)) for n in crops)
        return ProcessedImages(refs=refs, pixel_values=pixels.reshape(len(pixels), -1),
                               image_grid_thw=_rows_grid(crops + 1), texts=texts,
                               token_counts=(crops + 1) * self.tokens_per_image)


@dataclass(frozen=True, slots=True, kw_only=True)
class Gemma4ImageTokens(_GemmaImageTokens):
    family: ClassVar[str] = "Gemma 4"

    def _layout(self, refs: tuple[ImageRef, ...], out: Mapping[str, torch.Tensor]) -> ProcessedImages:
        pixels = out["pixel_values"].to(torch.float32)  # (I, max_patches, D), padded
        positions = out["image_position_ids"].to(torch.int64)  # (I, max_patches, 2): (x, y), -1 on padding
        counts = torch.as_tensor(out["num_soft_tokens_per_image"], dtype=torch.int64).reshape(-1)  # (I,)
        rows, grids = [], []
        for image, at in zip(pixels, positions):
            real = int((at[:, 0] >= 0).sum())
            height, width = int(at[:real, 1].max()) + 1, int(at[:real, 0].max()) + 1
            if height * width != real:
                raise Unmaskable("image_processor_error", f"{real} patches do not fill a {height} x {width} grid")
            rows.append(image[:real])
            grids.append((1, height, width))
        texts = tuple(f"{self.boi_token}{self.image_token * int(n)}{self.eoi_token}" for n in counts)
        return ProcessedImages(refs=refs, pixel_values=torch.cat(rows),
                               image_grid_thw=torch.tensor(grids, dtype=torch.int64), texts=texts, token_counts=counts)


@dataclass(frozen=True, slots=True, kw_only=True)
class Llama4ImageTokens(ImageTokens):
    family: ClassVar[str] = "Llama 4"
    image_start: str
    image_end: str
    tile_x_separator: str
    tile_y_separator: str
    patch_size: int
    """The vision tower's patch side in pixels (the processor's `patch_size`)."""
    downsample: int
    """Patches per image token: 1 / pixel_shuffle_ratio**2 (the tower's pixel shuffle)."""

    @classmethod
    def build(cls, image_processor: Any, tokenizer: Any, settings: Mapping[str, Any]) -> ImageTokens | UnsupportedImages:
        """The tokens, the tower's patch size and its pixel shuffle from the processor's settings (their defaults as
        the processor has them)."""
        tokens = _tokens_named(tokenizer, cls.family, **{field: settings.get(key, default)
                                                         for field, (key, default) in _LLAMA4_TOKENS.items()})
        if isinstance(tokens, UnsupportedImages):
            return tokens
        return cls(image_processor=image_processor, image_token_id=tokens.pop("image_token_id"),
                   patch_size=int(settings.get("patch_size", 14)),
                   downsample=round(1 / float(settings.get("pixel_shuffle_ratio", 0.5)) ** 2), **tokens)

    def _layout(self, refs: tuple[ImageRef, ...], out: Mapping[str, torch.Tensor]) -> ProcessedImages:
        pixels = out["pixel_values"].to(torch.float32)  # (N, C, S, S): each image's tiles, then its global tile
        ratios = torch.as_tensor(out["aspect_ratios"], dtype=torch.int64).reshape(-1, 2)  # (I, 2) tiles down, across
        per_tile = (pixels.shape[-2] // self.patch_size) * (pixels.shape[-1] // self.patch_size) // self.downsample
        tiles = ratios.prod(-1) + (ratios.prod(-1) > 1).long()  # (I,) a global tile after several
        texts = tuple(self._text(int(h), int(w), per_tile) for h, w in ratios)
        return ProcessedImages(refs=refs, pixel_values=pixels.reshape(len(pixels), -1),
                               image_grid_thw=_rows_grid(tiles), texts=texts, token_counts=tiles * per_tile)

    def _text(self, height: int, width: int, per_tile: int) -> str:
        """The processor's text of an image of `height` x `width` tiles: each tile's patch tokens, row by row between
        separators (when there are several), then the global tile's after the image marker."""
        patches = self.image_token * per_tile
        rows = "".join(self.tile_x_separator.join([patches] * width) + self.tile_y_separator
                       for _ in range(height)) if height * width > 1 else ""
        return f"{self.image_start}{rows}{self.placeholder}{patches}{self.image_end}"


def _rows_grid(rows: torch.Tensor) -> torch.Tensor:
    """(I, 3) grids (rows, 1, 1) of images stored as `rows` (I,) whole pictures each (Gemma 3's crops, Llama 4's
    tiles)."""
    return torch.stack([rows, torch.ones_like(rows), torch.ones_like(rows)], -1)


def fit_images(sequence: TokenizedSequence, images: ProcessedImages, image_token_id: int, *,
               min_supervised: int) -> TokenizedSequence:
    """`sequence` (tokenized with the images' texts in place, truncated to its length limit) with the references and
    grids of the images it keeps whole (`image_inputs` makes their pixels where they are needed), cut before the first
    image token of an image the truncation reached into. Raises `Unmaskable` when the image tokens are not the
    processor's, or too few supervised tokens are left."""
    at = torch.nonzero(sequence.input_ids == image_token_id).flatten()  # (n_image_tokens,) in order
    ends = torch.cumsum(images.token_counts, 0)  # (I,) one past each image's last image token, counted
    if len(at) > int(ends[-1]) or (len(at) < int(ends[-1]) and not sequence.truncated_tokens):
        raise Unmaskable("image_tokens_mismatch", f"{len(at)} image tokens (id {image_token_id}) where the processor "
                         f"makes {int(ends[-1])}: the user text holds image tokens, or set data.chat_template to the "
                         "target's image-text template")
    kept = int((ends <= len(at)).sum())  # images are in order: those whole are a prefix
    cut = sequence.num_tokens
    if kept < len(ends) and len(at) > int(ends[kept]) - int(images.token_counts[kept]):  # reached into image `kept`
        cut = int(at[int(ends[kept] - images.token_counts[kept])])
    result = replace(sequence, input_ids=sequence.input_ids[:cut], loss_mask=sequence.loss_mask[:cut],
                     truncated_tokens=sequence.truncated_tokens + sequence.num_tokens - cut, images=images.refs[:kept],
                     image_grid_thw=images.image_grid_thw[:kept] if kept else None)
    if int(result.loss_mask.sum()) < min_supervised:
        raise Unmaskable("too_few_supervised_tokens")
    return result


def image_inputs(images: ImageTokens, refs: Sequence[ImageRef]) -> tuple[torch.Tensor, torch.Tensor]:
    """`(pixel_values (P, D) float32, image_grid_thw (I, 3) int64)` of the images `refs` as the target's processor
    makes them (`ImageTokens.process`: the family's rows and grids, each image's bytes checked against its digest):
    the one way a stored reference becomes pixels again. `Unmaskable` when an image cannot be read as it was, or
    processed."""
    processed = images.process(refs)
    return processed.pixel_values, processed.image_grid_thw


def image_text(images: ImageTokens, processed: ProcessedImages) -> ImageText:
    """The substitution `masks.render` makes for `processed`'s images."""
    return ImageText(placeholder=images.placeholder, texts=processed.texts)


@dataclass(frozen=True, slots=True, kw_only=True)
class UnsupportedImages:
    """An image-text target whose images cannot be made into tokens here: image rows are refused with `reason`."""

    reason: str
    """One line: the family, why, and the fix."""


FAMILIES: dict[str, type[ImageTokens]] = {"Gemma3ImageProcessor": Gemma3ImageTokens,
                                          "Gemma4ImageProcessor": Gemma4ImageTokens,
                                          "Llama4ImageProcessor": Llama4ImageTokens}
"""Image processor class (without its `Pil` / `Fast` backend suffix) -> its family; Qwen2-VL-kind processors (with
`merge_size`) are the Qwen-VL family."""


def image_tokens_for(image_processor: Any, tokenizer: Any, settings: Mapping[str, Any]) -> ImageTokens | UnsupportedImages:
    """The image tokens of a target whose image processor is `image_processor`, its tokenizer `tokenizer`, and its
    processor's settings `settings` (processor_config.json), or why they cannot be made."""
    name = type(image_processor).__name__
    kind = (getattr(image_processor, "image_processor_type", None) or name).removesuffix("Fast").removesuffix("Pil")
    family = FAMILIES.get(kind, ImageTokens if isinstance(getattr(image_processor, "merge_size", None), int) else None)
    if family is None:
        return UnsupportedImages(reason=f"images of a target with a {name} are not supported yet (dflash-train knows "
                                 "the Qwen-VL, Gemma 3, Gemma 4 and Llama 4 processors): remove the image parts of the "
                                 "data to train on its text")
    return family.build(image_processor, tokenizer, settings)


_GEMMA_TOKENS = ("image_token", "boi_token", "eoi_token")
"""The tokenizer attributes naming Gemma's vision tokens (its soft token, begin and end of image)."""

_LLAMA4_TOKENS = {"placeholder": ("fake_image_token", "<|image|>"), "image_token": ("patch_token", "<|patch|>"),
                  "image_start": ("start_of_image_token", "<|image_start|>"),
                  "image_end": ("end_of_image_token", "<|image_end|>"),
                  "tile_x_separator": ("tile_x_separator_token", "<|tile_x_separator|>"),
                  "tile_y_separator": ("tile_y_separator_token", "<|tile_y_separator|>")}
"""Llama 4's vision tokens: field -> (the processor setting naming it, its default there)."""


def _tokens_named(tokenizer: Any, family: str, **tokens: Optional[str]) -> dict[str, Any] | UnsupportedImages:
    """`tokens` (field -> token text) and `image_token_id` (the id of `tokens["image_token"]`), or why not: a token
    that is not named, or not in the tokenizer."""
    missing = [f"{field} {text!r}" if text else field for field, text in tokens.items()
               if not text or tokenizer.convert_tokens_to_ids(text) in (None, tokenizer.unk_token_id)]
    if missing:
        return UnsupportedImages(reason=f"the tokenizer of a {family} target lacks its vision tokens ({', '.join(missing)}): "
                                 "give target.tokenizer the model's own tokenizer")
    return {**tokens, "image_token_id": int(tokenizer.convert_tokens_to_ids(tokens["image_token"]))}


def images_of(messages: Sequence[Any]) -> list[ImageRef]:
    """The image parts of `messages`, in order."""
    return [image for message in messages for image in message.images]


def require_images(images: Optional[ImageTokens | UnsupportedImages]) -> Optional[ImageTokens]:
    """`images`, or None for a text target; an `UnsupportedImages` raises its reason (a ConfigError)."""
    if isinstance(images, UnsupportedImages):
        raise ConfigError(images.reason)
    return images
