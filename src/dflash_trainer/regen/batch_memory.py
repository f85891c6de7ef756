"""How many prompts of a given length one decoding batch of the target can hold in the memory that is free.

A batch's memory is known before it is allocated: its KV cache (every layer's keys and values for the prompt and
the new tokens), the prefill's activations at the longest prompt, and, where attention materialises its scores (on
the CPU, or `eager` attention), a (heads, prompt, prompt) fp32 matrix per row. `DecodeBudget` holds those per-row
costs and half of the memory free when decoding starts (the rest for the model's own transients and the host), and
cuts a length-sorted run of prompts into batches that fit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from dflash_trainer.errors import ConfigError
from dflash_trainer.memory import free_bytes
from dflash_trainer.target.load import text_config

log = logging.getLogger(__name__)

USABLE_FRACTION = 0.5
"""Of the memory free when decoding starts, the share batches may plan to take."""

GiB = 2**30


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeBudget:
    kv_bytes_per_token: int
    """Keys and values of every layer for one token of one row."""
    prefill_bytes_per_token: int
    """Activations of one prompt token in the prefill (hidden states and the MLP's widest tensors)."""
    score_bytes_per_pair: int
    """Attention scores per (query, key) pair of one row: heads x 4 bytes where they are materialised, else 0."""
    budget_bytes: Optional[int]
    """What the batches may take (None: unknown, no limit)."""
    free_bytes: Optional[int]
    """The memory free when decoding started."""

    def row_bytes(self, prompt_tokens: int, new_tokens: int) -> int:
        return (self.kv_bytes_per_token * (prompt_tokens + new_tokens) + self.prefill_bytes_per_token * prompt_tokens
                + self.score_bytes_per_pair * prompt_tokens * prompt_tokens)

    def rows_that_fit(self, prompt_tokens: int, new_tokens: int) -> Optional[int]:
        """Rows of prompts up to `prompt_tokens` long one batch may hold (None: no limit known)."""
        if self.budget_bytes is None:
            return None
        return self.budget_bytes // max(1, self.row_bytes(prompt_tokens, new_tokens))


def decode_budget(model: nn.Module) -> DecodeBudget:
    """The per-row costs of decoding `model` (its config and dtype) and the memory its device has free now."""
    config = text_config(model.config)
    # the values as the config stores them: a loaded Gemma 4 refuses to read its per-layer head_dim as one attribute
    values = config.to_dict()
    param = next(model.parameters())
    elem = param.element_size()
    heads = values["num_attention_heads"]
    kv_heads = values.get("num_key_value_heads") or heads
    head_dim = max(values.get("head_dim") or 0, values.get("global_head_dim") or 0) or config.hidden_size // heads
    width = values.get("intermediate_size") or 4 * config.hidden_size
    layers = config.num_hidden_layers
    materialised = param.device.type == "cpu" or getattr(config, "_attn_implementation", None) == "eager"
    free = free_bytes(param.device)
    return DecodeBudget(
        kv_bytes_per_token=layers * 2 * kv_heads * head_dim * elem,
        prefill_bytes_per_token=(4 * config.hidden_size + 3 * width) * elem,
        score_bytes_per_pair=heads * 4 if materialised else 0,
        budget_bytes=None if free is None else int(free * USABLE_FRACTION),
        free_bytes=free,
    )


def cut_batches(lengths: list[int], order: list[int], *, batch_size: int, new_tokens: int,
                budget: DecodeBudget) -> list[list[int]]:
    """Batches of the prompt indices in `order` (sorted by length, shortest first), each at most `batch_size` rows
    and within the budget at its longest prompt. A prompt that fits in no batch alone is a ConfigError naming its
    length and the memory."""
    batches: list[list[int]] = []
    batch: list[int] = []
    cut_to: Optional[int] = None
    for i in order:
        fit = budget.rows_that_fit(lengths[i], new_tokens)
        if fit is not None and fit < 1:
            raise ConfigError(
                f"regenerate: one {lengths[i]}-token prompt with {new_tokens} new tokens needs about "
                f"{budget.row_bytes(lengths[i], new_tokens) / GiB:.1f} GiB to decode, over half of the "
                f"{(budget.free_bytes or 0) / GiB:.1f} GiB free: lower regenerate.max_prompt_tokens (prompts over it are "
                "skipped and counted) or regenerate.max_new_tokens, or run on a device with more memory")
        limit = batch_size if fit is None else min(batch_size, fit)
        if len(batch) >= limit:
            batches.append(batch)
            batch = []
        if fit is not None and fit < batch_size and (cut_to is None or fit < cut_to):
            cut_to = fit
        batch.append(i)
    if batch:
        batches.append(batch)
    if cut_to is not None:
        log.info("regenerate: batches cut to as few as %d rows (regenerate.batch_size=%d) to fit %.1f GiB of the "
                 "%.1f GiB free", cut_to, batch_size, (budget.budget_bytes or 0) / GiB, (budget.free_bytes or 0) / GiB)
    return batches
