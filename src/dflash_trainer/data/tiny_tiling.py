"""A Llama-4-kind tiling image processor for the tiny Llama 4 target (transformers' own needs torchvision).

It gives what Llama 4's processor gives, in the same layout: an image is fitted on a canvas of h x w square tiles
(h * w at most `max_tiles`), cut into its tiles row by row, and followed by a global tile (the whole image at tile
size) when it spans several; `pixel_values` (N, C, S, S) are every image's tiles in order, `aspect_ratios` (I, 2) each
image's (h, w). The canvas is the one that scales the image least (the least upscaling if any canvas holds it whole,
else the least downscaling), the smallest of equals; the image is resized into it keeping its aspect ratio (never
up, unless smaller than a tile) and padded with zeros at the bottom and right. Real Llama 4 targets use their own
processor (`AutoImageProcessor`), whose pixels these need not match: only the layout is the data's contract.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from PIL import Image


class TilingImageProcessor:
    """Llama-4-kind tiles of `tile` x `tile` pixels, at most `max_tiles` per image, normalised to [-1, 1]."""

    image_processor_type = "Llama4ImageProcessor"
    """The processor kind whose outputs this gives (`vision.image_tokens_for` reads it)."""

    def __init__(self, *, tile: int, max_tiles: int) -> None:
        self.tile, self.max_tiles = tile, max_tiles

    def __call__(self, *, images: list[Image.Image], return_tensors: str = "pt") -> dict[str, torch.Tensor]:
        tiles, ratios = [], []
        for image in images:
            height, width = self._canvas(image.height, image.width)
            tiles += self._tiles(image, height, width)
            ratios.append((height, width))
        return {"pixel_values": torch.stack(tiles), "aspect_ratios": torch.tensor(ratios, dtype=torch.int64)}

    def _canvas(self, height: int, width: int) -> tuple[int, int]:
        """(tiles down, tiles across) of the canvas the image is fitted on."""
        canvases = [(h, w) for h in range(1, self.max_tiles + 1) for w in range(1, self.max_tiles // h + 1)]
        scales = [min(h * self.tile / height, w * self.tile / width) for h, w in canvases]
        up = [s for s in scales if s >= 1]
        best = min(up) if up else max(scales)
        return min((c for c, s in zip(canvases, scales) if s == best), key=lambda c: c[0] * c[1])

    def _tiles(self, image: Image.Image, height: int, width: int) -> list[torch.Tensor]:
        """The image's (C, S, S) tiles row by row, then its global tile when there are several."""
        size = self.tile
        scale = min(height * size / image.height, width * size / image.width)
        if min(image.height, image.width) >= size:
            scale = min(scale, 1.0)
        resized = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                               Image.BILINEAR)
        canvas = np.zeros((height * size, width * size, 3), dtype=np.float32)
        pixels = _normalised(resized)
        canvas[: pixels.shape[0], : pixels.shape[1]] = pixels
        chw = torch.from_numpy(canvas).permute(2, 0, 1)  # (C, h*S, w*S)
        tiles = [chw[:, r * size : (r + 1) * size, c * size : (c + 1) * size] for r in range(height) for c in range(width)]
        if height * width > 1:
            tiles.append(torch.from_numpy(_normalised(image.resize((size, size), Image.BILINEAR))).permute(2, 0, 1))
        return tiles

    def to_json_string(self) -> str:
        return json.dumps({"image_processor_type": self.image_processor_type, "tile": self.tile,
                           "max_tiles": self.max_tiles})


def _normalised(image: Image.Image) -> np.ndarray:
    """(H, W, C) float32 in [-1, 1]."""
    return (np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0 - 0.5) / 0.5
