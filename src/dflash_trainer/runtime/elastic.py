"""Restarts under `torchrun --max-restarts N`: a relaunched incarnation continues the same run by itself.

torchrun's agent relaunches every worker of the job after a failure (a failure of one rank stops every rank,
`failures.py`), with the same command line. Its store outlives the workers: it is what tells a restart from a new
job, on every node alike (the agents' own restart counts can differ between nodes: an agent whose workers had not
failed yet restarts them without counting). Each rank counts its own starts there (`starts/rank<R>`), so every rank
of an incarnation knows its number; the process group and control plane of incarnation N live under their own key
prefix (`env.py`), away from the keys the incarnation before left in the same store.

Rank 0 records the run dir it claimed in the store (`run_dir`) and counts the incarnation in the run dir's
`.elastic.json` (how each earlier one ended, for `summary.json`'s `restarts`); the leader records each checkpoint it
writes (`checkpoint`), so that a restart that finds none of them stops instead of training the run again. Every rank of incarnation N > 1 reads
that run dir and continues it: from its newest intact checkpoint (`train.resume=latest`), or, when none was written
yet, from the start in the same dir (`train.overwrite=true`: the plan and outputs of the failed start are replaced).
A restart before rank 0 claimed a run dir starts as the first incarnation did. Without `--max-restarts` (or with 0)
nothing here applies: a run dir that holds a run is refused as before.

A rank that dies before it counts its start (while Python imports) leaves the counts unequal; the next incarnation's
ranks then wait for each other under different prefixes until `pipeline.timeout_s` and the job fails, named.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from dflash_trainer.errors import ConfigError
from dflash_trainer.rundir import RunDir, write_atomic
from dflash_trainer.train.checkpoint import list_checkpoints

log = logging.getLogger(__name__)

PREFIX = "dflash/elastic/"
"""This module's keys in torchrun's store (outside every incarnation's prefix: they outlive the workers)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ElasticJob:
    """This process's torchelastic job, when its agent may restart it (torchrun's environment)."""

    max_restarts: int
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    """torchrun's store, which the agent hosts and keeps across restarts."""


def elastic_job() -> Optional[ElasticJob]:
    """The torchelastic job from the environment, or None when not under torchrun or no restart is allowed."""
    env = os.environ
    max_restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if not env.get("TORCHELASTIC_RUN_ID") or max_restarts <= 0:
        return None
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise ConfigError(
            "torchrun --max-restarts without the agent's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1?): every restart "
            "would get a new store, and a relaunched job could not tell a restart from a new run. Unset it, or "
            "launch without --max-restarts and continue a failed run with --resume"
        )
    return ElasticJob(max_restarts=max_restarts, rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                      master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class Incarnation:
    """This process's place in the job's incarnations."""

    number: int
    """1 in the job's first incarnation, 2 after one restart, ..."""
    store: dist.Store
    """torchrun's store, unprefixed (it holds every incarnation's keys)."""
    max_restarts: int

    @property
    def prefix(self) -> str:
        """The key prefix of this incarnation's process group and control plane."""
        return f"dflash/incarnation-{self.number}"

    def earlier_run_dir(self) -> Optional[Path]:
        """The run dir an earlier incarnation's rank 0 claimed, or None (the first incarnation, or a restart before
        any claim)."""
        key = PREFIX + "run_dir"
        if self.number == 1 or not self.store.check([key]):
            return None
        return Path(self.store.get(key).decode())

    def record_run_dir(self, run_dir: Path) -> None:
        """Rank 0, once it claimed the run dir (and wrote the job's token into it): where a later incarnation finds
        the run."""
        self.store.set(PREFIX + "run_dir", str(Path(run_dir).resolve()))

    def record_checkpoint(self, step: int) -> None:
        """The leader, once checkpoint `step` is written: a later incarnation that finds none of the run's checkpoints
        knows the run had some (`check_continues`)."""
        self.store.set(PREFIX + "checkpoint", str(step))

    def recorded_checkpoint(self) -> Optional[int]:
        """The newest checkpoint step an incarnation of this job wrote, or None."""
        key = PREFIX + "checkpoint"
        return int(self.store.get(key).decode()) if self.store.check([key]) else None

    def job_token(self) -> str:
        """A random token naming this job, the same in every incarnation (the first to ask makes it): written into
        the run dir's restart record, it tells the run a restart continues from a run dir deleted or replaced
        between incarnations."""
        made = uuid.uuid4().hex
        return self.store.compare_set(PREFIX + "job_token", "", made).decode()

    def check_continues(self, run_dir: Path) -> None:
        """Every rank of a later incarnation, before it continues `run_dir`: the run dir must still be the run an
        earlier incarnation claimed (its marker, and its restart record naming this job), or the job stops, naming
        what changed, rather than train a new run from scratch and end as if nothing happened."""
        layout, gone = RunDir(run_dir), None
        if not layout.root.is_dir():
            gone = "is gone"
        elif not layout.is_marked():
            gone = f"is no longer a run (no {layout.marker.name})"
        elif _read_marker(run_dir).get("job") != self.job_token():
            gone = (f"was replaced: its {layout.restarts.name} does not name this job (another run, or the run "
                    "deleted and made again)")
        elif (saved := self.recorded_checkpoint()) is not None and not list_checkpoints(run_dir):
            gone = (f"holds none of its checkpoints (an earlier incarnation wrote step_{saved} in "
                    f"{layout.checkpoints}): they were deleted or moved")
        if gone is not None:
            raise ConfigError(
                f"torchrun restarted the job (incarnation {self.number}), but the run it was continuing, {run_dir}, "
                f"{gone}: stopping instead of training a new run there from scratch. Put the run dir back, or start "
                "a new job (another run.dir, or --resume on a run dir that holds a checkpoint)")


def count_start(store: dist.Store, rank: int, max_restarts: int) -> Incarnation:
    """Count this rank's start in the store: its incarnation."""
    return Incarnation(number=int(store.add(f"{PREFIX}starts/rank{rank}", 1)), store=store, max_restarts=max_restarts)


_THIS: Optional[Incarnation] = None


def this_incarnation(timeout_s: float = 300.0) -> Optional[Incarnation]:
    """This process's incarnation (its start counted once, on first use), or None when restarts are off."""
    global _THIS
    job = elastic_job()
    if job is None:
        return None
    if _THIS is None:
        store = dist.TCPStore(job.master_addr, job.master_port, job.world_size, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        _THIS = count_start(store, job.rank, job.max_restarts)
    return _THIS


def continuation(run_dir: Path) -> list[str]:
    """The overrides that continue a run in `run_dir` (module docstring)."""
    if list_checkpoints(run_dir):
        return ["train.resume=latest", f"run.dir={run_dir}"]
    return [f"run.dir={run_dir}", "train.overwrite=true"]


def _read_marker(run_dir: Path) -> dict:
    """`RUN/.elastic.json`, or {} when there is none yet or it is damaged (a warning names it: the restarts it
    counted are then missing from the summary, and the next incarnation writes it anew)."""
    path = RunDir(run_dir).restarts
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        log.warning("ignoring the damaged restart record %s (%s: %s): the earlier restarts it counted are left out; "
                    "it is written anew at the next restart", path, type(e).__name__, e)
        return {}
    if not isinstance(record, dict):
        log.warning("ignoring the damaged restart record %s (a JSON %s, not the object we write)", path,
                    type(record).__name__)
        return {}
    return record


def set_aside_summary(incarnation: Incarnation, run_dir: Path) -> None:
    """Rank 0 of a later incarnation, before it claims the run dir (whose `train.overwrite` would delete it): move the
    summary the incarnation before left to `summary-incarnation-N.json`, where `record_incarnation` reads how it
    ended, and where the next restart will not mistake it for this incarnation's."""
    try:
        RunDir(run_dir).summary.replace(_summary_of(run_dir, incarnation.number - 1))
    except OSError:
        pass  # none written: its ranks were killed before they could


def record_incarnation(incarnation: Incarnation, run_dir: Path) -> None:
    """Rank 0, once the run dir is claimed: record it in the store, and count this incarnation in
    `RUN/.elastic.json` with how the one before it ended (read from the summary it left)."""
    earlier = []
    if incarnation.number > 1:  # (an incarnation that failed before its claim is missing from the record)
        earlier = list(_read_marker(run_dir).get("earlier", [])) + [_ended(run_dir, incarnation.number - 1)]
    record = {"incarnation": incarnation.number, "job": incarnation.job_token(), "earlier": earlier}
    write_atomic(RunDir(run_dir).restarts, json.dumps(record, indent=1) + "\n")
    incarnation.record_run_dir(run_dir)  # after the record: a restart that finds the run dir finds the job's token
    if earlier:
        log.warning("torchrun restart %d of at most %d: continuing %s (the incarnation before ended %s)",
                    incarnation.number - 1, incarnation.max_restarts, run_dir, _describe(earlier[-1]))


def recorded_restarts(run_dir: Path) -> dict:
    """What a run's summary says of its restarts (`restarts`): how many, and how each earlier incarnation ended (its
    status and, when it failed, the rank and cause it named; `unknown` when it wrote none: every rank killed)."""
    earlier = list(_read_marker(run_dir).get("earlier", []))
    return {"count": len(earlier), "earlier": earlier}


def _summary_of(run_dir: Path, number: int) -> Path:
    return RunDir(run_dir).summary.with_name(f"summary-incarnation-{number}.json")


def _ended(run_dir: Path, number: int) -> dict:
    """How incarnation `number` ended, from the summary it left (`set_aside_summary`)."""
    try:
        summary = json.loads(_summary_of(run_dir, number).read_text())
    except (OSError, ValueError):
        summary = None
    if not isinstance(summary, dict):
        return {"incarnation": number, "status": "unknown"}
    keys = ("status", "failed_rank", "cause", "steps")
    return {"incarnation": number, **{k: summary[k] for k in keys if k in summary}}


def _describe(ended: dict) -> str:
    if ended.get("status") == "failed":
        return f"failed on rank {ended.get('failed_rank')}: {ended.get('cause')}"
    return f"with status {ended.get('status')} (no cause recorded: its ranks were killed)"
