"""Restarts under `torchrun --max-restarts` (`runtime/elastic.py`): a relaunched incarnation continues the run by
itself, from its last checkpoint, each job committed once; without restarts allowed nothing changes."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch.distributed as dist
from pipeline_helpers import assert_ok, checkpoints, committed_jobs, ledger, metrics, planned_jobs, torchrun

from dflash_trainer.errors import ConfigError
from dflash_trainer.rundir import RunDir
from dflash_trainer.runtime.elastic import (
    continuation,
    count_start,
    elastic_job,
    record_incarnation,
    recorded_restarts,
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
    assert json.loads(RunDir(run_dir).restarts.read_text())["incarnation"] == 2


def test_a_rank_killed_before_the_first_checkpoint_restarts_the_run_from_the_start(tmp_path):
    """Killed after step 1 with the first checkpoint due at step 2: the new incarnation finds no checkpoint, starts
    the run over in the same run dir (the earlier incarnation's outputs replaced, its summary kept aside), and trains
    every planned job once."""
    run_dir = tmp_path / "run"
    launch = torchrun(run_dir, 2, *COLOCATED, fault="kill:1@1", fault_restart=0, max_restarts=1, timeout_s=240)
    s = assert_ok(launch)
    assert "continuing" in launch.output and "from the start (no checkpoint yet)" in launch.output
    assert s["restarts"]["count"] == 1
    rows = [r for r in metrics(run_dir) if "jobs" in r]
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, len(steps) + 1))  # one series from step 1: the killed incarnation's rows are gone
    plan = planned_jobs(run_dir)
    committed = committed_jobs(rows)
    assert not [j for j, n in Counter(committed).items() if n > 1] and sorted(committed) == sorted(plan)
    assert sum(s["jobs_trained"].values()) == len(plan) and s["jobs_duplicated"] == 0


def test_without_restarts_allowed_nothing_applies(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert elastic_job() is None  # not under torchrun
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")  # torchrun's default
    assert elastic_job() is None
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # a store per restart: a restart looks like a new job
    with pytest.raises(ConfigError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        elastic_job()


def test_each_incarnation_counts_its_start_and_finds_the_run_an_earlier_one_claimed(tmp_path):
    store = dist.HashStore()  # stands for torchrun's store, which outlives the workers
    first = [count_start(store, rank, max_restarts=2) for rank in range(3)]
    assert {i.number for i in first} == {1} and first[0].earlier_run_dir() is None
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record_incarnation(first[0], run_dir)  # rank 0's claim
    assert recorded_restarts(run_dir) == {"count": 0, "earlier": []}
    second = [count_start(store, rank, max_restarts=2) for rank in (2, 0, 1)]  # any order
    assert {i.number for i in second} == {2} and len({i.prefix for i in second}) == 1
    assert second[1].prefix != first[0].prefix
    assert all(i.earlier_run_dir() == run_dir.resolve() for i in second)  # every rank continues the same run
    assert continuation(run_dir) == [f"run.dir={run_dir}", "train.overwrite=true"]  # no checkpoint yet
    (run_dir / "checkpoints" / "step_2").mkdir(parents=True)
    assert continuation(run_dir) == [f"run.dir={run_dir}", "train.overwrite=true"]  # a checkpoint being written
    (run_dir / "checkpoints" / "step_2" / "COMPLETE").write_text("{}")
    assert continuation(run_dir) == ["train.resume=latest", f"run.dir={run_dir}"]
    # how the first incarnation ended travels into the second's record (its summary set aside first)
    (run_dir / "summary.json").write_text(json.dumps({"status": "failed", "failed_rank": 2, "cause": "KeyError: x"}))
    set_aside_summary(second[1], run_dir)
    assert not (run_dir / "summary.json").exists() and (run_dir / "summary-incarnation-1.json").is_file()
    record_incarnation(second[1], run_dir)
    assert recorded_restarts(run_dir) == {"count": 1, "earlier": [{"incarnation": 1, "status": "failed",
                                                                   "failed_rank": 2, "cause": "KeyError: x"}]}
    third = count_start(store, 0, max_restarts=2)  # the second was killed before it wrote a summary
    record_incarnation(third, run_dir)
    assert [e["status"] for e in recorded_restarts(run_dir)["earlier"]] == ["failed", "unknown"]


def test_a_restart_before_any_claim_starts_as_the_first_incarnation_did():
    store = dist.HashStore()
    count_start(store, 0, max_restarts=1)  # incarnation 1 died before rank 0 claimed a run dir
    assert count_start(store, 0, max_restarts=1).earlier_run_dir() is None


def _restarted_run(tmp_path):
    """(the first incarnation, the second, the run dir the first claimed) of a job in a stand-in for torchrun's
    store."""
    store = dist.HashStore()
    first = count_start(store, 0, max_restarts=3)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".dflash-run").write_text("{}")
    record_incarnation(first, run_dir)
    return first, count_start(store, 0, max_restarts=3), run_dir


def test_a_restart_stops_when_the_run_it_continues_was_deleted_or_replaced(tmp_path):
    """Between incarnations the run dir is deleted, emptied, or replaced by another run at the same path: the restart
    names what changed and stops, instead of training a new run from scratch that ends `ok` as if nothing happened."""
    import shutil

    first, second, run_dir = _restarted_run(tmp_path)
    second.check_continues(second.earlier_run_dir())  # the same run: it continues
    assert second.job_token() == first.job_token()
    saved = (run_dir / ".elastic.json").read_text()
    (run_dir / ".dflash-run").unlink()
    with pytest.raises(ConfigError, match=r"incarnation 2\), but the run it was continuing, .* is no longer a run"):
        second.check_continues(run_dir)
    shutil.rmtree(run_dir)
    with pytest.raises(ConfigError, match="is gone: stopping instead of training a new run there from scratch"):
        second.check_continues(run_dir)
    run_dir.mkdir()  # another job's run at the same path
    (run_dir / ".dflash-run").write_text("{}")
    (run_dir / ".elastic.json").write_text(saved.replace(first.job_token(), "0" * 32))
    with pytest.raises(ConfigError, match="was replaced: its .elastic.json does not name this job"):
        second.check_continues(run_dir)
    (run_dir / ".elastic.json").unlink()  # a new run made by hand, no restart record
    with pytest.raises(ConfigError, match="was replaced"):
        second.check_continues(run_dir)


def test_a_restart_stops_when_the_run_it_continues_lost_its_checkpoints(tmp_path):
    """The run is there (marker, restart record), but the checkpoints an earlier incarnation wrote are gone: training
    it again from the start would end `ok` as if nothing happened. A run whose first incarnation failed before its
    first checkpoint continues from the start, as before."""
    first, second, run_dir = _restarted_run(tmp_path)
    second.check_continues(run_dir)  # no checkpoint written yet: it starts over, as before
    first.record_checkpoint(2)
    with pytest.raises(ConfigError, match=r"holds none of its checkpoints \(an earlier incarnation wrote step_2 in "):
        second.check_continues(run_dir)
    (run_dir / "checkpoints" / "step_2").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_2" / "COMPLETE").write_text("{}")
    second.check_continues(run_dir)
    assert second.recorded_checkpoint() == 2


def test_checkpoints_deleted_between_incarnations_stop_the_job_named(tmp_path):
    """Rank 0 deletes the run's checkpoints/ and dies after step 3 (checkpoint at 2) in the first incarnation: the
    restart says the checkpoints are gone and stops; nothing is trained again."""
    run_dir = tmp_path / "run"
    launch = torchrun(run_dir, 2, *COLOCATED, fault="wipe_checkpoints:3@0", fault_restart=0, max_restarts=1,
                      timeout_s=240)
    assert launch.returncode != 0, launch.output
    assert "holds none of its checkpoints (an earlier incarnation wrote step_2" in launch.output, launch.output[-4000:]
    assert not (run_dir / "checkpoints").exists()  # nothing trained again
    summary = run_dir / "summary.json"
    assert not summary.exists() or json.loads(summary.read_text())["status"] != "ok"


def test_a_run_dir_deleted_between_incarnations_stops_the_job_named(tmp_path):
    """Rank 0 deletes the run dir and dies after step 3 in the first incarnation: the restart finds the run gone and
    every rank stops with the reason; no new run is trained there and nothing ends `ok`."""
    run_dir = tmp_path / "run"
    launch = torchrun(run_dir, 2, *COLOCATED, fault="wipe_run:3@0", fault_restart=0, max_restarts=1, timeout_s=240)
    assert launch.returncode != 0, launch.output
    assert f"the run it was continuing, {run_dir.resolve()}, is gone: stopping" in launch.output
    assert not (run_dir / "summary.json").exists() and not (run_dir / "metrics.jsonl").exists()
