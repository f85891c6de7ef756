"""Why rows failed, counted per kind, and what fixes it: the one line `regenerate` and `synthesize` print.

Each failed row carries a kind, short enough to count (`HTTP 500`, `timeout`, `empty reply`, ...), beside its
full reason (`failed.jsonl` keeps both). A kind says whether a rerun can finish the row: a server fault can (fix
the server, rerun), a refusal or an unusable conversation cannot (the rerun asks the same and gets the same), so
only the first leaves an output incomplete.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TIMEOUT = "timeout"
CONNECTION = "connection error"
MALFORMED_JSON = "malformed JSON"
NO_CHOICES = "no choices"
"""A reply without a `choices` list (or with an empty one)."""
BAD_SHAPE = "unexpected reply"
"""A reply whose choice lacks its message or text."""
EMPTY_REPLY = "empty reply"
"""A chat reply with no content (null, empty or whitespace) and no reasoning."""
STOPPED = "stopped"
"""The run was stopping (Ctrl-C, an error elsewhere) while the request waited for its retry."""
UNUSABLE = "unusable conversation"
"""The conversation breaks the usable-conversation rule (`data/rules.py`): no request was made."""
OTHER = "other"
REFUSED = "HTTP 400"
"""The server refused the request (e.g. a prompt over its context length): a length limit."""

PERMANENT = frozenset({REFUSED, UNUSABLE})
"""Kinds a rerun would meet again: the row is settled, not missing."""

_CHECK_SERVER = "check the server (its log) at regenerate.url"
_HINTS = {
    REFUSED: "the server refused the prompt (HTTP 400, e.g. over its context length): raise the server's context "
             "length (vLLM --max-model-len) or lower regenerate.max_turns",
    TIMEOUT: "raise regenerate.request_timeout_s or lower regenerate.concurrency (replies took longer than the "
             "timeout)",
    EMPTY_REPLY: "the server answered with no content: check its chat template and reasoning parser",
    UNUSABLE: "fix the data (each reason in the log names the rule the conversation breaks)",
    STOPPED: "",
    "HTTP 429": "lower regenerate.concurrency (the server is rate limiting)",
    "HTTP 401": "give the server's credentials (HTTP 401/403)",
    "HTTP 403": "give the server's credentials (HTTP 401/403)",
    "HTTP 404": "check regenerate.url and regenerate.model (HTTP 404: no such endpoint or model)",
}


def http_kind(code: int) -> str:
    return f"HTTP {code}"


def kind_of_reason(reason: str) -> str:
    """The kind of a failure logged without one (an output written before kinds were recorded)."""
    if (match := re.search(r"HTTP (\d{3})", reason)) is not None:
        return http_kind(int(match.group(1)))
    for marker, kind in (("timed out", TIMEOUT), ("connection error", CONNECTION),
                         ("malformed JSON", MALFORMED_JSON), ("no content", EMPTY_REPLY)):
        if marker in reason:
            return kind
    return OTHER


@dataclass(frozen=True, slots=True, kw_only=True)
class Failures:
    """The rows whose latest attempt failed, per kind, and where their reasons are logged."""

    counts: dict[str, int]
    """Failed rows per kind, the most frequent first."""
    log: str
    """The failure log (`failed.jsonl`), one reason per row."""

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def retryable(self) -> int:
        """Failed rows a rerun can still write (a server fault, not a refusal or an unusable conversation)."""
        return sum(n for kind, n in self.counts.items() if kind not in PERMANENT)

    def per_kind(self) -> str:
        """`HTTP 500: 28, timeout: 2`."""
        return ", ".join(f"{kind}: {n}" for kind, n in sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def line(self) -> str:
        """`30 failed (HTTP 500: 28, timeout: 2; details in FILE)`; empty when nothing failed."""
        return f"{self.total} failed ({self.per_kind()}; details in {self.log})" if self.total else ""

    def fix(self) -> str:
        """What to do about these kinds, most frequent first (a server fault: check the server)."""
        hints: list[str] = []
        for kind in sorted(self.counts, key=lambda k: -self.counts[k]):
            hint = _HINTS.get(kind, _CHECK_SERVER)
            if hint and hint not in hints:
                hints.append(hint)
        return "; ".join(hints)


def failures(counts: dict[str, int], log: str) -> Failures:
    return Failures(counts={k: n for k, n in counts.items() if n}, log=log)


def what_to_do(failed: Failures, limit_fix: str = "") -> str:
    """One sentence, capitalised: `limit_fix` first when given (rows a limit or a filter left out), then a fix
    per kind of failure, the most frequent first (a server fault: check the server; a refusal: raise its
    context)."""
    text = "; ".join(h for h in (limit_fix, failed.fix() if failed.total else "") if h)
    return text[:1].upper() + text[1:]
