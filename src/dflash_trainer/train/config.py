"""Configuration of the optimizer, schedule and checkpoints."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from dflash_trainer.errors import ConfigError

COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
SCHEDULES = ("cosine", "wsd")
OPTIMIZERS = ("adamw", "muon")
MUON_LR_RATIO = 10.0
"""Muon's default peak lr over train.lr (speculators' default since its PR #746)."""


@dataclass
class TrainConfig:
    num_epochs: int = 1
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps (None: run all epochs)."""
    max_minutes: Optional[float] = None
    """Also stop once training has run this many minutes (None: no time limit); the final checkpoint, export
    and evaluation follow. The lr schedule (and the noise schedule) then advance by steps or by time,
    whichever is further along, so they end with the budget. Evaluations during training do not count; the
    training time of earlier sessions of a resumed run does (up to its checkpoint)."""
    grad_accum: int = 1
    """Pool batches per optimizer step on each drafter rank."""
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    schedule: str = "cosine"
    """After the warmup: cosine (decay to min_lr_ratio * lr) | wsd (hold the peak, then decay linearly to it over
    the last `decay_ratio` of training)."""
    decay_ratio: float = 0.2
    """wsd: the fraction of training spent decaying."""
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    optimizer: str = "adamw"
    """adamw | muon: Muon steps the drafter's weight matrices and AdamW (train.lr, train.betas) the rest; the
    vocabulary tables (any parameter with a vocabulary-sized dimension, or an embedding: DFlash2's codebooks,
    DSpark's Markov factors) stay out of Muon but step at its lr. train.weight_decay applies to all, the schedule
    scales every lr alike."""
    muon_lr: Optional[float] = None
    """train.optimizer=muon: Muon's peak lr (null: 10 x train.lr). Its step is scaled by 0.2 sqrt(max(rows, cols))
    per matrix, which makes its RMS about AdamW's at the same lr."""
    muon_momentum: float = 0.95
    """train.optimizer=muon: Muon's (Nesterov) momentum."""
    muon_table_lr: Optional[float] = None
    """train.optimizer=muon: the vocabulary tables' peak lr (AdamW; null: Muon's lr)."""
    grad_clip: float = 1.0
    ema_decay: Optional[float] = None
    """Evaluate, export and choose the best drafter by an exponential moving average of the weights with this
    decay per optimizer step (e.g. 0.999); None: the weights as trained."""
    dtype: str = "bfloat16"
    """Compute dtype of the drafter (weights and optimizer state stay fp32)."""
    compile: bool = True
    """torch.compile the drafter's training forward on CUDA (uncompiled flex attention materialises the
    scores: many times slower, and far more memory). No effect on CPU."""
    compile_mode: Optional[str] = None
    """torch.compile's `mode` for that forward: null (the default) | reduce-overhead (CUDA graphs) |
    max-autotune | max-autotune-no-cudagraphs."""
    blocks_per_chunk: int = 0
    """The most drafter blocks whose activations are alive at once. The step runs a batch's blocks in equal chunks
    of at most this many (forward, loss, backward per chunk; the context's keys and values computed once), so the
    blocks' share of its memory stops growing with the sequence; the loss and gradients are those of one pass.
    0: chosen from the free GPU memory at start, and logged (one pass whenever the whole batch fits; on the CPU
    always one pass). With FSDP2 sharding the step always runs one pass. A speed and memory knob only."""
    fsdp: Optional[bool] = None
    """Shard the drafter with FSDP2 over the drafter ranks. None: when its weights and Adam state (16 bytes
    per parameter) would take more than a quarter of a GPU; true/false: always/never (CPU: only if true)."""
    resume: Optional[str] = None
    """latest | a checkpoint path (--resume is short for latest)."""
    overwrite: bool = False
    """Replace a training run already in run.dir (--overwrite); without it, or train.resume, that is an error."""
    keep_last: int = 3
    checkpoint_interval: int = 500
    log_interval: int = 10
    max_nonfinite_steps: int = 10
    """Stop the run after this many skipped NaN/inf steps."""

    def __post_init__(self) -> None:
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"train.betas must be two values in [0, 1), got {self.betas}")
        if self.num_epochs < 1:
            raise ConfigError(f"train.num_epochs must be >= 1, got {self.num_epochs}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"train.max_steps must be >= 1 or null, got {self.max_steps}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ConfigError(f"train.max_minutes must be > 0 or null, got {self.max_minutes}")
        if self.resume is not None and self.overwrite:
            raise ConfigError("train.resume and train.overwrite exclude each other: continue the run or replace it")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"train.lr must be a finite number > 0, got {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"train.weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"train.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            raise ConfigError(f"train.ema_decay must be in (0, 1) or null, got {self.ema_decay}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"train.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not 0 < self.decay_ratio <= 1 - self.warmup_ratio:
            raise ConfigError(f"train.decay_ratio must be in (0, 1 - train.warmup_ratio], got {self.decay_ratio}")
        if self.schedule != "wsd" and self.decay_ratio != TrainConfig.__dataclass_fields__["decay_ratio"].default:
            raise ConfigError(f"train.decay_ratio={self.decay_ratio} is read only with train.schedule=wsd (the "
                              f"{self.schedule} schedule decays over all of training): set train.schedule=wsd, or "
                              f"drop train.decay_ratio (a recipe's: train.decay_ratio="
                              f"{TrainConfig.__dataclass_fields__['decay_ratio'].default}, its default)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.blocks_per_chunk < 0:
            raise ConfigError(f"train.blocks_per_chunk must be >= 0 (0: chosen from the free GPU memory), got "
                              f"{self.blocks_per_chunk}")
        for key in ("grad_accum", "keep_last", "checkpoint_interval", "log_interval"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key} must be >= 1, got {getattr(self, key)}")
        if not self.grad_clip >= 0 or math.isinf(self.grad_clip):
            raise ConfigError(f"train.grad_clip must be >= 0 (0 disables), got {self.grad_clip}")
        if self.compile_mode not in COMPILE_MODES:
            raise ConfigError(f"train.compile_mode must be one of {COMPILE_MODES}, got {self.compile_mode!r}")
        self._check_optimizer()
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError(f"train.dtype must be bfloat16, float16 or float32, got {self.dtype!r}")

    def _check_optimizer(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"train.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        for key in ("muon_lr", "muon_table_lr"):
            value = getattr(self, key)
            if value is None:
                continue
            if self.optimizer != "muon":
                raise ConfigError(f"train.{key}={value} is read only with train.optimizer=muon: set "
                                  f"train.optimizer=muon, or drop train.{key} "
                                  f"(train.{key}=null where a recipe sets it)")
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"train.{key} must be a finite number > 0 or null, got {value!r}")
        if not 0 <= self.muon_momentum < 1:
            raise ConfigError(f"train.muon_momentum must be in [0, 1), got {self.muon_momentum}")
        if self.optimizer != "muon" and self.muon_momentum != TrainConfig.__dataclass_fields__["muon_momentum"].default:
            raise ConfigError(f"train.muon_momentum={self.muon_momentum} is read only with train.optimizer=muon: set "
                              "train.optimizer=muon, or drop train.muon_momentum (AdamW's are train.betas)")

    @property
    def muon_peak_lr(self) -> float:
        """Muon's peak lr: train.muon_lr, or MUON_LR_RATIO x train.lr."""
        return self.muon_lr if self.muon_lr is not None else MUON_LR_RATIO * self.lr

    @property
    def muon_table_peak_lr(self) -> float:
        """The vocabulary tables' peak lr under Muon: train.muon_table_lr, or Muon's."""
        return self.muon_table_lr if self.muon_table_lr is not None else self.muon_peak_lr
