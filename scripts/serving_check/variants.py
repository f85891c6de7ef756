"""Drafter variants the check covers: how to build one with our code, run our forward, export it, and which
class each engine's loader must build from the export. A new variant (DFlash2) is one more `Variant` entry.

DFlash2 when it exists here (read from the engines' packages, not run): vLLM maps `architectures:
["DFlash2DraftModel"]` to `DFlash2Qwen3ForCausalLM` (`qwen3_dflash2.py`; the speculators type `dflash2` to the
same, with `conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k` copied into `dflash_config`);
SGLang's `dflash.py` builds `DFlash2DraftModel` (a `DFlashDraftModel` plus `CandidateSelector`, which needs
`dflash_config.selector_rank`). Its `reference` must return what both engines compare: the hidden states before the
selector, and the selector's scores separately.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.export import export_drafter
from dflash_trainer.drafter.export_speculators import export_speculators
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.spec import drafter_spec


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """A drafter's layer layout."""

    name: str
    num_layers: int
    sliding_layers: tuple[int, ...] = ()
    sliding_window: int | None = None


Exporter = Callable[[torch.nn.Module, str, str, Any], None]
"""export(drafter, out_dir, target_dir, target_config): writes one format."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Variant:
    name: str
    engine_classes: dict[str, str]
    """Engine -> the class its loader must build from our export."""
    build: Callable[[Shape, int, Any], torch.nn.Module]
    """build(shape, block_size, target_config): a drafter with our code, random weights."""
    reference: Callable[[torch.nn.Module, dict, torch.Tensor], torch.Tensor]
    """reference(drafter, inputs, embed_weight): our final hidden states (B, H) of the block."""
    exporters: dict[str, Exporter]
    """Format -> exporter."""


def _build_dflash(shape: Shape, block_size: int, target_config: Any) -> DFlashDrafter:
    config = DrafterConfig(num_layers=shape.num_layers, block_size=block_size,
                           sliding_layers=list(shape.sliding_layers), sliding_window=shape.sliding_window)
    # the tiny target's last embedding row is a spare one (past its tokenizer), as Qwen3's 151669
    spec = drafter_spec(target_config, config, mask_token_id=target_config.vocab_size - 1)
    return DFlashDrafter(spec, attention="sdpa")


def _reference_dflash(drafter: DFlashDrafter, inputs: dict, embed_weight: torch.Tensor) -> torch.Tensor:
    return drafter.forward_block(block_embeds=embed_weight[inputs["block_ids"]],
                                 block_positions=inputs["block_positions"], context_taps=inputs["taps"],
                                 context_positions=inputs["context_positions"]).hidden


def _export_dflash(drafter, out_dir: str, target_dir: str, target_config: Any) -> None:
    export_drafter(drafter, out_dir, target_config=target_config)


def _export_speculators(drafter, out_dir: str, target_dir: str, target_config: Any) -> None:
    # the verifier is the local target folder: vLLM 0.32 (the CPU build) reads it; 0.33 wants a hub id there
    export_speculators(drafter, out_dir, verifier=os.path.abspath(target_dir), target_config=target_config)


DFLASH = Variant(
    name="dflash",
    engine_classes={"vllm": "DFlashQwen3ForCausalLM", "sglang": "DFlashDraftModel"},
    build=_build_dflash,
    reference=_reference_dflash,
    exporters={"dflash": _export_dflash, "speculators": _export_speculators},
)

VARIANTS = {v.name: v for v in (DFLASH,)}
