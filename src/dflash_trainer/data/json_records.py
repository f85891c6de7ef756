"""Records of JSON and JSONL files, read with bounded cost: each record decoded alone, none larger than a cap held
or parsed, none nested deeper than `MAX_JSON_DEPTH` given to `json` (whose decoder recurses once per level). A
record refused comes as a `Drop(reason)` (`record_too_large`, `too_deeply_nested`, `invalid_json`, `not_utf8`),
counted by `sources.py`'s load report; a cut-off last record of a JSON array raises `Truncated`.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from dflash_trainer.data.config import DEFAULT_MAX_RECORD_BYTES
from dflash_trainer.errors import DataError

log = logging.getLogger(__name__)

_CHUNK_CHARS = 1 << 20

MAX_JSON_DEPTH = 100
"""Deepest nesting of arrays and objects a row may have. A conversation row nests 5 levels (row, turns, turn,
content parts, part), tool calls with JSON-schema arguments a few tens; far below the interpreter's recursion
limit (1000), which `json` would otherwise hit."""
HOSTILE = ("record_too_large", "too_deeply_nested")
"""Drop reasons of rows refused before parsing or tokenizing: warned about with their line numbers."""


class Drop(Exception):
    """A row left out, with the reason its load report counts."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.detail = detail
        """What in the row broke the rule (warned about for the first row of some reasons)."""


def _drop_cut_tail(error: UnicodeDecodeError):
    """Decoding errors handler: drop a character that the end of the file cut in two; re-raise any other."""
    if error.reason == "unexpected end of data":
        return "", error.end
    raise error


_CUT_TAIL = "dflash_drop_cut_tail"
codecs.register_error(_CUT_TAIL, _drop_cut_tail)


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_STRING_STOP = re.compile(r'[\\"]')
_SCALAR_END = re.compile(r"[,\]\s]")
_OPENERS = np.frombuffer(b"[{", dtype=np.uint8)
_CLOSERS = np.frombuffer(b"]}", dtype=np.uint8)


def _bracket_steps(text: str) -> np.ndarray:
    """(len(encoded text),) int64: +1 at each `[`/`{`, -1 at each `]`/`}` of UTF-8 `text`, 0 elsewhere."""
    b = np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8)
    return np.isin(b, _OPENERS).astype(np.int64) - np.isin(b, _CLOSERS)


def too_deeply_nested(text: str) -> bool:
    """True when the JSON value `text` nests arrays and objects deeper than `MAX_JSON_DEPTH`, found without
    recursion: brackets counted outside strings. An ordinary row has fewer brackets than the limit in all and costs
    two `count`s."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return False
    return int(np.cumsum(_bracket_steps(_JSON_STRING.sub("", text))).max(initial=0)) > MAX_JSON_DEPTH


def _parse_row(text: str) -> Any:
    """One JSON row, or a `Drop`: `too_deeply_nested` (checked before parsing), `invalid_json`."""
    if too_deeply_nested(text):
        return Drop("too_deeply_nested")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return Drop("invalid_json")
    except RecursionError:  # only when the recursion limit is far lower than usual
        return Drop("too_deeply_nested")


class _ValueEnd:
    """Where one JSON value ends, fed its text piece by piece (none of it kept), without recursion: to skip a
    record of a JSON array that cannot be decoded (nested too deeply, or larger than the record cap)."""

    def __init__(self, first: str):
        self.kind = "container" if first in "[{" else "string" if first == '"' else "scalar"
        self.depth = 0
        self.in_string = False
        self.escaped = False  # the last piece ended on a backslash inside a string

    def feed(self, text: str, i: int = 0) -> int:
        """The index in `text` just past the value's end (from `i`), or -1 when it goes on past `text`."""
        if self.kind == "scalar":  # a number or literal: it ends at the next separator
            m = _SCALAR_END.search(text, i)
            return -1 if m is None else m.start()
        n = len(text)
        while i < n:
            if self.escaped:
                i, self.escaped = i + 1, False
                continue
            if self.in_string:
                m = _STRING_STOP.search(text, i)
                if m is None:
                    return -1
                if m.group() == "\\":
                    i, self.escaped = m.end(), True
                    continue
                self.in_string, i = False, m.end()
                if self.kind == "string":
                    return i
                continue
            if self.kind == "string":  # its opening quote
                self.in_string, i = True, text.index('"', i) + 1
                continue
            quote = text.find('"', i)
            stop = n if quote < 0 else quote
            segment = text[i:stop]
            # the value starts on its opening bracket, so the depth is >= 1 from there until it closes
            depths = self.depth + np.cumsum(_bracket_steps(segment))  # (bytes of segment,)
            closed = np.flatnonzero(depths <= 0)
            if closed.size:
                k = int(closed[0]) + 1  # bytes of `segment` up to and with the closing bracket
                return i + len(segment.encode("utf-8", "surrogatepass")[:k].decode("utf-8", "surrogatepass"))
            if depths.size:
                self.depth = int(depths[-1])
            if quote < 0:
                return -1
            self.in_string, i = True, quote + 1
        return -1


def iter_json_array(path: Path, max_chars: int = DEFAULT_MAX_RECORD_BYTES) -> Iterator[Any]:
    """Records of a JSON array, decoded one at a time. A cut-off last record raises `Truncated`; a record that is
    not decoded within `max_chars` characters, or nests too deeply to decode, is skipped to its end and given as
    a `Drop`."""
    decoder = json.JSONDecoder()
    # A file cut inside a multi-byte character must still decode up to the cut (any other bad byte raises).
    with open(path, encoding="utf-8-sig", errors=_CUT_TAIL) as f:  # -sig: a byte-order mark is not text
        buf = f.read(_CHUNK_CHARS)
        pos = len(buf) - len(buf.lstrip())
        if buf[pos : pos + 1] != "[":
            raise DataError(f"{path}: expected a JSON array of conversations (first character is not '[')")
        pos += 1
        eof = False
        want = _CHUNK_CHARS
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            reason = None
            try:
                record, end = decoder.raw_decode(buf, pos) if pos < len(buf) else (None, -1)
                if end < 0:
                    raise json.JSONDecodeError("need more", buf, pos)
            except RecursionError:
                reason = "too_deeply_nested"
            except json.JSONDecodeError:
                if len(buf) - pos <= max_chars:
                    if eof:
                        if pos < len(buf):
                            raise Truncated() from None
                        raise Truncated(complete=False) from None
                    # a record larger than the buffer: grow geometrically (not quadratically), never past the cap
                    more = f.read(min(want, max_chars + 1 - (len(buf) - pos)))
                    want *= 2
                    eof = not more
                    buf = buf[pos:] + more
                    pos = 0
                    continue
                reason = "record_too_large"
            if reason is None:
                want = _CHUNK_CHARS
                yield record
                pos = end
                continue
            buf, pos, size = _skip_value(f, buf, pos)
            if reason == "record_too_large" and size <= max_chars:  # whole in the buffer, yet not JSON
                reason = "invalid_json"
            yield Drop(reason)
            want = _CHUNK_CHARS


def _skip_value(f, buf: str, pos: int) -> tuple[str, int, int]:
    """Read past the JSON value that starts at `buf[pos]` (more text read from `f` as needed, none kept): the
    buffer and position after it, and its size in characters. Raises `Truncated` when the file ends inside it."""
    scanner = _ValueEnd(buf[pos])
    end = scanner.feed(buf, pos)
    size = 0 if end < 0 else end - pos
    start = pos
    while end < 0:
        size += len(buf) - start
        buf, start = f.read(_CHUNK_CHARS), 0
        if not buf:
            raise Truncated()
        end = scanner.feed(buf)
        if end >= 0:
            size += end
    return buf, end, size


class Truncated(Exception):
    def __init__(self, complete: bool = True):
        super().__init__("truncated")
        self.partial_record = complete
        """True when text of a cut-off record follows the last complete one."""


def bounded_lines(f, max_bytes: int) -> Iterator[Optional[bytes]]:
    """The lines of binary file `f`, each read at most `max_bytes` bytes (newline excluded) at a time: a longer line
    is read past in pieces, never held whole, and given as None."""
    while True:
        raw = f.readline(max_bytes + 1)
        if not raw:
            return
        if len(raw) > max_bytes and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):
                raw = f.readline(_CHUNK_CHARS)
            yield None
            continue
        yield raw


def iter_jsonl(path: Path, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Iterator[Any]:
    """Rows of a JSONL file, each line decoded alone: a line that is not UTF-8 is dropped (`not_utf8`, counted and
    warned about with its line number), never decoded with replacement characters; a file with no UTF-8 row at
    all is an error (it is in another encoding). A line over `max_bytes` bytes, or nested deeper than
    `MAX_JSON_DEPTH`, is dropped before it is parsed (see the module docstring)."""
    bad, good = [], 0
    hostile: dict[str, list[int]] = {}
    with open(path, "rb") as f:
        for number, raw in enumerate(bounded_lines(f, max_bytes), 1):
            if raw is None:
                good += 1  # not decoded: says nothing of the file's encoding
                hostile.setdefault("record_too_large", []).append(number)
                yield Drop("record_too_large")
                continue
            if number == 1 and raw.startswith(codecs.BOM_UTF8):  # a byte-order mark would spoil the first row
                raw = raw[len(codecs.BOM_UTF8):]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                bad.append(number)
                yield Drop("not_utf8")
                continue
            if line.strip():
                good += 1
                row = _parse_row(line)
                if isinstance(row, Drop) and row.reason in HOSTILE:
                    hostile.setdefault(row.reason, []).append(number)
                yield row
    if bad and not good:
        raise DataError(f"{path}: not UTF-8 text (line {bad[0]} and every other line with a non-ASCII byte); "
                        f"convert it to UTF-8, e.g. `iconv -f latin1 -t utf-8 {path.name} > converted{path.suffix}`")
    if bad:
        log.warning("%s: %d lines are not UTF-8 (lines %s%s) and were left out; fix them, or convert the file if "
                    "it is in another encoding throughout", path, len(bad), ", ".join(map(str, bad[:5])),
                    ", ..." if len(bad) > 5 else "")
    for reason, lines in hostile.items():
        log.warning("%s: %d lines dropped as %s (lines %s%s): %s", path, len(lines), reason,
                    ", ".join(map(str, lines[:5])), ", ..." if len(lines) > 5 else "", _HOSTILE_FIX[reason](max_bytes))


_HOSTILE_FIX = {
    "record_too_large": lambda cap: f"over data.max_record_bytes={cap}; raise it if such rows are real data",
    "too_deeply_nested": lambda cap: f"arrays/objects nested deeper than {MAX_JSON_DEPTH} levels; no conversation "
                                     "row needs that many",
}
