"""The buffered pool on a drafter: a ring of preallocated slots filled by a receiver thread.

Invariant: every slot index is in exactly one state (free, filling, ready, in use); the number of
non-free slots never exceeds `capacity`, so memory is bounded by the preallocated ring. A slot goes back
to free only through `release`, after the optimizer step that used it.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Generic, Optional, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolEntry(Generic[T]):
    slot: int
    item: T
    """What the receiver put there (a HiddenStateBatch view of the slot's buffers)."""
    bucket_id: int


@dataclass
class PoolStats:
    takes: int = 0
    depth_sum: int = 0
    depth_max: int = 0
    """Most ready slots seen by a take."""
    occupied_max: int = 0
    """Most non-free slots (filling, ready or in use) at any time: the pool's memory high-water mark."""
    wait_s: float = 0.0
    bucket_counts: dict[int, int] = field(default_factory=dict)


class DepthMeter:
    """The mean pool depth (ready slots seen by a take) since the last reading: a per-step metric."""

    def __init__(self, stats: PoolStats) -> None:
        self.stats = stats
        self._takes = self._depth_sum = 0

    def __call__(self) -> dict:
        takes, depth_sum = self.stats.takes - self._takes, self.stats.depth_sum - self._depth_sum
        self._takes, self._depth_sum = self.stats.takes, self.stats.depth_sum
        return {"pool_depth": depth_sum / takes} if takes else {}


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolReport:
    """A drafter's pool figures at the end of a run, sent to the leader (through the store) for the summary."""

    takes: int
    """Batches taken by the trainer."""
    depth_sum: int
    """Sum over takes of the ready slots seen (mean depth = depth_sum / takes)."""
    depth_max: int
    occupied_max: int
    """Memory high-water mark in slots (never above the capacity)."""

    @staticmethod
    def of(stats: PoolStats) -> "PoolReport":
        return PoolReport(takes=stats.takes, depth_sum=stats.depth_sum, depth_max=stats.depth_max,
                          occupied_max=stats.occupied_max)


class BufferedPool(Generic[T]):
    """Slots handed between one producer (the receiver) and one consumer (the trainer).

    - `acquire_free` (producer) blocks until a slot is free;
    - `put_ready` (producer) publishes a filled slot;
    - `take` (consumer) returns a random ready slot once `min_ready` are ready or producers are done,
      first-in first-out when `fifo`; None when producers are done and nothing is left;
    - `release` (consumer) frees a slot after the step that used it.
    Every blocking call waits in `poll_s` steps, re-checks `check_abort` and the producer's error, and
    gives up after `timeout_s`.
    """

    def __init__(
        self,
        capacity: int,
        *,
        min_ready: int,
        fifo: bool = False,
        seed: int = 0,
        timeout_s: float = 900.0,
        poll_s: float = 0.05,
        check_abort: Callable[[], None] = lambda: None,
        on_release: Callable[[int], None] = lambda slot: None,
    ) -> None:
        if not 1 <= min_ready <= capacity:
            raise ValueError(f"min_ready must be in [1, capacity={capacity}], got {min_ready}")
        self.capacity = capacity
        self.min_ready = min_ready
        self.fifo = fifo
        self._rng = random.Random(seed)
        self._timeout_s = timeout_s
        self._poll_s = poll_s
        self._check_abort = check_abort
        self._on_release = on_release
        self._cond = threading.Condition()
        self._free: deque[int] = deque(range(capacity))
        self._ready: list[PoolEntry[T]] = []
        self._in_use = 0
        self._producers_done = False
        self._error: Optional[BaseException] = None
        self.stats = PoolStats()

    # -- producer side ---------------------------------------------------------------------------
    def acquire_free(self) -> int:
        with self._cond:
            self._wait(lambda: bool(self._free), "a free pool slot")
            slot = self._free.popleft()
            self.stats.occupied_max = max(self.stats.occupied_max, self.capacity - len(self._free))
            return slot

    def put_ready(self, slot: int, item: T, bucket_id: int) -> None:
        with self._cond:
            self._ready.append(PoolEntry(slot=slot, item=item, bucket_id=bucket_id))
            self._cond.notify_all()

    def return_unused(self, slot: int) -> None:
        """Give back a slot the producer acquired but did not fill (no credit: nothing was claimed)."""
        with self._cond:
            self._free.append(slot)
            self._cond.notify_all()

    def release_unused(self, slot: int) -> None:
        """Give back a slot filled by a claimed send that will not be trained (draining): its credit returns."""
        self.return_unused(slot)
        self._on_release(slot)

    def set_producers_done(self) -> None:
        with self._cond:
            self._producers_done = True
            self._cond.notify_all()

    def set_error(self, error: BaseException) -> None:
        """Forward a producer failure: the consumer's next `take` re-raises it."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    # -- consumer side ---------------------------------------------------------------------------
    def take(self) -> Optional[PoolEntry[T]]:
        start = time.monotonic()
        with self._cond:
            # Slots the consumer still holds (grad accumulation) cannot fill: lower the bar accordingly.
            self._wait(
                lambda: len(self._ready) >= max(1, min(self.min_ready, self.capacity - self._in_use))
                or self._producers_done,
                f"{self.min_ready} ready batches",
            )
            self.stats.wait_s += time.monotonic() - start
            if not self._ready:
                return None
            depth = len(self._ready)
            index = 0 if self.fifo else self._rng.randrange(depth)
            entry = self._ready.pop(index)
            self._in_use += 1
            self.stats.takes += 1
            self.stats.depth_sum += depth
            self.stats.depth_max = max(self.stats.depth_max, depth)
            self.stats.bucket_counts[entry.bucket_id] = self.stats.bucket_counts.get(entry.bucket_id, 0) + 1
            return entry

    def release(self, slot: int) -> None:
        with self._cond:
            self._in_use -= 1
            self._free.append(slot)
            self._cond.notify_all()
        self._on_release(slot)

    def wants_more(self) -> bool:
        """(Colocated producer) a free slot exists and fewer batches are ready than `take` waits for."""
        with self._cond:
            bar = max(1, min(self.min_ready, self.capacity - self._in_use))
            return bool(self._free) and len(self._ready) < bar

    def discard_ready(self) -> int:
        """Free every ready slot without training it (draining after the last step); returns how many."""
        with self._cond:
            slots = [e.slot for e in self._ready]
            self._ready.clear()
            self._free.extend(slots)
            self._cond.notify_all()
        for slot in slots:
            self._on_release(slot)
        return len(slots)

    @property
    def occupied(self) -> int:
        with self._cond:
            return self.capacity - len(self._free)

    @property
    def ready_count(self) -> int:
        with self._cond:
            return len(self._ready)

    def _wait(self, predicate: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self._timeout_s
        while True:
            if self._error is not None:
                raise RuntimeError(f"pool producer failed: {self._error!r}") from self._error
            if predicate():
                return
            self._check_abort()
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited over {self._timeout_s:.0f}s for {what}")
            self._cond.wait(self._poll_s)
