"""The DFlash drafter: Qwen3-style layers with KV injection of the target's tapped context.

Parameter names are exactly the export names (`layers.N.self_attn.q_proj.weight`, `fc.weight`, ...):
no embedding and no LM head (the target's, frozen, are passed in). In every layer, queries come only
from block tokens; keys/values are `concat(context, block)` through the same k_proj/v_proj with k_norm
on both; RoPE at absolute positions. Two forwards share the layer code:

- `forward_train`: all N blocks of a packed batch at once, masked (see `attention_mask.py`); it is
  `train_context` (the context's keys/values in every layer, once per batch) then `forward_train_blocks`
  (blocks against that context), which a chunked step calls on its own, a chunk of blocks at a time.
- `forward_blocks`: one block per row of a decoding batch, over a context K/V cache (`DraftContext`) that
  `extend_context` grows; `forward_block` is the same for one sequence.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from dflash_trainer.drafter.anchors import BlockPlan, token_seq_ids
from dflash_trainer.drafter.attention_mask import FlexMaskBuilder, dense_mask, mask_index
from dflash_trainer.drafter.dflash2 import BlockConv, CandidateSelector
from dflash_trainer.drafter.domino import correction_head
from dflash_trainer.drafter.dspark import MarkovHead
from dflash_trainer.drafter.lilicorr import LatticeHead
from dflash_trainer.drafter.spec import DrafterSpec
from dflash_trainer.errors import ConfigError

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""attend(q (R, nh, Lq, hd), k (R, nkv, Lk, hd), v (R, nkv, Lk, hd)) -> (R, nh, Lq, hd); R = 1 in training."""

_compiled_flex = None


def _flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask, options: dict) -> torch.Tensor:
    """flex_attention, compiled on CUDA (uncompiled it materialises the scores); plain on CPU. `options`:
    flex's kernel_options (tile sizes, warps, ...), empty for torch's defaults."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    kwargs = dict(block_mask=block_mask, enable_gqa=True, kernel_options=dict(options) or None)
    if q.device.type != "cuda" or torch.compiler.is_compiling():
        return flex_attention(q, k, v, **kwargs)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, **kwargs)


FLASH_MODULES = ("flash_attn.cute", "cutlass")
"""What flex's flash-attention backend imports when it compiles: FlashAttention-4 and its CuTeDSL."""


def check_flex_backend(options: dict, device: torch.device) -> None:
    """Refuse flex's flash-attention backend (`BACKEND: FLASH`, FlashAttention-4) before the first step where it
    cannot run: it needs FlashAttention-4's package and a Hopper or Blackwell GPU. Flex on the CPU ignores it."""
    if options.get("BACKEND") != "FLASH" or device.type != "cuda":
        return
    triton = "flex's Triton kernels run anywhere: drafter.flex_kernel_options.BACKEND=TRITON"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise ConfigError(f"drafter.flex_kernel_options.BACKEND=FLASH (FlashAttention-4) needs a Hopper or Blackwell "
                          f"GPU (compute capability 9.0+), and this one is {major}.{minor}; {triton}")
    missing = [name for name in FLASH_MODULES if not _importable(name)]
    if missing:
        raise ConfigError(
            f"drafter.flex_kernel_options.BACKEND=FLASH needs FlashAttention-4, and {', '.join(missing)} cannot be "
            f'imported: pip install --pre "flash-attn-4[cu13]" (without [cu13] for a CUDA 12 torch); or {triton}')


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # its parent package is missing
        return False


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """SDPA with GQA; on CUDA the kv heads are repeated so the memory-efficient kernel takes the bool mask."""
    if q.is_cuda and mask is not None:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (1, nh, Lk, hd)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class RotaryTable(nn.Module):
    """cos/sin tables at given positions; inv_freq stays fp32 whatever dtype the model is cast to."""

    def __init__(self, spec: DrafterSpec):
        super().__init__()
        hf = Qwen3RotaryEmbedding(spec.qwen3_config())
        self._inv_freq_fp32 = hf.inv_freq.detach().float().clone()
        self.attention_scaling = float(hf.attention_scaling)
        self.register_buffer("inv_freq", self._inv_freq_fp32.clone(), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq_fp32.to(self.inv_freq.device)  # undo any dtype cast
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # (..., L, hd/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (..., L, hd)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.unsqueeze(-2).to(dtype), sin.unsqueeze(-2).to(dtype)  # (..., L, 1, hd)


def _rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = cos_sin  # (..., L, 1, hd)
    return x * cos + rotate_half(x) * sin  # (..., L, heads, hd)


class DrafterAttention(nn.Module):
    def __init__(self, spec: DrafterSpec):
        super().__init__()
        h, hd = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)
        self.q_norm = Qwen3RMSNorm(hd, eps=spec.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(hd, eps=spec.rms_norm_eps)

    def kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm + RoPE) and values of tokens x (..., L, H) -> (..., L, nkv, hd) each."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return _rope(k, rope), v

    def forward(
        self,
        x: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attend: Attend,
    ) -> torch.Tensor:
        """x (..., Lq, H) block tokens, ctx_k/ctx_v (..., Lc, nkv, hd); the leading dim, when present, is a
        batch of rows (decoding). Returns (..., Lq, H)."""
        q = _rope(self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))), rope)  # (..., Lq, nh, hd)
        k_blk, v_blk = self.kv(x, rope)  # (..., Lq, nkv, hd)
        k = torch.cat([ctx_k, k_blk], dim=-3)  # (..., Lc + Lq, nkv, hd)
        v = torch.cat([ctx_v, v_blk], dim=-3)
        dtype = v.dtype  # under autocast the norms return fp32; attention runs in the value dtype
        q, k, v = (t.to(dtype).transpose(-3, -2) for t in (q, k, v))  # (..., heads, L, hd)
        if x.dim() == 2:
            q, k, v = q[None], k[None], v[None]
        out = attend(q, k, v)  # (R or 1, nh, Lq, hd)
        out = out.transpose(-3, -2).flatten(-2)  # (R or 1, Lq, nh*hd)
        return self.o_proj(out if x.dim() == 3 else out[0])  # (..., Lq, H)


class DrafterLayer(nn.Module):
    """A Qwen3 decoder layer with KV injection; a DFlash2 layer wraps both sublayers in `BlockConv`s."""

    def __init__(self, spec: DrafterSpec):
        super().__init__()
        self.block_size = spec.block_size
        self.self_attn = DrafterAttention(spec)
        self.mlp = Qwen3MLP(spec.qwen3_config())
        self.input_layernorm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        if spec.block_conv:
            with torch.random.fork_rng(devices=[]):  # the backbone draws its weights as a DFlash drafter does
                self.attention_conv = BlockConv(spec.hidden_size, spec.conv_kernel_size, spec.conv_group_size)
                self.mlp_conv = BlockConv(spec.hidden_size, spec.conv_kernel_size, spec.conv_group_size)

    def forward(self, h, ctx_k, ctx_v, rope, attend) -> torch.Tensor:
        """h (n*B, H): training's n blocks of B, or (R, B', H): decoding's one block a row (B' <= B near the end of
        a generation). The convolutions run along each block's slots."""
        attn = lambda x: self.self_attn(x, ctx_k, ctx_v, rope, attend)  # noqa: E731
        h = h + self._sublayer(attn, self.input_layernorm(h), getattr(self, "attention_conv", None))
        return h + self._sublayer(self.mlp, self.post_attention_layernorm(h), getattr(self, "mlp_conv", None))

    def _sublayer(self, fn: Callable, x: torch.Tensor, conv: Optional[BlockConv]) -> torch.Tensor:
        if conv is None:
            return fn(x)
        blocks = x if x.dim() == 3 else x.unflatten(0, (-1, self.block_size))  # (rows, B, H): a block a row
        y, delta = conv.prepare(blocks)
        out = fn(y if x.dim() == 3 else y.flatten(0, 1))  # the sublayer on x's own layout
        return conv.finish(out.view_as(blocks), delta).view_as(x)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainMasks:
    """Attention masks of one packed batch for `forward_train`."""

    kind: str
    """sdpa (dense bool masks) | flex (BlockMasks)."""
    by_window: dict
    """Layer window (None = full attention) -> (N*B, T + N*B) bool mask or flex BlockMask."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainContext:
    """The context of one packed batch as every layer's attention sees it (training); any subset of the batch's
    blocks can run against it (`forward_train_blocks`)."""

    keys: tuple[torch.Tensor, ...]
    """Per drafter layer, (T, nkv, hd): k_norm + RoPE applied."""
    values: tuple[torch.Tensor, ...]
    """Per drafter layer, (T, nkv, hd)."""
    dtype: torch.dtype
    """dtype of the context features hidden_norm(fc(taps)); the blocks' hidden states run in it."""

    @property
    def num_slots(self) -> int:
        return self.keys[0].shape[0]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.keys, *self.values)

    def detached(self) -> "TrainContext":
        """Leaf copies that collect the gradients of the blocks run against them (in `.grad`), so the context's
        own backward can run once, after all of them."""
        keys = tuple(k.detach().requires_grad_(k.requires_grad) for k in self.keys)
        values = tuple(v.detach().requires_grad_(v.requires_grad) for v in self.values)
        return TrainContext(keys=keys, values=values, dtype=self.dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class DraftContext:
    """Context keys/values of a batch of decoding rows (block keys are never cached).

    Every `extend_context` call appends the same number of slots to every row; slots that do not hold a
    committed token (rejected drafts, prompt padding) stay, with `valid` False, and no block sees them.
    """

    keys: tuple[torch.Tensor, ...]
    """Per drafter layer, (R, S, nkv, hd): k_norm + RoPE applied."""
    values: tuple[torch.Tensor, ...]
    """Per drafter layer, (R, S, nkv, hd)."""
    positions: torch.Tensor
    """(R, S) int64 absolute position of each slot."""
    valid: torch.Tensor
    """(R, S) bool: the slot holds a committed context token."""

    @property
    def length(self) -> int:
        return self.positions.shape[1]

    def select(self, rows: torch.Tensor) -> "DraftContext":
        """The context of `rows` (R',) int64 only, in that order."""
        return DraftContext(keys=tuple(k[rows] for k in self.keys), values=tuple(v[rows] for v in self.values),
                            positions=self.positions[rows], valid=self.valid[rows])


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockResult:
    hidden: torch.Tensor
    """(B', H) final hidden states of the block (after the final norm); slot k predicts position p0 + k."""
    cache: DraftContext
    """The context (one row) including the context passed to this call."""


class DFlashDrafter(nn.Module):
    def __init__(self, spec: DrafterSpec, *, attention: str = "auto", flex_kernel_options: Optional[dict] = None,
                 mask_tiles: str = "intervals"):
        super().__init__()
        self.spec = spec
        self.attention = attention
        self.flex_kernel_options = dict(flex_kernel_options or {})
        self.layers = nn.ModuleList(DrafterLayer(spec) for _ in range(spec.num_layers))
        self.fc = nn.Linear(spec.num_taps * spec.hidden_size, spec.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.norm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.rotary = RotaryTable(spec)
        self.candidate_selector: Optional[CandidateSelector] = None
        """DFlash2's selector over the top-K of each slot's logits (`dflash2.py`); None for DFlash."""
        if spec.variant == "dflash2":
            with torch.random.fork_rng(devices=[]):
                self.candidate_selector = CandidateSelector(spec.hidden_size, spec.vocab_size, spec.selector_rank,
                                                            spec.selector_top_k)
        self.markov_head: Optional[MarkovHead] = None
        """DSpark's Markov head (`dspark.py`); None for DFlash and DFlash2."""
        if spec.variant == "dspark":
            self.markov_head = MarkovHead(spec.vocab_size, spec.markov_rank)
        self.prefix_gru: Optional[nn.GRU] = None
        """Domino's correction head (`domino.py`; read from exports only), with `embed_proj`; None for the others."""
        self.embed_proj: Optional[nn.Sequential] = None
        if spec.variant == "domino":
            with torch.random.fork_rng(devices=[]):
                self.prefix_gru, self.embed_proj = correction_head(spec.hidden_size, spec.vocab_size,
                                                                   spec.domino_gru_hidden, spec.domino_emb_dim)
        self.lilicorr: Optional[LatticeHead] = None
        """LiLiCorr's lattice head over the top-K of each slot's logits (`lilicorr.py`); None for the others."""
        if spec.lattice is not None:
            with torch.random.fork_rng(devices=[]):
                self.lilicorr = LatticeHead(spec.lattice, model_hidden=spec.hidden_size, block_size=spec.block_size,
                                            rms_norm_eps=spec.rms_norm_eps)
        # stable mask_mod across batches (no recompiles)
        self._flex_masks = FlexMaskBuilder(from_intervals=mask_tiles == "intervals")
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """DFlash's backbone random (norms 1); DFlash2's convolutions the identity and its selector as
        `CandidateSelector.reset_parameters`, DSpark's Markov head as `MarkovHead.reset_parameters`, drawn from a generator of its own (seeded from the run's seed): a
        DFlash2 drafter's backbone is the DFlash drafter's of the same seed, and the random state moves on as that
        one's does."""
        extras = ("_conv.", "candidate_selector.", "markov_head.", "lilicorr.", "prefix_gru.", "embed_proj.")
        for name, p in self.named_parameters():
            if any(e in name for e in extras):
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
        for module in self.modules():
            if isinstance(module, BlockConv):
                module.reset_parameters()
        if self.candidate_selector is not None:
            self.candidate_selector.reset_parameters(std, seed=torch.initial_seed() + 1)
        if self.markov_head is not None:
            self.markov_head.reset_parameters(std, seed=torch.initial_seed() + 2)
        if self.lilicorr is not None:
            self.lilicorr.reset_parameters(std, seed=torch.initial_seed() + 2)

    @property
    def markov_w1(self) -> Optional[nn.Embedding]:
        """DSpark's `markov_head.markov_w1` (None for the other variants)."""
        return None if self.markov_head is None else self.markov_head.markov_w1

    @property
    def markov_w2(self) -> Optional[nn.Linear]:
        """DSpark's `markov_head.markov_w2` (None for the other variants)."""
        return None if self.markov_head is None else self.markov_head.markov_w2

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """Context features hidden_norm(fc(taps)): (T, K*H) -> (T, H)."""
        return self.hidden_norm(self.fc(taps))

    def anchor_context(self, taps: torch.Tensor) -> torch.Tensor:
        """`context` of a few rows, called outside the training forwards (LiLiCorr's anchors, in its loss): a
        method of its own so a sharded drafter gathers fc and hidden_norm for it (`train/parallel.py`)."""
        return self.context(taps)

    def _attention_kind(self, device: torch.device) -> str:
        if self.attention == "auto":
            return "flex" if device.type == "cuda" else "sdpa"
        return self.attention

    def build_masks(self, plan: BlockPlan, cu_seqlens: torch.Tensor, num_slots: int) -> TrainMasks:
        """The training attention masks of one packed batch (one per distinct layer window). Build them
        outside a compiled region and pass them to `forward_train` when compiling the forward."""
        kind = self._attention_kind(plan.positions.device)
        index = mask_index(plan, cu_seqlens, num_slots)
        windows = sorted({self.spec.layer_window(i) for i in range(self.spec.num_layers)}, key=lambda w: w or 0)
        build = dense_mask if kind == "sdpa" else self._flex_masks.build
        return TrainMasks(kind=kind, by_window={w: build(index, w) for w in windows})

    def forward_train(
        self,
        *,
        taps: torch.Tensor,
        cu_seqlens: torch.Tensor,
        plan: BlockPlan,
        embed_weight: torch.Tensor,
        masks: Optional[TrainMasks] = None,
    ) -> torch.Tensor:
        """All N blocks of a packed batch: taps (T, K*H), cu_seqlens (S+1,) int32, plan (N blocks of B),
        embed_weight (V, H) frozen target embedding, masks from `build_masks` (None: built here).
        Returns (N, B, H) after the final norm. Invalid blocks attend only to themselves (finite output,
        zero loss weight)."""
        if masks is None:
            masks = self.build_masks(plan, cu_seqlens, taps.shape[0])
        # the private bodies: `compile_forward_train` rebinds the public names, and must not nest them in here
        context = self._train_context(taps, cu_seqlens)
        return self._train_blocks(context, plan, embed_weight, masks)

    def train_context(self, taps: torch.Tensor, cu_seqlens: torch.Tensor,
                      positions: Optional[torch.Tensor] = None) -> TrainContext:
        """The keys and values of a packed batch's T context slots in every layer: taps (T, K*H), cu_seqlens
        (S+1,) int32 (RoPE positions restart at each sequence); positions (T,) int64 instead, when given (a
        context-parallel shard's slots are at their positions in the whole sequence)."""
        return self._train_context(taps, cu_seqlens, positions)

    def forward_train_blocks(
        self,
        *,
        context: TrainContext,
        plan: BlockPlan,
        cu_seqlens: torch.Tensor,
        embed_weight: torch.Tensor,
        masks: Optional[TrainMasks] = None,
    ) -> torch.Tensor:
        """The blocks of `plan` (any subset of the batch's blocks, e.g. `BlockPlan.select`) against the batch's
        `context`; masks from `build_masks` for these blocks (None: built here). Returns (n, B, H) after the
        final norm, equal to those blocks' rows of `forward_train`."""
        if masks is None:
            masks = self.build_masks(plan, cu_seqlens, context.num_slots)
        return self._train_blocks(context, plan, embed_weight, masks)

    def _train_context(self, taps: torch.Tensor, cu_seqlens: torch.Tensor,
                       positions: Optional[torch.Tensor] = None) -> TrainContext:
        num_slots = taps.shape[0]
        ctx = self.context(taps)  # (T, H)
        ctx_pos = positions
        if ctx_pos is None:
            seq = token_seq_ids(cu_seqlens, num_slots)  # (T,)
            ctx_pos = torch.arange(num_slots, device=taps.device) - cu_seqlens.to(torch.int64)[seq.clamp(min=0)]
        rope_ctx = self.rotary(ctx_pos, ctx.dtype)  # (T, 1, hd)
        kv = [layer.self_attn.kv(ctx, rope_ctx) for layer in self.layers]  # per layer (T, nkv, hd) x 2
        return TrainContext(keys=tuple(k for k, _ in kv), values=tuple(v for _, v in kv), dtype=ctx.dtype)

    def _train_blocks(self, context: TrainContext, plan: BlockPlan, embed_weight: torch.Tensor,
                      masks: TrainMasks) -> torch.Tensor:
        n, b = plan.positions.shape
        h = F.embedding(plan.block_ids.reshape(-1), embed_weight).to(context.dtype)  # (n*B, H)
        rope_blk = self.rotary(plan.positions.reshape(-1), h.dtype)  # (n*B, 1, hd)
        for i, layer in enumerate(self.layers):
            mask = masks.by_window[self.spec.layer_window(i)]
            if masks.kind == "sdpa":
                attend = lambda q, k, v, m=mask: _sdpa(q, k, v, m)
            else:
                attend = lambda q, k, v, m=mask: _flex_attention(q, k, v, m, self.flex_kernel_options)
            h = layer(h, context.keys[i], context.values[i], rope_blk, attend)
        return self.norm(h).view(n, b, -1)  # (n, B, H)

    def empty_context(self, rows: int, device: torch.device, dtype: torch.dtype) -> DraftContext:
        empty = torch.zeros(rows, 0, self.spec.num_key_value_heads, self.spec.head_dim, device=device, dtype=dtype)
        return DraftContext(
            keys=(empty,) * self.spec.num_layers,
            values=(empty,) * self.spec.num_layers,
            positions=torch.zeros(rows, 0, dtype=torch.int64, device=device),
            valid=torch.zeros(rows, 0, dtype=torch.bool, device=device),
        )

    def extend_context(
        self, cache: DraftContext, taps: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor
    ) -> DraftContext:
        """`cache` plus n slots per row: taps (R, n, K*H) at positions (R, n) int64, valid (R, n) bool."""
        ctx = self.context(taps.to(cache.keys[0].dtype))  # (R, n, H)
        rope = self.rotary(positions, ctx.dtype)  # (R, n, 1, hd)
        keys, values = [], []
        for layer, k_old, v_old in zip(self.layers, cache.keys, cache.values):
            k_new, v_new = layer.self_attn.kv(ctx, rope)  # (R, n, nkv, hd)
            keys.append(torch.cat([k_old, k_new.to(k_old.dtype)], dim=1))
            values.append(torch.cat([v_old, v_new.to(v_old.dtype)], dim=1))
        return DraftContext(keys=tuple(keys), values=tuple(values), positions=torch.cat([cache.positions, positions], 1),
                            valid=torch.cat([cache.valid, valid.bool()], 1))

    def forward_blocks(
        self,
        *,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        cache: DraftContext,
        block_lengths: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """One block per row, no training mask: each block sees its row's valid context and itself.

        block_embeds (R, B, H): target embeddings of [last committed token, MASK x (B-1)]; block_positions
        (R, B) int64: p0 .. p0+B-1 per row; cache: the rows' context, whose valid slots the caller keeps
        strictly before p0; block_lengths (R,) int64: a row's block is its first block_lengths[r] tokens
        (the later ones are invisible to it, as if the block were that short; None: all B). Sliding layers
        apply their causal window in absolute positions. Returns (R, B, H) after the final norm.
        """
        rows, b = block_positions.shape
        device = block_positions.device
        rope_blk = self.rotary(block_positions, block_embeds.dtype)  # (R, B, 1, hd)
        own = torch.ones(rows, b, dtype=torch.bool, device=device)  # (R, B) block keys
        if block_lengths is not None:
            own = torch.arange(b, device=device) < block_lengths[:, None]
        k_valid = torch.cat([cache.valid, own], 1)  # (R, S + B)
        full = k_valid[:, None, None, :]  # (R, 1, 1, S + B)
        masks: dict = {None: full}
        k_pos = torch.cat([cache.positions, block_positions], 1)[:, None, :]  # (R, 1, S + B)
        q_pos = block_positions[:, :, None]  # (R, B, 1)
        h = block_embeds  # (R, B, H)
        for i, layer in enumerate(self.layers):
            window = self.spec.layer_window(i)
            if window not in masks:
                masks[window] = (full[:, 0] & (k_pos <= q_pos) & (q_pos - k_pos < window))[:, None]  # (R, 1, B, S+B)
            attend = lambda q, k, v, m=masks[window]: _sdpa(q, k, v, m)
            h = layer(h, cache.keys[i], cache.values[i], rope_blk, attend)
        return self.norm(h)  # (R, B, H)

    def forward_block(
        self,
        *,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context_taps: Optional[torch.Tensor] = None,
        context_positions: Optional[torch.Tensor] = None,
        cache: Optional[DraftContext] = None,
    ) -> BlockResult:
        """`forward_blocks` for one sequence: block_embeds (B', H), block_positions (B',); context_taps
        (C, K*H) at context_positions (C,): context not yet in `cache` (None: none). Returns the block's
        hidden states (B', H) and the new cache."""
        if cache is None:
            cache = self.empty_context(1, block_embeds.device, block_embeds.dtype)
        if context_taps is not None:
            valid = torch.ones(1, context_taps.shape[0], dtype=torch.bool, device=context_taps.device)
            cache = self.extend_context(cache, context_taps[None], context_positions[None], valid)
        hidden = self.forward_blocks(block_embeds=block_embeds[None], block_positions=block_positions[None], cache=cache)
        return BlockResult(hidden=hidden[0], cache=cache)
