"""The process's place under torchrun (or alone), its device, process group and store."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from dflash_trainer.errors import ConfigError
from dflash_trainer.runtime.control import make_local_store
from dflash_trainer.runtime.elastic import this_incarnation


@dataclass(frozen=True, slots=True, kw_only=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def dist_env() -> DistEnv:
    """From torchrun's environment variables; one process when they are absent."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    return DistEnv(
        rank=int(env.get("RANK", "0")),
        world_size=world,
        local_rank=int(env.get("LOCAL_RANK", "0")),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
    )


def choose_device(kind: str, local_rank: int) -> torch.device:
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("run.device=cuda but no CUDA device is visible; use run.device=cpu or auto")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible): "
            "launch one process per GPU (torchrun --nproc_per_node <= GPUs)"
        )
    torch.cuda.set_device(local_rank)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return torch.device("cuda", local_rank)


def init_distributed(env: DistEnv, device: torch.device, timeout_s: float) -> tuple[dist.Store, Optional[dist.ProcessGroup]]:
    """(store, default group): torchrun's TCPStore and a gloo/NCCL group, or a HashStore alone."""
    if not env.distributed:
        return make_local_store(), None
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    device_id = device if device.type == "cuda" else None
    incarnation = this_incarnation(timeout_s)
    if incarnation is None:
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device_id)
    else:  # torchrun may restart the job: this incarnation's keys under its own prefix (elastic.py)
        store = dist.PrefixStore(incarnation.prefix, incarnation.store)
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device_id, rank=env.rank,
                                world_size=env.world_size, store=store)
    store = dist.distributed_c10d._get_default_store()
    return store, dist.group.WORLD
