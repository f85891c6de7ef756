"""`dflash-train train`: set up every rank, run its role, end together, write the summary.

One process (no torchrun) runs colocated with a HashStore. Under torchrun every rank finds its role
(`roles.py`), rank 0 chooses the run dir and prepares data and plans first (the others then hit the
tokenized cache), and the roles run: targets push batches, drafters train, colocated ranks do both.
Any exception ends the job: one process re-raises (the CLI reports it); under torchrun the failing
rank records its cause in the store and exits at once, and the others follow (`failures.py`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from dflash_trainer.config import Config
from dflash_trainer.data.plan import build_epoch_plan, plan_dir, read_epoch_plan, write_epoch_plan, write_summary
from dflash_trainer.data.prepare import PreparedData, prepare_data, summary_json
from dflash_trainer.data.tokenizer import load_tokenizer, ordinary_token
from dflash_trainer.data.types import Job
from dflash_trainer.drafter.spec import DrafterSpec, drafter_spec, first_spare_row
from dflash_trainer.regen.settings import warn_regen_mismatch
from dflash_trainer.rundir import claim_run_dir
from dflash_trainer.runtime.control import ControlPlane
from dflash_trainer.runtime.env import DistEnv, choose_device, dist_env, init_distributed
from dflash_trainer.runtime.failures import (
    AbortWatchdog, StopSignals, exit_now, fail_rank, is_secondary, record_dead_peer, stop_after_peer_failure,
)
from dflash_trainer.runtime.jobs import STOP, StoreJobSource
from dflash_trainer.runtime.liveness import Liveness
from dflash_trainer.runtime.pool import BufferedPool, DepthMeter, PoolReport
from dflash_trainer.runtime.roles import Placement, plan_placement
from dflash_trainer.runtime.split_eval import SplitEvalClient, SplitEvalServer, make_tau_tracker, split_eval_enabled
from dflash_trainer.runtime.summary import TargetStats, print_summary, run_summary, write_failed_summary, write_summary_file
from dflash_trainer.runtime.transport import LocalProducer, P2PShipper, Receiver
from dflash_trainer.target.batch import WireHeader, WireSpec, allocate, from_wire, wire_spec
from dflash_trainer.target.capture import TapCapture, compile_decoder_layers
from dflash_trainer.target.checks import check_target
from dflash_trainer.target.head import head_from_model, load_target_head
from dflash_trainer.target.load import load_target, target_model_config
from dflash_trainer.target.sender import BatchSender
from dflash_trainer.target.worker import Interval, forward_job, run_target_worker
from dflash_trainer.train.checkpoint import load_checkpoint, read_ledger, resolve_resume
from dflash_trainer.train.trainer import DrafterTrainer, TrainResult, data_fingerprint, model_signature, planned_steps

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSetup:
    """What every rank knows once setup is done (identical on all ranks)."""

    config: Config
    env: DistEnv
    device: torch.device
    placement: Placement
    run_dir: Path
    spec: DrafterSpec
    prepared: PreparedData
    plans_jobs: tuple[tuple[Job, ...], ...]
    """Every epoch's planned jobs."""
    remaining: tuple[tuple[Job, ...], ...]
    """Every epoch's jobs not yet committed (resume skips committed ones)."""
    resume_path: Optional[Path]
    drafter_group: Optional[dist.ProcessGroup]


def run_training(config: Config) -> int:
    env = dist_env()
    device = choose_device(config.run.device, env.local_rank)
    store, _ = init_distributed(env, device, config.pipeline.timeout_s)
    control = ControlPlane(store, rank=env.rank, stall_timeout_s=config.pipeline.timeout_s)
    holder: dict[str, Any] = {}
    watchdog = liveness = None
    if env.distributed:
        # The summary names the failed rank even when this rank leaves through the watchdog (it found another
        # rank's failure, or a silent rank, in the store).
        watchdog = AbortWatchdog(control, rank=env.rank, on_abort=lambda info: write_failed_summary(
            holder.get("run_dir"), info.rank, info.cause, keep_existing=True)).start()
        if config.pipeline.liveness_timeout_s > 0:
            liveness = Liveness(control, rank=env.rank, world_size=env.world_size,
                                timeout_s=config.pipeline.liveness_timeout_s).start()
    stop = StopSignals(control=control, on_failure=_peer_failed(holder, control), on_second=_stop_now(holder),
                       gone_peers=liveness.gone_peers if liveness is not None else lambda: []).install()
    holder["stop"] = stop
    started = time.time()
    try:
        setup = _setup(config, env, device, control, holder)
        summary = _run_role(setup, control, stop)
        if summary is not None:
            if stop.requested():
                summary["status"] = "stopped"
                summary["stopped_by"] = signal.Signals(stop.signum).name
            summary["elapsed_s"] = round(time.time() - started, 3)
            write_summary_file(setup.run_dir, summary)
            print_summary(summary, setup.run_dir)
            if config.logging.report:
                _write_report(setup.run_dir)
            control.set_value("run_done", "1")
        else:
            control.wait_value("run_done")
    except BaseException as error:
        cause = f"{type(error).__name__}: {error}"
        if not env.distributed:
            write_failed_summary(holder.get("run_dir"), env.rank, cause)
            raise
        if is_secondary(error, control, env.rank):
            # Failing *because* another rank did (Aborted, a broken connection): name that rank, not this one.
            if liveness is not None:
                record_dead_peer(control, liveness.gone_peers)
            first = control.aborted()
            write_failed_summary(holder.get("run_dir"), first.rank if first else -1,
                                  first.cause if first else f"a peer rank died ({cause})")
            stop_after_peer_failure(control, env.rank, error)
        control.abort(cause)  # first: the others stop now; the first failure recorded wins
        first = control.aborted()
        write_failed_summary(holder.get("run_dir"), first.rank if first else env.rank, first.cause if first else cause)
        fail_rank(control, env.rank, error)
    if liveness is not None:
        liveness.finish()
    if watchdog is not None:
        watchdog.stop()
    if env.distributed:
        dist.destroy_process_group()
    return stop.exit_code


# -- setup ------------------------------------------------------------------------------------------


def _setup(config: Config, env: DistEnv, device: torch.device, control: ControlPlane, holder: dict) -> RunSetup:
    placement = plan_placement(
        rank=env.rank, world_size=env.world_size, local_rank=env.local_rank, local_world_size=env.local_world_size,
        pipeline=config.pipeline, num_devices=torch.cuda.device_count() if device.type == "cuda" else None,
    )
    if env.rank == 0:
        run_dir = claim_run_dir(config)
        control.set_value("run_dir", str(run_dir))
    else:
        run_dir = Path(control.wait_value("run_dir"))
    holder["run_dir"] = run_dir
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, dir=str(run_dir)))
    # Before the data work: a wrong train.resume fails at once. Rank 0 checks the checkpoints (it reads them
    # whole for their checksums) and tells the others which one.
    resume_path = None
    if config.train.resume:
        if env.rank == 0:
            resume_path = resolve_resume(run_dir, config.train.resume)
            control.set_value("resume_path", str(resume_path))
        else:
            resume_path = Path(control.wait_value("resume_path"))
    tokenizer = load_tokenizer(config.target, config.data.chat_template)
    target_config = target_model_config(config.target)
    spec = drafter_spec(target_config, config.drafter, mask_token_id=first_spare_row(tokenizer))
    token = ordinary_token(tokenizer, spec.mask_token_id)
    if token is not None and env.rank == 0:
        log.warning("drafter.mask_token_id=%d is %r, an ordinary token of the tokenizer: the drafter's MASK slots "
                    "and that token share an embedding. Use a spare embedding row (default: the first past the "
                    "tokenizer, %d) or a reserved special token", spec.mask_token_id, token, len(tokenizer))

    if env.rank == 0:
        prepared = prepare_data(config, run_dir, tokenizer=tokenizer)
        plans = [_epoch_plan(config, run_dir, prepared, e) for e in range(config.train.num_epochs)]
        write_summary(run_dir, summary_json(prepared.summary, plans[0]))
        warn_regen_mismatch(config)  # data regenerated with other thinking/temperature than evaluation uses
        control.set_value("data_ready", "1")
    else:
        control.wait_value("data_ready")
        prepared = prepare_data(config, run_dir, tokenizer=tokenizer, write_files=False)
        plans = [read_epoch_plan(run_dir, e) for e in range(config.train.num_epochs)]

    ledger = read_ledger(resume_path) if resume_path else {}
    remaining = tuple(
        tuple(j for j in plan.jobs if j.job_id not in set(ledger.get(plan.epoch, []))) for plan in plans
    )
    group = None
    if env.distributed:  # every rank takes part in creating the drafters' group
        group = dist.new_group(list(placement.drafter_ranks))
    log.info("rank %d: role %s, run dir %s, %d jobs to train", env.rank, placement.role.value, run_dir,
             sum(len(r) for r in remaining))
    return RunSetup(
        config=config, env=env, device=device, placement=placement, run_dir=run_dir, spec=spec, prepared=prepared,
        plans_jobs=tuple(p.jobs for p in plans), remaining=remaining, resume_path=resume_path, drafter_group=group,
    )


def _epoch_plan(config: Config, run_dir: Path, prepared: PreparedData, epoch: int):
    """Read the epoch's plan back when it exists (resume), else build and write it."""
    if (plan_dir(run_dir) / f"epoch_{epoch}.json").is_file():
        return read_epoch_plan(run_dir, epoch)
    plan = build_epoch_plan(
        prepared.train.lengths, epoch=epoch, seed=config.run.seed, num_buckets=config.data.num_buckets,
        token_budget=config.pipeline.token_budget, max_seqs=config.batch.max_seqs,
    )
    write_epoch_plan(run_dir, plan)
    return plan


# -- roles ------------------------------------------------------------------------------------------


def _run_role(setup: RunSetup, control: ControlPlane, stop: StopSignals) -> Optional[dict]:
    """Returns the run summary on the leader (the first drafter rank), None elsewhere."""
    role = setup.placement.role
    if role.runs_target and not role.runs_drafter:
        stats = _run_target(setup, control)
        control.set_value(f"target_stats/{setup.env.rank}", json.dumps(dataclasses.asdict(stats)))
        return None
    result, target_stats, pool = _run_drafter(setup, control, stop)
    leader = setup.placement.rank == setup.placement.drafter_ranks[0]
    if not leader:
        if target_stats is not None:  # a colocated rank reports its target half too
            control.set_value(f"target_stats/{setup.env.rank}", json.dumps(dataclasses.asdict(target_stats)))
        control.set_value(f"pool_stats/{setup.env.rank}", json.dumps(dataclasses.asdict(PoolReport.of(pool.stats))))
        return None
    all_target_stats = [target_stats] if target_stats is not None else []
    others = [r for r in setup.placement.target_ranks if r != setup.env.rank]
    all_target_stats += [TargetStats(**json.loads(control.wait_value(f"target_stats/{r}"))) for r in others]
    pools = [PoolReport.of(pool.stats)] + [
        PoolReport(**json.loads(control.wait_value(f"pool_stats/{r}"))) for r in setup.placement.drafter_ranks[1:]
    ]
    return run_summary(setup, result, all_target_stats, pools)


def _load_checked_target(setup: RunSetup):
    config, spec = setup.config, setup.spec
    target = load_target(config.target, setup.device, seed=config.run.seed)
    check_target(
        target, tap_layer_ids=list(spec.tap_layer_ids), drafter_hidden_size=spec.hidden_size,
        mask_token_id=spec.mask_token_id, max_length=config.data.max_length,
    )
    capture = TapCapture(target, spec.tap_layer_ids, capture_last_hidden=config.drafter.kd_weight > 0)
    if config.target.compile and setup.device.type == "cuda":
        # Each layer compiled (hooks and early exit stay eager); padded shapes vary by job, so dynamic.
        compile_decoder_layers(target, upto=capture.stop_layer, dynamic=None)
    return target, capture


def _wire_spec(setup: RunSetup) -> WireSpec:
    return wire_spec(setup.config, hidden=setup.spec.hidden_size, num_taps=setup.spec.num_taps)


def _run_target(setup: RunSetup, control: ControlPlane) -> TargetStats:
    config = setup.config
    target, capture = _load_checked_target(setup)
    shipper = P2PShipper(control, rank=setup.env.rank, drafter_ranks=setup.placement.drafter_ranks, device=setup.device)
    sender = BatchSender.create(
        _wire_spec(setup), setup.device, depth=config.pipeline.target_postprocess_depth, ship=shipper.ship,
        finish=shipper.finish, timeout_s=config.pipeline.timeout_s, name=f"target-sender-{setup.env.rank}",
    )
    jobs = StoreJobSource(control, setup.remaining)
    server = None
    if setup.env.rank == setup.placement.target_ranks[0] and split_eval_enabled(config):
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
    )


def _run_drafter(setup: RunSetup, control: ControlPlane, stop: StopSignals,
                 ) -> tuple[TrainResult, Optional[TargetStats], BufferedPool]:
    config, placement, device = setup.config, setup.placement, setup.device
    rank = setup.env.rank
    colocated = placement.colocated
    target = capture = None
    if colocated:
        target, capture = _load_checked_target(setup)
        head = head_from_model(target)
    else:
        head = load_target_head(config.target, device, seed=config.run.seed)
    capacity = config.pipeline.pool_capacity
    pool = BufferedPool(
        capacity, min_ready=config.pipeline.min_ready, fifo=config.pipeline.deterministic,
        seed=config.run.seed * 1009 + rank, timeout_s=config.pipeline.timeout_s, check_abort=control.raise_if_aborted,
        on_release=(lambda slot: None) if colocated else (lambda slot: control.grant_credits(rank, 1)),
    )
    buffers = [allocate(_wire_spec(setup), device) for _ in range(capacity)]
    resume = None
    if setup.resume_path is not None:
        resume = load_checkpoint(
            setup.resume_path, model_signature=model_signature(setup.spec),
            data_fingerprint=data_fingerprint(config, setup.prepared.summary.content_sha256),
        )
    remaining_jobs = sum(len(r) for r in setup.remaining)
    empty = WireHeader(job_id=-1, bucket_id=-1, epoch=0, num_tokens=0, num_seqs=0,
                       has_last_hidden=config.drafter.kd_weight > 0, end_of_stream=False)
    trainer = DrafterTrainer(
        config, spec=setup.spec, head=head, device=device, group=setup.drafter_group,
        is_leader=rank == placement.drafter_ranks[0], run_dir=setup.run_dir,
        data_digest=setup.prepared.summary.content_sha256,
        total_steps=planned_steps(config, remaining_jobs, len(placement.drafter_ranks), resume.state.step if resume else 0),
        resume=resume, target_config=target_model_config(config.target),
        dummy_batch=from_wire(allocate(_wire_spec(setup), device), empty),  # zeros: no token, no loss
        stop_requested=stop.requested, step_metrics=DepthMeter(pool.stats),
    )
    target_stats: Optional[TargetStats] = None
    receiver = None
    tracker = _tau_tracker(setup, target, capture, head) if trainer.is_leader and colocated else None
    client = SplitEvalClient(control, setup.run_dir) if trainer.is_leader and not colocated and split_eval_enabled(config) else None
    evaluating = split_eval_enabled(config)  # the same on every drafter rank (FSDP2 gathers the model together)
    interval = config.eval.interval

    def on_step(record) -> None:
        due = evaluating and interval > 0 and record.step % interval == 0 and not record.skipped
        model = trainer.full_model() if due else None  # a collective with FSDP2; the leader gets the model
        if tracker is not None and model is not None:
            trainer.show_eval(tracker.evaluate(model, record.step, export=lambda out: trainer.export(out, model),
                                               sink=trainer.sink))
        if client is not None:
            if model is not None:
                client.request(trainer, record.step, model)
            client.poll(trainer.sink)
            if client.last is not None:
                trainer.show_eval(client.last)

    trainer.on_step_extra = on_step
    if colocated:
        target_stats = TargetStats(rank=rank)
        jobs = StoreJobSource(control, setup.remaining)

        pending: list[Interval] = []  # forward timers not read yet: reading one waits for its GPU work

        def forward(job: Job, wire):
            timer = Interval(device)
            batch, inputs = forward_job(capture, setup.prepared.train, job, wire)
            timer.stop()
            pending.append(timer)
            target_stats.tokens += inputs.num_tokens
            target_stats.batches += 1
            while pending and pending[0].done():  # no host sync: only timers whose events completed
                target_stats.busy_s += pending.pop(0).seconds()
            return batch

        producer = LocalProducer(pool, buffers, next_job=jobs.next_job, forward=forward)

        def take():
            producer.fill()
            entry = pool.take()
            return None if entry is None else (entry.item, lambda: pool.release(entry.slot))
    else:
        control.grant_credits(rank, capacity)
        receiver = Receiver(control, pool, buffers, rank=rank, num_targets=len(placement.target_ranks), device=device).start()

        def take():
            entry = pool.take()
            return None if entry is None else (entry.item, lambda: pool.release(entry.slot))

    t0 = time.perf_counter()
    result = trainer.run(take)
    if trainer.is_leader:
        control.set_value(STOP, "1")  # targets stop pulling jobs (max_steps reached or all done)
    if receiver is not None:
        # Before anything waits on a target: batches still in flight are received and dropped at once, so a
        # target blocked on credits moves on (and the first target can serve the final tau evaluation).
        receiver.drain()
    # Every drafter rank takes part in the final checkpoint and export (FSDP2 gathers the full state).
    if result.state.step > 0 and trainer.last_saved_step != result.state.step:
        trainer.save_checkpoint(result.state.step)
        result.checkpoints = trainer.checkpoints
    model = trainer.full_model()
    if trainer.is_leader:
        result.export_dir = str(trainer.export(setup.run_dir / "export", model))
        at_end = config.eval.at_end and not result.state.stop_requested  # stopping: be quick (a grace period runs)
        if tracker is not None and result.state.step > 0 and at_end:
            result.eval = tracker.finish(model, result.state.step, export=lambda out: trainer.export(out, model), sink=trainer.sink)
        elif tracker is not None and tracker.history:
            result.eval = tracker.summary(tracker.history[-1].step)
        if client is not None:
            result.eval = client.finish(trainer, result.state.step, model, at_end=at_end, sink=trainer.sink)
    if receiver is not None:
        receiver.join(config.pipeline.timeout_s)
    if target_stats is not None:
        target_stats.busy_s += sum(timer.seconds() for timer in pending)  # end of run: the last few timers
        target_stats.wall_s = time.perf_counter() - t0
    trainer.close()
    return result, target_stats, pool


def _tau_tracker(setup: RunSetup, target, capture, head):
    """Evaluation in place on a colocated leader (split runs: `split_eval.py`)."""
    if setup.config.eval.interval == 0 and not setup.config.eval.at_end:
        return None
    return make_tau_tracker(setup.config, target=target, capture=capture, head=head, run_dir=setup.run_dir,
                            device=setup.device)


def _write_report(run_dir: Path) -> None:
    """The run's report; a report that fails is a warning, never a failed run."""
    from dflash_trainer.report.page import write_report

    try:
        print(f"report: {write_report(run_dir)}", flush=True)
    except Exception as e:  # matplotlib missing or any drawing error: the run itself is done
        log.warning("could not write the run report (%s: %s); `dflash-train report %s` retries", type(e).__name__, e,
                    run_dir)


def _peer_failed(holder: dict, control: ControlPlane):
    """A signal after a peer's failure was recorded: the summary names that failure (unless a more precise
    one is there), and the rank leaves."""

    def leave(signum: int) -> None:
        info = control.aborted()
        write_failed_summary(holder.get("run_dir"), info.rank, info.cause, keep_existing=True)
        exit_now(128 + signum)

    return leave


def _stop_now(holder: dict):
    """A second stop signal: leave at once, saying so in the summary (no checkpoint since the last one)."""

    def leave(signum: int) -> None:
        if holder.get("run_dir") is not None:
            write_summary_file(holder["run_dir"], {"status": "stopped", "stopped_by": signal.Signals(signum).name,
                                                   "note": "stopped at once by a second signal: no final checkpoint"})
        exit_now(128 + signum)

    return leave
