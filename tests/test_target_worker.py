"""The target worker and its background sender: order, content, backpressure, failures, shutdown."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dflash_trainer.data.types import Job, TokenizedSequence
from dflash_trainer.target.capture import TapCapture
from dflash_trainer.target.worker import ListJobSource, run_target_worker
from dflash_trainer.transport.sender import BatchSender, SenderError
from dflash_trainer.transport.wire import HiddenStateBatch, WireSpec, allocate

H, TAPS = 64, (1, 3)
SPEC = WireSpec(token_budget=48, max_seqs=4, num_taps=len(TAPS), hidden=H, dtype=torch.float32, has_last_hidden=True)


def make_dataset(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        TokenizedSequence(input_ids=torch.randint(0, 300, (n,), generator=g), loss_mask=torch.rand(n, generator=g) > 0.5)
        for n in lengths
    ]


def make_jobs(dataset, groups):
    return [
        Job(job_id=100 + j, epoch=1, bucket_id=j % 2, sequence_ids=tuple(ids),
            num_tokens=sum(dataset[i].num_tokens for i in ids))
        for j, ids in enumerate(groups)
    ]


def cloned(batch: HiddenStateBatch) -> dict:
    """What a consumer keeps: ship must finish with the slot before returning, so copy it."""
    values = {n: getattr(batch, n) for n in batch.__slots__}
    return {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in values.items()}


def test_worker_ships_every_job_in_order_with_the_right_taps(tiny_target):
    dataset = make_dataset([7, 12, 5, 20, 9, 3, 16])
    jobs = make_jobs(dataset, [[0, 1], [2], [3, 4, 5], [6], [1, 2, 5]])
    shipped, finished = [], []
    sender = BatchSender.create(SPEC, "cpu", depth=2, ship=lambda b: shipped.append(cloned(b)),
                                finish=lambda: finished.append(True), timeout_s=10)
    seen_stats = []
    report = run_target_worker(
        capture=TapCapture(tiny_target, TAPS, capture_last_hidden=True), job_source=ListJobSource(jobs),
        dataset=dataset, sender=sender, on_stats=seen_stats.append,
    )
    assert finished == [True]
    assert [b["job_id"] for b in shipped] == [j.job_id for j in jobs]
    assert [s.job_id for s in report.batches] == [j.job_id for j in jobs] == [s.job_id for s in seen_stats]
    assert report.num_tokens == sum(j.num_tokens for j in jobs)
    assert report.batches[2].padded_tokens == 3 * 20 and report.padding_fraction > 0
    for job, batch in zip(jobs, shipped):
        assert (batch["epoch"], batch["bucket_id"], batch["num_seqs"]) == (1, job.bucket_id, len(job.sequence_ids))
        cu = batch["cu_seqlens"].tolist()
        for i, seq_id in enumerate(job.sequence_ids):
            seq = dataset[seq_id]
            with torch.no_grad():
                hs = tiny_target(seq.input_ids[None], output_hidden_states=True).hidden_states
            rows = slice(cu[i], cu[i + 1])
            assert torch.equal(batch["input_ids"][rows], seq.input_ids)
            assert torch.equal(batch["loss_mask"][rows], seq.loss_mask)
            for k, layer in enumerate(TAPS):
                torch.testing.assert_close(batch["taps"][rows, k * H : (k + 1) * H], hs[layer + 1][0],
                                           atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(tiny_target.model.norm(batch["last_hidden"][rows]), hs[-1][0],
                                       atol=1e-5, rtol=1e-5)


def test_sender_failure_fails_the_worker_with_the_cause(tiny_target):
    dataset = make_dataset([6, 6, 6, 6, 6])
    calls = []

    def ship(batch):
        calls.append(batch.job_id)
        if len(calls) == 2:
            raise OSError("link to drafter 3 is down")

    sender = BatchSender.create(SPEC, "cpu", depth=2, ship=ship, timeout_s=10)
    finished = []
    sender._finish = lambda: finished.append(True)
    with pytest.raises(SenderError, match="link to drafter 3 is down") as info:
        run_target_worker(capture=TapCapture(tiny_target, TAPS, capture_last_hidden=True),
                          job_source=ListJobSource(make_jobs(dataset, [[i] for i in range(5)])),
                          dataset=dataset, sender=sender)
    assert isinstance(info.value.__cause__, OSError)
    assert finished == []  # no end of stream after a failure
    assert not sender._thread.is_alive()


def test_ring_bounds_batches_in_flight_and_waits_time_out():
    release = threading.Event()
    shipping = []

    def ship(batch):
        shipping.append(batch.job_id)
        assert release.wait(10)

    sender = BatchSender.create(SPEC, "cpu", depth=2, ship=ship, timeout_s=0.3)
    slots = []
    for job_id in range(3):  # depth + 1 slots: the forward fills the last while 2 are queued/shipped
        slot = sender.acquire()
        slots.append(slot.index)
        if job_id < 2:
            sender.submit(slot, _dummy_batch(slot, job_id))
    assert sorted(slots) == [0, 1, 2]
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="a free send slot"):
        sender.acquire()
    assert 0.25 < time.monotonic() - t0 < 3
    release.set()
    sender.submit(slot, _dummy_batch(slot, 2))
    sender.close()
    assert shipping == [0, 1, 2]
    sender.close()  # idempotent


def test_abort_event_interrupts_a_blocked_forward():
    abort = threading.Event()
    sender = BatchSender.create(SPEC, "cpu", depth=1, ship=lambda b: time.sleep(5), timeout_s=30, abort_event=abort)
    for job_id in range(2):
        slot = sender.acquire()
        sender.submit(slot, _dummy_batch(slot, job_id))
    threading.Timer(0.2, abort.set).start()
    t0 = time.monotonic()
    with pytest.raises(SenderError, match="abort"):
        sender.acquire()
    assert time.monotonic() - t0 < 2


def test_plan_and_data_disagreement_is_refused(tiny_target):
    dataset = make_dataset([6, 8])
    job = Job(job_id=5, epoch=0, bucket_id=0, sequence_ids=(0, 1), num_tokens=13)
    sender = BatchSender.create(SPEC, "cpu", depth=1, ship=lambda b: None, timeout_s=5)
    with pytest.raises(ValueError, match="job 5: the plan says 13 tokens but its sequences have 14"):
        run_target_worker(capture=TapCapture(tiny_target, TAPS, capture_last_hidden=True),
                          job_source=ListJobSource([job]), dataset=dataset, sender=sender)


def _dummy_batch(slot, job_id: int) -> HiddenStateBatch:
    b = slot.buffers
    return HiddenStateBatch(job_id=job_id, bucket_id=0, epoch=0, num_tokens=0, num_seqs=0, cu_seqlens=b.cu_seqlens,
                            input_ids=b.input_ids, loss_mask=b.loss_mask.view(torch.bool), taps=b.taps,
                            last_hidden=b.last_hidden)


def test_allocate_shapes():
    wire = allocate(SPEC, "cpu")
    assert wire.taps.shape == (48, 2 * H) and wire.last_hidden.shape == (48, H) and wire.cu_seqlens.shape == (5,)
