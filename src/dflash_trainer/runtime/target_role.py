"""A target rank's life in a split run: pull jobs, forward them to the last tap, send the batches."""

from __future__ import annotations

from dflash_trainer.runtime.control import ControlPlane
from dflash_trainer.runtime.jobs import GroupJobSource, StoreJobSource
from dflash_trainer.runtime.remote_eval import SplitEvalServer, eval_enabled, make_tau_tracker
from dflash_trainer.runtime.setup import RunSetup, load_checked_target, run_wire_spec
from dflash_trainer.runtime.summary import TargetStats
from dflash_trainer.target.head import head_from_model
from dflash_trainer.target.worker import JobSource, run_target_worker
from dflash_trainer.transport.links import P2PShipper
from dflash_trainer.transport.sender import BatchSender


def run_target(setup: RunSetup, control: ControlPlane) -> TargetStats:
    """Forward the jobs this rank pulls and send the batches to the drafters; the first target rank also
    evaluates the drafters the leader sends it (between jobs, and after the last one until told to stop)."""
    config = setup.config
    target, capture = load_checked_target(setup, control)
    shipper = P2PShipper(control.claims, rank=setup.env.rank, drafter_ranks=setup.placement.node_drafter_ranks,
                          device=setup.device)
    sender = BatchSender.create(
        run_wire_spec(setup), setup.device, depth=config.pipeline.target_postprocess_depth, ship=shipper.ship,
        finish=shipper.finish, timeout_s=config.pipeline.timeout_s, name=f"target-sender-{setup.env.rank}",
    )
    jobs = _group_jobs(setup, StoreJobSource(control, setup.remaining))
    server = None
    if setup.env.rank == setup.placement.target_ranks[0] and eval_enabled(config):
        tracker = make_tau_tracker(config, target=target, capture=capture, head=head_from_model(target),
                                   run_dir=setup.run_dir, device=setup.device)
        server = SplitEvalServer(control, tracker, device=setup.device) if tracker is not None else None
    source = jobs if server is None else server.pausing(jobs)
    report = run_target_worker(capture=capture, job_source=source, dataset=setup.prepared.train, sender=sender)
    if server is not None:
        server.serve_until_end()
    return TargetStats(
        rank=setup.env.rank, tokens=report.num_tokens, batches=len(report.batches),
        busy_s=sum(b.forward_s for b in report.batches), wall_s=report.wall_s, bytes_moved=shipper.bytes_sent,
        slot_wait_s=sum(b.slot_wait_s for b in report.batches),
        batches_to={str(d): n for d, n in shipper.batches_to.items()},
    )


def run_target_member(setup: RunSetup, control: ControlPlane) -> None:
    """A member of a target group: run the leader's jobs on this rank's shard of the target, in lockstep with the
    leader (its sharded layers all-reduce with the group's). The taps it captures are the leader's too: nothing is
    sent; its batches go to a sender that ships nowhere."""
    _, capture = load_checked_target(setup, control)
    sender = BatchSender.create(
        run_wire_spec(setup), setup.device, depth=setup.config.pipeline.target_postprocess_depth,
        ship=lambda batch: None, finish=lambda: None, timeout_s=setup.config.pipeline.timeout_s,
        name=f"target-member-{setup.env.rank}",
    )
    run_target_worker(capture=capture, job_source=_group_jobs(setup, None), dataset=setup.prepared.train,
                      sender=sender)


def _group_jobs(setup: RunSetup, source: JobSource | None) -> JobSource:
    """`source` itself for a target of one rank; for a target group, the leader's pulls shared with its members."""
    if setup.target_group is None:
        assert source is not None
        return source
    leader = setup.placement.target_group[0]
    return GroupJobSource(source, setup.remaining, group=setup.target_group, leader=leader, device=setup.device)
