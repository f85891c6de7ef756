"""Tiny drafters and packed batches shared by the drafter tests (CPU, fp32, random weights)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dflash_trainer.drafter.anchors import BlockPlan, plan_blocks
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.spec import drafter_spec
from dflash_trainer.target.presets import preset_config


@pytest.fixture(autouse=True)
def single_thread():
    """Tiny CPU ops run faster on one thread (and do not stall when the cores are shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_drafter(block_size: int = 4, num_layers: int = 2, sliding_layers=(), sliding_window=None, seed=0, tap_layer_ids=None,
                 variant: str = "dflash", **dflash2):
    """A drafter of the tiny preset target; `variant="dflash2"` with its sizes in `dflash2` (conv_kernel_size, ...;
    the config's defaults otherwise)."""
    target_config = preset_config("tiny")
    config = DrafterConfig(
        num_layers=num_layers, block_size=block_size, gamma=2.0,
        sliding_layers=list(sliding_layers), sliding_window=sliding_window, tap_layer_ids=tap_layer_ids,
        variant=variant, **dflash2,
    )
    spec = drafter_spec(target_config, config, mask_token_id=target_config.vocab_size - 1)
    torch.manual_seed(seed)
    return DFlashDrafter(spec), target_config


@dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    taps: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    cu_seqlens: torch.Tensor
    embed_weight: torch.Tensor
    plan: BlockPlan


def packed_batch(drafter: DFlashDrafter, seqlens=(15, 18), num_slots=40, num_blocks=10, job_id=0, seed=1) -> Batch:
    spec = drafter.spec
    gen = torch.Generator().manual_seed(seed)
    total = sum(seqlens)
    cu = torch.tensor([0] + list(torch.tensor(seqlens).cumsum(0)) + [total], dtype=torch.int32)
    input_ids = torch.randint(0, 200, (num_slots,), generator=gen)
    loss_mask = torch.rand(num_slots, generator=gen) > 0.25
    loss_mask[total:] = False
    input_ids[total:] = 0
    taps = torch.randn(num_slots, spec.num_taps * spec.hidden_size, generator=gen)
    embed = torch.randn(spec.vocab_size, spec.hidden_size, generator=gen)
    plan = plan_blocks(
        input_ids=input_ids, loss_mask=loss_mask, cu_seqlens=cu, num_blocks=num_blocks,
        block_size=spec.block_size, mask_token_id=spec.mask_token_id, seed=0, epoch=0, job_id=job_id,
    )
    return Batch(taps=taps, input_ids=input_ids, loss_mask=loss_mask, cu_seqlens=cu, embed_weight=embed, plan=plan)


@torch.no_grad()
def perturb_dflash2(drafter: DFlashDrafter, seed: int = 11, scale: float = 0.3) -> None:
    """Move a DFlash2 drafter's convolutions off the identity and its selector off zero (random, seeded), so that
    parity tests exercise every term."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in drafter.named_parameters():
        if "_conv." in name or "candidate_selector." in name:
            p.add_(scale * torch.randn(p.shape, generator=gen))
