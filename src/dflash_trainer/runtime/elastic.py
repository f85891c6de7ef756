"""Restarts under `torchrun --max-restarts N`: a relaunched incarnation continues the same run by itself.

torchrun's agent relaunches every worker of the job after a failure, with the same command line, the same
`TORCHELASTIC_RUN_ID` (`none` unless `--rdzv-id` names one) and `TORCHELASTIC_RESTART_COUNT` one higher. A failure of
one rank stops every rank of the job (`failures.py`), so every node's agent counts the restart alike; the process
group and the control plane of each incarnation are keyed by that count (`env.py`), away from what the incarnation
before left in torchrun's store.

The first incarnation's rank 0 writes the run's `.elastic.json` (`RUN/.elastic.json`: the run id, the incarnations
so far and how each earlier one ended), and for a run dir it named itself (`runs/<name>-<time>`) a pointer
`runs/.elastic/<run id>` to it. Every rank of a restarted incarnation (count > 0) finds the run dir (`run.dir`, or
the pointer) holding its run id and continues it: from its newest intact checkpoint (`train.resume=latest`), or,
when none was written yet, from the start in the same dir (`train.overwrite=true`: the plan and the outputs of the
failed start are replaced). The decision reads only files rank 0 wrote before any rank could start training, so all
ranks of an incarnation decide alike. Without `--max-restarts` (or with 0), and in a job's first incarnation, nothing
here applies: a run dir that holds a run is refused as before.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dflash_trainer.rundir import RunDir, write_atomic

log = logging.getLogger(__name__)

MARKER = ".elastic.json"
"""The run dir's record of the torchelastic job that trains it."""
POINTERS = Path("runs") / ".elastic"
"""Where a job that named its own run dir (`runs/<name>-<time>`) leaves the way back to it, per run id."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ElasticJob:
    """This process's torchelastic job, when its agent may restart it."""

    run_id: str
    """TORCHELASTIC_RUN_ID: the same for every worker of the job, in every incarnation."""
    max_restarts: int
    restart_count: int
    """This node's agent's count (0 on a node whose workers did not fail)."""


def elastic_job() -> Optional[ElasticJob]:
    """The torchelastic job from the environment, or None when not under torchrun or no restart is allowed."""
    run_id, max_restarts = os.environ.get("TORCHELASTIC_RUN_ID"), os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    if not run_id or not max_restarts or int(max_restarts) <= 0:
        return None
    return ElasticJob(run_id=run_id, max_restarts=int(max_restarts),
                      restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def _read_marker(run_dir: Path) -> Optional[dict]:
    try:
        record = json.loads((run_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def run_dir_of(job: ElasticJob, run_dir: Optional[str]) -> Optional[Path]:
    """The run dir an earlier incarnation of this job trained: `run_dir` (the config's) when it holds this job's
    record, else the pointer's; None in the first incarnation, or when the one before died before it claimed one."""
    if job.restart_count == 0:
        return None
    candidates = [Path(run_dir).expanduser()] if run_dir else []
    try:
        candidates.append(Path((POINTERS / job.run_id).read_text().strip()))
    except OSError:
        pass
    for path in candidates:
        record = _read_marker(path)
        if record is not None and record.get("run_id") == job.run_id:
            return path
    return None


def continuation(job: ElasticJob, run_dir: Path) -> list[str]:
    """The overrides that continue the job's run in `run_dir` (module docstring)."""
    layout = RunDir(run_dir)
    if any((p / "COMPLETE").is_file() for _, p in layout.checkpoint_dirs()):
        return ["train.resume=latest", f"run.dir={run_dir}"]
    return [f"run.dir={run_dir}", "train.overwrite=true"]


def record_incarnation(job: ElasticJob, run_dir: Path, *, named_by_us: bool) -> None:
    """Rank 0, once the run dir is claimed: count this incarnation in `RUN/.elastic.json` with how the one before it
    ended (read from the summary it left), and point `runs/.elastic/<run id>` at a run dir it named itself."""
    record = _read_marker(run_dir)
    earlier: list[dict] = []
    if record is not None and record.get("run_id") == job.run_id:
        before = list(record.get("earlier", []))
        earlier = before + [_ended(run_dir, len(before) + 1)]
    write_atomic(run_dir / MARKER, json.dumps({"run_id": job.run_id, "incarnations": len(earlier) + 1,
                                               "earlier": earlier}, indent=1) + "\n")
    if named_by_us:
        POINTERS.mkdir(parents=True, exist_ok=True)
        write_atomic(POINTERS / job.run_id, str(run_dir.resolve()) + "\n")
    if earlier:
        log.warning("torchrun restart %d of at most %d: continuing %s (the incarnation before ended %s)",
                    len(earlier), job.max_restarts, run_dir, _describe(earlier[-1]))


def recorded_restarts(run_dir: Path) -> dict:
    """What a run's summary says of its restarts (`restarts`): how many, and how each earlier incarnation ended (its
    status and, when it failed, the rank and cause it named; `unknown` when it wrote none: every rank killed)."""
    record = _read_marker(run_dir) or {}
    earlier = list(record.get("earlier", []))
    return {"count": len(earlier), "earlier": earlier}


def set_aside_summary(job: ElasticJob, run_dir: Path) -> None:
    """Rank 0 of a later incarnation, before it claims the run dir (whose `train.overwrite` would delete it): move the
    summary the incarnation before left to `summary-incarnation-N.json`, where `record_incarnation` reads how it
    ended, and where the next restart will not mistake it for this incarnation's."""
    record = _read_marker(run_dir) or {}
    number = int(record.get("incarnations", 1))
    path = RunDir(run_dir).summary
    try:
        path.replace(_summary_of(run_dir, number))
    except OSError:
        pass  # none written: its ranks were killed before they could


def _summary_of(run_dir: Path, number: int) -> Path:
    return RunDir(run_dir).summary.with_name(f"summary-incarnation-{number}.json")


def _ended(run_dir: Path, number: int) -> dict:
    """How incarnation `number` ended, from the summary it left (`set_aside_summary`)."""
    try:
        summary = json.loads(_summary_of(run_dir, number).read_text())
    except (OSError, ValueError):
        return {"incarnation": number, "status": "unknown"}
    if not isinstance(summary, dict):
        return {"incarnation": number, "status": "unknown"}
    keys = ("status", "failed_rank", "cause", "steps")
    return {"incarnation": number, **{k: summary[k] for k in keys if k in summary}}


def _describe(ended: dict) -> str:
    if ended.get("status") == "failed":
        return f"failed on rank {ended.get('failed_rank')}: {ended.get('cause')}"
    return f"with status {ended.get('status')} (no cause recorded: its ranks were killed)"
