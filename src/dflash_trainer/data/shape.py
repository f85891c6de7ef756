"""`BatchShape`: the fixed shape of every packed batch of a run, derived once from the config."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.runtime.config import PipelineConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchShape:
    """Shapes shared by the epoch plan, the target's send buffers and the drafter step (fixed for a run, so
    buffers are preallocated and the step compiled once)."""

    token_budget: int
    """Token slots of a packed batch (`pipeline.token_budget`)."""
    max_seqs: int
    """Most sequences a batch can hold: every kept sequence has >= 2 * block_size tokens."""
    num_blocks: int
    """Drafter blocks per batch (`drafter.num_blocks`, default the recipe's 512 per 3072 tokens)."""

    @staticmethod
    def of(pipeline: PipelineConfig, drafter: DrafterConfig) -> "BatchShape":
        return BatchShape(
            token_budget=pipeline.token_budget,
            max_seqs=max(1, pipeline.token_budget // (2 * drafter.block_size)),
            num_blocks=drafter.blocks_for_budget(pipeline.token_budget),
        )
