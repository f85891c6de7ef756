"""`HiddenStateBatch`: the packed, fixed-shape batch a target sends to a drafter, and its wire form."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dflash_trainer.config import BatchShape, Config


@dataclass(frozen=True, slots=True, kw_only=True)
class HiddenStateBatch:
    """A packed batch of `token_budget` token slots; slots past `num_tokens` are padding.

    All tensors live on the same device (the target's GPU on the sender side, the drafter's on the
    receiver side); shapes are fixed for a run so buffers can be preallocated and steps compiled.
    """

    job_id: int
    bucket_id: int
    epoch: int
    num_tokens: int
    """Valid (real) tokens, a prefix of the buffer."""
    num_seqs: int
    """Sequences packed in the batch."""
    cu_seqlens: torch.Tensor
    """(max_seqs + 1,) int32: sequence starts; entries past num_seqs repeat num_tokens."""
    input_ids: torch.Tensor
    """(token_budget,) int64: token ids, 0 in padding slots."""
    loss_mask: torch.Tensor
    """(token_budget,) bool: assistant tokens; False in padding."""
    taps: torch.Tensor
    """(token_budget, K*H) target dtype: tap k in columns [k*H, (k+1)*H), outputs of layers tap_layer_ids."""
    last_hidden: Optional[torch.Tensor] = None
    """(token_budget, H) target dtype: the target's last hidden state before its final norm (KD), or None."""


# --- Wire form ------------------------------------------------------------------------------------
# A batch travels as a small int64 header followed (unless it is the end-of-stream message) by the
# fixed-shape payload tensors in PAYLOAD_ORDER. Both sides derive the same WireSpec from the config,
# so every message has the same shapes and the receiver can post its receives into preallocated buffers.

HEADER_LEN = 8
H_MAGIC, H_JOB_ID, H_BUCKET_ID, H_EPOCH, H_NUM_TOKENS, H_NUM_SEQS, H_FLAGS, H_RESERVED = range(HEADER_LEN)
WIRE_MAGIC = 0x0DF1A5_01
"""Header word 0: protocol id + version; a mismatch means both sides do not run the same protocol."""
FLAG_LAST_HIDDEN = 1
FLAG_END_OF_STREAM = 2
PAYLOAD_ORDER = ("cu_seqlens", "input_ids", "loss_mask", "taps", "last_hidden")


@dataclass(frozen=True, slots=True, kw_only=True)
class WireSpec:
    """Shapes and dtype of every wire batch of a run (derived by both sides from the same config)."""

    token_budget: int
    max_seqs: int
    num_taps: int
    hidden: int
    dtype: torch.dtype
    """Target dtype of `taps` and `last_hidden`."""
    has_last_hidden: bool
    """Whether batches carry the target's pre-norm last hidden state (distillation on)."""

    @classmethod
    def of(cls, batch: BatchShape, *, num_taps: int, hidden: int, dtype: torch.dtype, has_last_hidden: bool) -> "WireSpec":
        return cls(token_budget=batch.token_budget, max_seqs=batch.max_seqs, num_taps=num_taps, hidden=hidden,
                   dtype=dtype, has_last_hidden=has_last_hidden)


@dataclass(frozen=True, slots=True, kw_only=True)
class WireHeader:
    """The header's fields as host ints."""

    job_id: int
    bucket_id: int
    epoch: int
    num_tokens: int
    num_seqs: int
    has_last_hidden: bool
    end_of_stream: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class WireBatch:
    """Fixed-shape tensors of one message; also the type of preallocated send and receive buffers."""

    header: torch.Tensor
    """(HEADER_LEN,) int64: see the H_* indices."""
    cu_seqlens: torch.Tensor
    """(max_seqs + 1,) int32."""
    input_ids: torch.Tensor
    """(token_budget,) int64."""
    loss_mask: torch.Tensor
    """(token_budget,) uint8 (the bool loss mask reinterpreted, no copy)."""
    taps: torch.Tensor
    """(token_budget, K*H) target dtype."""
    last_hidden: Optional[torch.Tensor] = None
    """(token_budget, H) target dtype, or None when the spec has no last hidden state."""

    def payload(self) -> list[torch.Tensor]:
        """Payload tensors in the fixed send/receive order (PAYLOAD_ORDER)."""
        tensors = [self.cu_seqlens, self.input_ids, self.loss_mask, self.taps]
        return tensors + ([self.last_hidden] if self.last_hidden is not None else [])


def wire_spec(config: Config, *, hidden: int, num_taps: int) -> WireSpec:
    """The `WireSpec` of a run's hidden-state batches: taps in the target dtype, and the target's last hidden
    state when distilling."""
    return WireSpec.of(config.batch, num_taps=num_taps, hidden=hidden, dtype=getattr(torch, config.target.dtype),
                       has_last_hidden=config.drafter.needs_last_hidden)


def allocate(spec: WireSpec, device: torch.device | str) -> WireBatch:
    """Zeroed buffers for one wire batch of `spec` on `device` (send ring slots and receive buffers)."""
    t, k, h = spec.token_budget, spec.num_taps, spec.hidden
    return WireBatch(
        header=torch.zeros(HEADER_LEN, dtype=torch.int64, device=device),
        cu_seqlens=torch.zeros(spec.max_seqs + 1, dtype=torch.int32, device=device),
        input_ids=torch.zeros(t, dtype=torch.int64, device=device),
        loss_mask=torch.zeros(t, dtype=torch.uint8, device=device),
        taps=torch.zeros(t, k * h, dtype=spec.dtype, device=device),
        last_hidden=torch.zeros(t, h, dtype=spec.dtype, device=device) if spec.has_last_hidden else None,
    )


def check_wire(wire: WireBatch, spec: WireSpec) -> None:
    """Raise if `wire`'s buffers do not have the shapes and dtypes of `spec` (both sides must agree)."""
    ref = allocate(spec, "meta")
    for name in ("header",) + PAYLOAD_ORDER:
        got, want = getattr(wire, name), getattr(ref, name)
        if (got is None) != (want is None) or (
            got is not None and (got.shape != want.shape or got.dtype != want.dtype)
        ):
            describe = lambda x: None if x is None else (tuple(x.shape), x.dtype)  # noqa: E731
            raise ValueError(f"wire field {name}: got {describe(got)}, the wire spec needs {describe(want)}")


def _header_values(header: WireHeader) -> list[int]:
    flags = (FLAG_LAST_HIDDEN if header.has_last_hidden else 0) | (FLAG_END_OF_STREAM if header.end_of_stream else 0)
    values = [0] * HEADER_LEN
    values[H_MAGIC], values[H_FLAGS] = WIRE_MAGIC, flags
    values[H_JOB_ID], values[H_BUCKET_ID], values[H_EPOCH] = header.job_id, header.bucket_id, header.epoch
    values[H_NUM_TOKENS], values[H_NUM_SEQS] = header.num_tokens, header.num_seqs
    return values


def header_of(batch: HiddenStateBatch) -> WireHeader:
    return WireHeader(
        job_id=batch.job_id,
        bucket_id=batch.bucket_id,
        epoch=batch.epoch,
        num_tokens=batch.num_tokens,
        num_seqs=batch.num_seqs,
        has_last_hidden=batch.last_hidden is not None,
        end_of_stream=False,
    )


def encode_header(header: WireHeader, device: torch.device | str) -> torch.Tensor:
    """(HEADER_LEN,) int64 on `device` (a small host-to-device copy)."""
    return torch.tensor(_header_values(header), dtype=torch.int64, device=device)


def decode_header(header: torch.Tensor) -> WireHeader:
    # Host sync on a device header: the receiver needs the fields on the host to decide what follows.
    values = header.tolist()
    if values[H_MAGIC] != WIRE_MAGIC:
        raise ValueError(f"wire header magic {values[H_MAGIC]:#x} != {WIRE_MAGIC:#x}: mismatched peers or protocol")
    flags = values[H_FLAGS]
    return WireHeader(
        job_id=values[H_JOB_ID],
        bucket_id=values[H_BUCKET_ID],
        epoch=values[H_EPOCH],
        num_tokens=values[H_NUM_TOKENS],
        num_seqs=values[H_NUM_SEQS],
        has_last_hidden=bool(flags & FLAG_LAST_HIDDEN),
        end_of_stream=bool(flags & FLAG_END_OF_STREAM),
    )


END_OF_STREAM = WireHeader(
    job_id=-1, bucket_id=-1, epoch=-1, num_tokens=0, num_seqs=0, has_last_hidden=False, end_of_stream=True
)


def to_wire(batch: HiddenStateBatch) -> WireBatch:
    """The wire form of `batch`: views of its tensors (no copy) plus a fresh header on the same device."""
    return WireBatch(
        header=encode_header(header_of(batch), batch.taps.device),
        cu_seqlens=batch.cu_seqlens,
        input_ids=batch.input_ids,
        loss_mask=batch.loss_mask.view(torch.uint8),
        taps=batch.taps,
        last_hidden=batch.last_hidden,
    )


def from_wire(wire: WireBatch, header: Optional[WireHeader] = None) -> HiddenStateBatch:
    """A batch viewing `wire`'s tensors (no copy). Pass `header` when the host already knows it (a claim)."""
    header = decode_header(wire.header) if header is None else header
    if header.end_of_stream:
        raise ValueError("from_wire got the end-of-stream message, which carries no batch")
    if header.has_last_hidden != (wire.last_hidden is not None):
        raise ValueError(
            f"wire header says has_last_hidden={header.has_last_hidden} but the buffers "
            f"{'have' if wire.last_hidden is not None else 'lack'} last_hidden: sender and receiver specs differ"
        )
    return HiddenStateBatch(
        job_id=header.job_id,
        bucket_id=header.bucket_id,
        epoch=header.epoch,
        num_tokens=header.num_tokens,
        num_seqs=header.num_seqs,
        cu_seqlens=wire.cu_seqlens,
        input_ids=wire.input_ids,
        loss_mask=wire.loss_mask.view(torch.bool),
        taps=wire.taps,
        last_hidden=wire.last_hidden,
    )
