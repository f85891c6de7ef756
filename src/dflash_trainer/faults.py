"""Fault injection for the multi-process tests (TEST-ONLY: inert unless DFLASH_TEST_FAULT is set).

`DFLASH_TEST_FAULT` holds comma-separated rules `STAGE:ARG` or `STAGE:ARG@RANK` (only on global rank RANK):

- `target_forward:N`  raise in the target forward of this rank's N-th job (1-based, split or colocated)
- `sender:N`          raise in the target's sender thread when shipping its N-th batch
- `receiver:N`        raise in a drafter's receiver thread when receiving its N-th batch
- `drafter_step:N`    raise in the drafter before optimizer step N (global step count, resume included)
- `kill:N`            SIGKILL this process once optimizer step N is done (and checkpointed, when due)
- `kill_job:N`        SIGKILL the whole job after step N: torchrun's agent (this rank's parent) and every rank
- `wipe_run:N`        delete the run dir, then SIGKILL this process, once step N is done (a run dir lost between
                      torchrun's restarts)
- `wipe_checkpoints:N` the same with the run dir's checkpoints/ only (a run whose checkpoints were lost)
- `die_before_join:1` SIGKILL this rank just before it joins the process group (killed while it starts)
- `delay_target:S`    sleep S seconds in every target forward (a slow producer)
- `delay_drafter:S`   sleep S seconds before every drafter optimizer step (a slow consumer)
- `nan_batch:J`       the taps of job id J (or of every job: `nan_batch:all`) are NaN, written by the target
- `local_run_dir:1`   this rank looks for the run dir where a node without its shared storage would: an empty folder

`DFLASH_TEST_FAULT_RESTART=K` applies the rules only in the job's K-th restart (`TORCHELASTIC_RESTART_COUNT`; 0:
the first incarnation), so that a relaunched incarnation runs clean (tests of `torchrun --max-restarts`).

Call sites use `maybe_fault(stage, index)` (raise, kill or sleep) and `inject_nan(job_id)`; `index=None`
counts this process's calls of the stage (1-based).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import threading
import time
from typing import Optional

ENV = "DFLASH_TEST_FAULT"
RAISE_STAGES = ("target_forward", "sender", "receiver", "drafter_step")
DELAY_STAGES = {"target_forward": "delay_target", "drafter_step": "delay_drafter"}

_counts: dict[str, int] = {}
_lock = threading.Lock()


class InjectedFault(RuntimeError):
    """Raised by a DFLASH_TEST_FAULT rule."""


@functools.lru_cache(maxsize=8)
def _parse(spec: str) -> dict[str, str]:
    rules: dict[str, str] = {}
    rank = os.environ.get("RANK", "0")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        stage, _, arg = item.partition(":")
        arg, _, only_rank = arg.partition("@")
        if only_rank and only_rank != rank:
            continue
        rules[stage] = arg
    return rules


def _rules() -> dict[str, str]:
    spec = os.environ.get(ENV)
    only_in = os.environ.get(f"{ENV}_RESTART")
    if only_in is not None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != only_in:
        return {}
    return _parse(spec) if spec else {}


def maybe_fault(stage: str, index: Optional[int] = None, *, run_dir: Optional[str] = None) -> None:
    """Apply the rules for `stage` (one of RAISE_STAGES, or `kill` / `kill_job` / `wipe_run` after a step, which
    gets the `run_dir`)."""
    rules = _rules()
    if not rules:
        return
    if stage == "wipe_run" and run_dir:
        for rule, wiped in (("wipe_run", run_dir), ("wipe_checkpoints", os.path.join(run_dir, "checkpoints"))):
            if rules.get(rule) is not None and int(rules[rule]) == index:
                shutil.rmtree(wiped, ignore_errors=True)
                os.kill(os.getpid(), signal.SIGKILL)
    if index is None:
        with _lock:
            _counts[stage] = index = _counts.get(stage, 0) + 1
    delay = rules.get(DELAY_STAGES.get(stage, ""))
    if delay:
        time.sleep(float(delay))
    arg = rules.get(stage)
    if arg is None or int(arg) != index:
        return
    if stage in ("kill", "die_before_join"):
        os.kill(os.getpid(), signal.SIGKILL)
    if stage == "kill_job":
        kill_tree(os.getppid())
    raise InjectedFault(f"injected fault ({ENV}): {stage} #{index} on rank {os.environ.get('RANK', '0')}")


def applies(stage: str) -> bool:
    """Whether a rule for `stage` applies to this rank (a fault that changes what the rank sees, not one it raises)."""
    return stage in _rules()


def inject_nan(job_id: int) -> bool:
    """Whether the taps of `job_id` should be overwritten with NaN."""
    arg = _rules().get("nan_batch")
    return arg is not None and (arg == "all" or int(arg) == job_id)


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, parents before children (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and all its descendants (torchrun starts each rank in its own session, so a process
    group kill does not reach them); the calling process, if among them, goes last."""
    me = os.getpid()
    tree = [pid, *descendants(pid)]
    for p in tree:
        if p != me:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if me in tree:
        os.kill(me, signal.SIGKILL)
