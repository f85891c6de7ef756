"""How many threads a process running on the CPU gives torch: from the cores it may use, the work already on them,
and the processes of this job on the host.

torch's default (one thread per core) oversubscribes a shared or small machine: OpenMP's threads wait for each other
at every parallel region, so one thread that shares its core with another job slows every operation. Each process
therefore takes at most its share of the cores that are free when it starts: `(cores - load) / local processes`,
at least one. An explicit `run.cpu_threads`, or `OMP_NUM_THREADS` set by the user (torchrun sets it to 1 for
several processes), wins.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ThreadChoice:
    threads: int
    """Threads torch uses in this process (intra-op)."""
    reason: str
    """Why, for the log line."""


def choose_cpu_threads(requested: Optional[int], *, cores: int, load: float, processes: int,
                       omp_env: Optional[str]) -> ThreadChoice:
    """`requested`: run.cpu_threads (None: choose); `cores`: the cores this process may run on; `load`: the host's
    1-minute load average (work already running); `processes`: this job's processes on the host; `omp_env`: the
    OMP_NUM_THREADS variable, if set."""
    if requested is not None:
        return ThreadChoice(threads=requested, reason="run.cpu_threads")
    if omp_env:
        try:
            return ThreadChoice(threads=max(1, int(omp_env)), reason="OMP_NUM_THREADS")
        except ValueError:
            pass  # torch ignores a malformed value too: choose as if unset
    free = max(1, cores - math.ceil(load - 0.5))  # a core counts as busy once more than half of it is
    threads = max(1, free // max(1, processes))
    return ThreadChoice(threads=threads, reason=f"{cores} cores, {free} free (load {load:.1f}), "
                                                f"{processes} process{'es' if processes > 1 else ''} of this job")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def set_cpu_threads(requested: Optional[int]) -> ThreadChoice:
    """Choose and apply this process's torch thread count, and log it (one line)."""
    import torch

    choice = choose_cpu_threads(requested, cores=usable_cores(), load=os.getloadavg()[0],
                                processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                omp_env=os.environ.get("OMP_NUM_THREADS"))
    torch.set_num_threads(choice.threads)
    how = "" if choice.reason == "run.cpu_threads" else "; run.cpu_threads sets it"
    log.info("CPU threads: %d per process (%s%s)", choice.threads, choice.reason, how)
    return choice
