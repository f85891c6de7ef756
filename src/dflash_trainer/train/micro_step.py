"""One microbatch on a drafter: sample blocks, forward, chunked loss, backward (no host sync)."""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from dflash_trainer.config import Config
from dflash_trainer.drafter.anchors import plan_blocks
from dflash_trainer.drafter.loss import Teacher, drafter_loss
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.noise import add_tap_noise
from dflash_trainer.target.head import TargetHead
from dflash_trainer.target.load import DTYPES
from dflash_trainer.train.step_loop import MicroResult
from dflash_trainer.transport.wire import HiddenStateBatch


def compile_forward_train(model: DFlashDrafter, mode: Optional[str] = None) -> None:
    """torch.compile the drafter's `forward_train` (fixed shapes: dynamic=False; `mode` is torch.compile's).
    The attention masks are built eagerly outside the graph and passed in, so mask building stays out of
    the traced region."""
    compiled = torch.compile(model.forward_train, dynamic=False, mode=mode)

    def forward_train(*, taps, cu_seqlens, plan, embed_weight, masks=None):
        if masks is None:
            masks = model.build_masks(plan, cu_seqlens, taps.shape[0])
        return compiled(taps=taps, cu_seqlens=cu_seqlens, plan=plan, embed_weight=embed_weight, masks=masks)

    model.forward_train = forward_train  # an instance attribute shadows the method


def make_micro_step(
    config: Config, model: DFlashDrafter, head: TargetHead, *, device: torch.device, progress: Callable[[], float]
) -> Callable[[HiddenStateBatch], MicroResult]:
    """`progress()` is the fraction of training done (for the noise schedule)."""
    spec = model.spec
    dcfg = config.drafter
    compute = DTYPES[config.train.dtype]
    if compute == torch.float32:
        autocast = contextlib.nullcontext
        embed = head.embed_weight.float()  # fp32 compute: the frozen head in fp32 too
        lm_head = head.lm_head_weight.float()
    else:
        autocast = lambda: torch.autocast(device_type=device.type, dtype=compute)  # noqa: E731
        embed, lm_head = head.embed_weight, head.lm_head_weight

    def micro_step(batch: HiddenStateBatch) -> MicroResult:
        plan = plan_blocks(
            input_ids=batch.input_ids, loss_mask=batch.loss_mask, cu_seqlens=batch.cu_seqlens,
            num_blocks=config.batch.num_blocks, block_size=spec.block_size, mask_token_id=spec.mask_token_id,
            seed=config.run.seed, epoch=batch.epoch, job_id=batch.job_id,
        )
        taps = add_tap_noise(batch.taps, dcfg, progress=progress(), seed=config.run.seed, epoch=batch.epoch, job_id=batch.job_id)
        if compute == torch.float32:
            taps = taps.float()
        teacher = None
        if dcfg.kd_weight > 0:
            teacher = Teacher(last_hidden=batch.last_hidden, final_norm=head.final_norm)
        with autocast():
            hidden = model.forward_train(taps=taps, cu_seqlens=batch.cu_seqlens, plan=plan, embed_weight=embed)  # (N, B, H)
            loss = drafter_loss(
                hidden, plan, lm_head_weight=lm_head, gamma=dcfg.loss_gamma, chunk_rows=dcfg.loss_chunk_rows,
                kd_weight=dcfg.kd_weight, teacher=teacher, dpace=dcfg.dpace, dpace_alpha=dcfg.dpace_alpha,
                compiled_ce=dcfg.loss_kernel == "compiled",
            )
        loss.loss_sum.backward()
        return MicroResult(
            loss_sum=loss.loss_sum.detach().float(),
            weight_sum=loss.weight_sum.float(),
            slot_correct=loss.slot_correct.float(),
            slot_count=loss.slot_count.float(),
            tau_sum=loss.accept_sum.float(),
            num_blocks=loss.block_count.float(),
            num_tokens=batch.num_tokens,
        )

    return micro_step
