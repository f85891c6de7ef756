"""The wire form: header encoding, round trips in process and through a real gloo send/recv pair."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_trainer.config import load_config
from dflash_trainer.transport.p2p import recv_batch_into, send_batch, send_end_of_stream
from dflash_trainer.transport.wire import (
    END_OF_STREAM,
    H_MAGIC,
    HiddenStateBatch,
    WireHeader,
    WireSpec,
    allocate,
    check_wire,
    decode_header,
    encode_header,
    from_wire,
    to_wire,
    wire_spec,
)

SPEC = WireSpec(token_budget=24, max_seqs=3, num_taps=2, hidden=8, dtype=torch.bfloat16, has_last_hidden=True)


def make_batch(spec: WireSpec, job_id: int) -> HiddenStateBatch:
    """A deterministic batch (rebuilt identically in each process)."""
    g = torch.Generator().manual_seed(job_id)
    n = 10 + job_id
    cu = torch.tensor([0, 4, n] + [n] * (spec.max_seqs - 2), dtype=torch.int32)
    ids = torch.zeros(spec.token_budget, dtype=torch.int64)
    ids[:n] = torch.randint(1, 100, (n,), generator=g)
    mask = torch.zeros(spec.token_budget, dtype=torch.bool)
    mask[:n] = torch.rand(n, generator=g) > 0.5
    taps = torch.randn(spec.token_budget, spec.num_taps * spec.hidden, generator=g).to(spec.dtype)
    last = torch.randn(spec.token_budget, spec.hidden, generator=g).to(spec.dtype) if spec.has_last_hidden else None
    return HiddenStateBatch(
        job_id=job_id, bucket_id=job_id % 3, epoch=2, num_tokens=n, num_seqs=2,
        cu_seqlens=cu, input_ids=ids, loss_mask=mask, taps=taps, last_hidden=last,
    )


def assert_batches_equal(a: HiddenStateBatch, b: HiddenStateBatch) -> None:
    for name in ("job_id", "bucket_id", "epoch", "num_tokens", "num_seqs"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("cu_seqlens", "input_ids", "loss_mask", "taps", "last_hidden"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), name


def test_round_trip_in_process_is_zero_copy():
    batch = make_batch(SPEC, 3)
    wire = to_wire(batch)
    check_wire(wire, SPEC)
    assert wire.loss_mask.dtype == torch.uint8 and wire.loss_mask.data_ptr() == batch.loss_mask.data_ptr()
    back = from_wire(wire)
    assert_batches_equal(back, batch)
    assert back.taps.data_ptr() == batch.taps.data_ptr()


def test_header_round_trip_and_end_of_stream():
    header = WireHeader(job_id=123456789012, bucket_id=7, epoch=3, num_tokens=999, num_seqs=4,
                        has_last_hidden=True, end_of_stream=False)
    assert decode_header(encode_header(header, "cpu")) == header
    assert decode_header(encode_header(END_OF_STREAM, "cpu")).end_of_stream
    with pytest.raises(ValueError, match="end-of-stream"):
        from_wire(replace(allocate(SPEC, "cpu"), header=encode_header(END_OF_STREAM, "cpu")))
    bad = encode_header(header, "cpu")
    bad[H_MAGIC] = 1
    with pytest.raises(ValueError, match="magic"):
        decode_header(bad)


def test_spec_from_config_and_mismatches():
    config = load_config(None, ["target.random_init=tiny", "pipeline.token_budget=4096", "drafter.kd_weight=0.5"])
    spec = wire_spec(config, hidden=64, num_taps=5)
    assert spec == WireSpec(token_budget=4096, max_seqs=config.batch.max_seqs, num_taps=5, hidden=64,
                            dtype=torch.bfloat16, has_last_hidden=True)
    wire = to_wire(make_batch(SPEC, 1))
    other = WireSpec(token_budget=24, max_seqs=3, num_taps=3, hidden=8, dtype=torch.bfloat16, has_last_hidden=True)
    with pytest.raises(ValueError, match="wire field taps"):
        check_wire(wire, other)
    no_last = WireSpec(token_budget=24, max_seqs=3, num_taps=2, hidden=8, dtype=torch.bfloat16, has_last_hidden=False)
    with pytest.raises(ValueError, match="has_last_hidden=True"):
        from_wire(replace(allocate(no_last, "cpu"), header=wire.header))


def _peer(rank: int, store_path: str, out_path: str) -> None:
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        if rank == 1:  # the target: two batches, then the end of stream
            for job_id in (1, 2):
                send_batch(to_wire(make_batch(SPEC, job_id)), dst=0)
            send_end_of_stream(dst=0, device="cpu")
        else:  # the drafter: one set of preallocated buffers, reused for each message
            buffers = allocate(SPEC, "cpu")
            received = []
            while (batch := recv_batch_into(buffers, src=1)) is not None:
                assert batch.taps.data_ptr() == buffers.taps.data_ptr()
                received.append({n: getattr(batch, n) for n in batch.__slots__})
                received[-1] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in received[-1].items()}
            torch.save(received, out_path)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_round_trip_through_gloo_send_recv(tmp_path):
    out_path = str(tmp_path / "received.pt")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(_peer, args=(str(tmp_path / "store"), out_path), nprocs=2, join=True, start_method="spawn")
    received = torch.load(out_path)
    assert [r["job_id"] for r in received] == [1, 2]
    for r in received:
        assert_batches_equal(HiddenStateBatch(**r), make_batch(SPEC, r["job_id"]))
