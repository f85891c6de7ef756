"""FP8 targets: what `from_pretrained` gets for `target.quantize` and for checkpoints that ship FP8 weights,
the checks that this machine can run them, and random-weight FP8 targets built one layer at a time.

`target.quantize=fp8` is torchao's float8: each weight in e4m3 with one scale per output row, activations
quantized per token at run time, matmuls through `torch._scaled_mm`. It is one pure-Python wheel on top of
torch; under `torch.compile` (target.compile) the activation quantization fuses into the neighbouring kernels.
Only the linear layers inside the decoder layers are quantized: the embeddings, norms and LM head stay in
target.dtype (the drafter reads the embedding and LM head weights), and so does the residual stream that the
taps capture.

Checkpoints that ship FP8 weights (`quantization_config.quant_method: fp8`, as Qwen3-8B-FP8 does) load through
transformers' FineGrainedFP8 layers. On a GPU their matmuls come from a hub kernel (the `kernels` package
fetches kernels-community/finegrained-fp8); on the CPU transformers dequantizes them to target.dtype.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from dflash_trainer.errors import ConfigError
from dflash_trainer.target.config import TargetConfig

log = logging.getLogger(__name__)

ACTIVATION_AMAX_MIN = 1e-12
"""Floor of an activation row's absolute maximum when its FP8 scale is chosen: a zero row quantizes to zeros."""

FP8_CAPABILITY = (8, 9)
"""Compute capability with FP8 tensor cores (Ada 8.9, Hopper 9.0 and later)."""


def require_fp8_device(device: torch.device) -> None:
    """A ConfigError naming `target.quantize` unless `device` is a GPU with FP8 tensor cores."""
    if device.type != "cuda":
        raise ConfigError(f"target.quantize=fp8 needs a CUDA GPU with FP8 tensor cores (compute capability "
                          f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}+, e.g. H100/H200); the target is on {device}: "
                          "set target.quantize=null to run it in target.dtype")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        raise ConfigError(f"target.quantize=fp8 needs FP8 tensor cores (compute capability 8.9+); "
                          f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: "
                          "set target.quantize=null")


def torchao_fp8_config() -> Any:
    """torchao's rowwise float8 config (weights and activations in e4m3, one scale per row)."""
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow
    except ImportError as e:
        raise ConfigError(f"target.quantize=fp8 needs the torchao package (a release built for this torch, "
                          f"e.g. torchao 0.17 for torch 2.11): it cannot be imported ({e}). Install it, or set "
                          "target.quantize=null") from None
    # activation_value_lb: an all-zero activation row (the attention output of a query with every key masked,
    # e.g. a left-padded prompt's padding) would get scale 0 and turn into NaN, which masked attention then
    # spreads to the real tokens of its row (0 * NaN); with a bound set, torchao quantizes activations with torch
    # ops, not the mslk package's kernel, which this project does not install.
    # set_inductor_config=False: torchao's default turns on Inductor's coordinate-descent autotuning for every
    # later compile in the process (the drafter's too: minutes per graph and shape) and sets the float32 matmul
    # precision to TF32, which an fp32 evaluation must not get.
    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), activation_value_lb=ACTIVATION_AMAX_MIN,
                                                     set_inductor_config=False)


def quantize_layer_fp8(layer: nn.Module) -> None:
    """Replace the weights of every nn.Linear inside `layer` by rowwise FP8 ones, in place."""
    from torchao.quantization import quantize_

    quantize_(layer, torchao_fp8_config(), filter_fn=lambda module, fqn: isinstance(module, nn.Linear))


def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes held by `tensor`; a tensor subclass (torchao's Float8Tensor reports its bf16 dtype) by its parts."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(_nbytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def warn_weights_left_unquantized(layers: nn.Module, dtype: str) -> float:
    """Log how much of the decoder layers FP8 quantization left in `dtype`, and return it in GiB: only nn.Linear
    layers are quantized, so weight matrices held elsewhere (a MoE target's expert banks and routers) are not."""
    left_params = [p for m in layers.modules() if not isinstance(m, nn.Linear)
                   for p in m.parameters(recurse=False) if p.dim() >= 2]
    left = sum(_nbytes(p) for p in left_params) / 2**30
    if left:
        total = sum(_nbytes(p) for p in layers.parameters()) / 2**30
        log.warning("target.quantize=fp8: %.1f GiB of the decoder layers' %.1f GiB stay in %s: %d weight tensors held "
                    "outside nn.Linear layers (a MoE target's expert banks and routers), which alone are quantized "
                    "to FP8", left, total, dtype, len(left_params))
    return left


def shipped_quantization(model_config: PretrainedConfig) -> Optional[str]:
    """The `quant_method` of the checkpoint's `quantization_config` (e.g. `fp8`), None for plain weights."""
    if getattr(model_config, "quantization_config", None) is None:
        return None
    method = _shipped_field(model_config, "quant_method")
    return str(getattr(method, "value", method))


def _shipped_field(model_config: PretrainedConfig, name: str) -> Any:
    shipped = getattr(model_config, "quantization_config", None)
    return shipped.get(name) if isinstance(shipped, dict) else getattr(shipped, name, None)


@dataclass(frozen=True, slots=True, kw_only=True)
class PretrainedQuantization:
    """How a checkpoint's weights are quantized while `from_pretrained` loads them."""

    kwargs: dict = field(default_factory=dict)
    """Extra `from_pretrained` arguments: `quantization_config`, and `device_map` so that each weight is
    quantized on the target's device as it is read (a bf16 copy of the whole model never exists)."""
    requantize: bool = False
    """Quantize the decoder layers with `quantize_layer_fp8` after loading: the checkpoint shipped FP8 weights
    in its own format, loaded dequantized (so the bf16 model exists once, on the device)."""


def pretrained_quantization(cfg: TargetConfig, model_config: PretrainedConfig,
                            device: torch.device) -> PretrainedQuantization:
    """What `from_pretrained` needs for `cfg.quantize` and the checkpoint's own `quantization_config`."""
    from transformers import FineGrainedFP8Config, TorchAoConfig

    if cfg.quantize == "fp8":
        require_fp8_device(device)
    shipped = shipped_quantization(model_config)
    on_device = {"device_map": {"": device}}
    if shipped is None:
        if cfg.quantize is None:
            return PretrainedQuantization()
        torchao = TorchAoConfig(torchao_fp8_config(), modules_to_not_convert=["lm_head"])
        return PretrainedQuantization(kwargs={"quantization_config": torchao, **on_device})
    if shipped != "fp8":
        if cfg.quantize is not None:
            raise ConfigError(f"target.path={cfg.path!r} ships weights quantized by {shipped!r}, and "
                              "target.quantize=fp8 re-quantizes only plain or FP8 checkpoints: set "
                              "target.quantize=null to run it as it ships")
        return PretrainedQuantization()
    _require_package("accelerate", cfg, "to load them at all")
    if cfg.quantize == "fp8" or device.type != "cuda":
        if cfg.quantize is None:
            log.warning("target.path=%r ships FP8 weights; on %s they are loaded dequantized to target.dtype=%s",
                        cfg.path, device, cfg.dtype)
        # passed loading attributes replace the checkpoint's, so its list of layers left unquantized goes along
        keep = _shipped_field(model_config, "modules_to_not_convert")
        dequantize = FineGrainedFP8Config(dequantize=True, modules_to_not_convert=keep)
        return PretrainedQuantization(kwargs={"quantization_config": dequantize, **on_device},
                                      requantize=cfg.quantize == "fp8")
    _require_package("kernels", cfg, "for their FP8 matmuls (it fetches the hub kernel "
                     "kernels-community/finegrained-fp8, or finds it in the hub cache)")
    return PretrainedQuantization(kwargs=on_device)


def _require_package(name: str, cfg: TargetConfig, why: str) -> None:
    from transformers.utils import import_utils

    if not getattr(import_utils, f"is_{name}_available")():
        raise ConfigError(
            f"target.path={cfg.path!r} ships FP8 weights (quantization_config quant_method fp8), and transformers "
            f"needs the {name} package {why}: it is not installed. Install it"
            + (", or set target.quantize=fp8 to load them dequantized and quantize them again with torchao "
               "(peak memory: the bf16 model)" if name == "kernels" else "")
        )


def materialize_layerwise(model: PreTrainedModel, layers: nn.ModuleList, device: torch.device,
                          per_layer: Callable[[nn.Module], None]) -> None:
    """Give the meta-device `model` tensors on `device`, initialised by the model's own `_init_weights`:
    first everything outside `layers`, then one decoder layer at a time, each followed by `per_layer(layer)`.

    With `per_layer=quantize_layer_fp8` the device holds the FP8 layers plus one layer in bf16 at a time, so a
    target whose bf16 weights would not fit can still be built (a Llama-3-70B shape: ~70 GB instead of 140 GB).
    """
    in_layers = {id(m) for m in layers.modules()}
    outside = [m for m in model.modules() if id(m) not in in_layers]
    with torch.no_grad():
        for module in outside:
            module.to_empty(device=device, recurse=False)
        for module in outside:
            model._init_weights(module)
        model.tie_weights()
        for layer in layers:
            layer.to_empty(device=device)
            for module in layer.modules():
                model._init_weights(module)
            per_layer(layer)
