"""The shared job stream: every epoch's remaining jobs, handed out by the store cursor."""

from __future__ import annotations

import threading
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from dflash_trainer.data.types import Job
from dflash_trainer.runtime.control import ControlPlane
from dflash_trainer.target.worker import JobSource

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


class GroupJobSource:
    """A target group's jobs, in lockstep: the leader pulls each job from `source` (the store cursor: the group is
    one puller) and broadcasts its (epoch, job id), or the end, over the group; every member receives the same
    jobs in the same order, so the sharded layers' collectives of the group pair up forward by forward.

    `source` is None on the members; `epochs` (every epoch's remaining jobs, identical on every rank) turns a
    received id back into the job.
    """

    def __init__(self, source: Optional[JobSource], epochs: Sequence[Sequence[Job]], *, group: dist.ProcessGroup,
                 leader: int, device: torch.device) -> None:
        self._source = source
        self._jobs = {(job.epoch, job.job_id): job for jobs in epochs for job in jobs}
        self._group = group
        self._leader = leader
        self._device = device

    def next_job(self) -> Optional[Job]:
        message = torch.tensor([-1, -1], dtype=torch.int64)  # (epoch, job id); -1: no more jobs
        job = self._source.next_job() if self._source is not None else None
        if job is not None:
            message = torch.tensor([job.epoch, job.job_id], dtype=torch.int64)
        message = message.to(self._device)
        dist.broadcast(message, src=self._leader, group=self._group)  # members wait here for the leader's pull
        epoch, job_id = message.tolist()  # a host sync: one tiny message per job
        return None if epoch < 0 else self._jobs[(epoch, job_id)]
