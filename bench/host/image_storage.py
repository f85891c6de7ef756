"""What reading an image from the tokenized cache costs now that the cache stores references, not patches.

    python bench/host/image_storage.py                      # every family's tiny processor and Qwen3-VL's, 1024x1024 and 768x1024
    python bench/host/image_storage.py --processor DIR      # also the image processing of a model folder
    python bench/host/image_storage.py --smoke              # one small image, the tiny processors (checks the script)

For each processor and image (random pixels, saved as PNG and as JPEG: the slowest to decode), times
`data/vision.image_inputs` (read the file, check its SHA-256, decode, run the processor and the family's layout: what
reading a sequence does per image) and checks that processing twice gives the same bits. Beside it, the bytes an image
takes: the float32 pixel rows (`patches`: Qwen-VL's patches, another family's rows) the cache used to hold, the
reference it holds now (path + digest), the file. One CPU thread: the reading
rank's target thread does this work. Last line: JSON (`--out DIR`: also written there).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from bench.common import git_commit, write_result  # noqa: E402

from dflash_trainer.data.tiny_tokenizer import TINY_IMAGE_TOKENS, build_tiny_image_tokens  # noqa: E402
from dflash_trainer.data.types import ImageRef  # noqa: E402
from dflash_trainer.data.vision import ImageTokens, image_inputs, require_images  # noqa: E402


def qwen3_vl_processor():
    """The Pillow-backed Qwen2-VL processor with Qwen3-VL's settings (patch 16, temporal patch 2, merge 2, mean and
    std 0.5, 65,536 to 16,777,216 pixels), as its preprocessor_config.json gives them."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, size={"shortest_edge": 65536, "longest_edge": 16777216})


def processings(args) -> dict[str, ImageTokens]:
    """The image processings timed, by name: each family's tiny one, Qwen3-VL's, and `--processor`'s."""
    found = {f"tiny {family}": build_tiny_image_tokens(family) for family in TINY_IMAGE_TOKENS}
    if not args.smoke:
        found["qwen3-vl (Pillow)"] = replace(build_tiny_image_tokens("qwen3-vl"), image_processor=qwen3_vl_processor())
    if args.processor:
        from dflash_trainer.data.tokenizer import load_image_tokens, load_tokenizer
        from dflash_trainer.target.config import TargetConfig

        target = TargetConfig(path=args.processor)
        found[args.processor] = require_images(load_image_tokens(target, load_tokenizer(target)))
        if found[args.processor] is None:
            raise SystemExit(f"{args.processor} has no image processor")
    return found


def time_reads(images: ImageTokens, ref: ImageRef, repeats: int) -> tuple[float, torch.Tensor, bool]:
    """Median seconds of one `image_inputs` of `ref`, its pixel values, and whether every repeat gave the same bits."""
    first, _ = image_inputs(images, [ref])
    seconds, same = [], True
    for _ in range(repeats):
        t0 = time.perf_counter()
        pixels, _ = image_inputs(images, [ref])
        seconds.append(time.perf_counter() - t0)
        same &= torch.equal(pixels, first)
    return float(np.median(seconds)), first, same


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1024x1024,768x1024", help="comma-separated HxW of the test images")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--processor", default=None, help="a model folder whose image processor is timed too")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="also write the result JSON into this folder")
    args = p.parse_args(argv)
    if args.smoke:
        args.sizes, args.repeats = "96x128", 2
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    rows, timed = [], processings(args)
    with tempfile.TemporaryDirectory() as folder:
        for size in args.sizes.split(","):
            h, w = map(int, size.split("x"))
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            for fmt in ("PNG", "JPEG"):
                path = Path(folder) / f"{size}.{fmt.lower()}"
                Image.fromarray(pixels).save(path, format=fmt)
                ref = ImageRef(url=str(path), at=0, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
                for name, images in timed.items():
                    seconds, patches, same = time_reads(images, ref, args.repeats)
                    rows.append({"processor": name, "image": f"{size} {fmt}", "read_ms": 1e3 * seconds,
                                 "same_bits": same, "patches": int(patches.shape[0]),
                                 "float32_patch_bytes": patches.numel() * 4,
                                 "reference_bytes": len(ref.url) + len(ref.sha256),
                                 "file_bytes": path.stat().st_size})
    print(f"{'processor':<20}{'image':<16}{'read ms':>9}{'patches':>9}{'float32 MB':>12}{'reference B':>13}"
          f"{'file MB':>9}  same bits")
    for r in rows:
        print(f"{r['processor']:<20}{r['image']:<16}{r['read_ms']:>9.1f}{r['patches']:>9}"
              f"{r['float32_patch_bytes'] / 1e6:>12.1f}{r['reference_bytes']:>13}{r['file_bytes'] / 1e6:>9.2f}  "
              f"{r['same_bits']}")
    result = {"bench": "image_storage", "threads": 1, "rows": rows}
    print(json.dumps(result))
    if args.out is not None:
        result["commit"] = git_commit()
        write_result(result, "host", "image_storage", args.out)
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
