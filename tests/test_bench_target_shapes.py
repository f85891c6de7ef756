"""bench/target/target_shapes.py: the padded batches its variants forward."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the `bench` package

from bench.target.target_shapes import epoch_job_ids, job_inputs, rounded_length, shape_census, variant_length  # noqa: E402

from dflash_trainer.data.types import TokenizedSequence  # noqa: E402
from dflash_trainer.transport.wire import WireSpec, allocate  # noqa: E402


def test_variants_pad_as_named():
    assert [variant_length(n, "pad-64") for n in (1, 64, 65, 2000)] == [64, 64, 128, 2048]
    assert [rounded_length(n) for n in (20, 41, 1000, 1024, 1025)] == [20, 42, 1024, 1024, 1088]
    for n in (33, 1000, 1025):
        assert variant_length(n, "default") == variant_length(n, "no-cudnn") == n
        assert variant_length(n, "rounded") == variant_length(n, "rounded-rows") == rounded_length(n) > n
    for n in range(1, 4097):
        assert n <= rounded_length(n) < n * (1 + 1 / 16), n


def test_rounded_rows_appends_empty_rows_and_keeps_the_real_tokens_where_they_are():
    sequences = [TokenizedSequence(input_ids=torch.arange(1, n + 1), loss_mask=torch.ones(n, dtype=torch.bool))
                 for n in [40] + [3] * 32]  # 33 rows: rounded up to 34
    out = allocate(WireSpec(token_budget=256, max_seqs=40, num_taps=1, hidden=4, dtype=torch.float32,
                            has_last_hidden=False), "cpu")
    rounded = job_inputs(sequences, out, "rounded")
    rows = job_inputs(sequences, out, "rounded-rows")
    assert rounded.input_ids.shape == (33, 40) and rows.input_ids.shape == (34, 40)
    assert rows.padded_tokens == 34 * 40 and rows.num_tokens == rounded.num_tokens == 40 + 96
    assert torch.equal(rows.real_index, rounded.real_index) and rows.input_ids[33].eq(0).all()
    assert torch.equal(rows.input_ids.flatten()[rows.real_index], torch.cat([s.input_ids for s in sequences]))


def test_census_counts_each_shape_once_at_the_first_job_that_has_it():
    args = argparse.Namespace(num_buckets=2, token_budget=512, sequences=0)
    lengths = [100] * 23 + [40] * 30
    census = shape_census(args, lengths, epochs=3)
    by_epoch = [[(len(ids), max(lengths[i] for i in ids)) for ids in epoch_job_ids(args, lengths, e)] for e in range(3)]
    assert len(by_epoch[0]) > len(set(by_epoch[0])) > 1  # shapes repeat within an epoch: they are counted once
    assert [r["jobs"] for r in census] == [len(jobs) for jobs in by_epoch]
    assert census[0]["new_shapes"] == len(set(by_epoch[0]))
    assert sum(r["new_shapes"] for r in census) == len(set().union(*by_epoch))
