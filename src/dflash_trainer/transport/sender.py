"""The target's background sender: ships finished batches while the forward thread runs the next one.

The forward thread `acquire`s a free slot of a ring of `depth + 1` preallocated wire buffers, writes a
batch into it, and `submit`s it with a device event recorded after its writes. The sender thread waits on
that event (on its own thread; the forward never waits on a copy or a send), calls the injected `ship`
function, and only then returns the slot to the free list. `close()` sends the end of stream.

Queue invariant: each of the `depth + 1` slots is in exactly one place: the free list, the forward thread
(between acquire and submit), the queue (at most `depth` items), or the sender thread (being shipped). So
the forward blocks only when `depth` batches wait or ship and it already holds the last free slot.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from dflash_trainer.transport.wire import HiddenStateBatch, WireBatch, WireSpec, allocate

POLL_S = 0.05
"""How often blocking waits wake up to re-check the stop flag and the sender's error."""


class SenderError(RuntimeError):
    """The sender thread failed; raised in the forward thread by the next acquire, submit or close."""


class NullEvent:
    """Stands in for a CUDA event on the CPU, where every write is done when the call returns."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True


def new_event(device: torch.device) -> "torch.cuda.Event | NullEvent":
    return torch.cuda.Event() if device.type == "cuda" else NullEvent()


@dataclass(frozen=True, slots=True, kw_only=True)
class SendSlot:
    """One buffer of the send ring, handed to the forward thread by `acquire`."""

    index: int
    buffers: WireBatch
    """Preallocated wire buffers on the target device; the batch is written here."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Submitted:
    """A queue item: a batch to ship, or (slot None) the end of stream."""

    slot: Optional[SendSlot]
    batch: Optional[HiddenStateBatch]
    ready: "torch.cuda.Event | NullEvent | None"
    """Recorded on the forward stream after the batch's last write."""


class BatchSender:
    """Ships batches on a named daemon thread; see the module docstring for the queue invariant.

    `ship(batch)` must return only once the batch's buffers may be rewritten (its send completed).
    `finish()` runs once on the sender thread after the last batch (the runtime's end-of-stream message).
    Every wait has a timeout that re-checks the stop flags (its own, set by `abort` or a failure, and the
    runtime's `abort_event`, which it only reads); no wait lasts longer than `timeout_s` in total.
    """

    def __init__(
        self,
        *,
        slots: Sequence[WireBatch],
        ship: Callable[[HiddenStateBatch], None],
        finish: Callable[[], None] = lambda: None,
        timeout_s: float = 60.0,
        abort_event: Optional[threading.Event] = None,
        name: str = "target-sender",
    ):
        if len(slots) < 2:
            raise ValueError(f"the send ring needs >= 2 slots (depth + 1 with depth >= 1), got {len(slots)}")
        self.depth = len(slots) - 1
        self.device = slots[0].taps.device
        self._ship, self._finish, self._timeout_s = ship, finish, timeout_s
        self._stop = threading.Event()
        self._abort_event = abort_event
        self._error: Optional[BaseException] = None
        self._free: queue.Queue[SendSlot] = queue.Queue()
        for i, buffers in enumerate(slots):
            self._free.put(SendSlot(index=i, buffers=buffers))
        self._queue: queue.Queue[_Submitted] = queue.Queue(maxsize=self.depth)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @classmethod
    def create(cls, spec: WireSpec, device: torch.device | str, *, depth: int, **kwargs) -> "BatchSender":
        """A sender with a fresh ring of `depth + 1` slots of `spec` on `device`."""
        return cls(slots=[allocate(spec, device) for _ in range(depth + 1)], **kwargs)

    # --- forward thread -------------------------------------------------------------------------

    def acquire(self) -> SendSlot:
        """A free slot; waits (bounded) only when every slot is queued or being shipped."""
        return self._wait(lambda: self._free.get(timeout=POLL_S), "a free send slot")

    def submit(self, slot: SendSlot, batch: HiddenStateBatch) -> None:
        """Queue `batch` (written into `slot`) for shipping; records its event on the current stream."""
        self._raise_if_failed()
        ready = new_event(self.device)
        ready.record()
        item = _Submitted(slot=slot, batch=batch, ready=ready)
        self._wait(lambda: self._queue.put(item, timeout=POLL_S), "room in the send queue")

    def close(self) -> None:
        """Send the end of stream after every queued batch, join the thread, re-raise a sender failure."""
        if self._closed:
            return
        self._closed = True
        self._raise_if_failed()
        end = _Submitted(slot=None, batch=None, ready=None)
        self._wait(lambda: self._queue.put(end, timeout=POLL_S), "room for the end of stream")
        self._wait(self._join_step, "the sender thread to finish")
        self._raise_if_failed()

    def abort(self) -> None:
        """Stop without an end of stream (an error elsewhere); does not wait for queued batches."""
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=self._timeout_s)

    @property
    def failed(self) -> bool:
        return self._error is not None

    def _stopped(self) -> bool:
        return self._stop.is_set() or (self._abort_event is not None and self._abort_event.is_set())

    def _join_step(self) -> None:
        self._thread.join(timeout=POLL_S)
        if self._thread.is_alive():
            raise queue.Empty  # not yet: keep waiting

    def _wait(self, step: Callable[[], object], what: str):
        """Retry `step` (which raises queue.Empty/Full on its own short timeout) until it succeeds."""
        deadline = time.monotonic() + self._timeout_s
        while True:
            self._raise_if_failed()
            if self._stopped():
                raise SenderError(f"target sender stopped (abort) while waiting for {what}")
            try:
                return step()
            except (queue.Empty, queue.Full):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"target sender: waited more than {self._timeout_s:.0f} s for {what} "
                        "(pipeline.timeout_s); the consumer may be stuck"
                    ) from None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise SenderError(f"target sender thread failed: {self._error!r}") from self._error

    # --- sender thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped():
                try:
                    item = self._queue.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if item.slot is None:
                    self._finish()
                    return
                while not item.ready.query():  # the forward's writes are not done yet
                    if self._stopped():
                        return
                    time.sleep(0.0005)
                self._ship(item.batch)
                self._free.put(item.slot)
        except BaseException as exc:  # forwarded to the forward thread
            self._error = exc
            self._stop.set()
