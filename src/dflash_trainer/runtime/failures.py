"""Fail fast: any exception on any rank ends the whole job within seconds, with that rank's traceback.

The failing rank records its cause in the store (the abort flag), prints its traceback once, writes the
torchrun error file, and leaves with `os._exit` (threads or NCCL kernels can never hold it). A watchdog
thread on every rank polls the abort flag and leaves the same way; torchrun's agent ends whoever is left.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Callable, Optional

from dflash_trainer.runtime.control import ControlPlane

EXIT_FAILED = 1


def exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def fail_rank(control: Optional[ControlPlane], rank: int, error: BaseException, *, on_fail: Callable[[str], None] = lambda cause: None) -> None:
    """Record `error` as this rank's failure and end the process."""
    cause = f"{type(error).__name__}: {error}"
    if control is not None:
        control.abort(cause)
    tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    print(f"[rank {rank}] failed: {cause}\n{tb}", file=sys.stderr, flush=True)
    try:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        if isinstance(error, Exception):
            get_error_handler().record_exception(error)
    except Exception:
        pass
    try:
        on_fail(cause)
    except Exception:
        pass
    exit_now(EXIT_FAILED)


class AbortWatchdog:
    """Daemon thread: when another rank has failed, print its cause once and end this process."""

    def __init__(self, control: ControlPlane, *, rank: int, poll_s: float = 0.25, on_abort: Callable[[str], None] = lambda cause: None) -> None:
        self._control = control
        self._rank = rank
        self._poll_s = poll_s
        self._on_abort = on_abort
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"abort-watchdog-{rank}", daemon=True)

    def start(self) -> "AbortWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            info = self._control.aborted()
            if info is not None and info.rank != self._rank:
                msg = f"rank {info.rank} failed: {info.cause}"
                print(f"[rank {self._rank}] stopping: {msg}", file=sys.stderr, flush=True)
                try:
                    self._on_abort(msg)
                except Exception:
                    pass
                exit_now(EXIT_FAILED)
