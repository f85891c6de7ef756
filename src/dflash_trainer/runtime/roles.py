"""Roles and placement: which rank runs the target, the drafter, or both."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dflash_trainer.errors import ConfigError
from dflash_trainer.runtime.config import PipelineConfig


class Role(str, enum.Enum):
    TARGET = "target"
    """A target, or the leader (first rank) of a target group: pulls jobs, captures and sends the taps."""
    TARGET_MEMBER = "target-member"
    """Another rank of a target group: runs its leader's jobs on its shard of the target, sends nothing."""
    DRAFTER = "drafter"
    COLOCATED = "colocated"

    @property
    def runs_target(self) -> bool:
        return self in (Role.TARGET, Role.COLOCATED)

    @property
    def runs_drafter(self) -> bool:
        return self in (Role.DRAFTER, Role.COLOCATED)


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Where this rank sits in the job and what every rank does."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    roles: tuple[Role, ...]
    """Role of every global rank."""
    target_parallel: int = 1
    """Ranks per target group (`pipeline.target_parallel`): a leader and the members that follow it."""
    context_parallel: int = 1
    """Ranks per context-parallel group (`pipeline.context_parallel`): they share each sequence, shard by shard."""

    @property
    def role(self) -> Role:
        return self.roles[self.rank]

    @property
    def target_ranks(self) -> tuple[int, ...]:
        """The ranks that send taps: one per target (a group's leader); the drafters' producers."""
        return tuple(r for r, role in enumerate(self.roles) if role.runs_target)

    @property
    def target_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every target group's ranks, leader first (one rank each without tensor parallelism)."""
        return tuple(tuple(range(leader, leader + self.target_parallel)) for leader in self.target_ranks)

    @property
    def target_group(self) -> tuple[int, ...]:
        """This rank's target group (empty for a drafter)."""
        return next((g for g in self.target_groups if self.rank in g), ())

    @property
    def context_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every context-parallel group's ranks, in shard order: consecutive colocated ranks of one node (one rank
        each without context parallel)."""
        cp = self.context_parallel
        return tuple(tuple(range(first, first + cp)) for first in range(0, self.world_size, cp))

    @property
    def context_group(self) -> tuple[int, ...]:
        """This rank's context-parallel group, in shard order (itself alone without context parallel)."""
        return next(g for g in self.context_groups if self.rank in g)

    @property
    def replicas(self) -> int:
        """Data-parallel replicas of the drafter: its ranks over `context_parallel` (a CP group trains one batch
        together, so it counts as one replica, e.g. for the steps an epoch takes)."""
        return len(self.drafter_ranks) // self.context_parallel

    @property
    def drafter_ranks(self) -> tuple[int, ...]:
        return tuple(r for r, role in enumerate(self.roles) if role.runs_drafter)

    @property
    def node_ranks(self) -> range:
        """The global ranks of this rank's node (torchrun numbers a node's ranks consecutively)."""
        first = self.rank - self.local_rank
        return range(first, first + self.local_world_size)

    @property
    def node_drafter_ranks(self) -> tuple[int, ...]:
        """The drafters a target of this node sends to: hidden states never leave their node."""
        return tuple(r for r in self.drafter_ranks if r in self.node_ranks)

    @property
    def node_target_ranks(self) -> tuple[int, ...]:
        """The targets a drafter of this node receives from (every node has the same layout)."""
        return tuple(r for r in self.target_ranks if r in self.node_ranks)

    @property
    def colocated(self) -> bool:
        return self.role is Role.COLOCATED

    @property
    def drafter_index(self) -> int:
        """Position of this rank among the drafters (its data-parallel rank)."""
        return self.drafter_ranks.index(self.rank)


def plan_placement(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    pipeline: PipelineConfig,
    num_devices: int | None = None,
) -> Placement:
    """Assign roles: one process or `pipeline.colocated` -> every rank colocated; otherwise, on each
    node the first `pipeline.num_targets * pipeline.target_parallel` local ranks are targets (groups of
    `target_parallel` consecutive ranks, the first of each its leader) and the rest drafters.
    `pipeline.context_parallel` groups consecutive colocated ranks of a node (`Placement.context_groups`).

    `num_devices` is the GPU count of this node (None on CPU runs).
    """
    if world_size < 1 or local_world_size < 1 or world_size % local_world_size:
        raise ConfigError(
            f"world size {world_size} is not a multiple of the local world size {local_world_size}; "
            "launch the same --nproc_per_node on every node"
        )
    if num_devices is not None and local_world_size > num_devices:
        raise ConfigError(
            f"{local_world_size} ranks per node but only {num_devices} GPUs: "
            f"use torchrun --nproc_per_node {num_devices} (one process per GPU)"
        )
    tp = pipeline.target_parallel
    if world_size == 1 and tp > 1:
        raise ConfigError(
            f"pipeline.target_parallel={tp} needs a split run under torchrun: launch num_targets * target_parallel "
            f"target ranks plus at least one drafter rank per node (e.g. torchrun --nproc_per_node {tp + 1})"
        )
    cp = pipeline.context_parallel
    if cp > 1 and local_world_size % cp:
        raise ConfigError(
            f"pipeline.context_parallel={cp} needs a multiple of {cp} ranks per node (a CP group stays on one node), "
            f"got {local_world_size}: launch torchrun --nproc_per_node {-(-local_world_size // cp) * cp}"
        )
    if world_size == 1 or pipeline.colocated:
        roles = tuple(Role.COLOCATED for _ in range(world_size))
    else:
        target_ranks = pipeline.num_targets * tp
        if target_ranks >= local_world_size:
            raise ConfigError(
                f"pipeline.num_targets={pipeline.num_targets} x pipeline.target_parallel={tp} = {target_ranks} target "
                f"ranks per node leave no drafter among the {local_world_size} ranks of a node: launch more ranks per "
                f"node (torchrun --nproc_per_node > {target_ranks}), lower pipeline.num_targets"
                + (" or pipeline.target_parallel" if tp > 1 else ", or set pipeline.colocated=true")
            )
        roles = tuple(_split_role(r % local_world_size, target_ranks, tp) for r in range(world_size))
    if pipeline.deterministic and sum(role.runs_target for role in roles) != 1:
        raise ConfigError("pipeline.deterministic=true needs exactly one target rank (one process or num_targets=1 on one node)")
    return Placement(
        rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size, roles=roles,
        target_parallel=tp, context_parallel=cp,
    )


def _split_role(local_rank: int, target_ranks: int, target_parallel: int) -> Role:
    if local_rank >= target_ranks:
        return Role.DRAFTER
    return Role.TARGET if local_rank % target_parallel == 0 else Role.TARGET_MEMBER
