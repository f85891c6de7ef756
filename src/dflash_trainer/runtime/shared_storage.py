"""Whether every node sees the run dir rank 0 claimed: the same storage, not a node-local directory of that name.

Every rank reads what rank 0 writes into the run dir (the plans, the checkpoint to resume). On a node where `run.dir`
is a local directory, that read fails, or worse, finds an older run's files at the same path and trains on them. So
rank 0 writes a random token into the run dir (`.shared-check`) and tells every rank through the store; a rank on
another node waits for the file to show that token, for a bounded time (a shared filesystem may show a new file on
another node late: NFS caches directory contents for up to a minute), then goes on or stops the run, named.
"""

from __future__ import annotations

import secrets
import socket
import time
from pathlib import Path

from dflash_trainer import faults
from dflash_trainer.errors import ConfigError
from dflash_trainer.rundir import RunDir, write_atomic

SHARED_VIEW_TIMEOUT_S = 90.0
"""How long a node waits to see rank 0's token (NFS's directory cache lasts up to 60 s by default)."""


def publish_token(run_dir: Path) -> str:
    """Rank 0: a new token in the run dir; returns it (to put in the store)."""
    token = secrets.token_hex(8)
    write_atomic(RunDir(Path(run_dir)).shared_check, token)
    return token


def check_sees_token(run_dir: Path, token: str, *, timeout_s: float, poll_s: float = 0.5) -> None:
    """A rank on another node than rank 0: wait until the run dir shows rank 0's token, else a ConfigError."""
    path = RunDir(Path(run_dir)).shared_check
    if faults.applies("local_run_dir"):  # test-only hook: a node whose folder of that name is its own, empty
        path = Path(f"{run_dir}.node-local") / path.name
    deadline = time.monotonic() + timeout_s
    seen = None
    while True:
        try:
            seen = path.read_text().strip()
        except OSError:
            seen = None
        except ValueError:  # not UTF-8: damaged, or another tool's file
            seen = "(unreadable)"
        if seen == token or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    if seen != token:
        found = "no such file" if seen is None else "another run's token"
        raise ConfigError(
            f"run.dir={run_dir} on {socket.gethostname()} is not the directory rank 0 claimed ({path}: {found} after "
            f"{timeout_s:.0f} s): every node must see the run dir on shared storage (NFS, Lustre, ...). Put run.dir "
            "(and data.cache_dir, so the data is tokenized once) on a filesystem every node mounts at the same path"
        )
