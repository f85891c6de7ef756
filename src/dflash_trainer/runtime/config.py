"""Configuration of the target/drafter pipeline."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_trainer.errors import ConfigError


@dataclass
class PipelineConfig:
    token_budget: int = 16384
    """Tokens per packed batch (fixed shape of every hidden-state batch)."""
    num_targets: int = 1
    """Target ranks per node (the first local ranks) of a split run; colocated runs have a target on every rank."""
    target_parallel: int = 1
    """Ranks per target: each target is a group of this many consecutive local ranks holding one tensor-parallel
    copy (for a target larger than one GPU); the group's first rank sends the taps, the others compute only.
    A split run then has `num_targets * target_parallel` target ranks per node, and at least one drafter."""
    context_parallel: int = 1
    """Ranks that share one sequence (CP, for sequences longer than one GPU holds): each holds a contiguous shard of
    its tokens for the target's forward (attention across the shards) and the drafter's step (context keys and
    values gathered). Groups of this many consecutive ranks of a colocated run; a batch then holds one sequence,
    padded to `token_budget`, which must split evenly. A group pulls one job at a time and counts as one
    data-parallel replica (`runtime/feed.py`, `train/micro_step.py`). Not with FSDP2 or distillation yet."""
    target_loads_per_node: int = 1
    """Target-group ranks of one node that load the target at once: each reads the whole checkpoint into host
    memory before it keeps its shard, so the host needs this many copies of the model; the others wait, group
    by group (the start takes about target ranks per node / this many loads)."""
    colocated: bool = False
    """Every rank runs both a target and a drafter (forced with one process)."""
    min_ready: int = 2
    """A drafter takes a batch only when this many are ready (or all producers are done)."""
    pool_capacity: int = 4
    """Slots in each drafter's buffered pool (bounds memory)."""
    target_postprocess_depth: int = 2
    """Batches in flight between a target's forward and its sender thread."""
    deterministic: bool = False
    """One target, first-in first-out pool, RNG keyed by job (exact tests)."""
    liveness_timeout_s: float = 30.0
    """A rank whose heartbeat (a background thread's, every ~2 s) stops for this long ends the job, named as
    the failing rank (frozen, stopped or killed); 0 disables. Long pauses of training itself do not count."""
    timeout_s: float = 1800.0
    """Bound on any single wait (store, pool, sender, collectives): a stuck pipeline fails after this long.
    Failures themselves end the job within seconds (abort flag, torchrun); tests shorten this bound."""

    def __post_init__(self) -> None:
        if self.token_budget < 16:
            raise ConfigError(f"pipeline.token_budget must be >= 16, got {self.token_budget}")
        for key in ("num_targets", "target_parallel", "context_parallel", "target_loads_per_node", "min_ready",
                    "pool_capacity", "target_postprocess_depth"):
            if getattr(self, key) < 1:
                raise ConfigError(f"pipeline.{key} must be >= 1, got {getattr(self, key)}")
        if self.colocated and self.num_targets != 1:
            raise ConfigError(
                f"pipeline.num_targets={self.num_targets} has no effect with pipeline.colocated=true (every rank runs "
                "a target and a drafter): drop pipeline.num_targets, or set pipeline.colocated=false for a split run"
            )
        if self.colocated and self.target_parallel != 1:
            raise ConfigError(
                f"pipeline.target_parallel={self.target_parallel} needs a split run (a target group feeds drafter "
                "ranks); set pipeline.colocated=false and launch num_targets * target_parallel target ranks plus at "
                "least one drafter rank per node"
            )
        if self.context_parallel > 1 and self.token_budget % self.context_parallel:
            multiple = -(-self.token_budget // self.context_parallel) * self.context_parallel
            raise ConfigError(
                f"pipeline.context_parallel={self.context_parallel} splits each batch's pipeline.token_budget="
                f"{self.token_budget} slots into equal shards: set pipeline.token_budget to a multiple of "
                f"{self.context_parallel} (e.g. {multiple})"
            )
        if self.context_parallel > 1 and not self.colocated:
            raise ConfigError(
                f"pipeline.context_parallel={self.context_parallel} needs pipeline.colocated=true: each rank of a CP "
                "group runs its shard's target forward and drafter step, so the taps never leave its GPU"
            )
        if self.context_parallel > 1 and self.target_parallel > 1:
            raise ConfigError(
                f"pipeline.context_parallel={self.context_parallel} with pipeline.target_parallel="
                f"{self.target_parallel} is not supported: set one of them to 1"
            )
        if self.min_ready > self.pool_capacity:
            raise ConfigError(
                f"pipeline.min_ready ({self.min_ready}) must be <= pipeline.pool_capacity ({self.pool_capacity})"
            )
        if not self.liveness_timeout_s >= 0:
            raise ConfigError(f"pipeline.liveness_timeout_s must be >= 0 (0 disables), got {self.liveness_timeout_s}")
        if self.timeout_s <= 0:
            raise ConfigError(f"pipeline.timeout_s must be > 0, got {self.timeout_s}")
