"""The training set's images, stored as references: each image's source and grid, never its pixels.

The target's image processor turns a 1024 x 1024 image into ~25 MB of float32 patches (Qwen3-VL; every family's
pixels are float32 rows many times the size of the compressed image), so storing its output made a cache of image
data many times the size of the images. A stored image is its source instead: an
absolute file path with the SHA-256 of the file's bytes, or a data URL (kept whole: it is the image). Reading a
sequence makes its pixel values again, decoding each image and running the same processor
(`vision.image_inputs`); they are bit-identical to what tokenizing saw, since the bytes are checked against the
stored digest and the processor against the fingerprint the grids were made with. The price is the processor's CPU
time on the reading rank each time a sequence is read (bench/RESULTS.md, section 4; `bench/host/image_storage.py`).

`image_inputs` is the one place that turns references into the processor's output, whatever the family (its
`ImageTokens.process`): a new family plugs its processing in there, not here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from dflash_trainer.data.masks import Unmaskable
from dflash_trainer.data.types import ImageRef, TokenizedSequence
from dflash_trainer.data.vision import ImageTokens, image_inputs
from dflash_trainer.errors import DataError


def processing_sha256(images: ImageTokens) -> str:
    """Digest of what decides an image's pixel values and grid (the image processor and the image token)."""
    return hashlib.sha256(images.fingerprint().encode()).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class DatasetImages:
    """Every sequence's images, concatenated: sequence `i` has images `[image_offsets[i], image_offsets[i+1])`."""

    refs: tuple[ImageRef, ...]
    """Every image's source (`url`, `sha256`; `at` is not kept), sequence after sequence."""
    image_grid_thw: torch.Tensor
    """(num_images, 3) int64 on CPU: each image's grid; its product is the image's rows of pixel values
    (`vision.py`)."""
    image_offsets: torch.Tensor
    """(n + 1,) int64 on CPU: first image of each sequence, then the number of images."""
    processing: str
    """`processing_sha256` of the image processing the grids were made with."""
    images: Optional[ImageTokens] = None
    """The image processing that makes the pixel values on read (its digest is `processing`); None until
    `with_images` gives it (a dataset just loaded from the cache)."""

    def with_images(self, images: ImageTokens) -> "DatasetImages":
        """These images, read with `images`: a DataError when it is not the processing they were made with."""
        if processing_sha256(images) != self.processing:
            raise DataError("the tokenized images were made with another image processor than the target's: prepare "
                            "the data again with this target (its cache key differs, so `plan` or `train` does)")
        return replace(self, images=images)

    def of(self, i: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Sequence `i`'s `(pixel_values (P, D) float32, image_grid_thw (I, 3) int64)`, the pixels made from its
        images now; `(None, None)` when it has no image. A DataError names an image that cannot be read as it was."""
        a, b = int(self.image_offsets[i]), int(self.image_offsets[i + 1])
        if a == b:
            return None, None
        if self.images is None:
            raise ValueError("DatasetImages has no image processing to read its images with: call with_images")
        try:
            pixel_values, grid = image_inputs(self.images, self.refs[a:b])
        except Unmaskable as e:
            raise DataError(f"training sequence {i}: its image cannot be read as it was when the data was prepared "
                            f"({e.reason}: {e.detail}). Restore the image, or prepare the data again (rerun: a changed image rebuilds "
                            "the tokenized cache)") from None
        if not torch.equal(grid, self.image_grid_thw[a:b]):  # the processor's version changed its resizing
            raise DataError(f"training sequence {i}: the image processor now makes grids {grid.tolist()}, not "
                            f"{self.image_grid_thw[a:b].tolist()} as when the data was prepared: prepare it again "
                            "(delete the tokenized cache, data.cache_dir)")
        return pixel_values, grid

    def update_content_digest(self, h) -> None:
        """Add the training content to hashlib object `h`: grids, offsets, the processing and each image's bytes
        (a file's SHA-256, a data URL's text), not where the files are."""
        h.update(self.image_grid_thw.contiguous().numpy().tobytes())
        h.update(self.image_offsets.contiguous().numpy().tobytes())
        h.update(self.processing.encode())
        for ref in self.refs:
            h.update((ref.sha256 or hashlib.sha256(ref.url.encode()).hexdigest()).encode())

    def sources_json(self) -> bytes:
        """The stored form of the references: the processing and each distinct source once, and which each image
        is."""
        sources = list(dict.fromkeys((r.url, r.sha256) for r in self.refs))
        index = {s: k for k, s in enumerate(sources)}
        return json.dumps({"processing": self.processing, "sources": sources,
                           "image_source": [index[(r.url, r.sha256)] for r in self.refs]}).encode()

    def tensors(self) -> dict[str, torch.Tensor]:
        """What the tokenized cache saves (the references as UTF-8 JSON bytes)."""
        blob = torch.frombuffer(bytearray(self.sources_json()), dtype=torch.uint8)
        return {"image_sources": blob, "image_grid_thw": self.image_grid_thw, "image_offsets": self.image_offsets}

    @staticmethod
    def from_tensors(t: dict[str, torch.Tensor], images: Optional[ImageTokens]) -> "DatasetImages":
        """The images `tensors` saved, read with `images` (None: not readable until `with_images`)."""
        stored = json.loads(t["image_sources"].numpy().tobytes().decode("utf-8"))
        sources = [ImageRef(url=url, at=0, sha256=digest) for url, digest in stored["sources"]]
        loaded = DatasetImages(refs=tuple(sources[k] for k in stored["image_source"]),
                               image_grid_thw=t["image_grid_thw"], image_offsets=t["image_offsets"],
                               processing=stored["processing"])
        return loaded if images is None else loaded.with_images(images)

    @staticmethod
    def from_sequences(sequences: Sequence[TokenizedSequence],
                       images: Optional[ImageTokens]) -> Optional["DatasetImages"]:
        """The images of `sequences` (tokenized with `images`), or None when none has any (a text dataset stores
        nothing more)."""
        with_images = [s for s in sequences if s.image_grid_thw is not None]
        if not with_images:
            return None
        if images is None:
            raise ValueError("sequences with images need the image processing they were tokenized with")
        counts = [len(s.images) for s in sequences]
        if any(len(s.images) != len(s.image_grid_thw) for s in with_images):
            raise ValueError("a sequence's images and grids differ in number: make sequences with vision.fit_images")
        return DatasetImages(refs=tuple(ImageRef(url=r.url, at=0, sha256=r.sha256) for s in with_images
                                        for r in s.images),
                             image_grid_thw=torch.cat([s.image_grid_thw for s in with_images]),
                             image_offsets=torch.cumsum(torch.tensor([0] + counts, dtype=torch.long), 0),
                             processing=processing_sha256(images), images=images)
