"""The control plane on the c10d store: job cursor, done counters, values, liveness beats, abort flag; and the
transport's credits and claims (`transport/claims.py`, as `ControlPlane.claims`).

Nothing else runs a server: `torchrun` already hosts a TCPStore; one process uses a HashStore.

Keys (all under `prefix/`):
- `epoch/E/next`            job cursor of epoch E (`add` hands out the next index of the epoch plan)
- `credits/D/granted|taken` free-slot credits of drafter rank D (granted by D, taken by targets)
- `claims/D/n`, `claims/D/i` claims addressed to drafter D, in claim order (i = 1, 2, ...)
- `done/NAME`               done counters (also `NAME/left` of `turns`)
- `abort`                   JSON {rank, cause} of the first failing rank
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator, Optional

import torch.distributed as dist

from dflash_trainer.transport.claims import StoreClaims


class Aborted(RuntimeError):
    """Another rank failed; this rank stops."""


class StallTimeout(RuntimeError):
    """A wait outlasted pipeline.stall_timeout_s: the pipeline is stuck."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortInfo:
    rank: int
    cause: str


class ControlPlane:
    """Typed access to the store. Every wait polls, re-checks the abort flag, and is bounded."""

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        prefix: str = "dft",
        poll_s: float = 0.01,
        stall_timeout_s: float = 900.0,
    ) -> None:
        self.store = store
        self.rank = rank
        self.prefix = prefix
        self.poll_s = poll_s
        self.stall_timeout_s = stall_timeout_s
        self.claims = StoreClaims(store, key=self._key, poll=self._poll)
        """Claims and credits of the batches in flight (`transport/claims.py`)."""

    def _key(self, *parts: object) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def _counter(self, key: str) -> int:
        return int(self.store.add(key, 0))

    def _get_if_set(self, key: str) -> Optional[bytes]:
        return self.store.get(key) if self.store.check([key]) else None

    def _poll(self, what: str, ready: Callable[[], Optional[object]], timeout_s: Optional[float] = None):
        """Call `ready` until it returns non-None; raise on abort or after `timeout_s` (default: the stall
        timeout)."""
        timeout_s = self.stall_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        delay = self.poll_s
        while True:
            self.raise_if_aborted()
            value = ready()
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise StallTimeout(f"rank {self.rank} waited over {timeout_s:.0f}s for {what}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.2)

    # -- job cursor ------------------------------------------------------------------------------
    def next_job_index(self, epoch: int) -> int:
        """Index of the next unclaimed job of the epoch's (remaining) job list."""
        return int(self.store.add(self._key("epoch", epoch, "next"), 1)) - 1

    # -- done counters ---------------------------------------------------------------------------
    def mark_done(self, name: str) -> int:
        return int(self.store.add(self._key("done", name), 1))

    def count_done(self, name: str) -> int:
        return self._counter(self._key("done", name))

    def wait_done(self, name: str, count: int) -> None:
        self._poll(f"{count} x done/{name}", lambda: True if self.count_done(name) >= count else None)

    @contextmanager
    def turns(self, name: str, at_once: int, place: int) -> Iterator[None]:
        """Run the block when the ranks before `place` (0, 1, ... in a fixed order: whatever order they arrive
        in) have left theirs but `at_once - 1`. Nothing inside may wait for a rank still waiting for its turn.
        Each turn ahead may last up to the stall timeout; a rank that fails, waiting or inside, counts as left."""
        must_leave = place + 1 - at_once
        try:
            self._poll(f"its turn of {name} ({must_leave} to finish first)",
                       lambda: True if self.count_done(f"{name}/left") >= must_leave else None,
                       timeout_s=self.stall_timeout_s * max(1, must_leave))
            yield
        finally:
            self.mark_done(f"{name}/left")

    # -- values ----------------------------------------------------------------------------------
    def set_value(self, name: str, value: str) -> None:
        self.store.set(self._key("value", name), value.encode())

    def has_value(self, name: str) -> bool:
        return bool(self.store.check([self._key("value", name)]))

    def wait_value(self, name: str) -> str:
        key = self._key("value", name)
        return self._poll(f"value {name}", lambda: self._get_if_set(key)).decode()

    # -- liveness --------------------------------------------------------------------------------
    def beat(self) -> None:
        self.store.add(self._key("beat", self.rank), 1)

    def beats(self, rank: int) -> int:
        return self._counter(self._key("beat", rank))

    # -- abort -----------------------------------------------------------------------------------
    def abort(self, cause: str, *, rank: Optional[int] = None) -> None:
        """Record a failure: this rank's, or `rank`'s when this rank found another one dead (the first record
        wins: compare_set on an empty key)."""
        info = json.dumps({"rank": self.rank if rank is None else rank, "cause": cause}).encode()
        try:
            self.store.compare_set(self._key("abort"), b"", info)
        except Exception:  # the store may be gone while the job is ending
            pass

    def aborted(self) -> Optional[AbortInfo]:
        key = self._key("abort")
        try:
            if not self.store.check([key]):
                return None
            data = json.loads(self.store.get(key).decode())
        except Exception:
            return None
        return AbortInfo(rank=int(data["rank"]), cause=str(data["cause"]))

    def raise_if_aborted(self) -> None:
        info = self.aborted()
        if info is not None and info.rank != self.rank:
            raise Aborted(f"rank {info.rank} failed: {info.cause}")


def make_local_store(timeout_s: float = 300.0) -> dist.Store:
    """A store for a single process (no torchrun)."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=timeout_s))
    return store
