"""`dflash-train train`: a rank's whole run, top to bottom: set up (`setup.py`), run its role (`target_role.py`,
`drafter_role.py`), end together, write the summary and the report.

One process (no torchrun) runs colocated with a HashStore. Under torchrun every rank finds its role
(`roles.py`), rank 0 chooses the run dir and prepares data and plans first (the others then hit the
tokenized cache), and the roles run: targets push batches, drafters train, colocated ranks do both.
Any exception ends the job: one process re-raises (the CLI reports it); under torchrun the failing
rank records its cause in the store and exits at once, and the others follow (`failures.py`); a rank
that stops answering is found by the others (`liveness.py`); SIGTERM/SIGINT stop every rank cleanly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from dflash_trainer.config import Config
from dflash_trainer.faults import maybe_fault
from dflash_trainer.resume import Change
from dflash_trainer.runtime.control import ControlPlane
from dflash_trainer.runtime.drafter_role import run_drafter
from dflash_trainer.runtime.elastic import record_incarnation, recorded_restarts, this_incarnation
from dflash_trainer.runtime.env import (
    CONTROL_PREFIX,
    DistEnv,
    choose_device,
    control_store,
    dist_env,
    join_process_group,
)
from dflash_trainer.runtime.failures import (
    AbortWatchdog,
    StopSignals,
    exit_now,
    fail_rank,
    first_failure,
    is_secondary,
    stop_after_peer_failure,
)
from dflash_trainer.runtime.liveness import Liveness
from dflash_trainer.runtime.rendezvous import rendezvous_closed_check, rendezvous_watch
from dflash_trainer.runtime.roles import Role
from dflash_trainer.runtime.setup import RunSetup, setup_run
from dflash_trainer.runtime.summary import (
    TargetStats,
    print_summary,
    run_summary,
    write_failed_summary,
    write_summary_file,
)
from dflash_trainer.runtime.target_role import run_target, run_target_member
from dflash_trainer.transport.pool import PoolReport

log = logging.getLogger(__name__)


def run_training(config: Config, resume_changes: tuple[Change, ...] = ()) -> int:
    """`resume_changes`: the `resume.Change`s this resume applied to the run's config (logged, and in the summary)."""
    env = dist_env()
    device = choose_device(config.run.device, env.local_rank)
    holder: dict[str, Any] = {}
    # A file-size limit (ulimit -f) then fails the write with EFBIG, which the checkpoint names, instead of
    # killing the process without a word.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    control, watchdog = _connect(env, device, config.pipeline.timeout_s, holder)
    liveness = None
    if env.distributed and config.pipeline.liveness_timeout_s > 0:  # every rank has joined: each one beats
        liveness = Liveness(control, rank=env.rank, world_size=env.world_size,
                            timeout_s=config.pipeline.liveness_timeout_s).start()
    stop = StopSignals(control=control, on_failure=_peer_failed(holder, control), on_second=_stop_now(holder),
                       gone_peers=liveness.gone_peers if liveness is not None else lambda: []).install()
    holder["stop"] = stop
    holder["env"] = env
    started = time.time()
    try:
        setup = setup_run(config, env, device, control, on_run_dir=lambda path: holder.update(run_dir=path),
                          on_claim=_claimed(holder))
        summary = _run_role(setup, control, stop) if not setup.finished else None
        if setup.finished:
            if env.rank == 0:
                _say_finished(config, setup.run_dir, holder["claim"])
        elif summary is not None:
            _write_run_summary(config, setup, control, stop, summary, resume_changes=resume_changes, started=started)
        else:
            control.wait_value("run_done")
    except BaseException as error:
        cause = f"{type(error).__name__}: {error}"
        if not env.distributed:
            write_failed_summary(holder.get("run_dir"), env.rank, cause)
            _release(holder, failed=True)
            stop.uninstall()
            raise
        if is_secondary(error, control, env.rank):
            # Failing *because* another rank did (Aborted, a broken connection): name that rank, not this one.
            first = first_failure(control, liveness.gone_peers if liveness is not None else lambda: [])
            write_failed_summary(holder.get("run_dir"), first.rank if first else -1,
                                  first.cause if first else f"a peer rank died ({cause})")
            stop_after_peer_failure(control, env.rank, error)
        control.abort(cause)  # first: the others stop now; the first failure recorded wins
        first = control.aborted()
        write_failed_summary(holder.get("run_dir"), first.rank if first else env.rank, first.cause if first else cause)
        _release(holder, failed=True)
        fail_rank(control, env.rank, error)
    _release(holder, failed=False)
    if liveness is not None:
        liveness.finish()
    if watchdog is not None:
        watchdog.stop()
    if env.distributed:
        dist.destroy_process_group()
    stop.uninstall()
    return stop.exit_code


def _connect(env: DistEnv, device: torch.device, timeout_s: float,
             holder: dict) -> tuple[ControlPlane, Optional[AbortWatchdog]]:
    """This rank's control plane, and under torchrun its abort watchdog, started before the rank joins the process
    group wherever the job's store allows (`env.control_store`): a rank that fails before it joins, or while the
    others wait for it there, records its failure, and the waiting ranks stop with it rather than wait out
    pipeline.timeout_s."""
    store = control_store(env, timeout_s)
    control = watchdog = None
    if store is not None:
        control = ControlPlane(store, rank=env.rank, stall_timeout_s=timeout_s)
        watchdog = _watch(control, env, holder) if env.distributed else None
    if env.distributed:
        # a rank of another node that died before joining is seen only by its agent, which closes the rendezvous
        closed = rendezvous_closed_check()
        rendezvous = rendezvous_watch(closed, rank=env.rank).start() if closed is not None else None
        maybe_fault("die_before_join")  # test-only hook: SIGKILL this rank before it joins
        joined = join_process_group(env, device, timeout_s)
        if rendezvous is not None:
            rendezvous.stop()
        if control is None:  # the job's store exists only now: the control plane on a connection of its own
            control = ControlPlane(dist.PrefixStore(CONTROL_PREFIX, joined.clone()), rank=env.rank,
                                   stall_timeout_s=timeout_s)
            watchdog = _watch(control, env, holder)
    return control, watchdog


def _watch(control: ControlPlane, env: DistEnv, holder: dict) -> AbortWatchdog:
    # The summary names the failed rank even when this rank leaves through the watchdog (it found another rank's
    # failure, or a silent rank, in the store).
    return AbortWatchdog(control, rank=env.rank, on_abort=lambda info: write_failed_summary(
        holder.get("run_dir"), info.rank, info.cause, keep_existing=True)).start()


def _say_finished(config: Config, run_dir: Path, claim) -> None:
    """Rank 0, a resume of a run that ended well with nothing left to train: leave the run as it was, and say so."""
    claim.restore_config()  # left as it was: this resume changed nothing
    limits = ["every planned job committed"]
    if config.train.max_steps is not None:
        limits.append(f"train.max_steps={config.train.max_steps} reached")
    if config.train.max_minutes is not None:
        limits.append(f"train.max_minutes={config.train.max_minutes} spent over its sessions")
    print(f"run.dir={run_dir} is finished: its summary says ok and nothing is left to train "
          f"({', or '.join(limits)}). It is left as it is. "
          "To train on, resume with a higher train.max_steps, train.num_epochs or train.max_minutes; its "
          "drafters are in export/ and best/.", flush=True)


def _write_run_summary(config: Config, setup: RunSetup, control: ControlPlane, stop: StopSignals, summary: dict, *,
                       resume_changes: tuple[Change, ...], started: float) -> None:
    """The rank that holds the run's summary: complete it (how it ended, resume changes, restarts, time), write and
    print it (and the report), then tell the other ranks the run is done."""
    if stop.requested():
        summary["status"] = "stopped"
        summary["stopped_by"] = signal.Signals(stop.signum).name
        summary["resume_command"] = resume_command(setup.run_dir, setup.env)
    if resume_changes:
        summary["resume_changes"] = [{"key": c.key, "old": c.old, "new": c.new} for c in resume_changes]
    if this_incarnation() is not None:  # under torchrun --max-restarts: how many restarts, and why
        summary["restarts"] = recorded_restarts(setup.run_dir)
    summary["elapsed_s"] = round(time.time() - started, 3)
    write_summary_file(setup.run_dir, summary)
    print_summary(summary, setup.run_dir)
    if stop.requested():
        print(f"stopped by {summary['stopped_by']}; continue this run with:\n  {summary['resume_command']}", flush=True)
    if config.logging.report:
        _write_report(setup.run_dir)
    control.set_value("run_done", "1")


def resume_command(run_dir: Path, env) -> str:
    """The command that continues the run in `run_dir`, from this directory (the run's config.yaml may name paths
    relative to it; torchrun's rendezvous options, for several nodes, are the user's own)."""
    train = f"train --resume run.dir={shlex.quote(str(Path(run_dir).resolve()))}"
    if not env.distributed:
        return f"cd {shlex.quote(os.getcwd())} && {entry_point('dflash-train')} {train}"
    nodes = env.world_size // max(1, env.local_world_size)
    launcher = f"{entry_point('torchrun')} --nproc_per_node {env.local_world_size}"
    if nodes > 1:
        launcher = (f"{entry_point('torchrun')} --nnodes {nodes} --nproc_per_node {env.local_world_size} "
                    "<the same --rdzv-* options>")
    return f"cd {shlex.quote(os.getcwd())} && {launcher} -m dflash_trainer {train}"


def entry_point(name: str) -> str:
    """`name` (dflash-train, torchrun) as the user's shell runs it: inside a virtual environment its absolute path
    there (a script such as scripts/demo.sh activates the environment for itself only), else the bare name."""
    if sys.prefix != sys.base_prefix and (path := Path(sys.executable).parent / name).is_file():
        return shlex.quote(str(path))
    return name


def _release(holder: dict, *, failed: bool) -> None:
    """Rank 0 lets go of the run dir (a failed start leaves no directory it created; `rundir.py`)."""
    claim = holder.pop("claim", None)
    if claim is not None:
        claim.release(failed=failed)


# -- roles ------------------------------------------------------------------------------------------


def _run_role(setup: RunSetup, control: ControlPlane, stop: StopSignals) -> Optional[dict]:
    """Run this rank's role; returns the run summary on the leader (the first drafter rank), None elsewhere.
    The other ranks send the leader their figures through the store."""
    rank, placement = setup.env.rank, setup.placement
    if placement.role is Role.TARGET_MEMBER:  # computes its group's forwards; its leader reports for the group
        run_target_member(setup, control)
        return None
    if placement.role.runs_target and not placement.role.runs_drafter:
        control.set_value(f"target_stats/{rank}", json.dumps(dataclasses.asdict(run_target(setup, control))))
        return None
    outcome = run_drafter(setup, control, stop)
    if rank != placement.drafter_ranks[0]:
        if outcome.target_stats is not None:  # a colocated rank reports its target half too
            control.set_value(f"target_stats/{rank}", json.dumps(dataclasses.asdict(outcome.target_stats)))
        control.set_value(f"pool_stats/{rank}", json.dumps(dataclasses.asdict(outcome.pool)))
        return None
    targets = [outcome.target_stats] if outcome.target_stats is not None else []
    targets += [TargetStats(**json.loads(control.wait_value(f"target_stats/{r}")))
                for r in placement.target_ranks if r != rank]
    pools = [outcome.pool] + [PoolReport(**json.loads(control.wait_value(f"pool_stats/{r}")))
                              for r in placement.drafter_ranks[1:]]
    return run_summary(setup, outcome.result, targets, pools)


def _write_report(run_dir: Path) -> None:
    """The run's report; a report that fails is a warning, never a failed run."""
    from dflash_trainer.report.page import write_report

    try:
        print(f"report: {write_report(run_dir)}", flush=True)
    except Exception as e:  # matplotlib missing or any drawing error: the run itself is done
        log.warning("could not write the run report (%s: %s); `dflash-train report %s` retries", type(e).__name__, e,
                    run_dir)


def _claimed(holder: dict):
    """Rank 0's `on_claim`: keep the run dir's claim (released at the end), and under `torchrun --max-restarts`
    record it for a later incarnation (`elastic.py`)."""
    incarnation = this_incarnation()

    def claimed(claim) -> None:
        holder["claim"] = claim
        if incarnation is not None:
            record_incarnation(incarnation, claim.path)

    return claimed


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
            command = resume_command(holder["run_dir"], holder["env"])
            write_summary_file(holder["run_dir"], {"status": "stopped", "stopped_by": signal.Signals(signum).name,
                                                   "note": "stopped at once by a second signal: no final checkpoint",
                                                   "resume_command": command})
            print(f"stopped at once; continue this run from its last checkpoint with:\n  {command}", flush=True)
        exit_now(128 + signum)

    return leave
