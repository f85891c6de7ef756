"""How hidden-state batches get from a target to a drafter's pool.

Two implementations behind one small interface:
- colocated (`LocalProducer`): the target forward writes straight into a free pool slot, in process;
- split (`P2PShipper` on the target, `Receiver` on the drafter): torch.distributed point-to-point (NCCL
  between GPUs, gloo on CPU) of fixed-shape buffers, following the data-plane rules:
  * a target takes a free-slot credit of a drafter and records a claim in the store *before* sending;
  * a drafter posts receives only for claimed sends, per source, in claim order; each target has at most
    one claimed-but-unsent batch (its sender is sequential), so the head claim of every drafter is always
    being sent: no cycle can form, and receives never wait on the drafters' all-reduces;
  * a send buffer is reused only after its send completed (the sender thread waits on an event of its
    own stream); the drafter's receiver waits on its own stream's event before publishing a slot;
  * end of stream is an explicit claim.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from dflash_trainer.data.types import Job
from dflash_trainer.faults import maybe_fault
from dflash_trainer.transport.claims import Claim, StoreClaims
from dflash_trainer.transport.p2p import recv_batch_into, send_batch
from dflash_trainer.transport.pool import BufferedPool
from dflash_trainer.transport.wire import HiddenStateBatch, WireBatch, to_wire


class _StreamScope:
    """Run communication on a dedicated CUDA stream and wait (this thread only) for it to finish."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None

    def run(self, fn: Callable[[], object]):
        if not self.cuda:
            return fn()
        with torch.cuda.stream(self.stream):
            out = fn()
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()  # blocks this communication thread only, never the device or the trainer
        return out


class P2PShipper:
    """Target side: `ship` (credit, claim, send) and `finish` (end-of-stream claims), on the sender thread."""

    def __init__(self, claims: StoreClaims, *, rank: int, drafter_ranks: Sequence[int], device: torch.device,
                 group: Optional[dist.ProcessGroup] = None) -> None:
        self.claims = claims
        self.rank = rank
        self.drafter_ranks = tuple(drafter_ranks)
        self.group = group
        self.scope = _StreamScope(device)
        self.bytes_sent = 0
        self.batches_to: dict[int, int] = {}
        """Batches sent to each drafter rank."""

    @property
    def batches_sent(self) -> int:
        return sum(self.batches_to.values())

    def ship(self, batch: HiddenStateBatch) -> None:
        maybe_fault("sender", self.batches_sent + 1)  # test-only hook
        drafter = self.claims.take_credit(self.drafter_ranks, start=self.rank)
        self.claims.post_claim(Claim(
            target_rank=self.rank, drafter_rank=drafter, epoch=batch.epoch, job_id=batch.job_id,
            bucket_id=batch.bucket_id, num_tokens=batch.num_tokens, num_seqs=batch.num_seqs,
        ))
        wire = to_wire(batch)
        self.scope.run(lambda: send_batch(wire, drafter, self.group))
        self.bytes_sent += sum(t.numel() * t.element_size() for t in wire.payload())
        self.batches_to[drafter] = self.batches_to.get(drafter, 0) + 1

    def finish(self) -> None:
        for drafter in self.drafter_ranks:
            self.claims.post_claim(Claim(target_rank=self.rank, drafter_rank=drafter, epoch=-1, job_id=-1, end_of_stream=True))


class Receiver:
    """Drafter side: a named daemon thread that turns claims into filled pool slots.

    Invariant: claims are consumed strictly in order; each non-final claim is matched by exactly one
    receive from its target into a free slot. After `drain()` received batches are returned at once (their
    credits granted back) so targets that are still sending never block. Errors go to the pool.
    """

    def __init__(self, claims: StoreClaims, pool: BufferedPool, buffers: Sequence[WireBatch], *, rank: int,
                 num_targets: int, device: torch.device, group: Optional[dist.ProcessGroup] = None) -> None:
        self.claims = claims
        self.pool = pool
        self.buffers = buffers
        self.rank = rank
        self.num_targets = num_targets
        self.group = group
        self.scope = _StreamScope(device)
        self._draining = threading.Event()
        self.bytes_received = 0
        self.batches_received = 0
        self._thread = threading.Thread(target=self._run, name=f"receiver-{rank}", daemon=True)

    def start(self) -> "Receiver":
        self._thread.start()
        return self

    def drain(self) -> None:
        self._draining.set()
        self.pool.discard_ready()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"drafter {self.rank}: receiver still waiting for targets after {timeout_s:.0f}s")

    def _run(self) -> None:
        try:
            index, ended = 1, 0
            while ended < self.num_targets:
                claim = self.claims.wait_claim(self.rank, index)
                index += 1
                if claim.end_of_stream:
                    ended += 1
                    continue
                slot = self.pool.acquire_free()
                batch = self.scope.run(lambda: recv_batch_into(self.buffers[slot], claim.target_rank, self.group))
                if batch is None or batch.job_id != claim.job_id:
                    raise RuntimeError(
                        f"drafter {self.rank}: claim for job {claim.job_id} from rank {claim.target_rank} "
                        f"received {'end of stream' if batch is None else f'job {batch.job_id}'}"
                    )
                self.batches_received += 1
                maybe_fault("receiver", self.batches_received)  # test-only hook
                self.bytes_received += sum(t.numel() * t.element_size() for t in self.buffers[slot].payload())
                if self._draining.is_set():
                    self.pool.release_unused(slot)
                else:
                    self.pool.put_ready(slot, batch, claim.bucket_id)
            self.pool.set_producers_done()
        except BaseException as e:  # forwarded: the trainer's next take() raises it
            self.pool.set_error(e)


class LocalProducer:
    """Colocated: pulls a job and forwards it into a free pool slot when the trainer needs more batches."""

    def __init__(self, pool: BufferedPool, buffers: Sequence[WireBatch], *, next_job: Callable[[], Optional[Job]],
                 forward: Callable[[Job, WireBatch], HiddenStateBatch]) -> None:
        self.pool = pool
        self.buffers = buffers
        self.next_job = next_job
        self.forward = forward
        self.exhausted = False
        self.batches = 0

    def fill(self) -> None:
        """Produce until the pool holds what `take` waits for, or the jobs run out."""
        while not self.exhausted and self.pool.wants_more():
            job = self.next_job()
            if job is None:
                self.exhausted = True
                self.pool.set_producers_done()
                return
            slot = self.pool.acquire_free()
            try:
                batch = self.forward(job, self.buffers[slot])
            except BaseException:
                self.pool.return_unused(slot)
                raise
            self.batches += 1
            self.pool.put_ready(slot, batch, job.bucket_id)
