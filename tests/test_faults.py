"""Fault tests (torchrun, gloo, CPU): an exception in any stage, or a rank killed with SIGKILL, ends the whole
job non-zero within a bound, and the output (and summary.json, when the failing rank could write it)
names the failing rank and its cause. Faults are injected with DFLASH_TEST_FAULT (faults.py)."""

from __future__ import annotations

import pytest
from pipeline_helpers import summary, torchrun

BOUND_S = 60.0
"""Start-up (imports, data) included: a hang would run into pipeline.timeout_s=60 plus start-up."""

SPLIT_1_1 = ("pipeline.colocated=false", "pipeline.num_targets=1")


@pytest.mark.parametrize(
    "fault, nproc, failing_rank, cause",
    [
        ("target_forward:3", 2, 0, "target_forward #3"),
        ("sender:2", 2, 0, "sender #2"),
        ("receiver:2", 2, 1, "receiver #2"),
        # a non-leader drafter of two: the other one waits in the step's all-reduce and must still end
        ("drafter_step:3@2", 3, 2, "drafter_step #3"),
    ],
    ids=["target_forward", "sender", "receiver", "drafter_step"],
)
def test_exception_in_a_stage_ends_the_job_with_its_cause(tmp_path, fault, nproc, failing_rank, cause):
    run_dir = tmp_path / "run"
    launch = torchrun(run_dir, nproc, *SPLIT_1_1, fault=fault, timeout_s=BOUND_S + 30)
    assert launch.returncode != 0
    assert launch.elapsed_s < BOUND_S, f"took {launch.elapsed_s:.0f}s"
    assert f"[rank {failing_rank}] failed: " in launch.output  # the failing rank's own report ...
    assert f"InjectedFault: injected fault (DFLASH_TEST_FAULT): {cause} on rank {failing_rank}" in launch.output
    assert "Traceback" in launch.output  # ... with its traceback
    root = launch.output.split("Root Cause (first observed failure):")[-1]
    assert cause in root, root[:2000]  # torchrun's error file names it too (or the abort it caused)
    s = summary(run_dir)
    assert s["status"] == "failed"
    assert s["failed_rank"] == failing_rank, s  # not a rank that merely stopped because of it
    assert cause in s["cause"], s


def test_sigkill_of_the_leader_drafter_ends_the_job(tmp_path):
    """kill -9 of the only drafter (the leader, which writes checkpoints and the summary) after step 3: the
    target, blocked in a send or waiting for credits, ends too, and torchrun names the killed rank."""
    run_dir = tmp_path / "run"
    launch = torchrun(run_dir, 2, *SPLIT_1_1, fault="kill:3@1", timeout_s=BOUND_S + 30)
    assert launch.returncode != 0
    assert launch.elapsed_s < BOUND_S, f"took {launch.elapsed_s:.0f}s"
    root = launch.output.split("Root Cause (first observed failure):")[-1]
    assert "rank      : 1 (local_rank: 1)" in root and "Signal 9 (SIGKILL)" in root, root[:2000]
    s = summary(run_dir)  # written by the surviving target: it found the killed rank's process gone
    assert s["status"] == "failed" and s["failed_rank"] == 1 and "died without a word" in s["cause"], s


def test_a_named_mistake_under_torchrun_reads_as_in_one_process(tmp_path):
    """A ConfigError found on a rank after torchrun started (here: two target ranks with pipeline.deterministic) is
    one line with the fix and exit status 2 from that rank, as in one process: no traceback of ours, and none in
    torchrun's report (its error file is not written for it)."""
    launch = torchrun(tmp_path / "run", 3, "pipeline.colocated=false", "pipeline.num_targets=2",
                      "pipeline.deterministic=true", timeout_s=120)
    assert launch.returncode != 0
    lines = [line for line in launch.output.splitlines() if "dflash-train train: error: pipeline.deterministic" in line]
    assert len(lines) == 1 and lines[0].startswith("[rank "), launch.output  # said once, by the rank that won
    assert "failed (exitcode: 2)" in launch.output
    assert "dflash_trainer.errors.ConfigError" not in launch.output and "] failed: ConfigError" not in launch.output


def test_a_mistake_every_rank_finds_before_it_joins_is_one_line(tmp_path):
    """Every rank refuses the same config before it joins the process group: the user reads the mistake once, from
    the rank that recorded it first, with the rank's label as once training started; every rank exits 2."""
    launch = torchrun(tmp_path / "run", 2, "pipeline.timeout_s=0", timeout_s=90)
    lines = [line for line in launch.output.splitlines() if "dflash-train train: error:" in line]
    assert len(lines) == 1, launch.output
    assert lines[0].startswith(("[rank 0] ", "[rank 1] ")) and "pipeline.timeout_s must be > 0" in lines[0]
    assert launch.output.count("exitcode  : 2") + launch.output.count("exitcode: 2") >= 2, launch.output
