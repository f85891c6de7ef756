"""How each image-text family's forward takes its images, from the rows and grids the data side stores (`data/vision.py`).

The image-text model (`load.image_text_model`) runs on a batch's ids with the family's pixel inputs: the vision
tower's outputs replace the image tokens, and the decoder sees what it sees in HF's forward of each conversation with
its images, at the same positions and with the same masks:
- Qwen-VL: the patches and grids as stored; M-RoPE positions from the model's `get_rope_index` (a row's text after an
  image continues from the image's largest position), passed explicitly, which keeps the model's cached
  `rope_deltas` (its decoding state) untouched;
- Gemma 3: each row one (C, S, S) image; `token_type_ids` mark the image tokens, which HF lets see each other
  within an image (bidirectional), on top of the causal mask;
- Gemma 4: each image's real patches, padded to the batch's largest image, and their (x, y) positions (-1 on
  padding) rebuilt from the grid; `mm_token_type_ids` mark the image tokens (bidirectional within an image where
  the config says so);
- Llama 4: each row one (C, S, S) tile; plain causal (and chunked) attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from dflash_trainer.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageForward:
    """What an image-text model's forward of a batch with images takes besides its ids."""

    kwargs: dict[str, torch.Tensor] = field(default_factory=dict)
    """The forward's image keywords (pixels in the family's shape, grids, token types), on the model's device."""
    mrope_positions: Optional[torch.Tensor] = None
    """(3, B, S) int64 M-RoPE positions (time, height, width) of a Qwen-VL batch; None: the default positions."""
    rope_deltas: Optional[torch.Tensor] = None
    """(B,) int64 (Qwen-VL): a row's text after its last slot sits at M-RoPE position slot position + delta."""


def image_forward(model: nn.Module, ids: torch.Tensor, valid: Optional[torch.Tensor], pixel_values: torch.Tensor,
                  grid: torch.Tensor) -> ImageForward:
    """The image inputs of image-text `model` (`image_text_model`) for `ids` (B, S) with `valid` (B, S) bool (None: all
    valid, as in right-padded rows whose padding nobody reads), from the stored `pixel_values` (P, D) and `grid`
    (I, 3) of the batch's images, row after row."""
    config = model.config
    image = ids == config.image_token_id  # (B, S)
    if valid is not None:
        image &= valid
    dtype = next(model.parameters()).dtype
    if hasattr(model, "get_rope_index"):  # Qwen-VL
        # host sync: get_rope_index walks each row's token types on the host
        positions, deltas = model.get_rope_index(input_ids=ids, mm_token_type_ids=image.int(), image_grid_thw=grid,
                                                 attention_mask=None if valid is None else valid.long())
        return ImageForward(kwargs={"pixel_values": pixel_values, "image_grid_thw": grid}, mrope_positions=positions,
                            rope_deltas=deltas.reshape(-1).to(ids.device))
    kind = config.model_type
    if kind == "gemma3":
        size = config.vision_config.image_size
        pixels = pixel_values.to(dtype).view(-1, config.vision_config.num_channels, size, size)  # (N, C, S, S)
        return ImageForward(kwargs={"pixel_values": pixels, "token_type_ids": image.long()})
    if kind == "gemma4":
        pixels, positions = _padded_patches(pixel_values.to(dtype), grid)
        return ImageForward(kwargs={"pixel_values": pixels, "image_position_ids": positions,
                                    "mm_token_type_ids": image.long()})
    if kind == "llama4":
        size = config.vision_config.image_size
        return ImageForward(kwargs={"pixel_values": pixel_values.to(dtype).view(-1, 3, size, size)})  # (N, C, S, S)
    raise ConfigError(f"images of a {type(model).__name__} target are not supported yet (Qwen-VL, Gemma 3, Gemma 4 and "
                      "Llama 4 are): remove the image parts of the data to train on its text")


def _padded_patches(rows: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma 4's pixel inputs: (I, L, D) patches and (I, L, 2) their (x, y) positions, each image's h*w patches (in
    row-major order, as the processor makes them) padded to the largest image's L with zeros at position -1."""
    sizes = grid.prod(-1).tolist()  # host sync: the split needs each image's patch count
    longest = max(sizes)
    pixels = rows.new_zeros(len(sizes), longest, rows.shape[-1])  # (I, L, D)
    positions = torch.full((len(sizes), longest, 2), -1, dtype=torch.int64, device=rows.device)  # (I, L, 2)
    for i, (patches, width) in enumerate(zip(rows.split(sizes), grid[:, 2].tolist())):
        at = torch.arange(len(patches), device=rows.device)  # (h*w,)
        pixels[i, : len(patches)] = patches
        positions[i, : len(patches)] = torch.stack([at % width, at // width], -1)
    return pixels, positions
