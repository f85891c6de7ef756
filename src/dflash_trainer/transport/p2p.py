"""Point-to-point transfer of wire batches (torch.distributed: gloo on CPU, NCCL on GPU): a header, then
(unless it is the end of the stream) the fixed-shape payload, into preallocated receive buffers."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from dflash_trainer.transport.wire import (
    END_OF_STREAM,
    HiddenStateBatch,
    WireBatch,
    decode_header,
    encode_header,
    from_wire,
)


def send_batch(wire: WireBatch, dst: int, group: Optional[dist.ProcessGroup] = None) -> None:
    """Send the header, then (unless it is end of stream) the payload in PAYLOAD_ORDER; returns when sent.

    On NCCL "sent" means enqueued on the communicator's stream; the caller records an event after it
    before reusing the buffers.
    """
    works = [dist.isend(wire.header, dst=dst, group=group)]
    works += [dist.isend(t, dst=dst, group=group) for t in wire.payload()]
    for work in works:
        work.wait()


def send_end_of_stream(dst: int, device: torch.device | str, group: Optional[dist.ProcessGroup] = None) -> None:
    """The explicit last message of a stream: a header with FLAG_END_OF_STREAM and no payload."""
    dist.isend(encode_header(END_OF_STREAM, device), dst=dst, group=group).wait()


def recv_batch_into(
    buffers: WireBatch, src: int, group: Optional[dist.ProcessGroup] = None
) -> Optional[HiddenStateBatch]:
    """Receive one message from `src` into preallocated `buffers`; None at end of stream.

    The returned batch views `buffers`: it is valid until the next receive into them.
    """
    dist.irecv(buffers.header, src=src, group=group).wait()
    header = decode_header(buffers.header)  # host read: end of stream has no payload to post
    if header.end_of_stream:
        return None
    if header.has_last_hidden != (buffers.last_hidden is not None):
        raise ValueError(
            f"batch {header.job_id} from rank {src}: has_last_hidden={header.has_last_hidden} but the receive "
            "buffers disagree: both sides must derive their WireSpec from the same config (drafter.kd_weight)"
        )
    works = [dist.irecv(t, src=src, group=group) for t in buffers.payload()]
    for work in works:
        work.wait()
    return from_wire(buffers, header)
