"""Liveness: every rank beats in the c10d store, and every rank checks that all the others still beat.

Invariant: a rank whose beat counter has not moved for `timeout_s`, as measured on the checking rank's own
clock (no clock is compared across machines), is silent: the first rank to see it records the failure in
the store under the silent rank's number, and every rank then ends (`AbortWatchdog`), the summary naming
it. The beat comes from a daemon thread, so the main thread's long pauses (a checkpoint, an evaluation, a
compile) do not stop it; a frozen (SIGSTOP), swapped-out or killed process does. A rank that finished its
part says so, and is not checked any more.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Optional

from dflash_trainer.runtime.control import ControlPlane


class Liveness:
    def __init__(self, control: ControlPlane, *, rank: int, world_size: int, timeout_s: float) -> None:
        self.control = control
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.interval_s = min(2.0, timeout_s / 5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"liveness-{rank}", daemon=True)
        self._reported = False

    def start(self) -> "Liveness":
        self.control.set_value(f"proc/{self.rank}", json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        self.control.beat()
        self._thread.start()
        return self

    def finish(self) -> None:
        """This rank's part is over: the others stop checking it."""
        self._stop.set()
        try:
            self.control.set_value(f"finished/{self.rank}", "1")
        except Exception:  # the store may be gone while the job is ending
            pass


    def _run(self) -> None:
        others = [r for r in range(self.world_size) if r != self.rank]
        seen = {r: (-1, time.monotonic()) for r in others}  # rank -> (beats, when that count was first seen)
        while not self._stop.wait(self.interval_s):
            try:
                self.control.beat()
                now = time.monotonic()
                for r in others:
                    if self.control.has_value(f"finished/{r}"):
                        continue
                    beats = self.control.beats(r)
                    if beats != seen[r][0]:
                        seen[r] = (beats, now)
                    elif now - seen[r][1] > self.timeout_s and not self._reported:
                        self._reported = True
                        self.control.abort(
                            f"rank {r} stopped answering: no heartbeat for {now - seen[r][1]:.0f}s (frozen, stopped or "
                            f"killed; pipeline.liveness_timeout_s={self.timeout_s:g})", rank=r)
            except Exception:  # the store is gone: the job is ending, the failure is reported elsewhere
                return

    def gone_peers(self) -> list[int]:
        """Peers on this host whose process no longer exists: killed without a word (SIGKILL, the OOM killer),
        which is why torchrun sends the others SIGTERM."""
        gone = []
        host = socket.gethostname()
        for r in range(self.world_size):
            if r == self.rank or self.control.has_value(f"finished/{r}"):
                continue
            try:
                proc = json.loads(self.control.wait_value(f"proc/{r}")) if self.control.has_value(f"proc/{r}") else None
            except Exception:  # the store is gone
                proc = None
            if proc is not None and proc["host"] == host and not _alive(proc["pid"]):
                gone.append(r)
        return gone


def _alive(pid: int) -> Optional[bool]:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (dead, not yet reaped by torchrun) still answers kill(0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
