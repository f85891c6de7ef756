"""Claims and credits in the c10d store: how a target and a drafter agree on every batch before it moves.

NCCL has no receive-from-any-source and its kernels cannot be cancelled, so a drafter posts a receive only for
a send that a target has claimed: the target first takes a credit (a free pool slot of some drafter, granted
by the drafter), then posts a claim addressed to that drafter; the drafter reads its claims in order and posts
exactly one receive per claim. Invariant: claimed sends never exceed granted slots, so a receive always has
room and a send always has a receiver. Every wait polls the store and is bounded (the caller's `poll`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

import torch.distributed as dist


@dataclass(frozen=True, slots=True, kw_only=True)
class Claim:
    """A target's announcement that it will send one batch (or end of stream) to a drafter."""

    target_rank: int
    drafter_rank: int
    epoch: int
    job_id: int
    """-1 for an end-of-stream claim."""
    bucket_id: int = -1
    num_tokens: int = 0
    num_seqs: int = 0
    end_of_stream: bool = False

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def decode(raw: bytes) -> "Claim":
        return Claim(**json.loads(raw.decode()))


class StoreClaims:
    """Credits and claims as store counters and keys. `key(*parts)` names a store key; `poll(what, ready)` calls
    `ready` until it returns non-None, bounded and interruptible (ControlPlane's)."""

    def __init__(self, store: dist.Store, *, key: Callable[..., str],
                 poll: Callable[[str, Callable[[], Optional[object]]], object]) -> None:
        self.store = store
        self._key = key
        self._poll = poll

    def _counter(self, key: str) -> int:
        return int(self.store.add(key, 0))

    # -- credits ---------------------------------------------------------------------------------
    def grant_credits(self, drafter_rank: int, n: int = 1) -> None:
        self.store.add(self._key("credits", drafter_rank, "granted"), n)

    def free_credits(self, drafter_rank: int) -> int:
        granted = self._counter(self._key("credits", drafter_rank, "granted"))
        taken = self._counter(self._key("credits", drafter_rank, "taken"))
        return granted - taken

    def try_take_credit(self, drafter_ranks: Sequence[int], *, start: int = 0) -> Optional[int]:
        """Take one credit from the drafter with the most free slots (ties: rotate from `start`).

        Count-safe under races: a take that overshoots `granted` is undone and retried later.
        """
        order = [drafter_ranks[(start + i) % len(drafter_ranks)] for i in range(len(drafter_ranks))]
        free = [(self.free_credits(d), -i, d) for i, d in enumerate(order)]
        best_free, _, best = max(free)
        if best_free <= 0:
            return None
        taken_key = self._key("credits", best, "taken")
        taken = int(self.store.add(taken_key, 1))
        if taken <= self._counter(self._key("credits", best, "granted")):
            return best
        self.store.add(taken_key, -1)
        return None

    def take_credit(self, drafter_ranks: Sequence[int], *, start: int = 0) -> int:
        return self._poll("a free drafter slot", lambda: self.try_take_credit(drafter_ranks, start=start))

    # -- claims ----------------------------------------------------------------------------------
    def post_claim(self, claim: Claim) -> int:
        index = int(self.store.add(self._key("claims", claim.drafter_rank, "n"), 1))
        self.store.set(self._key("claims", claim.drafter_rank, index), claim.encode())
        return index

    def wait_claim(self, drafter_rank: int, index: int) -> Claim:
        """The claim number `index` (1-based) addressed to `drafter_rank`."""
        key = self._key("claims", drafter_rank, index)
        raw = self._poll(f"claim {index} for drafter {drafter_rank}", lambda: self._get_if_set(key))
        return Claim.decode(raw)

    def _get_if_set(self, key: str) -> Optional[bytes]:
        return self.store.get(key) if self.store.check([key]) else None

    def _get_if_set(self, key: str) -> Optional[bytes]:
        return self.store.get(key) if self.store.check([key]) else None
