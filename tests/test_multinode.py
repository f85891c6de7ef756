"""Several nodes: two torchrun agents on localhost stand for two machines (`--nnodes 2 --node_rank 0/1`, a c10d
rendezvous, gloo), each node a target and two drafters, against one node running the same ranks."""

from __future__ import annotations

from collections import Counter

import pytest

from pipeline_helpers import assert_ok, checkpoints, committed_jobs, ledger, metrics, planned_jobs, torchrun

SPLIT = ("pipeline.colocated=false", "pipeline.num_targets=1", "train.checkpoint_interval=2")


def test_two_nodes_train_every_job_once_and_keep_hidden_states_inside_each_node(tmp_path):
    """Ranks 0-2 on node 0 and 3-5 on node 1 (target, drafter, drafter on each): every planned job trained once
    across both nodes, each target's batches only to its own node's drafters, one summary and one metrics series.
    Against one node running the same six ranks (2 targets, 4 drafters: the same global batch): the same tokens,
    each run as many steps as its busiest drafter had batches, the loss within tolerance."""
    two = tmp_path / "two-nodes"
    launch = torchrun(two, 3, *SPLIT, nnodes=2, timeout_s=240)
    s = assert_ok(launch)
    assert s["world_size"] == 6 and s["roles"] == ["target", "drafter", "drafter"] * 2
    sends = {int(t): {int(d): n for d, n in to.items()} for t, to in s["target_sends"].items()}
    assert set(sends) == {0, 3} and all(sum(to.values()) > 0 for to in sends.values())  # both nodes' targets worked
    assert set(sends[0]) <= {1, 2} and set(sends[3]) <= {4, 5}  # no batch crossed a node
    assert sum(n for to in sends.values() for n in to.values()) == sum(s["target_batches"].values())

    rows = [r for r in metrics(two) if "jobs" in r]
    plan = planned_jobs(two)
    committed = committed_jobs(rows)
    assert not [j for j, n in Counter(committed).items() if n > 1] and sorted(committed) == sorted(plan)
    assert sorted(ledger(checkpoints(two)[-1])) == sorted(plan)
    assert s["jobs_duplicated"] == 0 and sum(s["jobs_trained"].values()) == len(plan)
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps))  # one writer of the metrics: no step logged twice
    assert len(list(two.glob("summary*.json"))) == 1

    one = tmp_path / "one-node"
    s1 = assert_ok(torchrun(one, 6, "pipeline.colocated=false", "pipeline.num_targets=2",
                            "train.checkpoint_interval=2", timeout_s=240))
    assert s1["roles"] == ["target", "target", "drafter", "drafter", "drafter", "drafter"]
    assert s1["tokens_trained"] == s["tokens_trained"]
    # The store hands jobs to whichever target asks first, so one node's drafters may get more batches than the
    # other's; drafters step together until the last one runs dry: a run takes as many steps (grad_accum 1) as its
    # busiest drafter had batches, at least the batches over the four drafters.
    for summary in (s, s1):
        assert summary["steps"] == max(batches_per_drafter(summary).values())
        assert summary["steps"] >= -(-sum(summary["target_batches"].values()) // 4)
    assert abs(s1["final_loss"] - s["final_loss"]) <= 0.05 * s1["final_loss"]


def batches_per_drafter(summary: dict) -> Counter:
    """Batches each drafter rank received, over every target."""
    received = Counter()
    for to in summary["target_sends"].values():
        received.update({int(d): n for d, n in to.items()})
    return received


def test_a_rank_killed_on_one_node_restarts_both_nodes_and_the_run_continues(tmp_path):
    """Two nodes under `--max-restarts 1`: drafter rank 4 (node 1) is killed with SIGKILL after step 3 in the first
    incarnation. Both agents relaunch their ranks (node 0's may do so without counting a restart of its own); every
    rank of the new incarnation continues the run from step_2, and every planned job is trained once."""
    run_dir = tmp_path / "run"
    launch = torchrun(run_dir, 3, *SPLIT, nnodes=2, fault="kill:3@4", fault_restart=0, max_restarts=1, timeout_s=300)
    s = assert_ok(launch)
    assert "torchrun restarted the job" in launch.output and s["restarts"]["count"] == 1
    rows = [r for r in metrics(run_dir) if "jobs" in r]
    plan = planned_jobs(run_dir)
    committed = committed_jobs(rows)
    assert not [j for j, n in Counter(committed).items() if n > 1] and sorted(committed) == sorted(plan)
    assert sorted(ledger(checkpoints(run_dir)[-1])) == sorted(plan) and s["jobs_duplicated"] == 0


LIVENESS_S = 10.0
"""pipeline.liveness_timeout_s of the tests below: every rank of every node must stop within it of the failure."""


def assert_named_failure(launch, rank: int, message: str) -> None:
    """The job failed with `message` as one line from `rank`, the rank exited 2 (as `dflash-train` in one process),
    no other cause is named, and every node ended within the liveness timeout of the first."""
    assert launch.returncode != 0, launch.output[-4000:]
    lines = [line for line in launch.output.splitlines() if "dflash-train train: error:" in line]
    assert len(lines) == 1 and lines[0].startswith(f"[rank {rank}] dflash-train train: error: {message}"), \
        launch.output[-6000:]
    assert "exitcode  : 2" in launch.output and "stopped answering" not in launch.output, launch.output[-6000:]
    assert "dflash_trainer.errors.ConfigError" not in launch.output, launch.output[-6000:]
    assert max(launch.node_ended_s) - min(launch.node_ended_s) < LIVENESS_S, (launch.node_ended_s,
                                                                               launch.output[-6000:])


def test_a_node_whose_command_line_is_refused_ends_the_other_node_too(tmp_path):
    """Node 1's ranks refuse their config before they join the process group (its command line differs: a bad
    pipeline.timeout_s): one line from its rank with exit status 2, and node 0's rank, waiting for it to join, stops
    with it within the liveness timeout instead of waiting out its own pipeline.timeout_s (60 s here)."""
    launch = torchrun(tmp_path / "run", 1, f"pipeline.liveness_timeout_s={LIVENESS_S}", nnodes=2,
                      node_args=[[], ["pipeline.timeout_s=0"]], timeout_s=150)
    assert_named_failure(launch, 1, "pipeline.timeout_s must be > 0")
    assert "[rank 0] stopping: rank 1 failed: ConfigError: pipeline.timeout_s must be > 0" in launch.output


def test_a_node_that_does_not_see_the_run_dir_stops_every_node_named(tmp_path):
    """Node 1's rank looks for the run dir where a node without its shared storage would (`local_run_dir`: an empty
    folder of its own), does not find rank 0's token there and stops the run, named, after waiting pipeline.timeout_s
    (20 s here) for it. Meanwhile node 0's rank waits in torch's set-up of a process group for node 1: its heartbeat
    goes on (it is not named as silent), and it stops within the liveness timeout of node 1's error."""
    run_dir = tmp_path / "run"
    launch = torchrun(run_dir, 1, f"pipeline.liveness_timeout_s={LIVENESS_S}", "pipeline.timeout_s=20", nnodes=2,
                      fault="local_run_dir:1@1", timeout_s=150)
    assert_named_failure(launch, 1, f"run.dir={run_dir} on ")
    assert "is not the directory rank 0 claimed" in launch.output
    assert f"[rank 0] stopping: rank 1 failed: ConfigError: run.dir={run_dir} on " in launch.output


@pytest.mark.parametrize("store", ["agent", "rank 0"])
def test_a_rank_killed_before_it_joins_ends_the_other_node_within_the_liveness_timeout(tmp_path, monkeypatch, store):
    """Node 1's rank is SIGKILLed before it joins the process group (while it starts: the OOM killer), so it tells
    nobody; its agent closes torchrun's rendezvous and exits. Node 0's rank, waiting in torch's set-up for it, sees the
    rendezvous closed and stops, saying so, within the liveness timeout instead of pipeline.timeout_s (60 s here):
    with the agent's store and with the store hosted by rank 0 (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) alike."""
    if store == "rank 0":
        monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    launch = torchrun(tmp_path / "run", 1, f"pipeline.liveness_timeout_s={LIVENESS_S}", nnodes=2,
                      fault="die_before_join:1@1", timeout_s=150)
    assert launch.returncode != 0
    assert "[rank 0] stopping: torchrun's rendezvous was closed: another node's torchrun gave up" in launch.output, \
        launch.output[-6000:]
    assert max(launch.node_ended_s) - min(launch.node_ended_s) < LIVENESS_S, (launch.node_ended_s,
                                                                               launch.output[-6000:])
