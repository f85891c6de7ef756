"""Roles and placement: which rank runs the target, the drafter, or both."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dflash_trainer.errors import ConfigError
from dflash_trainer.runtime.config import PipelineConfig


class Role(str, enum.Enum):
    TARGET = "target"
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

    @property
    def role(self) -> Role:
        return self.roles[self.rank]

    @property
    def target_ranks(self) -> tuple[int, ...]:
        return tuple(r for r, role in enumerate(self.roles) if role.runs_target)

    @property
    def drafter_ranks(self) -> tuple[int, ...]:
        return tuple(r for r, role in enumerate(self.roles) if role.runs_drafter)

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
    node the first `pipeline.num_targets` local ranks are targets and the rest drafters.

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
    if world_size == 1 or pipeline.colocated:
        roles = tuple(Role.COLOCATED for _ in range(world_size))
    else:
        if pipeline.num_targets >= local_world_size:
            raise ConfigError(
                f"pipeline.num_targets={pipeline.num_targets} leaves no drafter among the "
                f"{local_world_size} ranks of a node: lower it or set pipeline.colocated=true"
            )
        roles = tuple(
            Role.TARGET if r % local_world_size < pipeline.num_targets else Role.DRAFTER
            for r in range(world_size)
        )
    if pipeline.deterministic and sum(role.runs_target for role in roles) != 1:
        raise ConfigError("pipeline.deterministic=true needs exactly one target rank (one process or num_targets=1 on one node)")
    return Placement(
        rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size, roles=roles
    )
