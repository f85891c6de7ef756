"""Tap capture: run the target up to its last tapped layer and gather each tap's real tokens into a packed buffer.

Layout. A job's sequences are right-padded to the longest into a `(B, S)` batch, with no attention mask.
Right padding with the default positions `0..S-1` gives every real token exactly the position and the
causal context it has when the sequence runs alone: in a causal decoder token t sees only tokens <= t, and
the padding comes after every real token of its row. The pad rows compute values nobody reads. A padding
mask would change nothing we read, but it takes every attention backend off its causal fast path (a masked
kernel with no causal tile skipping: a large part of the forward; bench/RESULTS.md).
Jobs are length-bucketed, so little is padded. `real_index` lists the flat `b * S + t` positions of the real
tokens, sequence after sequence: that is the packed order.

Capture. A forward hook on each tapped decoder layer gathers `output.view(B*S, H)[real_index]` straight into
its column slice `taps[:n, k*H:(k+1)*H]` of the packed buffer with one `index_select(out=...)`: no concat,
no temporary, no host copy. Tap id `l` is the output of decoder layer `l` (HF `hidden_states[l + 1]`).

Early exit. The hook of the stop layer raises the private `_StopForward`, which `TapCapture.run` catches:
the decoder layers after it, the final norm and the LM head never run. We call the decoder (`model.model`),
never the causal LM, so logits are never computed even without early exit. The stop layer is the last tapped
layer, or the last decoder layer when the pre-norm last hidden state is captured for distillation (the
exception then skips just the final norm). Raising from a hook keeps the model's own forward (masks, rotary
embeddings, layer types) in charge, so any `model.model.layers` architecture works unchanged; the cost is
that the whole model cannot be one compiled graph: compile the layers instead (`compile_decoder_layers`).

Context parallel. A sequence sharded over a CP group (`context_parallel.py`) runs as one `(1, S)` batch per rank
(`shard_inputs`), at its positions in the sequence, with an attention that reaches across the shards; the hooks
capture the shard's real tokens as above.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from dflash_trainer.data.types import TokenizedSequence
from dflash_trainer.target.checks import check_tap_layer_ids
from dflash_trainer.target.context_parallel import ShardAttention, across_shards
from dflash_trainer.errors import ConfigError
from dflash_trainer.target.images import image_forward
from dflash_trainer.target.load import find_decoder, image_text_model, text_config
from dflash_trainer.target.tap_points import hook_tap, visual_feature_layers
from dflash_trainer.transport.wire import WireBatch


SDPA_WITHOUT_CUDNN = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
"""SDPA's backends but cuDNN's attention, whose plan for each new shape costs more than a small forward."""


class _StopForward(Exception):
    """Raised by the stop layer's hook to end the target forward early; never escapes `TapCapture.run`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardInputs:
    """A job's sequences as the padded target batch, plus where their real tokens are."""

    input_ids: torch.Tensor
    """(B, S) int64 on the target device: right-padded with 0 to S >= the longest (no mask needed, see the module
    docstring)."""
    real_index: torch.Tensor
    """(num_tokens,) int64 on the target device: flat positions b*S + t of real tokens, in packed order."""
    num_tokens: int
    num_seqs: int
    padded_tokens: int
    """B * S: tokens the forward computes, padding included."""
    position_ids: Optional[torch.Tensor] = None
    """(B, S) int64 RoPE positions; None: 0..S-1 in every row. A context-parallel shard's are its positions in the
    whole sequence."""
    shard: Optional[ShardAttention] = None
    """Set for a context-parallel shard (`shard_inputs`): its attention sees the whole sequence across the group."""
    pixel_values: Optional[torch.Tensor] = None
    """(P, D) float32 on the target device: the pixel rows of the batch's images as stored (`data/vision.py`), row
    after row (the order of their image tokens in `input_ids`); None when no sequence has an image."""
    image_grid_thw: Optional[torch.Tensor] = None
    """(num_images, 3) int64 on the target device: each image's grid (its product: the image's rows), in order."""


def prepare_inputs(sequences: Sequence[TokenizedSequence], out: WireBatch, *,
                   pad_to: Optional[int] = None) -> ForwardInputs:
    """Pad `sequences` for the forward and write their packed ids, loss mask and cu_seqlens into `out`.

    The batch is `(B, max(longest, pad_to))`. `out.input_ids` / `out.loss_mask` are zero past the real tokens;
    `out.cu_seqlens` repeats num_tokens past num_seqs. Host tensors are built on the CPU and copied with one
    non-blocking copy each.
    """
    token_budget, max_seqs = out.input_ids.numel(), out.cu_seqlens.numel() - 1
    device = out.input_ids.device
    lengths = [s.num_tokens for s in sequences]
    num_tokens, num_seqs = sum(lengths), len(lengths)
    if not 0 < num_seqs <= max_seqs:
        raise ValueError(f"a batch needs 1..{max_seqs} sequences (config max_seqs), got {num_seqs}")
    if num_tokens > token_budget:
        raise ValueError(f"batch has {num_tokens} tokens > pipeline.token_budget {token_budget}")
    if min(lengths) < 1:
        raise ValueError("a batch contains an empty sequence")
    seq_len = max(max(lengths), pad_to or 0)

    padded_ids = torch.zeros(num_seqs, seq_len, dtype=torch.int64)  # (B, S)
    packed_ids = torch.zeros(token_budget, dtype=torch.int64)  # (T,)
    packed_mask = torch.zeros(token_budget, dtype=torch.uint8)  # (T,)
    cu_seqlens = torch.full((max_seqs + 1,), num_tokens, dtype=torch.int32)
    real_index = torch.empty(num_tokens, dtype=torch.int64)  # (n,)
    start = 0
    for b, (seq, n) in enumerate(zip(sequences, lengths)):
        padded_ids[b, :n] = seq.input_ids
        packed_ids[start : start + n] = seq.input_ids
        packed_mask[start : start + n] = seq.loss_mask.to(torch.uint8)
        real_index[start : start + n] = torch.arange(n) + b * seq_len
        cu_seqlens[b] = start
        start += n

    def to_device(t: torch.Tensor) -> torch.Tensor:
        if device.type == "cuda":
            t = t.pin_memory()  # page-locked so the copy is truly asynchronous
        return t.to(device, non_blocking=True)

    out.input_ids.copy_(to_device(packed_ids), non_blocking=True)
    out.loss_mask.copy_(to_device(packed_mask), non_blocking=True)
    out.cu_seqlens.copy_(to_device(cu_seqlens), non_blocking=True)
    with_images = [s for s in sequences if s.image_grid_thw is not None]
    return ForwardInputs(
        input_ids=to_device(padded_ids),
        real_index=to_device(real_index),
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        padded_tokens=num_seqs * seq_len,
        pixel_values=to_device(torch.cat([s.pixel_values for s in with_images])) if with_images else None,
        image_grid_thw=to_device(torch.cat([s.image_grid_thw for s in with_images])) if with_images else None,
    )


def shard_inputs(sequence: TokenizedSequence, attention: ShardAttention,
                 device: torch.device | str) -> ForwardInputs:
    """The forward of one context-parallel shard of `sequence` (`context_parallel.py`): its S slots as a (1, S)
    batch at their positions in the sequence, right-padded past the sequence's end. Its taps are the shard's real
    tokens, in order."""
    shard = attention.shard
    if sequence.num_tokens != shard.num_tokens:
        raise ValueError(f"the shard is of a {shard.num_tokens}-token sequence, got {sequence.num_tokens} tokens")
    n = shard.real_tokens
    ids = torch.zeros(shard.length, dtype=torch.int64)  # (S,)
    ids[:n] = sequence.input_ids[shard.start : shard.start + n]
    return ForwardInputs(
        input_ids=ids[None].to(device), real_index=torch.arange(n, device=device), num_tokens=n, num_seqs=1,
        padded_tokens=shard.length, position_ids=shard.positions(device)[None], shard=attention,
    )


class TapCapture:
    """Captures the taps (and optionally the pre-norm last hidden state) of a target into wire buffers.

    The buffers (`WireBatch`, from `batch.allocate`) are owned by the caller: the sender's ring of
    `depth + 1` slots, so a slot is rewritten only after its send completed. Hooks are installed for the
    duration of one `run` only, so the same model can serve other uses (e.g. speculative decoding) between.
    """

    def __init__(self, model: nn.Module, tap_layer_ids: Sequence[int], *, capture_last_hidden: bool = False,
                 cudnn_attention: bool = True):
        self.cudnn_attention = cudnn_attention
        """Whether SDPA may pick cuDNN's attention in the forward (`target.cudnn_attention`)."""
        self.decoder = find_decoder(model)
        self.layers = self.decoder.layers
        self.image_text = image_text_model(model)
        """The image-text model around the decoder (vision tower, M-RoPE positions), or None for a text target."""
        self.model = model
        """The whole target: its config says after which layers a forward with images adds visual features."""
        num_layers = len(self.layers)
        check_tap_layer_ids(tap_layer_ids, num_layers)
        self.tap_layer_ids = tuple(tap_layer_ids)
        self.capture_last_hidden = capture_last_hidden
        self.hidden = int(text_config(model.config).hidden_size)
        self.stop_layer = num_layers - 1 if capture_last_hidden else max(self.tap_layer_ids)
        """Index of the last decoder layer that runs."""

    def run(self, inputs: ForwardInputs, out: WireBatch) -> None:
        """Forward `inputs` up to the stop layer; write taps (and last_hidden) rows [0, num_tokens) of `out`.

        Rows past num_tokens keep what an earlier batch left there (zeros at first): consumers use num_tokens.
        """
        h, n = self.hidden, inputs.num_tokens
        if out.taps.shape[1] != len(self.tap_layer_ids) * h:
            raise ValueError(f"out.taps has {out.taps.shape[1]} columns, need {len(self.tap_layer_ids)} x {h}")
        if self.capture_last_hidden != (out.last_hidden is not None):
            raise ValueError(
                f"capture_last_hidden={self.capture_last_hidden} but the wire buffers "
                f"{'have' if out.last_hidden is not None else 'lack'} last_hidden: build both from one WireSpec"
            )
        destinations: dict[int, list[torch.Tensor]] = {}
        for k, layer_id in enumerate(self.tap_layer_ids):
            destinations.setdefault(layer_id, []).append(out.taps[:n, k * h : (k + 1) * h])  # (n, H) strided view
        if self.capture_last_hidden:
            destinations.setdefault(self.stop_layer, []).append(out.last_hidden[:n])  # (n, H)
        # after a layer where the model adds visual features, the tap is the next layer's input (`tap_points.py`)
        added_after = visual_feature_layers(self.model, with_images=inputs.pixel_values is not None)
        handles = [hook_tap(self.layers, layer_id, added_after,
                            self._reader(dsts, inputs.real_index, layer_id == self.stop_layer))
                   for layer_id, dsts in destinations.items()]
        # cuDNN's attention builds an execution plan for every new batch shape (bench/RESULTS.md)
        kernels = nullcontext() if self.cudnn_attention else sdpa_kernel(list(SDPA_WITHOUT_CUDNN))
        try:
            with torch.no_grad(), kernels, across_shards(self.decoder, inputs.shard) as shard_kwargs:
                if inputs.pixel_values is not None:
                    self._forward_with_images(inputs)
                else:
                    self.decoder(input_ids=inputs.input_ids, position_ids=inputs.position_ids, use_cache=False,
                                 **shard_kwargs)
        except _StopForward:
            pass
        else:
            raise RuntimeError(f"target forward finished without reaching stop layer {self.stop_layer}")
        finally:
            for handle in handles:
                handle.remove()

    def _forward_with_images(self, inputs: ForwardInputs) -> None:
        """The image-text model's own forward: the vision tower's outputs replace the image tokens, at the positions
        and with the masks the family's forward gives each row (`images.py`; Qwen-VL's deepstack features join the
        first decoder layers)."""
        model = self.image_text
        if model is None or inputs.shard is not None:
            raise ConfigError("a batch with images needs an image-text target (a vision tower) and no context "
                              "parallel (pipeline.context_parallel=1)")
        # right-padded: the padding comes after every real token, and no image token is padding (pad id 0)
        images = image_forward(model, inputs.input_ids, None, inputs.pixel_values, inputs.image_grid_thw)
        model(input_ids=inputs.input_ids, position_ids=images.mrope_positions, use_cache=False, **images.kwargs)

    def _reader(self, destinations: list[torch.Tensor], real_index: torch.Tensor, stop: bool) -> Callable:
        return lambda hidden: self._gather(hidden, destinations, real_index, stop)

    def _gather(self, hidden: torch.Tensor, destinations: list[torch.Tensor], real_index: torch.Tensor,
                stop: bool) -> None:
        flat = hidden.reshape(-1, self.hidden)  # (B*S, H), a view of (B, S, H)
        for dst in destinations:
            torch.index_select(flat, 0, real_index, out=dst)  # (n, H) gathered in place
        if stop:
            raise _StopForward


def compile_decoder_layers(model: nn.Module, *, upto: Optional[int] = None, **compile_kwargs) -> None:
    """`torch.compile` each decoder layer's forward (layers 0..upto), leaving hooks and early exit eager.

    All layers share one code object, so dynamo may specialise per layer; the recompile limit is raised
    (a process-wide dynamo setting) so no layer silently falls back to eager.
    """
    layers = find_decoder(model).layers
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(layers))
    for layer in list(layers)[: None if upto is None else upto + 1]:
        layer.forward = torch.compile(layer.forward, **compile_kwargs)
