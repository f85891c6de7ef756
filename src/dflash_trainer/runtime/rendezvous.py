"""Whether torchrun's rendezvous was closed: another node's agent gave up on the job.

A rank that dies before it joins the process group (SIGKILL, the OOM killer, while it imports or loads) cannot tell
anyone; its node's torchrun agent sees it die and, with no restart left, closes the job's c10d rendezvous and exits.
The agents of the other nodes do not act on that: their ranks would wait in torch's process-group set-up for
`pipeline.timeout_s` (30 minutes by default). Those ranks watch the rendezvous instead (`rendezvous_watch`) until they
have joined, and stop within seconds of its closing, saying why.

The rendezvous lives in a store at the agents' `--rdzv-endpoint`, which torchrun does not pass to its workers (their
own store is another one); a rank reads it from its agent's command line (its parent process). The state is
torch's own record of the rendezvous (`torch.distributed.elastic.rendezvous.dynamic_rendezvous`: a pickled
`_RendezvousState` under `torch.rendezvous.<rdzv-id>`). Where any of this cannot be read (another launcher, another
rendezvous backend, another torch), nothing is watched and the rank waits as before.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import pickle
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

from dflash_trainer.runtime.failures import StopWatch

log = logging.getLogger(__name__)


def agent_rendezvous(cmdline: list[str]) -> Optional[tuple[str, int, str]]:
    """(host, port, rendezvous id) of a torchrun agent's c10d rendezvous, from its command line; None when it uses
    another backend or is no torchrun."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    from torch.distributed.run import get_args_parser

    starts = [i + 1 for i, word in enumerate(cmdline) if word == "torch.distributed.run" or
              Path(word).name == "torchrun"]
    if not starts:
        return None
    try:
        args = get_args_parser().parse_args(cmdline[starts[0]:])
    except SystemExit:  # argparse's way to refuse a command line
        return None
    if args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
        return None
    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
    return host, port, args.rdzv_id


_RENDEZVOUS_TYPES = {("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
                     ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
                     ("datetime", "datetime"), ("datetime", "timedelta"), ("datetime", "timezone")}
"""The only classes torch's rendezvous record holds: anything else in the store's bytes is refused, never built."""


class _RendezvousUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _RENDEZVOUS_TYPES:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of torch's rendezvous record")
        return super().find_class(module, name)


def read_rendezvous_state(raw: bytes) -> object:
    """torch's rendezvous record from the store's value (base64 of its pickle), built from its own classes only."""
    return _RendezvousUnpickler(io.BytesIO(base64.b64decode(raw))).load()


def rendezvous_closed_check(timeout_s: float = 10.0) -> Optional[Callable[[], bool]]:
    """Under torchrun with a c10d rendezvous: a function telling whether the job's rendezvous was closed; else None."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            cmdline = [w.decode() for w in f.read().split(b"\0") if w]
        found = agent_rendezvous(cmdline)
        if found is None:
            return None
        host, port, run_id = found
        import torch.distributed as dist

        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # no /proc, an agent we cannot read, a store we cannot reach: nothing to watch
        log.debug("not watching torchrun's rendezvous: %s: %s", type(e).__name__, e)
        return None
    key = f"torch.rendezvous.{run_id}"

    def closed() -> bool:
        return bool(getattr(read_rendezvous_state(store.get(key)), "closed", False))

    return closed


def rendezvous_watch(closed: Callable[[], bool], *, rank: int, poll_s: float = 2.0) -> StopWatch:
    """From before this rank joins the process group until it has (`stop()`): when the rendezvous is closed, say so and
    end the process."""

    def reason() -> Optional[str]:
        try:
            if not closed():
                return None
        except Exception:  # the store is gone (the job is ending) or its record unreadable: nothing to say
            return None
        return ("torchrun's rendezvous was closed: another node's torchrun gave up on the job (one of its ranks failed "
                "before it joined; that node's log names it)")

    return StopWatch(reason, rank=rank, name="rendezvous-watch", poll_s=poll_s, grace_s=0.0)
