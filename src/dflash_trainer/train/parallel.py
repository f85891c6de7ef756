"""Data parallelism of the drafter over the drafter ranks: replicated weights with one gradient all-reduce
per step (the default), or FSDP2 (`train.fsdp=true`) sharding weights, gradients and optimizer state.

With FSDP2 every collective must be entered by every drafter rank: the step loop runs the same number of
backward passes on each rank (zero-weight passes where a rank has no batch), and the full state dicts for
checkpoints, exports and tau evaluations are gathered by all ranks together.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_FULL = StateDictOptions(full_state_dict=True)
"""Full tensors on every rank (cpu_offload would keep them on global rank 0 only, which need not be the
leader drafter); `_to_cpu` then moves them off the device."""


def _to_cpu(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_cpu(v) for v in tree)
    return tree


def want_sharding(setting: Optional[bool], model: nn.Module, device: torch.device, world: int) -> bool:
    """`train.fsdp`: explicit, or (None) when fp32 weights + Adam moments + gradients exceed 1/4 of the GPU."""
    if world < 2:
        return False
    if setting is not None:
        return setting
    if device.type != "cuda":
        return False
    state_bytes = 16 * sum(p.numel() for p in model.parameters())
    return state_bytes > torch.cuda.get_device_properties(device).total_memory / 4


def shard_drafter(model: nn.Module, group: dist.ProcessGroup, device: torch.device) -> None:
    """FSDP2 over the drafter group: each decoder layer (and its attention) is a unit, the root holds fc and
    the norms."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    mesh = DeviceMesh.from_group(group, device.type)
    for layer in model.layers:
        # The attention is its own unit: the training forward calls its `kv` (context keys/values) outside
        # the layer's forward, so `kv` is registered as a forward method that gathers the weights too.
        fully_shard(layer.self_attn, mesh=mesh, reshard_after_forward=False)
        register_fsdp_forward_method(layer.self_attn, "kv")
        fully_shard(layer, mesh=mesh)
    if getattr(model, "candidate_selector", None) is not None:
        # DFlash2's selector runs in the loss, outside the drafter's forwards: a unit of its own whose scoring
        # gathers its weights (its codebooks are vocabulary-sized)
        fully_shard(model.candidate_selector, mesh=mesh)
        register_fsdp_forward_method(model.candidate_selector, "scores")
    if getattr(model, "lilicorr", None) is not None:
        fully_shard(model.lilicorr, mesh=mesh)  # LiLiCorr's lattice head runs in the loss: a unit of its own
    fully_shard(model, mesh=mesh)
    # the drafter is not called through forward(): its training forwards (one pass; the chunked step's context and
    # blocks) and decoding's block forward gather the root's weights as a forward does
    for method in ("forward_train", "train_context", "forward_train_blocks", "forward_block", "anchor_context"):
        if hasattr(model, method):
            register_fsdp_forward_method(model, method)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """FSDP2: reduce-scatter gradients in this backward (the step's last microbatch) or keep accumulating."""
    if is_sharded(model):
        model.set_requires_gradient_sync(enabled)


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) weights on the CPU; a collective when the model is sharded."""
    if is_sharded(model):
        return _to_cpu(get_model_state_dict(model, options=_FULL))
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Optimizer state keyed by parameter name (the same layout sharded or not); a collective when sharded."""
    return _to_cpu(get_optimizer_state_dict(model, optimizer, options=_FULL))


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
                    optimizer_state: Optional[dict[str, Any]]) -> None:
    """Load full weights (and optimizer state saved by `full_optimizer_state`) into a sharded or plain model."""
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
    if optimizer_state is not None:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=StateDictOptions(full_state_dict=True))


def global_norm(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm over sharded gradients is a DTensor: its full value (a 0-d tensor)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
