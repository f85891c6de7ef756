"""bench/target_shapes.py: the padded lengths its variants forward at, and that extra padding leaves the taps alone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from target_shapes import padded_length, repad  # noqa: E402

from dflash_trainer.data.types import TokenizedSequence  # noqa: E402
from dflash_trainer.target.capture import TapCapture, prepare_inputs  # noqa: E402
from dflash_trainer.transport.wire import WireSpec, allocate  # noqa: E402


def test_padded_lengths_round_up_and_pad_16th_adds_under_a_sixteenth():
    assert [padded_length(n, "pad-64") for n in (1, 64, 65, 2000)] == [64, 64, 128, 2048]
    assert [padded_length(n, "pad-16th") for n in (20, 1000, 1024, 1025)] == [20, 1024, 1024, 1088]
    assert all(padded_length(n, v) == n for v in ("default", "no-cudnn") for n in (33, 1000))
    for n in range(32, 4097):
        padded = padded_length(n, "pad-16th")
        assert n <= padded < n * (1 + 1 / 16), n
    # the point of it: an epoch's lengths fall on far fewer values
    assert len({padded_length(n, "pad-16th") for n in range(32, 2049)}) <= 16 * 6 + 1


@pytest.mark.parametrize("extra", [0, 1, 37])
def test_repadded_batch_gives_the_same_taps(tiny_target, extra):
    g = torch.Generator().manual_seed(0)
    sequences = [TokenizedSequence(input_ids=torch.randint(0, 300, (n,), generator=g),
                                   loss_mask=torch.ones(n, dtype=torch.bool)) for n in (9, 17, 4)]
    taps = (0, 2, 3)
    spec = WireSpec(token_budget=64, max_seqs=6, num_taps=len(taps), hidden=64, dtype=torch.float32,
                    has_last_hidden=False)
    capture = TapCapture(tiny_target, taps)
    plain, wider = allocate(spec, "cpu"), allocate(spec, "cpu")
    inputs = prepare_inputs(sequences, plain)
    capture.run(inputs, plain)
    longer = repad(prepare_inputs(sequences, wider), 17 + extra)
    assert longer.input_ids.shape == (3, 17 + extra) and longer.padded_tokens == 3 * (17 + extra)
    capture.run(longer, wider)
    n = inputs.num_tokens
    torch.testing.assert_close(wider.taps[:n], plain.taps[:n], rtol=1e-5, atol=1e-5)
