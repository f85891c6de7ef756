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
from dflash_trainer.target.load import DTYPES, find_decoder, load_target, target_model_config


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetHead:
    embed_weight: torch.Tensor
    """(V, H) target dtype, frozen: embeds the drafter's block inputs."""
    lm_head_weight: torch.Tensor
    """(V, H) target dtype, frozen: projects drafter outputs to the vocabulary."""
    final_norm: nn.Module
    """The target's final RMSNorm (frozen), for distillation from its pre-norm last hidden state."""


def head_from_model(model: nn.Module) -> TargetHead:
    out = model.get_output_embeddings()
    return TargetHead(
        embed_weight=model.get_input_embeddings().weight.detach(),
        lm_head_weight=out.weight.detach(),
        final_norm=find_decoder(model).norm,
    )


_EMBED_KEYS = ("model.embed_tokens.weight",)
_HEAD_KEYS = ("lm_head.weight",)
_NORM_KEYS = ("model.norm.weight",)


def _safetensors_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file, from a sharded index or a single model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {k: single for k in f.keys()}
    return {}


def _read_head(files, embed_key, head_key, norm_key, config, device, dtype) -> TargetHead:
    def read(key: str) -> torch.Tensor:
        with safe_open(str(files[key]), framework="pt", device="cpu") as f:
            return f.get_tensor(key).to(device=device, dtype=dtype)

    embed = read(embed_key)
    head = embed if head_key == embed_key else read(head_key)
    norm = nn.RMSNorm(config.hidden_size, eps=getattr(config, "rms_norm_eps", 1e-6), device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(read(norm_key))
    norm.requires_grad_(False)
    return TargetHead(embed_weight=embed, lm_head_weight=head, final_norm=norm)


def read_target_tensors(cfg: TargetConfig, names: Sequence[str], seed: int = 0) -> dict[str, torch.Tensor]:
    """Named tensors of the target's state dict (e.g. `model.layers.5.mlp.up_proj.weight`) on the CPU in
    `cfg.dtype`: read one by one from a local safetensors checkpoint, else from the whole model."""
    dtype = DTYPES[cfg.dtype]
    if cfg.path is not None and Path(cfg.path).is_dir():
        files = _safetensors_files(Path(cfg.path))
        if all(n in files for n in names):
            out = {}
            for name in names:
                with safe_open(str(files[name]), framework="pt", device="cpu") as f:
                    out[name] = f.get_tensor(name)
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
        files = _safetensors_files(Path(cfg.path))
        embed_key = next((k for k in _EMBED_KEYS if k in files), None)
        norm_key = next((k for k in _NORM_KEYS if k in files), None)
        head_key = next((k for k in _HEAD_KEYS if k in files), None)
        tied = bool(getattr(target_model_config(cfg), "tie_word_embeddings", False)) if files else False
        if embed_key and norm_key and (head_key or tied):
            return _read_head(files, embed_key, head_key or embed_key, norm_key, target_model_config(cfg), device, dtype)
    model = load_target(cfg, device, seed=seed)
    head = head_from_model(model)
    for layer in find_decoder(model).layers:  # free the decoder layers: only the head is kept
        layer.to("meta")
    return head
