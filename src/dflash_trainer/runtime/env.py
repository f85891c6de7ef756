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


CONTROL_PREFIX = "dflash/control"
"""The control plane's keys in the job's store (under the incarnation's prefix when torchrun may restart the job)."""


def control_store(env: DistEnv, timeout_s: float) -> Optional[dist.Store]:
    """The control plane's store (`control.py`), on a connection of its own. Torch's process-group set-up holds its
    store connection while it waits for a peer (gloo's connections, NCCL's unique id): the liveness beats and the
    abort flag must still get through then, or a rank waiting for a peer that failed waits out pipeline.timeout_s.

    One process: a HashStore. Under torchrun with the agent's store (its default): a new client of that store, made
    before this rank joins the process group, so that a rank failing before it joins is seen by the ranks waiting for
    it there (`failures.record_failure_before_join`). None when the job's store is hosted by rank 0 as it joins
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or a launcher without torchrun's agent): `join_process_group`'s store,
    cloned, then."""
    if not env.distributed:
        return make_local_store()
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    incarnation = this_incarnation(timeout_s)
    if incarnation is not None:  # torchrun may restart the job: this incarnation's keys (elastic.py)
        return dist.PrefixStore(f"{incarnation.prefix}/{CONTROL_PREFIX}", incarnation.store.clone())
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(CONTROL_PREFIX, client)


def join_process_group(env: DistEnv, device: torch.device, timeout_s: float) -> dist.Store:
    """Join the job's gloo/NCCL process group (the default group); returns its store. Waits up to `timeout_s` for
    every rank to join."""
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
    return dist.distributed_c10d._get_default_store()
