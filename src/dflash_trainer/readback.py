"""Reading back the files this package wrote (run dir, plans, caches, checkpoints).

A file we wrote can still be damaged when read back: a disk error, a copy cut short, a hand edit, a byte flipped
in storage. Such a file must never end in a `UnicodeDecodeError` or `JSONDecodeError` traceback, which names
neither the file nor what to do: these helpers turn the damage into an error of the caller's class (DataError,
ConfigError, ...) that names what the file is, its path, what is wrong and the fix. A missing file is not damage:
its OSError passes through, for the caller that knows whether a missing file is expected.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from dflash_trainer.errors import DataError


def decode_problem(error: UnicodeDecodeError) -> str:
    """Where a file is not UTF-8 text, in words."""
    return f"byte 0x{error.object[error.start]:02x} at offset {error.start} is not UTF-8 text"


def json_problem(error: json.JSONDecodeError) -> str:
    """What is wrong with a JSON text, in words: an end reached mid-value is named as a cut (the usual damage: a
    copy or a write cut short), anything else by its place."""
    # a string left open runs to the end of the text, so it is a cut too, though the error points at its start
    if error.pos >= len(error.doc.rstrip()) or error.msg.startswith("Unterminated string"):
        return "it ends mid-value: cut short"
    return f"not valid JSON at line {error.lineno}, column {error.colno}: {error.msg}"


def damaged(path: str | Path, *, what: str, problem: str, fix: str, error: type[Exception] = DataError) -> Exception:
    """The error to raise for a damaged file: `<what> <path> is damaged (<problem>): <fix>`; its `damage`
    attribute holds `problem` alone, for a caller that words its own message."""
    e = error(f"{what} {path} is damaged ({problem}): {fix}")
    e.damage = problem
    return e


def read_text_file(path: str | Path, *, what: str, fix: str, error: type[Exception] = DataError) -> str:
    """The UTF-8 text of a file we wrote; a byte that is not UTF-8 is `error` naming the file and `fix`."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise damaged(path, what=what, problem=decode_problem(e), fix=fix, error=error) from None


def parse_json(text: str, path: str | Path, *, what: str, fix: str, error: type[Exception] = DataError,
               line: Optional[int] = None) -> Any:
    """The JSON value of `text` (the file `path`, or its line `line`); a cut or invalid text is `error` naming the
    file (and line) and `fix`."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        where = f"{path}:{line}" if line is not None else path
        raise damaged(where, what=what, problem=json_problem(e), fix=fix, error=error) from None
    except RecursionError:  # nesting no writer of ours produces
        where = f"{path}:{line}" if line is not None else path
        raise damaged(where, what=what, problem="nested too deeply", fix=fix, error=error) from None


def read_json_file(path: str | Path, *, what: str, fix: str, error: type[Exception] = DataError,
                   expect: Optional[type] = dict) -> Any:
    """The JSON value of a file we wrote: not UTF-8, cut short, not JSON or (with `expect`) not of that type is
    `error` naming the file and `fix`."""
    value = parse_json(read_text_file(path, what=what, fix=fix, error=error), path, what=what, fix=fix, error=error)
    if expect is not None and not isinstance(value, expect):
        raise damaged(path, what=what, problem=f"a JSON {type(value).__name__}, not {_article(expect)}", fix=fix,
                      error=error)
    return value


def _article(kind: type) -> str:
    return {dict: "an object", list: "an array"}.get(kind, f"a {kind.__name__}")
