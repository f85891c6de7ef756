"""A drafter rank's feed: where its training batches come from, behind `take`, `stop` and `close`.

- `ColocatedFeed`: this rank's own target forwards jobs into the pool's free slots just before each take
  (in-process, no thread, no copy). Under context parallel a CP group is one puller: its first rank pulls each job
  and shares it (`GroupJobSource`), every rank forwards its shard of the job's sequence, and the group's pools,
  filled and taken in the same order with the same seed, hand out the same batch on every rank at each take.
- `ReceivedFeed`: a receiver thread fills the pool with the batches the target ranks send (claims in the store,
  point-to-point receives), returning a credit to the targets whenever a slot is released.

Either way the pool (`BufferedPool`) holds the batches: its invariant and bounds are in `pool.py`.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Protocol

from dflash_trainer.data.types import Job
from dflash_trainer.runtime.control import ControlPlane
from dflash_trainer.runtime.jobs import GroupJobSource, StoreJobSource
from dflash_trainer.runtime.setup import RunSetup, run_wire_spec
from dflash_trainer.runtime.summary import TargetStats
from dflash_trainer.target.capture import TapCapture
from dflash_trainer.target.worker import Interval, JobSource, forward_job, forward_shard_job
from dflash_trainer.transport.links import LocalProducer, Receiver
from dflash_trainer.transport.pool import BufferedPool
from dflash_trainer.transport.wire import HiddenStateBatch, allocate

Taken = Optional[tuple[HiddenStateBatch, Callable[[], None]]]
"""A batch and its release (call it once the optimizer step that used it is done), or None: no more batches."""


class Feed(Protocol):
    pool: BufferedPool

    def take(self) -> Taken: ...

    def stop(self) -> None:
        """Training is over: batches still on their way are dropped, so no target waits on this rank."""

    def close(self, timeout_s: float) -> Optional[TargetStats]:
        """End the feed; returns the stats of this rank's own target (colocated), else None."""


def _take(pool: BufferedPool) -> Taken:
    entry = pool.take()
    return None if entry is None else (entry.item, lambda: pool.release(entry.slot))


def _pool(setup: RunSetup, control: ControlPlane, on_release: Callable[[int], None]) -> BufferedPool:
    p = setup.config.pipeline
    # seeded by the CP group's first rank (this rank without CP): a group's pools must pick the same batches
    seed = setup.config.run.seed * 1009 + setup.placement.context_group[0]
    return BufferedPool(p.pool_capacity, min_ready=p.min_ready, fifo=p.deterministic, seed=seed, timeout_s=p.timeout_s,
                        check_abort=control.raise_if_aborted, on_release=on_release)


class ColocatedFeed:
    def __init__(self, setup: RunSetup, control: ControlPlane, capture: TapCapture) -> None:
        self.pool = _pool(setup, control, on_release=lambda slot: None)
        self.stats = TargetStats(rank=setup.env.rank)
        self._setup, self._capture = setup, capture
        self._pending: list[Interval] = []  # forward timers not read yet: reading one waits for its GPU work
        self._started: Optional[float] = None
        buffers = [allocate(run_wire_spec(setup), setup.device) for _ in range(self.pool.capacity)]
        jobs: JobSource = StoreJobSource(control, setup.remaining)
        self._shard = setup.shards
        if self._shard is not None:  # the group is one puller: its first rank pulls, the others receive
            leader = setup.placement.context_group[0]
            jobs = GroupJobSource(jobs if setup.env.rank == leader else None, setup.remaining,
                                  group=self._shard.group, leader=leader, device=setup.device)
        self._producer = LocalProducer(self.pool, buffers, next_job=jobs.next_job, forward=self._forward)

    def _forward(self, job: Job, wire) -> HiddenStateBatch:
        timer = Interval(self._setup.device)
        dataset = self._setup.prepared.train
        if self._shard is None:
            batch, inputs = forward_job(self._capture, dataset, job, wire)
        else:
            batch, inputs = forward_shard_job(self._capture, dataset, job, wire, self._shard)
        timer.stop()
        self._pending.append(timer)
        self.stats.tokens += inputs.num_tokens
        self.stats.batches += 1
        while self._pending and self._pending[0].done():  # no host sync: only timers whose events completed
            self.stats.busy_s += self._pending.pop(0).seconds()
        return batch

    def take(self) -> Taken:
        if self._started is None:
            self._started = time.perf_counter()
        self._producer.fill()
        return _take(self.pool)

    def stop(self) -> None:
        pass

    def close(self, timeout_s: float) -> Optional[TargetStats]:
        self.stats.busy_s += sum(timer.seconds() for timer in self._pending)  # end of run: the last few timers
        self._pending = []
        self.stats.wall_s = time.perf_counter() - (self._started or time.perf_counter())
        return self.stats


class ReceivedFeed:
    def __init__(self, setup: RunSetup, control: ControlPlane) -> None:
        rank = setup.env.rank
        self.pool = _pool(setup, control, on_release=lambda slot: control.claims.grant_credits(rank, 1))
        buffers = [allocate(run_wire_spec(setup), setup.device) for _ in range(self.pool.capacity)]
        control.claims.grant_credits(rank, self.pool.capacity)
        self._receiver = Receiver(control.claims, self.pool, buffers, rank=rank,
                                  num_targets=len(setup.placement.node_target_ranks), device=setup.device).start()

    def take(self) -> Taken:
        return _take(self.pool)

    def stop(self) -> None:
        # Before anything waits on a target: batches still in flight are received and dropped at once, so a
        # target blocked on credits moves on (and the first target can serve the final tau evaluation).
        self._receiver.drain()

    def close(self, timeout_s: float) -> Optional[TargetStats]:
        self._receiver.join(timeout_s)
        return None


def make_feed(setup: RunSetup, control: ControlPlane, capture: Optional[TapCapture]) -> Feed:
    """The colocated feed when this rank holds a target (`capture`), else the received one."""
    return ColocatedFeed(setup, control, capture) if capture is not None else ReceivedFeed(setup, control)
