"""Context parallel (CP) for the target: one sequence sharded over a group of ranks, attention across the shards.

A sequence too long for one GPU is split into `size` equal contiguous shards (padded at the end to a multiple of
`size`); CP rank i holds tokens [i*S, (i+1)*S) and runs every decoder layer on them alone, except the attention:
a custom attention function (registered with transformers' `AttentionInterface` and switched on for the forward of
a shard only) all-gathers each layer's keys and values over the group and attends the shard's queries causally to
the keys of the shards up to its own. RoPE runs at the tokens' positions in the whole sequence (`position_ids`), so
each rank ends with exactly the taps that the unsharded forward gives its tokens. Right padding of the last shard
changes no real token, as in `capture.py`: a causal decoder's token t sees only tokens <= t.

The gather is autograd-free (the target is frozen and runs under no_grad) and holds every shard's keys and values
of one layer at a time: 2 x T x kv_heads x head_dim elements (about 1 GB at 256K tokens for Qwen3-8B in bf16). The
local queries see the first (i+1)*S keys through a lower-right causal bias, which SDPA's flash and memory-efficient
kernels take without a materialised mask. A ring (passing the shards around while computing) would overlap the
communication and hold two shards instead of all; the results would be the same.

Scope: full-attention layers without attention sinks (Llama, Qwen, Mistral-like); a sliding-window or sink layer is
refused when it runs. PyTorch's own CP (`torch.distributed.tensor.experimental.context_parallel`) needs CUDA; this
runs on gloo too, so the CPU tests check it against the unsharded forward.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface

from dflash_trainer.errors import ConfigError

ATTENTION = "dflash_context_parallel"
"""The attention implementation's name in transformers' registry."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SequenceShard:
    """One rank's contiguous share of a sequence sharded over a context-parallel group."""

    index: int
    """This rank's position in the CP group (its shard's number)."""
    size: int
    """Ranks in the CP group (`pipeline.context_parallel`)."""
    length: int
    """Token slots per shard (S): the padded sequence has size * S slots."""
    num_tokens: int
    """Real tokens of the whole sequence (the slots past them are padding, in the last shards)."""

    @staticmethod
    def of(num_tokens: int, *, size: int, index: int, padded_tokens: Optional[int] = None) -> "SequenceShard":
        """Shard `index` of a sequence of `num_tokens` padded to `padded_tokens` slots (default: the next multiple
        of `size`; a run pads every batch to `pipeline.token_budget`, so that shapes are fixed)."""
        padded = padded_tokens if padded_tokens is not None else -(-num_tokens // size) * size
        if padded % size or padded < num_tokens or not 0 <= index < size:
            raise ValueError(f"cannot shard {num_tokens} tokens padded to {padded} into {size} (shard {index})")
        return SequenceShard(index=index, size=size, length=padded // size, num_tokens=num_tokens)

    @property
    def start(self) -> int:
        """Position in the sequence of the shard's first slot."""
        return self.index * self.length

    @property
    def stop(self) -> int:
        return self.start + self.length

    @property
    def padded_tokens(self) -> int:
        return self.size * self.length

    @property
    def real_tokens(self) -> int:
        """Real tokens in this shard: its first min(S, max(0, num_tokens - start)) slots."""
        return min(self.length, max(0, self.num_tokens - self.start))

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """(S,) int64: the positions in the sequence of the shard's slots."""
        return torch.arange(self.start, self.stop, device=device)


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardAttention:
    """What the attention of a shard's forward needs; passed to every layer as the `context_parallel` keyword."""

    group: dist.ProcessGroup
    """The CP group; its rank i holds shard i."""
    shard: SequenceShard


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardGroup:
    """A rank's place in its CP group, for every sequence it shares (the runtime builds it once, `runtime/feed.py`,
    `runtime/drafter_role.py`)."""

    group: dist.ProcessGroup
    """The CP group; its rank i holds shard i of each sequence."""
    index: int
    """This rank's position in the group (the shard it holds)."""
    size: int
    """Ranks in the group (`pipeline.context_parallel`)."""

    def shard(self, num_tokens: int, padded_tokens: int) -> SequenceShard:
        """This rank's shard of a sequence of `num_tokens` tokens padded to `padded_tokens` slots."""
        return SequenceShard.of(num_tokens, size=self.size, index=self.index, padded_tokens=padded_tokens)

    def attention(self, num_tokens: int, padded_tokens: int) -> ShardAttention:
        return ShardAttention(group=self.group, shard=self.shard(num_tokens, padded_tokens))


def sharded_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    context_parallel: Optional[ShardAttention] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (1, nh, S, hd), key/value (1, nkv, S, hd) of this shard.
    Returns (1, S, nh, hd), each query attending to the keys of the whole sequence up to its own position."""
    if context_parallel is None:
        raise RuntimeError(f"the {ATTENTION!r} attention runs only inside `across_shards` (a shard's forward)")
    if sliding_window is not None or kwargs.get("s_aux") is not None:
        raise ConfigError(f"pipeline.context_parallel: target layer {type(module).__name__} has a sliding window or "
                          "attention sinks, which the context-parallel attention does not implement; use "
                          "pipeline.context_parallel=1")
    shard = context_parallel.shard
    local = torch.stack([key, value]).contiguous()  # (2, 1, nkv, S, hd)
    parts = [torch.empty_like(local) for _ in range(shard.size)]
    dist.all_gather(parts, local, group=context_parallel.group)  # no autograd: the target is frozen
    seen = torch.cat(parts[: shard.index + 1], dim=3)  # (2, 1, nkv, (i+1)*S, hd): keys up to this shard's end
    # query j (position start + j) sees keys 0 .. start + j: a causal mask aligned to the last key
    bias = causal_lower_right(query.shape[2], seen.shape[3])
    out = F.scaled_dot_product_attention(query, seen[0], seen[1], attn_mask=bias, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None  # (1, S, nh, hd)


AttentionInterface.register(ATTENTION, sharded_attention)


@contextmanager
def across_shards(decoder: nn.Module, attention: Optional[ShardAttention]) -> Iterator[dict]:
    """While a shard's forward runs, its model's attention is `sharded_attention` (restored after, so the same model
    still decodes alone, e.g. for evaluation). Yields the keywords the decoder call adds (none without a shard)."""
    if attention is None:
        yield {}
        return
    config = decoder.config
    before = config._attn_implementation
    config._attn_implementation = ATTENTION  # also skips building a mask: no mask function is registered for it
    try:
        yield {"context_parallel": attention}
    finally:
        config._attn_implementation = before
