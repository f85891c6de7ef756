"""Multi-process CPU runs (torchrun, gloo) of the split pipeline: exactly-once jobs, slow stages, bounded pools,
and the deterministic mode's loss equal to the loss computed inline."""

from __future__ import annotations

from collections import Counter

import torch
from pipeline_helpers import assert_ok, committed_jobs, inline_losses, metrics, planned_jobs, torchrun


def _assert_every_job_once(run_dir, summary) -> list[int]:
    planned = planned_jobs(run_dir)
    committed = committed_jobs(metrics(run_dir))
    dupes = [j for j, n in Counter(committed).items() if n > 1]
    assert not dupes, f"jobs committed twice: {dupes}"
    assert sorted(committed) == sorted(planned), (sorted(committed), sorted(planned))
    assert summary["jobs_planned"] == {"0": len(planned)}
    assert summary["jobs_trained"] == {"0": len(planned)}
    assert summary["jobs_duplicated"] == 0
    return committed


def test_one_target_two_drafters_slow_consumer(tmp_path):
    """1 target + 2 drafters, drafters slowed down (the producer is much faster than the consumers):
    every job is committed exactly once; each drafter's pool never holds more than its capacity (occupied
    slots are the only place batches live on a drafter, so this bounds drafter memory); the pools fill up
    and the target is throttled (it waits for a send slot: backpressure reaches the producer instead of a
    queue growing)."""
    run_dir = tmp_path / "run"
    launch = torchrun(run_dir, 3, "pipeline.colocated=false", "pipeline.num_targets=1", "pipeline.pool_capacity=3",
                      fault="delay_drafter:0.15")
    s = assert_ok(launch)
    _assert_every_job_once(run_dir, s)
    assert s["roles"] == ["target", "drafter", "drafter"]
    assert s["pool_capacity"] == 3
    assert s["pool_occupied_max"] == 3, s  # full: producer ahead of consumer ...
    assert s["pool_depth_max"] <= 3, s  # ... and never above capacity
    assert s["target_slot_wait_s"] > 0.2, s  # the target's forward blocked on backpressure


def test_two_targets_one_drafter_slow_target(tmp_path):
    """2 targets + 1 drafter, target rank 0 slowed down: every job is still committed exactly once, the fast
    target did most of them (jobs are pulled from the shared cursor, no per-target queue), and the pool stays
    within capacity."""
    run_dir = tmp_path / "run"
    launch = torchrun(run_dir, 3, "pipeline.colocated=false", "pipeline.num_targets=2", fault="delay_target:0.5@0")
    s = assert_ok(launch)
    _assert_every_job_once(run_dir, s)
    assert s["roles"] == ["target", "target", "drafter"]
    batches = s["target_batches"]
    assert batches["0"] + batches["1"] == len(planned_jobs(run_dir))
    assert batches["1"] > 2 * batches["0"], batches
    assert s["pool_occupied_max"] <= s["pool_capacity"] and s["pool_depth_max"] <= s["pool_capacity"], s


def test_tp2_target_group_feeds_a_drafter(tmp_path):
    """One target group of 2 ranks (tensor-parallel, gloo) + 1 drafter: the run ends ok with every job trained
    exactly once; the group is one target: only its leader pulls jobs, sends batches and reports (the member runs
    the same forwards in lockstep, else the sharded layers' all-reduces would never pair up)."""
    run_dir = tmp_path / "run"
    launch = torchrun(run_dir, 3, "pipeline.colocated=false", "pipeline.num_targets=1", "pipeline.target_parallel=2",
                      "eval.interval=0")
    s = assert_ok(launch)
    _assert_every_job_once(run_dir, s)
    assert s["roles"] == ["target", "target-member", "drafter"]
    assert s["target_batches"] == {"0": len(planned_jobs(run_dir))}


DETERMINISTIC = ("pipeline.colocated=false", "pipeline.num_targets=1", "pipeline.deterministic=true",
                 "train.grad_accum=1")


def test_deterministic_pipeline_loss_equals_inline_loss(tmp_path):
    """1 target + 1 drafter in deterministic mode: jobs are trained in plan order, and every step's loss
    equals the loss of the same steps replayed in this process with the target forward run inline (same
    seeds, no transport): hidden states arrive bit-exact and the drafter's randomness is keyed by job."""
    run_dir = tmp_path / "run"
    s = assert_ok(torchrun(run_dir, 2, *DETERMINISTIC))
    rows = metrics(run_dir)
    order = committed_jobs(rows)
    assert all(len(r["jobs"]) == 1 for r in rows)
    assert order == planned_jobs(run_dir)  # first in, first out
    assert s["jobs_trained"] == {"0": len(order)}
    inline = inline_losses(run_dir, DETERMINISTIC, order)
    piped = [r["loss"] for r in rows]
    assert len(inline) == len(piped)
    assert torch.allclose(torch.tensor(piped), torch.tensor(inline), rtol=1e-5, atol=1e-6), (piped, inline)
