"""The target worker loop: pull jobs, forward them to the last tap, hand the packed batches to the sender."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import torch

from dflash_trainer.data.types import Job, TokenizedSequence
from dflash_trainer.errors import ConfigError
from dflash_trainer.faults import inject_nan, maybe_fault
from dflash_trainer.target.capture import ForwardInputs, TapCapture, prepare_inputs, shard_inputs
from dflash_trainer.target.context_parallel import ShardGroup
from dflash_trainer.transport.sender import BatchSender
from dflash_trainer.transport.wire import HiddenStateBatch, WireBatch, WireHeader, from_wire


class JobSource(Protocol):
    """Hands out the jobs of an epoch plan; the runtime backs it with the c10d store's job cursor."""

    def next_job(self) -> Optional[Job]:
        """The next job to run, or None when the plan is exhausted."""
        ...


class ListJobSource:
    """An in-memory JobSource over a fixed list (tests, single-process runs); thread-safe."""

    def __init__(self, jobs: Sequence[Job]):
        self._jobs = list(jobs)
        self._next = 0
        self._lock = threading.Lock()

    def next_job(self) -> Optional[Job]:
        with self._lock:
            if self._next >= len(self._jobs):
                return None
            self._next += 1
            return self._jobs[self._next - 1]


class Dataset(Protocol):
    def __getitem__(self, seq_id: int) -> TokenizedSequence: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetBatchStats:
    """What one job cost the target."""

    job_id: int
    num_seqs: int
    num_tokens: int
    """Real tokens shipped."""
    padded_tokens: int
    """Tokens the forward computed (B * S, padding included)."""
    forward_s: float
    """Device time of input copy + forward + capture (CUDA events on GPU, wall time on CPU)."""
    slot_wait_s: float
    """Host time the forward thread waited for a free send slot (backpressure from the consumer)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetWorkerReport:
    batches: tuple[TargetBatchStats, ...]
    wall_s: float
    """Host time from the first job pulled to the end of stream sent."""

    @property
    def num_tokens(self) -> int:
        return sum(b.num_tokens for b in self.batches)

    @property
    def padding_fraction(self) -> float:
        padded = sum(b.padded_tokens for b in self.batches)
        return 1.0 - self.num_tokens / padded if padded else 0.0


class Interval:
    """Times the forward of one batch: CUDA events on GPU (read once done, no sync), wall clock on CPU."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._cuda:
            self._end.record()
        else:
            self._seconds = time.perf_counter() - self._t0

    def done(self) -> bool:
        return not self._cuda or self._end.query()

    def seconds(self) -> float:
        """Call once `done()`; otherwise this waits for the device (only at the end of the run)."""
        if not self._cuda:
            return self._seconds
        self._end.synchronize()  # a no-op wait when done() is True; the final drain otherwise
        return self._start.elapsed_time(self._end) / 1000.0


def forward_job(capture: TapCapture, dataset: Dataset, job: Job, buffers: WireBatch) -> tuple[HiddenStateBatch, ForwardInputs]:
    """Run one job's sequences through the target into `buffers`; the batch views them."""
    sequences = [dataset[i] for i in job.sequence_ids]
    _check_tokens(job, sum(s.num_tokens for s in sequences))
    maybe_fault("target_forward")  # test-only hook, inert unless DFLASH_TEST_FAULT is set
    inputs = prepare_inputs(sequences, buffers)
    capture.run(inputs, buffers)
    if inject_nan(job.job_id):  # test-only hook
        buffers.taps[: inputs.num_tokens].fill_(float("nan"))
    header = WireHeader(
        job_id=job.job_id,
        bucket_id=job.bucket_id,
        epoch=job.epoch,
        num_tokens=inputs.num_tokens,
        num_seqs=inputs.num_seqs,
        has_last_hidden=buffers.last_hidden is not None,
        end_of_stream=False,
    )
    return from_wire(buffers, header), inputs


def _check_tokens(job: Job, real: int) -> None:
    if real != job.num_tokens:
        raise ValueError(
            f"job {job.job_id}: the plan says {job.num_tokens} tokens but its sequences have {real}: "
            "the epoch plan and the tokenized data disagree (re-run planning)"
        )


def forward_shard_job(capture: TapCapture, dataset: Dataset, job: Job, buffers: WireBatch,
                      group: ShardGroup) -> tuple[HiddenStateBatch, ForwardInputs]:
    """Context parallel: this rank's shard of one job's sequence through the target, every rank of `group` at once
    (their attention layers gather each other's keys and values). `buffers` gets the whole sequence's ids, loss
    mask and cu_seqlens (the drafter samples blocks on the whole sequence) and, in rows [0, real tokens of the
    shard), the shard's taps; the header counts the whole sequence. Returns the batch and the shard's inputs."""
    if len(job.sequence_ids) != 1:
        raise ValueError(f"job {job.job_id} has {len(job.sequence_ids)} sequences: a context-parallel batch holds one "
                         "(BatchShape.max_seqs); the epoch plan was made for another pipeline.context_parallel")
    sequence = dataset[job.sequence_ids[0]]
    if sequence.pixel_values is not None:
        raise ConfigError(f"job {job.job_id}: a sequence with images cannot be split over a context-parallel group "
                          "yet; set pipeline.context_parallel=1 for image-text data")
    _check_tokens(job, sequence.num_tokens)
    maybe_fault("target_forward")  # test-only hook, inert unless DFLASH_TEST_FAULT is set
    # the whole sequence's packed fields, as one rank writes them (its padded ids for a forward go unused)
    prepare_inputs([sequence], buffers)
    token_budget = buffers.input_ids.numel()
    inputs = shard_inputs(sequence, group.attention(sequence.num_tokens, token_budget), buffers.taps.device)
    capture.run(inputs, buffers)
    if inject_nan(job.job_id):  # test-only hook
        buffers.taps[: inputs.num_tokens].fill_(float("nan"))
    header = WireHeader(job_id=job.job_id, bucket_id=job.bucket_id, epoch=job.epoch, num_tokens=sequence.num_tokens,
                        num_seqs=1, has_last_hidden=buffers.last_hidden is not None, end_of_stream=False)
    return from_wire(buffers, header), inputs


def run_target_worker(
    *,
    capture: TapCapture,
    job_source: JobSource,
    dataset: Dataset,
    sender: BatchSender,
    abort_event: Optional[threading.Event] = None,
    on_stats: Optional[Callable[[TargetBatchStats], None]] = None,
) -> TargetWorkerReport:
    """Run every job `job_source` hands out, then close `sender` (end of stream) and report.

    On any error (including a sender failure, re-raised here with its cause) the sender is aborted
    without an end of stream and the error propagates. `on_stats` gets each batch's stats once its
    device time is known (in job order, a batch or two late on GPU).
    """
    t_start = time.perf_counter()
    pending: list[tuple[dict, Interval]] = []
    done: list[TargetBatchStats] = []

    def flush(wait: bool) -> None:
        while pending and (wait or pending[0][1].done()):
            fields, interval = pending.pop(0)
            stats = TargetBatchStats(forward_s=interval.seconds(), **fields)
            done.append(stats)
            if on_stats is not None:
                on_stats(stats)

    try:
        while True:
            if abort_event is not None and abort_event.is_set():
                raise RuntimeError("target worker aborted (abort flag set by another stage)")
            job = job_source.next_job()
            if job is None:
                break
            t_wait = time.perf_counter()
            slot = sender.acquire()
            slot_wait_s = time.perf_counter() - t_wait
            interval = Interval(slot.buffers.taps.device)
            batch, inputs = forward_job(capture, dataset, job, slot.buffers)
            interval.stop()
            sender.submit(slot, batch)
            fields = dict(
                job_id=job.job_id,
                num_seqs=inputs.num_seqs,
                num_tokens=inputs.num_tokens,
                padded_tokens=inputs.padded_tokens,
                slot_wait_s=slot_wait_s,
            )
            pending.append((fields, interval))
            flush(wait=False)
        sender.close()
    except BaseException:
        sender.abort()
        raise
    flush(wait=True)
    return TargetWorkerReport(batches=tuple(done), wall_s=time.perf_counter() - t_start)
