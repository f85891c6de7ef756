"""Tensor-parallel targets: shard a loaded target over the process group of its target group.

The model's own tensor-parallel plan (transformers' `base_model_tp_plan`: attention and MLP projections
column/row-wise, embeddings vocab-parallel) is applied with transformers' `apply_tensor_parallelism` on a
one-dimensional `DeviceMesh` built from the group. Each row-wise projection all-reduces its output, so the
residual stream between decoder layers (what the taps read) is replicated: every rank of the group holds the
same hidden states, and the layer hooks of `TapCapture` work unchanged on any of them.

transformers' own `from_pretrained(distributed_config=...)` builds its mesh over the whole world; here the
world also holds drafter ranks, so the plan is applied to a model that every rank of the group built or loaded
identically (same checkpoint, or the same seed), each keeping its own slice.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers.distributed.configuration_utils import DistributedConfig
from transformers.distributed.tensor_parallel import apply_tensor_parallelism

from dflash_trainer.errors import ConfigError
from dflash_trainer.target.load import text_config


def check_shardable(model_config, size: int) -> None:
    """The attention heads (query and key/value) must split evenly over `size` ranks."""
    text = text_config(model_config)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if value is not None and value % size:
            raise ConfigError(
                f"pipeline.target_parallel={size} does not divide the target's {name}={value}: each rank of a target "
                f"group holds whole heads; choose a target_parallel that divides {value}"
            )


def unshardable(model: nn.Module, size: int, reason: Exception) -> ConfigError:
    return ConfigError(f"pipeline.target_parallel={size}: cannot shard target {type(model).__name__} ({reason}); "
                       "use pipeline.target_parallel=1")


def library_takes_plan() -> bool:
    """transformers >= 5.2x: `apply_tensor_parallelism(model, mesh, tp_plan)` with the plan resolved by the caller;
    earlier 5.x (5.17 on the device image): `apply_tensor_parallelism(model, mesh)` reads the model's `tp_plan`."""
    return "tp_plan" in inspect.signature(apply_tensor_parallelism).parameters


def tensor_parallel_plan(model: nn.Module, size: int) -> dict[str, str]:
    """The model's own tensor-parallel plan for `size` ranks; a ConfigError when it has none, since the library
    would then shard nothing and every rank would hold the whole model."""
    try:
        # the library's resolver: EP rules win, `*` expanded to the layer numbers
        plan = model._resolve_parallel_plans(DistributedConfig(tp_size=size))[0] if library_takes_plan() \
            else model.tp_plan
        if not plan:
            raise ValueError("it has no tensor-parallel plan")
    except ValueError as e:  # no plan for this architecture, or a plan the library refuses
        raise unshardable(model, size, e) from None
    return plan


def shard_target(model: nn.Module, group: dist.ProcessGroup, device: torch.device) -> nn.Module:
    """Shard `model` (on the host or on `device`) over `group` in place, and move it to `device`.

    Every rank of `group` calls this with identical weights. Parameters are sharded one at a time, each slice
    copied out on its own (`distribute_tensor` clones it), so a model loaded on the host never needs more device
    memory than its shards plus one full parameter.
    """
    size = dist.get_world_size(group)
    check_shardable(model.config, size)
    plan = tensor_parallel_plan(model, size)
    mesh = DeviceMesh.from_group(group, device.type, mesh_dim_names=("tp",))
    try:
        if library_takes_plan():
            apply_tensor_parallelism(model, mesh, plan)
        else:
            apply_tensor_parallelism(model, mesh)
    except ValueError as e:  # a layer the plan's style refuses (e.g. a width that does not split)
        raise unshardable(model, size, e) from None
    return model.to(device)
