"""A drafter rank's life: its feed and trainer, evaluation during training, then together with the other
drafter ranks the final checkpoint and export, and on the leader the final evaluation."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from dflash_trainer.rundir import RunDir
from dflash_trainer.runtime.control import ControlPlane
from dflash_trainer.runtime.failures import StopSignals
from dflash_trainer.runtime.elastic import this_incarnation
from dflash_trainer.runtime.feed import make_feed
from dflash_trainer.runtime.jobs import STOP
from dflash_trainer.runtime.remote_eval import SplitEvalClient, eval_enabled, make_tau_tracker
from dflash_trainer.runtime.setup import RunSetup, load_checked_target, run_wire_spec
from dflash_trainer.runtime.summary import TargetStats
from dflash_trainer.target.head import head_from_model, load_target_head
from dflash_trainer.target.load import target_model_config
from dflash_trainer.train.checkpoint import LoadedCheckpoint, load_checkpoint
from dflash_trainer.train.step_loop import StepRecord
from dflash_trainer.train.tau_eval import TauSummary
from dflash_trainer.train.trainer import (
    DrafterTrainer,
    TrainResult,
    budget_note,
    data_fingerprint,
    model_signature,
    planned_steps,
)
from dflash_trainer.transport.pool import DepthMeter, PoolReport
from dflash_trainer.transport.wire import WireHeader, allocate, from_wire

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class DrafterOutcome:
    result: TrainResult
    target_stats: Optional[TargetStats]
    """This rank's own target half (colocated), else None."""
    pool: PoolReport


class Evaluations:
    """Evaluation every `eval.interval` steps and at the end: in place on a colocated leader (a tracker over its
    own target), through the first target rank in a split run (`remote_eval.py`), or none. Every drafter rank
    holds one (FSDP2 gathers the model on all of them); only the leader evaluates."""

    def __init__(self, setup: RunSetup, control: ControlPlane, *, target, capture, head, is_leader: bool) -> None:
        config = setup.config
        self.config = config
        self.enabled = eval_enabled(config)  # the same on every drafter rank
        colocated = setup.placement.colocated
        self.tracker = None
        if is_leader and colocated and (config.eval.interval > 0 or config.eval.at_end):
            self.tracker = make_tau_tracker(config, target=target, capture=capture, head=head, run_dir=setup.run_dir,
                                            device=setup.device)
        self.client = SplitEvalClient(control, setup.run_dir) if is_leader and not colocated and self.enabled else None

    def on_step(self, trainer: DrafterTrainer, record: StepRecord) -> None:
        interval = self.config.eval.interval
        due = self.enabled and interval > 0 and record.step % interval == 0 and not record.skipped
        model = trainer.full_model() if due else None  # a collective with FSDP2; the leader gets the model
        if self.tracker is not None and model is not None:
            trainer.show_eval(self.tracker.evaluate(model, record.step, export=lambda out: trainer.export(out, model),
                                                    sink=trainer.sink,
                                                    blocks_per_chunk=trainer.chunks.blocks_per_chunk))
        if self.client is not None:
            if model is not None:
                self.client.request(trainer, record.step, model)
            self.client.poll(trainer.sink)
            if self.client.last is not None:
                trainer.show_eval(self.client.last)

    def finish(self, trainer: DrafterTrainer, result: TrainResult, model) -> Optional[TauSummary]:
        """The final evaluation on the leader (skipped when stopping: a grace period runs), its summary entry."""
        at_end = self.config.eval.at_end and not result.state.stop_requested
        step = result.state.step
        summary = None
        if self.tracker is not None and step > 0 and at_end:
            summary = self.tracker.finish(model, step, export=lambda out: trainer.export(out, model), sink=trainer.sink,
                                          blocks_per_chunk=trainer.chunks.blocks_per_chunk)
        elif self.tracker is not None and self.tracker.history:
            summary = self.tracker.summary(self.tracker.history[-1].step)
        if self.client is not None:
            summary = self.client.finish(trainer, step, model, at_end=at_end, sink=trainer.sink)
        return summary


def run_drafter(setup: RunSetup, control: ControlPlane, stop: StopSignals) -> DrafterOutcome:
    config, placement, device = setup.config, setup.placement, setup.device
    target = capture = None
    if placement.colocated:
        target, capture = load_checked_target(setup, control)
        head = head_from_model(target)
    else:
        head = load_target_head(config.target, device, seed=config.run.seed)
    feed = make_feed(setup, control, capture)
    resume = _checkpoint_to_resume(setup)
    is_leader = setup.env.rank == placement.drafter_ranks[0]
    evaluations = Evaluations(setup, control, target=target, capture=capture, head=head, is_leader=is_leader)
    empty = WireHeader(job_id=-1, bucket_id=-1, epoch=0, num_tokens=0, num_seqs=0,
                       has_last_hidden=config.drafter.needs_last_hidden, end_of_stream=False)
    remaining_jobs = sum(len(r) for r in setup.remaining)
    if is_leader:
        log.info("budget: %s", budget_note(config, remaining_jobs, placement.replicas,
                                           resume.state.step if resume else 0))
    incarnation = this_incarnation() if is_leader else None

    def on_step(trainer: DrafterTrainer, record: StepRecord) -> None:
        if incarnation is not None and trainer.last_saved_step == record.step:  # written this step
            incarnation.record_checkpoint(record.step)
        evaluations.on_step(trainer, record)

    trainer = DrafterTrainer(
        config, spec=setup.spec, head=head, device=device, group=setup.drafter_group, is_leader=is_leader,
        run_dir=setup.run_dir, data_digest=setup.prepared.summary.content_sha256,
        total_steps=planned_steps(config, remaining_jobs, placement.replicas, resume.state.step if resume else 0),
        resume=resume, target_config=target_model_config(config.target), on_step=on_step,
        dummy_batch=from_wire(allocate(run_wire_spec(setup), device), empty),  # zeros: no token, no loss
        stop_requested=stop.requested, step_metrics=DepthMeter(feed.pool.stats), shards=setup.shards,
    )
    result = trainer.run(feed.take)
    if is_leader:
        control.set_value(STOP, "1")  # targets stop pulling jobs (max_steps reached or all done)
    feed.stop()
    # Every drafter rank takes part in the final checkpoint and export (FSDP2 gathers the full state).
    if result.state.step > 0 and trainer.last_saved_step != result.state.step:
        trainer.save_checkpoint(result.state.step)
        result.checkpoints = trainer.checkpoints
        if incarnation is not None:
            incarnation.record_checkpoint(result.state.step)
    model = trainer.full_model()
    if is_leader:
        result.export_dir = str(trainer.export(RunDir(setup.run_dir).export, model))
        result.eval = evaluations.finish(trainer, result, model)
    target_stats = feed.close(config.pipeline.timeout_s)
    trainer.close()
    return DrafterOutcome(result=result, target_stats=target_stats, pool=PoolReport.of(feed.pool.stats))


def _checkpoint_to_resume(setup: RunSetup) -> Optional[LoadedCheckpoint]:
    if setup.resume_path is None:
        return None
    return load_checkpoint(setup.resume_path, model_signature=model_signature(setup.spec),
                           data_fingerprint=data_fingerprint(setup.config, setup.prepared.summary.content_sha256))
