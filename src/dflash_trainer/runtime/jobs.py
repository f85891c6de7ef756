"""The shared job stream: every epoch's remaining jobs, handed out by the store cursor."""

from __future__ import annotations

import threading
from typing import Optional, Sequence

from dflash_trainer.data.types import Job
from dflash_trainer.runtime.control import ControlPlane

STOP = "stop"
"""Control value set by the first drafter when training ends early (max_steps): targets stop pulling."""


class StoreJobSource:
    """Pulls jobs epoch after epoch: `epochs[e]` is epoch e's list of not-yet-committed jobs (identical on
    every rank); `store.add` on the epoch's cursor hands each index to exactly one puller."""

    def __init__(self, control: ControlPlane, epochs: Sequence[Sequence[Job]], *, first_epoch: int = 0) -> None:
        self._control = control
        self._epochs = epochs
        self._epoch = first_epoch
        self._lock = threading.Lock()
        self.pulled = 0

    def next_job(self) -> Optional[Job]:
        with self._lock:
            while self._epoch < len(self._epochs):
                if self._control.has_value(STOP):
                    return None
                jobs = self._epochs[self._epoch]
                index = self._control.next_job_index(self._epoch)
                if index < len(jobs):
                    self.pulled += 1
                    return jobs[index]
                self._epoch += 1
            return None
