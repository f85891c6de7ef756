"""The drafter step loop: gradient accumulation over pool batches, one small all-reduce per step.

Per optimizer step each drafter rank takes up to `grad_accum` batches from its pool, runs forward +
backward on the *unnormalised* weighted loss sum, then all ranks all-reduce one small stats vector
(batches, loss-weight sum, loss sum, non-finite flag, ...). From it every rank knows, identically:
- the step's total loss weight: gradients are summed over ranks and divided by it, so the loss is
  normalised over the whole step (all microbatches of all ranks), not per microbatch;
- whether any rank saw NaN/inf: then every rank skips the step together;
- whether every rank ran dry: then the run ends together (a partial last step is still taken);
- the training time spent (the first rank's clock less its pauses for evaluations, plus what earlier sessions
  of a resumed run spent: one value everywhere, for the schedule); once it reaches the time budget, this is the
  last step everywhere;
- whether a rank was asked to stop (SIGTERM, Ctrl-C): then this is the last step everywhere.
A job is committed (enters the ledger) when the optimizer step that used it completes.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from dflash_trainer.faults import maybe_fault
from dflash_trainer.train.optim import sync_scale_and_clip
from dflash_trainer.train.parallel import set_gradient_sync

log = logging.getLogger(__name__)

SLOW_START_SHARE = 0.2
"""A first step that ends later than this share of the time budget into a session is warned about."""

B = TypeVar("B")


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroResult:
    """What one microbatch's forward + backward produced (device tensors, no host sync)."""

    loss_sum: torch.Tensor
    """0-d fp32: sum of weighted per-slot losses (already back-propagated)."""
    weight_sum: torch.Tensor
    """0-d fp32: sum of the loss weights."""
    slot_correct: torch.Tensor
    """(B-1,) fp32: argmax hits among valid labels, per block slot k = 1..B-1."""
    slot_count: torch.Tensor
    """(B-1,) fp32: valid labels per block slot."""
    tau_sum: torch.Tensor
    """0-d fp32: sum over valid blocks of the simulated acceptance length."""
    num_blocks: torch.Tensor
    """0-d fp32: valid blocks."""
    num_tokens: int
    """Real tokens this rank trained on (host value from the batch header): the batch's, or under context
    parallel its shard's (the group's add up to the batch's)."""
    counts_batch: bool = True
    """Whether this rank counts the batch in the step's totals: a CP group's ranks train one batch together, and
    only its first rank counts it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    step: int
    """Optimizer steps completed after this one."""
    skipped: bool
    loss: float
    accuracy: float
    """Argmax hits / valid labels over all slots."""
    slot_accuracy: tuple[float, ...]
    """Per block slot k = 1..B-1."""
    sim_tau: float
    grad_norm: float
    lr: float
    batches: int
    tokens: int
    job_ids: tuple[int, ...]
    """Jobs committed by this step (all ranks)."""
    step_time_s: float
    wait_time_s: float


@dataclass
class LoopState:
    step: int = 0
    skipped_steps: int = 0
    tokens: int = 0
    committed: list[tuple[int, int]] = field(default_factory=list)
    """(epoch, job_id) committed by this run, in commit order."""
    time_spent_s: float = 0.0
    """Training time by the last step, earlier sessions included, evaluations not (the same on every rank)."""
    time_fraction: float = 0.0
    """`time_spent_s` over the time budget (0 without a budget)."""

    stop_requested: bool = False
    """A rank was asked to stop (a signal): the run stopped after the last step."""

    @property
    def out_of_time(self) -> bool:
        return self.time_fraction >= 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTotals:
    """One optimizer step's sums over every drafter rank, read on the host after the step's one all-reduce
    (the same values on every rank)."""

    loss_sum: float
    """Weighted loss, non-finite microbatches counted as 0 (see `nonfinite`)."""
    weight_sum: float
    tau_sum: float
    blocks: float
    nonfinite: float
    """Microbatches whose loss was NaN/inf."""
    slot_correct: tuple[float, ...]
    """(B-1,) argmax hits per block slot."""
    slot_count: tuple[float, ...]
    batches: float
    tokens: float
    time_spent_s: float
    """The first rank's training time (the others add 0): read before the collective, the clocks of the other
    ranks may not yet include a pause of the first one that they will wait through."""
    stop: float
    """Ranks asked to stop."""

    DEVICE_SUMS = ("loss_sum", "weight_sum", "tau_sum", "blocks", "nonfinite")
    HOST_SUMS = ("batches", "tokens", "time_spent_s", "stop")

    @classmethod
    def width(cls, slots: int) -> int:
        """Length of the packed vector that is all-reduced."""
        return len(cls.DEVICE_SUMS) + 2 * slots + len(cls.HOST_SUMS)

    @classmethod
    def unpack(cls, flat: Sequence[float], slots: int) -> "StepTotals":
        """From the reduced vector [device sums, slot correct, slot count, host sums] read back on the host."""
        n = len(cls.DEVICE_SUMS)
        values = dict(zip(cls.DEVICE_SUMS, flat[:n]))
        values.update(zip(cls.HOST_SUMS, flat[n + 2 * slots : cls.width(slots)]))
        return cls(slot_correct=tuple(flat[n : n + slots]), slot_count=tuple(flat[n + slots : n + 2 * slots]),
                   **values)


class StepLoop(Generic[B]):
    """Runs optimizer steps until the pools of all drafter ranks are dry or `max_steps` is reached."""

    def __init__(
        self,
        *,
        start_step: int = 0,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        micro_step: Callable[[B], MicroResult],
        job_key: Callable[[B], Optional[tuple[int, int]]],
        grad_accum: int,
        block_size: int,
        grad_clip: float,
        group: Optional[dist.ProcessGroup],
        device: torch.device,
        max_steps: Optional[int] = None,
        max_nonfinite_steps: int = 10,
        dummy_batch: Optional[B] = None,
        time_budget_s: Optional[float] = None,
        time_spent_s: float = 0.0,
        stop_requested: Callable[[], bool] = lambda: False,
    ) -> None:
        """`dummy_batch` (FSDP2 only): a batch with no supervised token, run by a rank that has no batch;
        `time_budget_s`: the run stops once it has trained this long (counted from `run`, plus `time_spent_s`, the
        training time of earlier sessions of a resumed run, less the paused time); `stop_requested()`:
        True once this rank is asked to stop (every rank then stops after the same step)."""
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.micro_step = micro_step
        self.job_key = job_key
        self.grad_accum = grad_accum
        self.slots = block_size - 1
        self.grad_clip = grad_clip
        self.group = group
        self.device = device
        self.max_steps = max_steps
        self.max_nonfinite_steps = max_nonfinite_steps
        self.dummy_batch = dummy_batch
        self.time_budget_s = time_budget_s
        self.time_spent_before_s = time_spent_s
        self.stop_requested = stop_requested
        self._started = time.monotonic()
        self._paused_s = 0.0
        self.world = dist.get_world_size(group) if group is not None else 1
        self.clock_rank = group is None or dist.get_rank(group) == 0
        """This rank's clock is the run's (its pauses, for the evaluations it runs, are left out)."""
        self.state = LoopState(step=start_step, time_spent_s=time_spent_s,
                               time_fraction=time_spent_s / time_budget_s if time_budget_s else 0.0)

    def run(
        self,
        take: Callable[[], Optional[tuple[B, Callable[[], None]]]],
        on_step: Callable[[StepRecord], None] = lambda record: None,
    ) -> LoopState:
        """`take` returns (batch, release) or None when this rank's pool is dry for good."""
        self._started = time.monotonic()
        first = True
        while self.max_steps is None or self.state.step < self.max_steps:
            record = self.step(take)
            if record is None:
                break
            if first:
                self._warn_on_slow_start()
                first = False
            on_step(record)
            if self.state.out_of_time or self.state.stop_requested:
                break
        return self.state

    def _warn_on_slow_start(self) -> None:
        """The time budget counts this session's start (compiling, the first batches); the lr schedule follows
        the budget, so a start that takes much of it leaves little training at the peak lr: say so."""
        if not (self.time_budget_s and self.clock_rank):
            return
        share = (self.state.time_spent_s - self.time_spent_before_s) / self.time_budget_s
        if share > SLOW_START_SHARE:
            log.warning("the first step ended %.0f s after the training loop started, %.0f%% of the time budget "
                        "(train.max_minutes): the time before it (compiling, the first target batches) counts as "
                        "training time, and the lr schedule follows it. Raise train.max_minutes, or find what the "
                        "start waited on", self.state.time_spent_s - self.time_spent_before_s, 100 * share)

    def pause(self, seconds: float) -> None:
        """Leave `seconds` (spent between steps on this rank, e.g. on an evaluation) out of the training time.
        Only the first rank's pauses count: its clock is the run's, and the other ranks wait for it."""
        self._paused_s += seconds

    def step(self, take) -> Optional[StepRecord]:
        maybe_fault("drafter_step", self.state.step + 1)  # test-only hook
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)  # the first backward writes the gradients (no add, no fill)
        packed, releases, keys, wait = self._microbatches(take)
        if self.group is not None and self.world > 1:
            dist.all_reduce(packed, group=self.group)
        gathered = self._gather_jobs(keys)  # (world * grad_accum, 2)
        weight_sum = packed[StepTotals.DEVICE_SUMS.index("weight_sum")]
        grad_norm_t = sync_scale_and_clip(self.params, weight_sum, max_norm=self.grad_clip, group=self.group,
                                          sharded=self.dummy_batch is not None)
        # One host sync per step: every rank needs the same skip / stop decision, the ledger and the log values.
        flat = torch.cat([packed, grad_norm_t.double().reshape(1), gathered.double().reshape(-1)]).tolist()
        width = StepTotals.width(self.slots)
        totals, grad_norm, rows = StepTotals.unpack(flat, self.slots), flat[width], flat[width + 1 :]
        job_ids = [(int(e), int(j)) for e, j in zip(rows[0::2], rows[1::2]) if j >= 0]
        self.state.time_spent_s = totals.time_spent_s  # the first rank's, on every rank
        self.state.time_fraction = self.state.time_spent_s / self.time_budget_s if self.time_budget_s else 0.0
        self.state.stop_requested = totals.stop > 0
        if totals.batches == 0:
            for release in releases:
                release()
            return None
        skipped = totals.nonfinite > 0 or not math.isfinite(grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self._apply(skipped, int(totals.tokens))
        # Skipped jobs are committed too: they were consumed, and a resume must not redo them.
        self.state.committed.extend(job_ids)
        for release in releases:
            release()
        return StepRecord(
            step=self.state.step,
            skipped=skipped,
            # A NaN/inf loss is logged as such (NaN), not as the 0 it was zeroed to for the all-reduce.
            loss=float("nan") if totals.nonfinite > 0 else totals.loss_sum / max(totals.weight_sum, 1e-12),
            accuracy=sum(totals.slot_correct) / max(sum(totals.slot_count), 1.0),
            slot_accuracy=tuple(c / max(n, 1.0) for c, n in zip(totals.slot_correct, totals.slot_count)),
            sim_tau=totals.tau_sum / max(totals.blocks, 1.0),
            grad_norm=float("nan") if totals.nonfinite > 0 else grad_norm,  # a NaN loss: no real gradient
            lr=lr,
            batches=int(totals.batches),
            tokens=int(totals.tokens),
            job_ids=tuple(j for _, j in job_ids),
            step_time_s=time.perf_counter() - start,
            wait_time_s=wait,
        )

    def _microbatches(self, take) -> tuple[torch.Tensor, list[Callable[[], None]], list[tuple[int, int]], float]:
        """Forward + backward of up to `grad_accum` batches. Returns the vector to all-reduce (the layout of
        `StepTotals`, on the device), the batches' releases, their (epoch, job id) and the host time spent
        waiting for them."""
        sums = torch.zeros(len(StepTotals.DEVICE_SUMS), dtype=torch.float64, device=self.device)
        slots = torch.zeros(2, self.slots, dtype=torch.float64, device=self.device)  # (2, B-1) correct, count
        host = dict.fromkeys(StepTotals.HOST_SUMS, 0.0)
        releases, keys, wait, dry = [], [], 0.0, False
        for micro in range(self.grad_accum):
            set_gradient_sync(self.model, micro == self.grad_accum - 1)
            got = None
            if not dry:
                t0 = time.perf_counter()
                got = take()
                wait += time.perf_counter() - t0
            if got is None:
                dry = True
                if self.dummy_batch is None:
                    break
                # FSDP2: every rank runs the same number of backward passes (their reduce-scatters pair up);
                # a dry rank runs a zero-weight batch that adds nothing to the loss or the gradients.
                self.micro_step(self.dummy_batch)
                continue
            batch, release = got
            releases.append(release)
            key = self.job_key(batch)  # None: another rank reports it (a context-parallel group's first rank)
            if key is not None:
                keys.append(key)
            out = self.micro_step(batch)
            host["batches"] += out.counts_batch
            host["tokens"] += out.num_tokens
            sums += torch.stack([
                torch.nan_to_num(out.loss_sum.detach().double(), nan=0.0, posinf=0.0, neginf=0.0),
                out.weight_sum.detach().double(), out.tau_sum.detach().double(), out.num_blocks.detach().double(),
                1.0 - torch.isfinite(out.loss_sum).to(torch.float64),
            ])
            slots += torch.stack([out.slot_correct.detach().double(), out.slot_count.detach().double()])
        if self.clock_rank:
            host["time_spent_s"] = self.time_spent_before_s + time.monotonic() - self._started - self._paused_s
        host["stop"] = float(self.stop_requested())
        host_t = torch.tensor([host[k] for k in StepTotals.HOST_SUMS], dtype=torch.float64)
        packed = torch.cat([sums, slots.reshape(-1), host_t.to(self.device, non_blocking=True)])  # one copy a step
        return packed, releases, keys, wait

    def _apply(self, skipped: bool, tokens: int) -> None:
        """The optimizer step, or the skip of a step with NaN/inf (on every rank at once)."""
        if not skipped:
            self.optimizer.step()
            self.scheduler.step()
            self.state.step += 1
            self.state.tokens += tokens
            return
        self.state.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        log.warning("non-finite loss or gradient: step skipped on all ranks (%d so far)", self.state.skipped_steps)
        if self.state.skipped_steps > self.max_nonfinite_steps:
            raise FloatingPointError(
                f"{self.state.skipped_steps} steps had NaN/inf loss or gradients (limit "
                f"train.max_nonfinite_steps={self.max_nonfinite_steps}): check the data and lower train.lr"
            )

    def _gather_jobs(self, keys: Sequence[tuple[int, int]]) -> torch.Tensor:
        """(world * grad_accum, 2) int64 device tensor: (epoch, job_id) of this step's batches on all ranks,
        -1 padded (a fixed-size all-gather; read on the host with the step's other values)."""
        local = torch.full((self.grad_accum, 2), -1, dtype=torch.int64)
        if any(not 0 <= k < 2**53 for key in keys for k in key):  # the host reads them through float64
            raise ValueError(f"epoch and job ids must be in [0, 2**53), got {keys}")
        if keys:
            local[: len(keys)] = torch.tensor(keys, dtype=torch.int64)
        local = local.to(self.device, non_blocking=True)
        if self.group is None or self.world == 1:
            return local
        gathered = torch.empty(self.world * self.grad_accum, 2, dtype=torch.int64, device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        gather(gathered, local, group=self.group)
        return gathered
