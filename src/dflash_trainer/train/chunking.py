"""How many of a batch's blocks the drafter step runs at once (`train.blocks_per_chunk`), from its memory.

Each block's forward activations live until its backward. One pass over all N blocks therefore needs memory in
proportion to N, which grows with the sequence (the recipe's 512 blocks per 3,072 tokens), and a long-context
batch does not fit. The chunked step (`micro_step.py`) runs the blocks in chunks, each chunk's forward and backward
before the next, so only one chunk's activations are alive at a time; what stays is in proportion to the context
(T tokens), not to the blocks. This module picks the chunk size: explicit, or the most blocks the free GPU memory
holds by the estimates below. They count the tensors an eager step saves for its backward; a compiled step
(`train.compile` on a GPU) saves fewer, about half per block (`COMPILED_BLOCK_SHARE`, fitted to the measured
peak memory of the 8B shape's step at 32K in one pass and in two chunks: bench/RESULTS.md section 2).

Per block of B tokens, with H hidden, q = heads*hd, kv = kv_heads*hd, I the MLP width, L layers, e the compute
dtype's bytes (fp32 parts: the residual stream and every norm's input, as the norms compute in fp32):
  per token and layer   4*(2H + q + kv)          fp32 inputs of the four norms (input, post-attention, q, k)
                        + e*(7H + 4q + 3kv + 4I)  norm outputs, the linears' inputs (autocast copies), q, the
                                                  attention output, the block's keys/values, the MLP's four
                        + 4*heads                 the attention's log-sum-exp
  per token, once       (9 + e)*H                 the final norm and the loss's stored gradient of each row
Fixed per microbatch (whatever the chunk size), with V the vocabulary:
  context               T*((8 + e)*H + L*(2e*H + (4 + e)*kv))   fc/norm activations, each layer's k/v inputs
  context keys/values   T*L*kv*5*(4 + e)                        keys (fp32) and values as leaves, their fp32
                                                                gradient sums, each chunk's gradients, and each
                                                                chunk's copies of them beside its blocks
  loss logits           drafter.loss_chunk_rows * V * (e + 8)   one chunk of logits and its fp32 work
  training state        12 bytes per parameter                  fp32 gradients and the two Adam moments (not yet
                                                                allocated when the step is planned)
The budget is the free memory (the driver's free memory plus what PyTorch's allocator holds unused) less
`RESERVED_FRACTION` of the device, for fragmentation, compiled kernels' workspaces and a colocated target's forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
import torch

from dflash_trainer.drafter.spec import DrafterSpec

log = logging.getLogger(__name__)

RESERVED_FRACTION = 0.15
"""Share of the device's memory the planner leaves alone."""
COMPILED_BLOCK_SHARE = 0.6
"""Share of `block_bytes` a compiled step keeps per block, with a margin (fitted to the 32K
peaks of one pass and of two chunks, bench/RESULTS.md section 2)."""
TRAINING_STATE_BYTES = 12
"""Bytes per drafter parameter allocated after planning: fp32 gradient and two fp32 Adam moments."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkPlan:
    """How the drafter step splits a batch's blocks (the same for every batch of a run: fixed shapes)."""

    num_blocks: int
    """Blocks per batch (N)."""
    blocks_per_chunk: int
    """Blocks per chunk, the last one padded with invalid blocks; N: one pass."""
    reason: str
    """Why this size (for the log)."""

    @property
    def num_chunks(self) -> int:
        return -(-self.num_blocks // self.blocks_per_chunk)

    @property
    def one_pass(self) -> bool:
        return self.blocks_per_chunk >= self.num_blocks


def block_bytes(spec: DrafterSpec, elem: int) -> int:
    """Estimated bytes of one block's activations kept for its backward (module docstring); `elem`: bytes per
    element of the compute dtype."""
    h, i, kv, q = spec.hidden_size, spec.intermediate_size, spec.num_key_value_heads * spec.head_dim, \
        spec.num_attention_heads * spec.head_dim
    layer = 4 * (2 * h + q + kv) + elem * (7 * h + 4 * q + 3 * kv + 4 * i) + 4 * spec.num_attention_heads
    return spec.block_size * (spec.num_layers * layer + (9 + elem) * h)


def fixed_bytes(spec: DrafterSpec, elem: int, *, token_budget: int, loss_chunk_rows: int, num_params: int) -> int:
    """Estimated bytes of a step that do not depend on its chunk size (module docstring)."""
    h, kv, layers = spec.hidden_size, spec.num_key_value_heads * spec.head_dim, spec.num_layers
    context = token_budget * ((8 + elem) * h + layers * (2 * elem * h + (4 + elem) * kv))
    keys_values = token_budget * layers * kv * 5 * (4 + elem)
    logits = loss_chunk_rows * spec.vocab_size * (elem + 8)
    return context + keys_values + logits + TRAINING_STATE_BYTES * num_params


def even_chunks(num_blocks: int, most: int) -> int:
    """The chunk size that splits `num_blocks` into the fewest chunks of at most `most` blocks, as equal as
    possible (the least padding in the last one)."""
    chunks = -(-num_blocks // max(1, min(most, num_blocks)))
    return -(-num_blocks // chunks)


def auto_blocks_per_chunk(spec: DrafterSpec, *, num_blocks: int, token_budget: int, elem: int, loss_chunk_rows: int,
                          num_params: int, free_bytes: int, total_bytes: int, compiled: bool = False) -> int:
    """The most blocks a chunk may hold within `free_bytes` (less the reserve and the fixed part), within
    [1, num_blocks], evened out over the chunks (`even_chunks`); `compiled`: the step's forward is compiled."""
    budget = free_bytes - RESERVED_FRACTION * total_bytes - fixed_bytes(
        spec, elem, token_budget=token_budget, loss_chunk_rows=loss_chunk_rows, num_params=num_params)
    per_block = block_bytes(spec, elem) * (COMPILED_BLOCK_SHARE if compiled else 1.0)
    return even_chunks(num_blocks, int(budget // per_block))


def free_device_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device: the driver's free memory plus what this process's allocator holds
    unused (it reuses that first)."""
    free, total = torch.cuda.mem_get_info(device)  # a driver query (no stream sync), once at start
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), total


def plan_chunks(*, setting: int, spec: DrafterSpec, num_blocks: int, token_budget: int, compute: torch.dtype,
                loss_chunk_rows: int, num_params: int, device: torch.device, compiled: bool = False) -> ChunkPlan:
    """`train.blocks_per_chunk` (`setting`; 0: auto) resolved for a run: explicit sizes are evened out; auto is one
    pass on the CPU, else the most blocks the free memory holds. (A sharded drafter's state is counted whole: its
    chunks are planned as an unsharded one's, conservatively.)"""
    if setting:
        return ChunkPlan(num_blocks=num_blocks, blocks_per_chunk=even_chunks(num_blocks, setting),
                         reason=f"train.blocks_per_chunk={setting}")
    if device.type != "cuda":
        return ChunkPlan(num_blocks=num_blocks, blocks_per_chunk=num_blocks, reason="auto on the CPU: one pass")
    elem = torch.finfo(compute).bits // 8
    free, total = free_device_bytes(device)
    size = auto_blocks_per_chunk(spec, num_blocks=num_blocks, token_budget=token_budget, elem=elem,
                                 loss_chunk_rows=loss_chunk_rows, num_params=num_params, free_bytes=free,
                                 total_bytes=total, compiled=compiled)
    share = COMPILED_BLOCK_SHARE if compiled else 1.0
    reason = (f"auto: {free / 2**30:.1f} GiB free of {total / 2**30:.1f}, about "
              f"{share * block_bytes(spec, elem) / 2**20:.1f} MiB per block{' compiled' if compiled else ''}")
    if size == 1 and num_blocks > 1:
        log.warning("the drafter step's memory estimate leaves room for one block per chunk at most (%s): the step "
                    "may run out of memory; lower pipeline.token_budget (and data.max_length)", reason)
    return ChunkPlan(num_blocks=num_blocks, blocks_per_chunk=size, reason=reason)


def log_plan(plan: ChunkPlan) -> None:
    if plan.one_pass:
        log.info("drafter step: one pass over %d blocks (%s)", plan.num_blocks, plan.reason)
    else:
        log.info("drafter step: %d blocks in %d chunks of %d (%s)", plan.num_blocks, plan.num_chunks,
                 plan.blocks_per_chunk, plan.reason)
