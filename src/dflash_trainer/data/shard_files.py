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
from dflash_trainer.readback import decode_problem, json_problem
from dflash_trainer.rundir import write_atomic

log = logging.getLogger(__name__)

REPAIR = ("rerun the same `dflash-train regenerate` / `synthesize` command with this --out: it drops the damaged "
          "rows and asks for them again, keeping every other row")


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
    """The file's complete lines; a last line without its newline is dropped (and cut off when `repair`). A line
    damaged on disk (not UTF-8, not a row we write) is an error naming it, or with `repair` (a resume of the
    writer) is dropped from the file with a warning, so that its row counts as not written and is asked again."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        if repair:
            log.warning("%s: truncating a partially written last line (%d bytes)", path, len(data) - end)
            with open(path, "r+b") as f:
                f.truncate(end)
        data = data[:end]
    if repair:
        data = _drop_damaged_lines(path, data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:  # our writer writes UTF-8 only: bytes damaged on disk
        lineno = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{lineno}: {decode_problem(e)}; the file is damaged: {REPAIR}") from None
    # split on "\n" only: str.splitlines also splits on U+2028, U+0085 and the like, which JSON leaves unescaped
    # inside strings (ensure_ascii=False), and would cut a row in two
    return text.split("\n")[:-1]


def _drop_damaged_lines(path: Path, data: bytes) -> bytes:
    """`data` (whole lines) without the lines that are not a row (or failure entry) we write; the file rewritten
    without them (atomically) when there were any."""
    lines = data.split(b"\n")[:-1]
    bad = [i for i, line in enumerate(lines, 1) if _row_problem(line) is not None]
    if not bad:
        return data
    dropped = set(bad)
    kept = b"".join(line + b"\n" for i, line in enumerate(lines, 1) if i not in dropped)
    write_atomic(path, kept)
    log.warning("%s: dropped %d damaged line(s) (lines %s%s: %s); their rows are asked again", path, len(bad),
                ", ".join(map(str, bad[:5])), "..." if len(bad) > 5 else "", _row_problem(lines[bad[0] - 1]))
    return kept


def _row_problem(line: bytes) -> str | None:
    """Why `line` is not a row we write (None: it is one)."""
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        return decode_problem(e)
    except json.JSONDecodeError as e:
        return f"not JSON ({json_problem(e)})"
    except RecursionError:
        return "nested too deeply"
    return None if isinstance(row, dict) and "id" in row else "not a row with an id"


def parse_row(path: Path, lineno: int, line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: not a JSON row ({json_problem(e)}); the file is damaged: {REPAIR}") from None
    except RecursionError:
        raise DataError(f"{path}:{lineno}: not a row we write (nested too deeply); the file is damaged: {REPAIR}"
                        ) from None
    if not isinstance(row, dict) or "id" not in row:
        raise DataError(f"{path}:{lineno}: a row without an id, not written by dflash-train regenerate; the file is "
                        f"damaged: {REPAIR}")
    return row


def read_rows(out_dir: str | Path) -> Iterator[dict[str, Any]]:
    """The rows of a regenerate output directory in write order (read-only: a partial last line is skipped)."""
    out = Path(out_dir)
    for path in shard_paths(out):
        for lineno, line in enumerate(complete_lines(path, repair=False), 1):
            yield parse_row(path, lineno, line)
