"""Reading the JSONL shards of a `dflash-train regenerate` output directory (the writer is `regen/shards.py`).

A shard holds one row per line, `{"messages": [...], "id": "<source>:<index>"}`; a last line without its
newline is a row cut mid-write (a crash): readers leave it out, the writer's resume cuts it off.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterator

from dflash_trainer.errors import DataError

log = logging.getLogger(__name__)


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.jsonl"


def shard_paths(out_dir: Path) -> list[Path]:
    """The shards in order; refuses gaps in the numbering (a shard deleted by hand)."""
    paths = sorted(out_dir.glob("shard_*.jsonl"))
    for i, path in enumerate(paths):
        if path.name != shard_name(i):
            raise DataError(f"{out_dir}: expected {shard_name(i)}, found {path.name}; shards must be numbered from 0")
    return paths


def complete_lines(path: Path, repair: bool) -> list[str]:
    """The file's complete lines; a last line without its newline is dropped (and cut off when `repair`)."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        if repair:
            log.warning("%s: truncating a partially written last line (%d bytes)", path, len(data) - end)
            with open(path, "r+b") as f:
                f.truncate(end)
        data = data[:end]
    # split on "\n" only: str.splitlines also splits on U+2028, U+0085 and the like, which JSON leaves unescaped
    # inside strings (ensure_ascii=False), and would cut a row in two
    return data.decode("utf-8").split("\n")[:-1]


def parse_row(path: Path, lineno: int, line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: not a JSON row ({e}); the file is corrupt, use a new --out dir") from None
    if not isinstance(row, dict) or "id" not in row:
        raise DataError(f"{path}:{lineno}: row without an id; not written by dflash-train regenerate")
    return row


def read_rows(out_dir: str | Path) -> Iterator[dict[str, Any]]:
    """The rows of a regenerate output directory in write order (read-only: a partial last line is skipped)."""
    out = Path(out_dir)
    for path in shard_paths(out):
        for lineno, line in enumerate(complete_lines(path, repair=False), 1):
            yield parse_row(path, lineno, line)
