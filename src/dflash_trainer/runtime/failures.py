"""Fail fast: any exception on any rank ends the whole job within seconds, with that rank's traceback.

The failing rank records its cause in the store (the abort flag), prints its traceback once, writes the
torchrun error file, and leaves with `os._exit` (threads or NCCL kernels can never hold it). A watchdog
thread on every rank polls the abort flag and leaves the same way; torchrun's agent ends whoever is left.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Callable, Optional

from dflash_trainer.errors import ConfigError, DataError, StorageError
from dflash_trainer.runtime.control import AbortInfo, ControlPlane

EXIT_FAILED = 1
EXIT_NAMED = 2
"""The exit status of a named mistake (bad config, data, storage), as `dflash-train` gives it in one process."""
NAMED_ERRORS = (ConfigError, DataError, StorageError)


def exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def fail_rank(control: Optional[ControlPlane], rank: int, error: BaseException, *, on_fail: Callable[[str], None] = lambda cause: None) -> None:
    """Record `error` as this rank's failure and end the process."""
    cause = f"{type(error).__name__}: {error}"
    if control is not None:
        control.abort(cause)
    named = isinstance(error, NAMED_ERRORS)
    if named:  # a mistake the message names with its fix: one line, as one process prints it, and its exit status
        if not said_by_another(control.aborted() if control is not None else None, rank, error):
            print(f"[rank {rank}] dflash-train train: error: {error}", file=sys.stderr, flush=True)
    else:
        tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        print(f"[rank {rank}] failed: {cause}\n{tb}", file=sys.stderr, flush=True)
    try:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        if isinstance(error, Exception) and not named:  # the error file holds a traceback: none for a named mistake
            get_error_handler().record_exception(error)
    except Exception:
        pass
    try:
        on_fail(cause)
    except Exception:
        pass
    exit_now(EXIT_NAMED if named else EXIT_FAILED)


def said_by_another(first: Optional[AbortInfo], rank: int, error: BaseException) -> bool:
    """Whether the job's first failure is this same mistake found by another rank (every rank of a node reads the
    same config): that rank prints it, and the user reads it once."""
    return first is not None and first.rank != rank and first.cause == f"{type(error).__name__}: {error}"


def record_failure_before_join(error: BaseException, *, timeout_s: float = 10.0) -> Optional[AbortInfo]:
    """Under torchrun, a rank that fails before its control plane exists (its config, its device): record the failure
    in the job's store as `fail_rank` does, so that the ranks already waiting for this one to join the process group
    stop with its cause (their `AbortWatchdog`) instead of waiting out pipeline.timeout_s. Returns the job's first
    failure (None when the store cannot be reached). Never raises: the error itself is what the caller reports."""
    from dflash_trainer.runtime.env import control_store, dist_env

    env = dist_env()
    if not env.distributed:
        return None
    try:
        store = control_store(env, timeout_s)
        if store is None:  # the job's store is rank 0's and exists only once it joins
            return None
        control = ControlPlane(store, rank=env.rank)
        control.abort(f"{type(error).__name__}: {error}")
        return control.aborted()
    except Exception:  # the store is unreachable: the others end at their own timeouts
        return None


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "ProcessGroupNCCL", "NCCL error")


def is_secondary(error: BaseException, control: Optional[ControlPlane], rank: int) -> bool:
    """True when `error` is a consequence of another rank's failure: the abort flag names another rank, or
    the error (or one it was raised from) is a broken connection to a peer."""
    from dflash_trainer.runtime.control import Aborted

    if control is not None:
        info = control.aborted()
        if info is not None and info.rank != rank:
            return True
    seen = error
    while seen is not None:
        if isinstance(seen, Aborted) or any(marker in str(seen) for marker in _PEER_GONE):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def stop_after_peer_failure(control: Optional[ControlPlane], rank: int, error: BaseException, *, grace_s: float = 3.0) -> None:
    """End a rank whose error only follows another rank's failure, without claiming to be the cause: wait
    `grace_s` so torchrun observes the failing rank first (its root cause), then exit non-zero."""
    info = control.aborted() if control is not None else None
    why = f"rank {info.rank} failed: {info.cause}" if info is not None else f"a peer rank is gone ({type(error).__name__}: {error})"
    print(f"[rank {rank}] stopping: {why}", file=sys.stderr, flush=True)
    time.sleep(grace_s)
    if control is not None and control.aborted() is None:  # a peer died without a word (kill -9)
        control.abort(f"a peer rank died; rank {rank} lost its connection ({type(error).__name__}: {error})")
    exit_now(EXIT_FAILED)


class StopWatch:
    """Daemon thread: polls `reason()` (why this rank must stop, or None); once it has one, prints it, calls
    `on_stop(reason)`, waits `grace_s` (so that a failing rank exits first: torchrun names it as the root cause) and
    ends the process."""

    def __init__(self, reason: Callable[[], Optional[str]], *, rank: int, name: str, poll_s: float,
                 grace_s: float, on_stop: Callable[[str], None] = lambda reason: None) -> None:
        self._reason = reason
        self._grace_s = grace_s
        self._rank = rank
        self._poll_s = poll_s
        self._on_stop = on_stop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-{rank}", daemon=True)

    def start(self) -> "StopWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            reason = self._reason()
            if reason is not None and not self._stop.is_set():
                print(f"[rank {self._rank}] stopping: {reason}", file=sys.stderr, flush=True)
                try:
                    self._on_stop(reason)
                except Exception:
                    pass
                time.sleep(self._grace_s)
                exit_now(EXIT_FAILED)


class AbortWatchdog(StopWatch):
    """When another rank has failed (the abort flag names it), print its cause once and end this process."""

    def __init__(self, control: ControlPlane, *, rank: int, poll_s: float = 0.25, grace_s: float = 2.0,
                 on_abort: Callable[[AbortInfo], None] = lambda info: None) -> None:
        def reason() -> Optional[str]:
            info = control.aborted()
            return f"rank {info.rank} failed: {info.cause}" if info is not None and info.rank != rank else None

        super().__init__(reason, rank=rank, name="abort-watchdog", poll_s=poll_s, grace_s=grace_s,
                         on_stop=lambda _: on_abort(control.aborted()))


def record_dead_peer(control: ControlPlane, gone_peers: Callable[[], list[int]]) -> None:
    """When no failure is recorded yet but a peer's process is gone (killed without a word), record that peer's
    death, so that the summary names it rather than this rank's consequence of it."""
    if control.aborted() is None:
        for rank in gone_peers()[:1]:
            control.abort(f"rank {rank} died without a word: its process is gone (killed: SIGKILL or the OOM killer; "
                          "torchrun's log names the signal)", rank=rank)


def first_failure(control: ControlPlane, gone_peers: Callable[[], list[int]], *, within_s: float = 3.0,
                  poll_s: float = 0.1) -> Optional[AbortInfo]:
    """The job's first failure, for a rank that failed because of another one: recorded in the store, or a peer on
    this host found dead (`record_dead_peer`); waits up to `within_s` for either. A broken connection can come
    first: the failing rank records its cause just after, and the kernel closes a killed process's sockets before
    the process is gone (then it still answers kill(0))."""
    deadline = time.monotonic() + within_s
    while True:
        record_dead_peer(control, gone_peers)
        info = control.aborted()
        if info is not None or time.monotonic() >= deadline:
            return info
        time.sleep(poll_s)


class StopSignals:
    """SIGTERM and SIGINT stop a run cleanly: the first asks every rank to stop after the current optimizer
    step (the step loop all-reduces the request), then the final checkpoint and `summary.json` (status
    `stopped`) are written and the process exits 128 + the signal. A second signal leaves at once.

    Under torchrun the agent also sends SIGTERM to the ranks left when one of them fails: when a peer's failure
    is recorded in the store, the signal is that failure's, not a stop, and the rank leaves at once.
    Install from the main thread (Python delivers signals there); `uninstall` gives the earlier handlers back when the
    run returns to a process that goes on (training called from Python: a later Ctrl-C interrupts it again).
    """

    def __init__(self, *, control: ControlPlane, on_failure: Callable[[int], None],
                 on_second: Callable[[int], None], gone_peers: Callable[[], list[int]] = lambda: []) -> None:
        """`on_failure(signum)`: a peer failed (records it and leaves); `on_second(signum)`: leave now;
        `gone_peers()`: peers whose process is gone (a SIGTERM then comes from torchrun after their death)."""
        self.control = control
        self.gone_peers = gone_peers
        self.on_failure = on_failure
        self.on_second = on_second
        self.signum: Optional[int] = None
        self._earlier: dict[int, object] = {}

    def install(self) -> "StopSignals":
        import signal

        for signum in (signal.SIGTERM, signal.SIGINT):
            self._earlier[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        import signal

        for signum, handler in self._earlier.items():
            signal.signal(signum, handler)
        self._earlier.clear()

    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum is not None else 0

    def _handle(self, signum, frame) -> None:
        import signal as signals

        record_dead_peer(self.control, self.gone_peers)
        if self.control.aborted() is not None:
            self.on_failure(signum)
        elif self.signum is not None:
            self.on_second(signum)
        else:
            self.signum = signum
            print(f"{signals.Signals(signum).name}: stopping after this step (final checkpoint and summary); "
                  "send it again to stop at once", file=sys.stderr, flush=True)
