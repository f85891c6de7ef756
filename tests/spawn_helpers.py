"""Helpers for tests that spawn ranks with torch.multiprocessing: a free port, and the end of a rank. No import-time
side effects (every spawned child imports this module)."""

from __future__ import annotations

import os
import socket
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leave_spawned_rank() -> None:
    """The end of a spawned gloo rank whose work is done and written: destroys the process group and leaves with
    os._exit(0). Gloo's worker threads may still be releasing a finished collective's tensors when the interpreter
    finalizes, and the GIL they then take aborts the process (SIGABRT, "terminate called without an active
    exception"; gdb shows it in ProcessGroupGloo::runLoop), after every result was saved; leaving before the
    interpreter finalizes cannot meet it."""
    import torch.distributed as dist

    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
