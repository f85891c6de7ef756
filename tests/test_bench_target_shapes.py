"""bench/target_shapes.py: the padded lengths its variants forward at."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from target_shapes import variant_length  # noqa: E402

from dflash_trainer.target.capture import padded_length  # noqa: E402


def test_variants_pad_as_named():
    assert [variant_length(n, "pad-64") for n in (1, 64, 65, 2000)] == [64, 64, 128, 2048]
    for n in (33, 1000, 1025):
        assert variant_length(n, "default") == variant_length(n, "no-cudnn") == n
        assert variant_length(n, "rounded") == padded_length(n, "rounded") > n
