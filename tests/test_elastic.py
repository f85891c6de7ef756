"""Restarts under `torchrun --max-restarts` (`runtime/elastic.py`): a relaunched incarnation continues the run by
itself, from its last checkpoint, each job committed once; without restarts allowed nothing changes."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
from pipeline_helpers import assert_ok, checkpoints, committed_jobs, ledger, metrics, planned_jobs, torchrun

from dflash_trainer.runtime import elastic
from dflash_trainer.runtime.elastic import (
    continuation,
    elastic_job,
    record_incarnation,
    recorded_restarts,
    run_dir_of,
    set_aside_summary,
)

SPLIT_1_2 = ("pipeline.colocated=false", "pipeline.num_targets=1", "train.checkpoint_interval=2")
COLOCATED = ("pipeline.colocated=true", "train.checkpoint_interval=2")


@pytest.mark.parametrize("nproc,layout,fault", [
    (3, SPLIT_1_2, "kill:3@2"),  # a drafter rank of a split job
    (2, COLOCATED, "kill:3@0"),  # rank 0: the run dir's claim holder, target and drafter
], ids=["split-drafter-rank", "colocated-rank-0"])
def test_a_killed_rank_restarts_the_job_and_the_run_continues_from_its_checkpoint(tmp_path, nproc, layout, fault):
    """Under `--max-restarts 1` (torchrun's default static rendezvous), one rank is killed with SIGKILL after step 3
    (checkpoint at 2) in the first incarnation only. torchrun relaunches every rank with the same command; the new
    incarnation resumes the run from step_2 with no flag, trains it to the end with every planned job committed
    once, and says so in its log and summary."""
    run_dir = tmp_path / "run"
    launch = torchrun(run_dir, nproc, *layout, fault=fault, fault_restart=0, max_restarts=1, timeout_s=240)
    s = assert_ok(launch)
    assert "torchrun restarted the job" in launch.output and "continuing" in launch.output
    assert s["restarts"]["count"] == 1
    earlier = s["restarts"]["earlier"]
    assert len(earlier) == 1 and earlier[0]["incarnation"] == 1 and earlier[0]["status"] in ("failed", "unknown")
    rows = [r for r in metrics(run_dir) if "jobs" in r]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)) and steps == sorted(steps)  # the killed run's rows past step 2 are replaced
    committed = committed_jobs(rows)
    plan = planned_jobs(run_dir)
    assert not [j for j, n in Counter(committed).items() if n > 1] and sorted(committed) == sorted(plan)
    assert sorted(ledger(checkpoints(run_dir)[-1])) == sorted(plan)  # every planned job committed, once
    assert sum(s["jobs_trained"].values()) == len(plan) and s["jobs_duplicated"] == 0
    record = json.loads((run_dir / elastic.MARKER).read_text())
    assert record["incarnations"] == 2


@pytest.fixture
def job(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the pointers live in ./runs/.elastic
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    return elastic_job()


def test_without_restarts_allowed_nothing_applies(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert elastic_job() is None  # not under torchrun
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # torchrun's default
    assert elastic_job() is None


def test_a_later_incarnation_finds_its_run_and_how_to_continue_it(job, tmp_path):
    named = tmp_path / "runs" / "demo-20261205-000000"
    named.mkdir(parents=True)
    assert run_dir_of(job, None) is None  # the first incarnation: nothing recorded yet
    record_incarnation(job, named, named_by_us=True)
    assert recorded_restarts(named) == {"count": 0, "earlier": []}
    assert run_dir_of(job, None) is None  # a first incarnation never continues (torchrun's run id is often `none`)
    restarted = dataclasses.replace(job, restart_count=1)
    # a relaunch with the same command line (no run.dir: the name was chosen) finds it through the pointer
    assert run_dir_of(restarted, None) == named.resolve()
    assert continuation(job, named) == [f"run.dir={named}", "train.overwrite=true"]  # no checkpoint yet
    (named / "checkpoints" / "step_2").mkdir(parents=True)
    assert continuation(job, named) == [f"run.dir={named}", "train.overwrite=true"]  # a checkpoint being written
    (named / "checkpoints" / "step_2" / "COMPLETE").write_text("{}")
    assert continuation(job, named) == ["train.resume=latest", f"run.dir={named}"]
    # how the first incarnation ended travels into the second's record (its summary set aside first)
    (named / "summary.json").write_text(json.dumps({"status": "failed", "failed_rank": 2, "cause": "KeyError: x"}))
    set_aside_summary(job, named)
    assert not (named / "summary.json").exists() and (named / "summary-incarnation-1.json").is_file()
    record_incarnation(restarted, named, named_by_us=False)
    assert recorded_restarts(named) == {"count": 1, "earlier": [{"incarnation": 1, "status": "failed",
                                                                 "failed_rank": 2, "cause": "KeyError: x"}]}
    record_incarnation(restarted, named, named_by_us=False)  # the second was killed before it wrote a summary
    assert [e["status"] for e in recorded_restarts(named)["earlier"]] == ["failed", "unknown"]


def test_another_jobs_run_is_not_continued(job, tmp_path, monkeypatch):
    """A run dir that holds another torchelastic job's run (another run id) is not this job's to continue: the
    run dir rules apply (refused without --resume or --overwrite)."""
    given = tmp_path / "given"
    given.mkdir()
    record_incarnation(job, given, named_by_us=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert run_dir_of(elastic_job(), str(given)) == given
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")
    assert run_dir_of(elastic_job(), str(given)) is None
