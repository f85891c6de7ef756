"""The frozen pieces of the target that the drafter uses: input embedding, LM head, final norm; and any
other target tensors a drafter rank reads without loading the whole target (initialisation)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open
from torch import nn

from dflash_trainer.errors import ConfigError
from dflash_trainer.target.config import TargetConfig
from dflash_trainer.target.load import (
    DTYPES,
    auto_model_class,
    find_decoder,
    find_final_norm,
    load_target,
    module_name,
    target_model_config,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetHead:
    embed_weight: torch.Tensor
    """(V, H) target dtype, frozen: embeds the drafter's block inputs. Row i is what the target's input-embedding
    module returns for token i, as DFlash inference embeds a block with that module: the table itself, or the
    table times the module's scale where it has one (Gemma's sqrt(H); then a copy, not the tied LM head)."""
    lm_head_weight: torch.Tensor
    """(V, H) target dtype, frozen: projects drafter outputs to the vocabulary."""
    final_norm: nn.Module
    """The target's final norm (frozen, its own class: Gemma's scales by 1 + weight), for distillation from its
    pre-norm last hidden state."""


def embedding_scale(module: nn.Module) -> float | None:
    """The scalar a target's input-embedding module multiplies its table by: 1.0 for a plain `nn.Embedding`,
    transformers' `scalar_embed_scale` for its scaled embeddings (Gemma 1-4, MiniCPM3), None when unknown (another
    class: the caller measures it on real weights, or loads them)."""
    if type(module) is nn.Embedding:
        return 1.0
    scale = getattr(module, "scalar_embed_scale", None)
    return float(scale) if isinstance(scale, (int, float)) else None


def _measured_embedding_scale(module: nn.Module) -> float:
    """The scale of a materialised embedding module, from its output for a few tokens against its table; a module
    whose output is not the table times one scalar is refused (the drafter's block embeddings could not follow)."""
    weight = module.weight
    ids = torch.arange(min(8, weight.shape[0]), device=weight.device)
    with torch.no_grad():
        out, rows = module(ids).float(), weight[ids].float()  # (8, H)
    scale = float((out * rows).sum() / (rows * rows).sum().clamp_min(1e-30))
    if not torch.allclose(out, rows * scale, rtol=1e-2, atol=1e-6):
        raise ConfigError(
            f"the target's input embedding ({type(module).__name__}) is not its table times a scalar, so the "
            "drafter's block embeddings cannot be taken from it: this architecture is not supported as a target yet"
        )
    return scale


def _scaled(table: torch.Tensor, scale: float) -> torch.Tensor:
    """The block-embedding table: `table` itself at scale 1, else a scaled copy (rounded as the module rounds)."""
    if scale == 1.0:
        return table
    return table * torch.tensor(scale, dtype=torch.float32, device=table.device).to(table.dtype)  # as transformers'


def head_from_model(model: nn.Module) -> TargetHead:
    embed = model.get_input_embeddings()
    scale = embedding_scale(embed)
    scale = _measured_embedding_scale(embed) if scale is None else scale
    return TargetHead(
        embed_weight=_scaled(embed.weight.detach(), scale),
        lm_head_weight=model.get_output_embeddings().weight.detach(),
        final_norm=find_final_norm(find_decoder(model)),
    )


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """Where one of the target's tensors sits in its safetensors checkpoint."""

    file: Path
    key: str
    """Its name in the file: the module's name, or an older layout's that transformers renames when it loads
    (Gemma 3 image-text checkpoints: `language_model.model.norm.weight` is `model.language_model.norm.weight`)."""

    def read(self) -> torch.Tensor:
        """The tensor on the CPU, as stored."""
        with safe_open(str(self.file), framework="pt", device="cpu") as f:
            return f.get_tensor(self.key)


def _safetensors_files(path: Path) -> dict[str, Path]:
    """Tensor name in the files -> file, from a sharded index or a single model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {k: single for k in f.keys()}
    return {}


def _module_names(keys: Sequence[str], skeleton: nn.Module) -> dict[str, str | None]:
    """A checkpoint's tensor names -> the module's state-dict names, as transformers renames them when it loads;
    None for a tensor that a converter rewrites on load (merged or split: not the module's tensor as stored).
    Where this transformers has no such renaming (its loading internals moved), the names on disk are taken as
    the modules': a checkpoint in another layout then takes the whole load."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        transforms = get_model_conversion_mapping(skeleton)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        meta_state = skeleton.state_dict()
        names = {}
        for key in keys:
            renamed, converted_by = rename_source_key(key, renamings, converters, skeleton.base_model_prefix,
                                                      meta_state)
            names[key] = None if converted_by is not None else renamed
        return names
    except (ImportError, AttributeError, TypeError):
        return {key: key for key in keys}


def _stored_tensors(path: Path, skeleton: nn.Module) -> dict[str, StoredTensor]:
    """The module's state-dict name -> where the checkpoint at `path` stores that tensor; empty without
    safetensors files. `skeleton`: the target on the meta device (its class decides the renaming)."""
    files = _safetensors_files(path)
    if not files:
        return {}
    names = _module_names(list(files), skeleton)
    return {names[key]: StoredTensor(file, key) for key, file in files.items() if names[key] is not None}


def _meta_skeleton(cfg: TargetConfig) -> nn.Module:
    """The target's modules on the meta device (no memory, no weights): their classes, constants and names."""
    with torch.device("meta"):
        config = target_model_config(cfg)
        return auto_model_class(config).from_config(config, trust_remote_code=cfg.trust_remote_code)


@dataclass(frozen=True, slots=True, kw_only=True)
class DecoderLayout:
    """Where the target keeps its decoder, from its modules on the meta device (no weights read)."""

    prefix: str
    """State-dict name of the decoder stack: `model`, or `model.language_model` in image-text-to-text targets."""
    layer_parameter_names: list[set[str]]
    """Per decoder layer, the parameter names within it (`self_attn.q_proj.weight`, ...)."""


def decoder_layout(cfg: TargetConfig) -> DecoderLayout:
    skeleton = _meta_skeleton(cfg)
    decoder = find_decoder(skeleton)
    return DecoderLayout(prefix=module_name(skeleton, decoder),
                         layer_parameter_names=[{n for n, _ in layer.named_parameters()} for layer in decoder.layers])


def _read_head(stored: dict[str, StoredTensor], skeleton: nn.Module, device, dtype) -> TargetHead | None:
    """The head read tensor by tensor from a checkpoint (`skeleton`: the target on the meta device, which also gives
    the embedding's scale and the final norm's class); None when the checkpoint lacks one of them or the
    embedding's scale is unknown without its weights."""
    embed_module, norm = skeleton.get_input_embeddings(), find_final_norm(find_decoder(skeleton))
    embed_key = module_name(skeleton, embed_module) + ".weight"
    head_key = module_name(skeleton, skeleton.get_output_embeddings()) + ".weight"
    norm_prefix = module_name(skeleton, norm) + "."
    if head_key not in stored and skeleton.get_output_embeddings().weight is embed_module.weight:  # tied
        head_key = embed_key
    scale = embedding_scale(embed_module)
    if scale is None or not all(k in stored for k in [embed_key, head_key] + [norm_prefix + n for n in norm.state_dict()]):
        return None

    def read(key: str) -> torch.Tensor:
        return stored[key].read().to(device=device, dtype=dtype)

    embed = read(embed_key)
    head = embed if head_key == embed_key else read(head_key)
    norm = norm.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, tensor in norm.state_dict().items():
            tensor.copy_(read(norm_prefix + name))
    norm.requires_grad_(False)
    return TargetHead(embed_weight=_scaled(embed, scale), lm_head_weight=head, final_norm=norm)


def read_target_tensors(cfg: TargetConfig, names: Sequence[str], seed: int = 0) -> dict[str, torch.Tensor]:
    """Named tensors of the target's state dict (e.g. `model.layers.5.mlp.up_proj.weight`) on the CPU in
    `cfg.dtype`: read one by one from a local safetensors checkpoint, else from the whole model."""
    dtype = DTYPES[cfg.dtype]
    if cfg.path is not None and Path(cfg.path).is_dir():
        stored = _stored_tensors(Path(cfg.path), _meta_skeleton(cfg))
        if all(n in stored for n in names):
            out = {name: stored[name].read() for name in names}
            # FP8 weights mean nothing without their scales: the whole load below dequantizes them
            if not any(t.is_floating_point() and t.element_size() == 1 for t in out.values()):
                return {name: t.to(dtype) for name, t in out.items()}
    # on the CPU, in cfg.dtype: FP8 is the target rank's business (target.quantize), not this copy's
    state = load_target(replace(cfg, quantize=None), "cpu", seed=seed).state_dict()
    missing = [n for n in names if n not in state]
    if missing:
        raise ConfigError(f"the target has no tensors {missing[:4]} (a Llama/Qwen-like layout is expected)")
    return {n: state[n].detach().clone() for n in names}


def load_target_head(cfg: TargetConfig, device: torch.device, seed: int = 0) -> TargetHead:
    """The head on a drafter rank without loading the decoder layers when the checkpoint allows it.

    Random-init targets are rebuilt from the same seed (the same weights the target rank has); local
    safetensors checkpoints are read tensor by tensor; anything else falls back to a full load.
    """
    dtype = DTYPES[cfg.dtype]
    if cfg.path is not None and Path(cfg.path).is_dir():
        skeleton = _meta_skeleton(cfg)
        stored = _stored_tensors(Path(cfg.path), skeleton)
        head = _read_head(stored, skeleton, device, dtype) if stored else None
        if head is not None:
            return head
    model = load_target(cfg, device, seed=seed)
    head = head_from_model(model)
    for layer in find_decoder(model).layers:  # free the decoder layers: only the head is kept
        layer.to("meta")
    return head
