"""The drafter side of a run: model, optimizer, resume, the step loop, checkpoints, logs, export.

Placement-free: the runtime hands it a `take()` that yields batches (from a pool filled by a receiver
thread or by the colocated target) and the drafters' process group.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from dflash_trainer.config import Config
from dflash_trainer.drafter.export import export_drafter, init_from_export, warm_start
from dflash_trainer.drafter.init import check_target_layers, init_from_target, target_tensor_names
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.spec import DrafterSpec
from dflash_trainer.errors import ConfigError
from dflash_trainer.faults import maybe_fault
from dflash_trainer.rundir import RunDir, input_dir_problem, write_atomic
from dflash_trainer.target.context_parallel import ShardGroup
from dflash_trainer.target.head import TargetHead, decoder_layout, read_target_tensors
from dflash_trainer.train.checkpoint import (
    COMPLETE,
    CheckpointState,
    LoadedCheckpoint,
    read_checkpoint_drafter,
    save_checkpoint,
)
from dflash_trainer.train.ema import WeightAverage, split_averaged
from dflash_trainer.train.metrics import RESUMED, build_sinks, read_metrics
from dflash_trainer.train.micro_step import compile_forward_train, make_micro_step, plan_step_chunks
from dflash_trainer.train.optim import build_optimizer
from dflash_trainer.train.parallel import (
    full_optimizer_state,
    full_weights,
    load_full_state,
    shard_drafter,
    want_sharding,
)
from dflash_trainer.train.schedule import build_scheduler
from dflash_trainer.train.step_loop import LoopState, StepLoop, StepRecord
from dflash_trainer.train.tau_eval import TauSummary
from dflash_trainer.train.throughput import ThroughputFigures, ThroughputMeter
from dflash_trainer.transport.wire import HiddenStateBatch

log = logging.getLogger(__name__)

Take = Callable[[], Optional[tuple[HiddenStateBatch, Callable[[], None]]]]


def model_signature(spec: DrafterSpec) -> dict:
    """What a checkpoint must share with the config to resume."""
    d = asdict(spec)
    if spec.variant == "dflash":  # a DFlash drafter's signature as before the variants: its checkpoints still resume
        d = {k: v for k, v in d.items() if k not in DFLASH2_FIELDS}
    if d.get("lattice", 0) is None:  # a drafter without LiLiCorr's lattice head: its signature as before that variant
        del d["lattice"]
    for key in DOMINO_FIELDS:  # Domino's head (read from exports, never trained): checkpoints keep their signature
        if not d.get(key):
            d.pop(key, None)
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items() if k != "rope_parameters"}


DFLASH2_FIELDS = ("variant", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DOMINO_FIELDS = ("domino_gru_hidden", "domino_emb_dim")


def data_fingerprint(config: Config, data_digest: str) -> str:
    """The training data's content digest plus the settings the epoch plans derive from: a checkpoint resumes
    on the same data and plans, even if the code that tokenized the data changed meanwhile."""
    parts = [data_digest, config.pipeline.token_budget, config.batch.max_seqs, config.data.num_buckets, config.run.seed]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


@dataclass
class TrainResult:
    state: LoopState
    ledger: dict[int, list[int]]
    """Committed job ids per epoch, resume included."""
    elapsed_s: float
    step_time_s: float
    """Drafter busy time (steps minus waiting for batches)."""
    wait_time_s: float
    last_record: Optional[StepRecord]
    checkpoints: list[str] = field(default_factory=list)
    export_dir: Optional[str] = None
    eval: Optional[TauSummary] = None
    """Real tau at the end, or None when not measured."""
    throughput: Optional[ThroughputFigures] = None
    """The session's token rates (`throughput.py`)."""


class DrafterTrainer:
    def __init__(
        self,
        config: Config,
        *,
        spec: DrafterSpec,
        head: TargetHead,
        device: torch.device,
        group: Optional[dist.ProcessGroup],
        is_leader: bool,
        run_dir: Path,
        data_digest: str,
        total_steps: int,
        resume: Optional[LoadedCheckpoint] = None,
        target_config=None,
        on_step: Callable[["DrafterTrainer", StepRecord], None] = lambda trainer, record: None,
        dummy_batch: Optional[HiddenStateBatch] = None,
        stop_requested: Callable[[], bool] = lambda: False,
        step_metrics: Callable[[], dict] = dict,
        shards: Optional[ShardGroup] = None,
    ) -> None:
        """`on_step(trainer, record)`: called after each step (evaluation); `dummy_batch`: a batch with no
        supervised token (needed with `train.fsdp`; see `parallel.py`); `stop_requested()`: True once this rank is
        asked to stop (a signal); `step_metrics()`: more figures for each step's metrics row (e.g. pool depth);
        `shards`: this rank's context-parallel group, whose ranks (all in `group`) train each batch together."""
        self.config = config
        self.spec = spec
        self.head = head
        self.device = device
        self.group = group
        self.is_leader = is_leader
        self.run_dir = run_dir
        self.target_config = target_config
        self.total_steps = max(1, total_steps)
        self.on_step_extra = on_step
        self.step_metrics = step_metrics
        self.signature = model_signature(spec)
        self.fingerprint = data_fingerprint(config, data_digest)
        self.model = build_drafter(config, spec, device, resuming=resume is not None)
        world = dist.get_world_size(group) if group is not None else 1
        # context parallel keeps the weights whole on every rank (train.fsdp=true is refused at start)
        self.sharded = shards is None and want_sharding(config.train.fsdp, self.model, device, world)
        if self.sharded:
            shard_drafter(self.model, group, device)
        if config.train.compile and device.type == "cuda":
            compile_forward_train(self.model, mode=config.train.compile_mode)
        self.optimizer = build_optimizer(self.model, config.train, vocab_size=spec.vocab_size, group=group)
        train = config.train
        self.scheduler = build_scheduler(self.optimizer, total_steps=self.total_steps, warmup_ratio=train.warmup_ratio,
                                         min_lr_ratio=train.min_lr_ratio, schedule=train.schedule,
                                         decay_ratio=train.decay_ratio, time_fraction=self.time_fraction)
        self.average = self._weight_average()
        self.ledger: dict[int, list[int]] = {}
        if resume is not None:
            self._restore(resume)
        self.chunks = plan_step_chunks(config, self.model, device)
        """How the step splits a batch's blocks; held-out validation drafts its anchors in the same chunks."""
        self.loop = self._step_loop(resume, head=head, shards=shards, dummy_batch=dummy_batch,
                                    stop_requested=stop_requested)
        if resume is not None:
            self.loop.state.tokens = int(resume.state.extra.get("tokens", 0))  # tokens_trained counts every session
            if is_leader:
                _truncate_metrics(RunDir(run_dir).metrics, resume.state.step)
        self.sink = build_sinks(run_dir, tensorboard=config.logging.tensorboard, wandb=config.logging.wandb,
                                enabled=is_leader, wandb_project=config.logging.wandb_project, config=asdict(config))
        if resume is not None:  # the report marks where each session of the run started
            self.sink.log(resume.state.step, {RESUMED: 1})
        self.checkpoints: list[str] = []
        self.shown: dict[str, str] = {}
        """Latest evaluation figures shown beside the training figures in the progress bar."""
        self.last_saved_step: Optional[int] = resume.state.step if resume is not None else None

    def _step_loop(self, resume: Optional[LoadedCheckpoint], *, head: TargetHead, shards: Optional[ShardGroup],
                   dummy_batch: Optional[HiddenStateBatch], stop_requested: Callable[[], bool]) -> StepLoop:
        """The optimizer-step loop over this trainer's model, from the resumed step and time spent."""
        config, train = self.config, self.config.train
        return StepLoop(
            start_step=resume.state.step if resume is not None else 0,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            micro_step=make_micro_step(config, self.model, head, device=self.device, progress=self.progress,
                                       shards=shards, chunks=self.chunks),
            # a CP group trains each job together: its first rank alone commits it (the ledger counts it once)
            job_key=lambda b: (b.epoch, b.job_id) if shards is None or shards.index == 0 else None,
            grad_accum=train.grad_accum,
            block_size=self.spec.draft_length + 1,  # the loop counts one accuracy per drafting slot
            grad_clip=train.grad_clip,
            group=self.group,
            device=self.device,
            max_steps=train.max_steps,
            max_nonfinite_steps=train.max_nonfinite_steps,
            dummy_batch=dummy_batch if self.sharded else None,
            time_budget_s=60.0 * train.max_minutes if train.max_minutes is not None else None,
            time_spent_s=float(resume.state.extra.get("time_spent_s", 0.0)) if resume is not None else 0.0,
            stop_requested=stop_requested,
        )

    def time_fraction(self) -> float:
        """Fraction of `train.max_minutes` spent (0 without a time budget)."""
        return self.loop.state.time_fraction if hasattr(self, "loop") else 0.0

    def progress(self) -> float:
        """Fraction of training done: of the steps, or of the time budget when that runs out first."""
        steps = self.loop.state.step / self.total_steps if hasattr(self, "loop") else 0.0
        return min(1.0, max(steps, self.time_fraction()))

    def _weight_average(self) -> Optional[WeightAverage]:
        decay = self.config.train.ema_decay
        if decay is None:
            return None
        if self.sharded:
            raise ConfigError("train.ema_decay is not supported with FSDP2 sharding yet: set train.fsdp=false (or "
                              "train.ema_decay=null)")
        return WeightAverage(self.model, decay)

    def _restore(self, ckpt: LoadedCheckpoint) -> None:
        saved = ckpt.state.extra.get("optimizer", "adamw")  # checkpoints from before train.optimizer: AdamW's
        if saved != self.config.train.optimizer:
            raise ConfigError(f"checkpoint {ckpt.path} was trained with train.optimizer={saved}, the config asks for "
                              f"train.optimizer={self.config.train.optimizer}: resume with train.optimizer={saved}, "
                              f"or start a new run.dir from its weights (drafter.init_from={ckpt.path})")
        weights, averaged = split_averaged(ckpt.weights)
        missing = set(self.model.state_dict()) ^ set(weights)
        if missing:
            raise ValueError(f"checkpoint {ckpt.path} weights do not match the drafter: {sorted(missing)[:4]}")
        load_full_state(self.model, self.optimizer, weights, ckpt.optimizer_state)
        if self.average is not None:
            loaded = self.average.load_state_dict(averaged)
            log.info("weight average (train.ema_decay): %s", "resumed" if loaded else
                     f"{ckpt.path} has none, it starts from the resumed weights")
        self.scheduler.load_state_dict(ckpt.state.scheduler)
        self.ledger = {e: list(ids) for e, ids in ckpt.state.ledger.items()}
        torch.set_rng_state(ckpt.rng["torch"])
        random.setstate((3, tuple(ckpt.python_random), None))
        log.info("resumed from %s at step %d (%d jobs committed)", ckpt.path, ckpt.state.step,
                 sum(len(v) for v in self.ledger.values()))

    def run(self, take: Take) -> TrainResult:
        start = time.perf_counter()
        meter = ThroughputMeter(start)
        busy = wait = 0.0
        last: Optional[StepRecord] = None
        seen = len(self.loop.state.committed)
        bar = self._progress_bar()

        def on_step(record: StepRecord) -> None:
            nonlocal busy, wait, last, seen
            busy += record.step_time_s - record.wait_time_s
            wait += record.wait_time_s
            last = record
            for e, j in self.loop.state.committed[seen:]:
                self.ledger.setdefault(e, []).append(j)
            seen = len(self.loop.state.committed)
            if self.average is not None and not record.skipped:
                self.average.update()
            rates = meter.step(record.tokens, record.step_time_s, record.wait_time_s, time.perf_counter())
            self._log(record, rates, bar)
            if record.step % self.config.train.checkpoint_interval == 0 and not record.skipped:
                self.save_checkpoint(record.step)
            maybe_fault("kill", record.step)  # test-only hooks: SIGKILL this rank / the whole job
            maybe_fault("kill_job", record.step)
            maybe_fault("wipe_run", record.step, run_dir=str(self.run_dir))
            extra_start = time.monotonic()
            self.on_step_extra(self, record)  # evaluations: not training time
            self.loop.pause(time.monotonic() - extra_start)

        state = self.loop.run(take, on_step)
        if bar is not None:
            bar.close()
        if state.out_of_time:
            log.info("train.max_minutes=%s reached: stopped after step %d", self.config.train.max_minutes, state.step)
        if state.stop_requested:
            log.info("stopped on request after step %d", state.step)
        return TrainResult(
            state=state, ledger=self.ledger, elapsed_s=time.perf_counter() - start, step_time_s=busy,
            wait_time_s=wait, last_record=last, checkpoints=self.checkpoints, throughput=meter.figures(),
        )

    def _progress_bar(self):
        if not (self.is_leader and self.config.logging.progress):
            return None
        from tqdm import tqdm

        return tqdm(total=self.total_steps, initial=self.loop.state.step, desc="train", unit="step", dynamic_ncols=True)

    def _log(self, record: StepRecord, rates: dict[str, Optional[float]], bar) -> None:
        """`rates`: the step's token rates (`throughput.py` defines them; steady tokens/s is None in the warm-up)."""
        if not self.is_leader:
            return
        steady = rates["tokens_per_s"]
        shown = "warm-up" if steady is None else f"{steady:,.0f}"
        values = {
            "loss": record.loss, "acc": record.accuracy, "sim_tau": record.sim_tau, "lr": record.lr,
            "grad_norm": record.grad_norm, "batches": record.batches, "tokens": record.tokens,
            **rates, "step_time_s": record.step_time_s, "wait_time_s": record.wait_time_s,
            "skipped": record.skipped, "jobs": list(record.job_ids),
            "slot_acc": [round(a, 4) for a in record.slot_accuracy], **self.step_metrics(),
        }
        self.sink.log(record.step, values)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{record.loss:.3f}", acc=f"{record.accuracy:.3f}", tau=f"{record.sim_tau:.2f}",
                            steady_tok_s=shown, **self.shown, refresh=False)
        elif record.step % self.config.train.log_interval == 0:
            log.info("step %d loss %.4f acc %.3f sim_tau %.2f lr %.2e steady tok/s %s", record.step, record.loss,
                     record.accuracy, record.sim_tau, record.lr, shown)

    def show_eval(self, summary: TauSummary) -> None:
        """Show an evaluation's held-out figures in the progress bar from now on."""
        self.shown = {"real_tau": f"{summary.tau:.2f}"}
        if summary.val is not None:
            self.shown |= {"val_walk_tau": f"{summary.val['walk_tau']:.2f}", "val_loss": f"{summary.val['loss']:.3f}"}

    def save_checkpoint(self, step: int) -> Optional[Path]:
        """Called on every drafter rank (with FSDP2 the full state is gathered by all); the leader writes."""
        self.last_saved_step = step
        if not (self.sharded or self.is_leader):
            return None
        weights = full_weights(self.model)
        optimizer_state = full_optimizer_state(self.model, self.optimizer)
        if not self.is_leader:
            return None
        if self.average is not None:
            weights = weights | self.average.state_dict()
        state = CheckpointState(
            step=step, epoch=max(self.ledger) if self.ledger else 0, ledger=self.ledger,
            model_signature=self.signature, data_fingerprint=self.fingerprint,
            scheduler=self.scheduler.state_dict(),
            extra={"tokens": self.loop.state.tokens, "time_spent_s": self.loop.state.time_spent_s,
                   "optimizer": self.config.train.optimizer},
        )
        path = save_checkpoint(self.run_dir, state, weights, optimizer_state, keep_last=self.config.train.keep_last)
        self.checkpoints.append(str(path))
        log.info("checkpoint %s", path)
        return path

    def full_model(self) -> Optional[DFlashDrafter]:
        """The drafter to evaluate and export, with full weights: the model itself, a copy holding the weight
        average (`train.ema_decay`), or with FSDP2 an unsharded copy on the leader (gathered by every drafter rank
        together; None on the others)."""
        if self.average is not None:
            copy = DFlashDrafter(self.spec, attention="sdpa").to(self.device)
            copy.load_state_dict(self.average.averaged_state(self.model))
            return copy
        if not self.sharded:
            return self.model
        weights = full_weights(self.model)
        if not self.is_leader:
            return None
        copy = DFlashDrafter(self.spec, attention="sdpa")
        copy.load_state_dict(weights)
        return copy.to(self.device)

    def export(self, out_dir: Path, model: Optional[DFlashDrafter] = None) -> Optional[Path]:
        """Export `model` (default: `full_model()`, a collective with FSDP2); written by the leader."""
        model = model if model is not None else self.full_model()
        if model is None:
            return None
        # Served next to the target: exported in its dtype (bf16 for real targets), as the released drafters are.
        return export_drafter(model, out_dir, target_config=self.target_config, dtype=getattr(torch, self.config.target.dtype))

    def close(self) -> None:
        self.sink.close()


def build_drafter(config: Config, spec: DrafterSpec, device: torch.device, *, resuming: bool = False) -> DFlashDrafter:
    """The drafter to train, initialised from the seed, the target's layers or an export (`drafter.init_from`).
    `resuming`: a checkpoint's weights replace these, so `drafter.init_from` is not read (it may be gone)."""
    torch.manual_seed(config.run.seed)
    model = DFlashDrafter(spec, attention=config.drafter.attention, mask_tiles=config.drafter.mask_tiles,
                          flex_kernel_options=config.drafter.flex_kernel_options).to(device)
    with torch.no_grad():
        model.init_weights()
    source = None if resuming else config.drafter.init_from
    if source and source != "target" and (problem := input_dir_problem("drafter.init_from", Path(source).expanduser())):
        raise ConfigError(f"{problem}; give a drafter export (RUN/export, RUN/best), a training checkpoint "
                          "(RUN/checkpoints/step_N), `target` (the target's own layers), or null (random weights)")
    if source == "target":
        layout = decoder_layout(config.target)
        check_target_layers(model, layout.layer_parameter_names)
        names = target_tensor_names(model, layout.prefix)
        init_from_target(model, read_target_tensors(config.target, sorted(set(names.values())), seed=config.run.seed))
        start = "the target's decoder layers"
    elif source and (Path(source) / COMPLETE).is_file():  # a training checkpoint
        ckpt = read_checkpoint_drafter(Path(source))
        warm_start(model, ckpt.weights, variant=ckpt.variant, tap_layer_ids=ckpt.tap_layer_ids,
                   where=f"drafter.init_from={source}")
        start = f"the training checkpoint {source}"
    elif source:
        init_from_export(model, source)
        start = f"the export {source}"
    elif resuming:
        log.info("drafter weights come from the checkpoint it resumes (drafter.init_from=%s is not read again)",
                 config.drafter.init_from)
        return model
    else:
        start = f"random weights (run.seed={config.run.seed})"
    log.info("drafter weights start from %s (drafter.init_from=%s; a resume then loads its checkpoint's)", start,
             source)
    return model


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop the rows a resumed run will write again (steps after its checkpoint), keeping the file's history."""
    if not path.is_file():
        return
    write_atomic(path, "".join(json.dumps(row) + "\n" for row in read_metrics(path, upto=step)))


def _data_steps(config: Config, remaining_jobs: int, num_drafters: int, start_step: int) -> int:
    """The step at which the remaining jobs run out: one job per drafter per micro-step, grad_accum a step."""
    return start_step + math.ceil(remaining_jobs / (config.train.grad_accum * max(1, num_drafters)))


def budget_note(config: Config, remaining_jobs: int, num_drafters: int, start_step: int) -> str:
    """Which budget ends the run (the data's epochs, train.max_steps) and what the other would allow; the minutes
    (train.max_minutes) are said when set, since only the run can tell whether they bind."""
    data_steps = _data_steps(config, remaining_jobs, num_drafters, start_step)
    epochs = f"train.num_epochs={config.train.num_epochs} ({remaining_jobs} jobs left)"
    max_steps = config.train.max_steps
    if max_steps is not None and max_steps < data_steps:
        note = f"train.max_steps={max_steps} ends this run at step {max_steps}; {epochs} would allow {data_steps}"
    elif max_steps is not None:
        note = (f"the data ends this run at step {data_steps}: {epochs}, before train.max_steps={max_steps}; "
                "raise train.num_epochs to train longer")
    else:
        note = f"the data ends this run at step {data_steps}: {epochs}"
    if config.train.max_minutes is not None:
        note += f", unless train.max_minutes={config.train.max_minutes} runs out first"
    return note


def planned_steps(config: Config, remaining_jobs: int, num_drafters: int, start_step: int) -> int:
    """Optimizer steps the schedule spans: the remaining jobs over (grad_accum x drafters), capped by max_steps."""
    steps = _data_steps(config, remaining_jobs, num_drafters, start_step)
    if config.train.max_steps is not None:
        steps = min(steps, config.train.max_steps)
    return max(1, steps)

