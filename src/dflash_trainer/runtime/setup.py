"""Every rank's setup for `dflash-train train`: the run dir, the resume point, the drafter's spec, the data and
epoch plans, the placement and the drafters' group, as one `RunSetup` the roles read."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from dflash_trainer.config import Config
from dflash_trainer.data.plan import EpochPlan, plan_epoch, read_epoch_plan, write_epoch_plan, write_summary
from dflash_trainer.data.prepare import PreparedData, prepare_data, summary_json
from dflash_trainer.data.tokenizer import load_tokenizer, ordinary_token
from dflash_trainer.data.types import Job
from dflash_trainer.drafter.attention_mask import dense_step_bytes
from dflash_trainer.drafter.model import check_flex_backend
from dflash_trainer.drafter.spec import DrafterSpec, drafter_spec, first_spare_row
from dflash_trainer.errors import ConfigError
from dflash_trainer.memory import available_host_bytes
from dflash_trainer.regen.settings import hint_foreign_replies, warn_regen_mismatch
from dflash_trainer.rundir import RunClaim, RunDir, claim_run_dir
from dflash_trainer.runtime.control import ControlPlane
from dflash_trainer.runtime.env import DistEnv
from dflash_trainer.runtime.remote_eval import eval_enabled
from dflash_trainer.runtime.roles import Placement, plan_placement
from dflash_trainer.runtime.shared_storage import SHARED_VIEW_TIMEOUT_S, check_sees_token, publish_token
from dflash_trainer.target.capture import TapCapture, compile_decoder_layers
from dflash_trainer.target.checks import check_max_length, check_target
from dflash_trainer.target.context_parallel import ShardGroup
from dflash_trainer.target.load import load_target, target_model_config
from dflash_trainer.target.parallel import shard_target
from dflash_trainer.train.checkpoint import check_fits, read_ledger, read_step, read_time_spent_s, resolve_resume
from dflash_trainer.train.chunking import even_chunks
from dflash_trainer.train.trainer import data_fingerprint, model_signature
from dflash_trainer.transport.wire import WireSpec, wire_spec

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
    target_group: Optional[dist.ProcessGroup] = None
    """This rank's target group (`pipeline.target_parallel` > 1 on a target rank): the target is sharded over it."""
    context_group: Optional[dist.ProcessGroup] = None
    """This rank's context-parallel group (`pipeline.context_parallel` > 1): its ranks share each sequence, shard by
    shard, for the target's forward and the drafter's step."""
    finished: bool = False
    """A resumed run that had already ended well with nothing left to train (every planned job committed, or
    `train.max_steps` reached): it is left as it is."""

    @property
    def shards(self) -> Optional[ShardGroup]:
        """This rank's place in its context-parallel group (None without context parallel)."""
        if self.context_group is None:
            return None
        ranks = self.placement.context_group
        return ShardGroup(group=self.context_group, index=ranks.index(self.env.rank), size=len(ranks))


def setup_run(config: Config, env: DistEnv, device: torch.device, control: ControlPlane,
              on_run_dir: Callable[[Path], None] = lambda path: None,
              on_claim: Callable[[RunClaim], None] = lambda claim: None) -> RunSetup:
    """Every rank's setup: placement, the run dir (rank 0 claims it, the others wait for it), the checkpoint to
    resume, the drafter's spec, the data and epoch plans (rank 0 prepares, the others read the cache), the
    drafters' process group. `on_run_dir(path)` learns the run dir as soon as it is known; `on_claim(claim)`
    (rank 0) takes the run dir's claim, to release when the run ends."""
    check_context_parallel(config)
    check_flex_backend(config.drafter.flex_kernel_options, device)  # before the run dir and the data work
    placement = plan_placement(
        rank=env.rank, world_size=env.world_size, local_rank=env.local_rank, local_world_size=env.local_world_size,
        pipeline=config.pipeline, num_devices=torch.cuda.device_count() if device.type == "cuda" else None,
    )
    check_target_groups(config)
    run_dir = _shared_run_dir(config, env, control, on_claim)
    on_run_dir(run_dir)
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
    # before the memory check: a max_length past the target's positions is the cause, not the token budget it needs
    check_max_length(config.data.max_length, spec.max_position_embeddings)
    check_cpu_step_memory(config, spec, device)
    token = ordinary_token(tokenizer, spec.mask_token_id)
    if token is not None and env.rank == 0:
        log.warning("drafter.mask_token_id=%d is %r, an ordinary token of the tokenizer: the drafter's MASK slots "
                    "and that token share an embedding. Use a spare embedding row (default: the first past the "
                    "tokenizer, %d) or a reserved special token", spec.mask_token_id, token, len(tokenizer))

    if env.rank == 0:
        prepared = prepare_data(config, run_dir, tokenizer=tokenizer)
        if resume_path is not None:  # before the plans are read back and any rank starts on them
            check_fits(resume_path, model_signature=model_signature(spec),
                       data_fingerprint=data_fingerprint(config, prepared.summary.content_sha256))
        plans = [epoch_plan(config, run_dir, prepared, e) for e in range(config.train.num_epochs)]
        write_summary(run_dir, summary_json(prepared.summary, plans[0]))
        warn_regen_mismatch(config)  # data regenerated with other thinking/temperature than evaluation uses
        hint_foreign_replies(config)  # replies the target did not write teach it little
        control.set_value("data_ready", "1")
    else:
        control.wait_value("data_ready")
        prepared = prepare_data(config, run_dir, tokenizer=tokenizer, write_files=False)
        plans = [read_epoch_plan(run_dir, e) for e in range(config.train.num_epochs)]

    ledger = read_ledger(resume_path) if resume_path else {}
    committed = {plan.epoch: set(ledger.get(plan.epoch, [])) for plan in plans}
    remaining = tuple(tuple(j for j in plan.jobs if j.job_id not in committed[plan.epoch]) for plan in plans)
    group, target_group, context_group = _process_groups(env, placement)
    log.info("rank %d: role %s, run dir %s, %d jobs to train", env.rank, placement.role.value, run_dir,
             sum(len(r) for r in remaining))
    return RunSetup(
        config=config, env=env, device=device, placement=placement, run_dir=run_dir, spec=spec, prepared=prepared,
        plans_jobs=tuple(p.jobs for p in plans), remaining=remaining, resume_path=resume_path, drafter_group=group,
        target_group=target_group, context_group=context_group,
        finished=resume_path is not None and _finished(config, run_dir, resume_path, remaining),
    )


def _shared_run_dir(config: Config, env: DistEnv, control: ControlPlane,
                    on_claim: Callable[[RunClaim], None]) -> Path:
    """The run dir: rank 0 claims it and publishes it; the others wait for it, and a rank on another node checks it
    sees the same folder (a token rank 0 wrote), not a local namesake."""
    if env.rank == 0:
        claim = claim_run_dir(config, "train")
        on_claim(claim)
        control.set_value("run_dir_token", publish_token(claim.path))
        # absolute: a relative run.dir (or the default runs/NAME-TIME) names rank 0's folder on every node, whatever
        # folder a node's ranks run in; links are kept, since a node may mount the storage behind another real path
        control.set_value("run_dir", os.path.abspath(claim.path))
        return claim.path
    run_dir = Path(control.wait_value("run_dir"))
    if env.rank >= env.local_world_size:
        check_sees_token(run_dir, control.wait_value("run_dir_token"),
                         timeout_s=min(SHARED_VIEW_TIMEOUT_S, config.pipeline.timeout_s))
    return run_dir


def _process_groups(env: DistEnv, placement: Placement) -> tuple[Optional[dist.ProcessGroup], ...]:
    """(the drafters' group, this rank's target group, its context group): None where there is none. Every rank
    takes part in creating every group, in the same order."""
    group = target_group = context_group = None
    if env.distributed:
        group = dist.new_group(list(placement.drafter_ranks))
        for ranks in placement.target_groups if placement.target_parallel > 1 else ():
            created = dist.new_group(list(ranks))
            target_group = created if env.rank in ranks else target_group
        for ranks in placement.context_groups if placement.context_parallel > 1 else ():
            created = dist.new_group(list(ranks))
            context_group = created if env.rank in ranks else context_group
    return group, target_group, context_group


def check_target_groups(config: Config) -> None:
    """What a run with target groups cannot do yet: evaluate tau during the run (the evaluating target rank would
    decode alone, while the other ranks of its group hold the rest of its weights)."""
    if config.pipeline.target_parallel > 1 and eval_enabled(config):
        raise ConfigError(
            f"pipeline.target_parallel={config.pipeline.target_parallel}: evaluating tau during a run needs the whole "
            "target on one rank; set eval.interval=0 and eval.at_end=false"
        )


def check_context_parallel(config: Config) -> None:
    """What a context-parallel run cannot do yet (distillation is refused with the config, `config.py`): FSDP2 of
    the drafter (a CP group's ranks would also shard the weights among themselves, and the dry-rank dummy batches
    of a partial last step do not know the group's shards)."""
    cp = config.pipeline.context_parallel
    if cp > 1 and config.train.fsdp:
        raise ConfigError(
            f"pipeline.context_parallel={cp} with train.fsdp=true is not supported: set train.fsdp=false (the "
            "drafter's weights are replicated on every rank of a CP group)"
        )


def check_cpu_step_memory(config: Config, spec: DrafterSpec, device: torch.device) -> None:
    """On the CPU the drafter attends through dense (queries x keys) masks, whose memory grows with the square of
    the batch: refuse a token budget whose step would not fit, rather than be killed by the kernel mid-step."""
    if device.type != "cpu":
        return
    shape = config.batch
    setting = config.train.blocks_per_chunk  # the CPU chunks only when set (`train/chunking.py`)
    blocks = even_chunks(shape.num_blocks, setting) if setting else shape.num_blocks
    need = dense_step_bytes(num_blocks=blocks, block_size=spec.block_size,
                            token_budget=shape.token_budget, num_layers=spec.num_layers)
    free = available_host_bytes()
    if free is not None and need > free:
        at_once = f"{blocks} at a time (train.blocks_per_chunk)" if blocks < shape.num_blocks else "all at once"
        raise ConfigError(
            f"pipeline.token_budget={shape.token_budget} is too large for training on the CPU: its {shape.num_blocks} "
            f"blocks of {spec.block_size}, {at_once}, attend through dense masks, about {need / 2**30:.1f} GiB a "
            f"step, and {free / 2**30:.1f} GiB is available. Lower pipeline.token_budget (the memory grows with its "
            "square), set a smaller train.blocks_per_chunk, or train on a GPU (flex attention)"
        )


def _finished(config: Config, run_dir: Path, resume_path: Path, remaining: tuple[tuple[Job, ...], ...]) -> bool:
    """Whether the run to resume ended well (summary status ok) with nothing left: a resume would only replace its
    summary with an empty session's. More epochs, a higher `train.max_steps` or `train.max_minutes` leave work."""
    path = RunDir(run_dir).summary
    try:
        status = json.loads(path.read_text()).get("status")
    except FileNotFoundError:  # a run stopped before it wrote one
        return False
    except (OSError, ValueError, AttributeError) as e:
        log.warning("%s cannot be read (%s): the run is taken as not finished and resumed; its new summary replaces "
                    "it", path, type(e).__name__)
        return False
    max_steps, max_minutes = config.train.max_steps, config.train.max_minutes
    done = (not any(remaining) or (max_steps is not None and read_step(resume_path) >= max_steps)
            or (max_minutes is not None and read_time_spent_s(resume_path) >= 60.0 * max_minutes))
    return status == "ok" and done


def epoch_plan(config: Config, run_dir: Path, prepared: PreparedData, epoch: int) -> EpochPlan:
    """Read the epoch's plan back when it exists (resume), else build and write it."""
    if RunDir(run_dir).epoch_plan(epoch).is_file():
        return read_epoch_plan(run_dir, epoch)
    plan = plan_epoch(config, prepared.train.lengths, epoch)
    write_epoch_plan(run_dir, plan)
    return plan


def load_checked_target(setup: RunSetup, control: ControlPlane) -> tuple[torch.nn.Module, TapCapture]:
    """The target, checked against the drafter's spec, and its tap capture (layers compiled when asked)."""
    config, spec = setup.config, setup.spec
    # A target group's ranks each build the whole target on the host, identically, then keep their shards: the
    # target ranks of a node take turns (pipeline.target_loads_per_node at once), so the host holds that many
    # copies. They go by local rank, i.e. group by group, so each group is whole as early as it can be. Sharding
    # is local (no collective): a rank inside its turn never waits for one still waiting for its turn.
    sharded = setup.target_group is not None
    env = setup.env
    turn = (control.turns(f"target_load/node{env.rank // env.local_world_size}",
                          config.pipeline.target_loads_per_node, place=env.local_rank) if sharded else nullcontext())
    with turn:
        target = load_target(config.target, "cpu" if sharded else setup.device, seed=config.run.seed)
        check_target(
            target, tap_layer_ids=list(spec.tap_layer_ids), drafter_hidden_size=spec.hidden_size,
            mask_token_id=spec.mask_token_id, max_length=config.data.max_length,
        )
        if sharded:
            target = shard_target(target, setup.target_group, setup.device)
    capture = TapCapture(target, spec.tap_layer_ids, capture_last_hidden=config.drafter.needs_last_hidden,
                         cudnn_attention=config.target.cudnn_attention)
    if config.target.compile and setup.device.type == "cuda":
        # Each layer compiled (hooks and early exit stay eager); padded shapes vary by job, so dynamic.
        compile_decoder_layers(target, upto=capture.stop_layer, dynamic=None)
    return target, capture


def run_wire_spec(setup: RunSetup) -> WireSpec:
    """The shape of this run's hidden-state batches."""
    return wire_spec(setup.config, hidden=setup.spec.hidden_size, num_taps=setup.spec.num_taps)
