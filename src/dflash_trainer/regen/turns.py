"""Multi-turn regeneration: which turns are prompts, and the conversation rebuilt with the target's replies.

The system and user turns are kept; every assistant turn is replaced by the target's reply, generated in
order, each conditioned on the regenerated earlier turns. A trailing user turn gets a reply too, so
prompt-only datasets work. A later turn that cannot be asked (local backend: its prompt is over
`regenerate.max_prompt_tokens`; openai backend: the server refuses it with HTTP 400, e.g. over its context
length) ends the conversation before it: the answered turns are kept, the row counted as cut. At the first
turn the row is skipped (local) or failed (openai). Both backends drive a conversation through `TurnState`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_trainer.data.rules import REASONS, REGENERATE, conversation_problem
from dflash_trainer.data.types import Conversation, Message
from dflash_trainer.regen.failures import UNUSABLE


@dataclass(frozen=True, slots=True, kw_only=True)
class RegenOutcome:
    """The result for one source conversation, produced by a backend and written by the store."""

    row_id: str
    """Stable id of the source row: `conversation.source + ':' + str(conversation.source_index)`."""
    messages: tuple[Message, ...] | None
    """The regenerated conversation (replies verbatim, think blocks included); None when it failed."""
    error: str | None
    """Why the row failed or was skipped (None on success)."""
    skipped: str | None = None
    """Set when the row was left out by a limit rather than failed: the limit, short (the count's key)."""
    cut: str | None = None
    """Set when a limit ended the conversation before its last user turn (the limit, short): `messages` holds
    the turns answered before it."""
    kind: str | None = None
    """Set when the row failed: why, short enough to count (`regen/failures.py`: `HTTP 500`, `timeout`, ...)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Continuation:
    """Text the target wrote after a prompt (`synthesize` asks for user turns this way)."""

    text: str
    """The new text, cut before the stop token or stop string that ended it, decoded verbatim."""
    finished: bool
    """It ended at a stop token or string; False: it hit the token cap first (a truncated turn)."""


def row_id(conversation: Conversation) -> str:
    """`<source>:<index>`, and `#k` for the k-th extra sample of the same prompts."""
    base = f"{conversation.source}:{conversation.source_index}"
    return f"{base}#{conversation.sample}" if conversation.sample else base


def structure_error(conversation: Conversation) -> str | None:
    """Why the conversation cannot be regenerated (the usable-conversation rule, `data/rules.py`), or None."""
    reason = conversation_problem(conversation.messages, REGENERATE)
    return None if reason is None else f"{reason}: {REASONS[reason]}"


class TurnState:
    """One conversation being rebuilt: call `next_prompt`, generate, `add_reply`, until the prompt is None."""

    def __init__(self, conversation: Conversation) -> None:
        self.row_id = row_id(conversation)
        messages = conversation.messages
        self._users = [m for m in messages if m.role == "user"]
        self._messages: list[Message] = [messages[0]] if messages and messages[0].role == "system" else []
        self._replied = 0

    def next_prompt(self) -> tuple[Message, ...] | None:
        """The messages to answer next (ending with a user turn), or None when every user turn has a reply."""
        if self._replied >= len(self._users):
            return None
        return (*self._messages, self._users[self._replied])

    def add_reply(self, text: str) -> None:
        self._messages.append(self._users[self._replied])
        self._messages.append(Message(role="assistant", content=text))
        self._replied += 1

    @property
    def replied(self) -> int:
        """User turns answered so far."""
        return self._replied

    def outcome(self, cut: str | None = None) -> RegenOutcome:
        """The rebuilt conversation; before every user turn has a reply only when a limit `cut` it short."""
        assert cut is not None or self.next_prompt() is None, "outcome() before every user turn has a reply"
        assert self._replied > 0, "a conversation cut before its first reply is skipped, not written"
        return RegenOutcome(row_id=self.row_id, messages=tuple(self._messages), error=None, cut=cut)


def limit_turns(conversation: Conversation, max_turns: int | None) -> Conversation:
    """The conversation cut before its (max_turns + 1)-th user turn (None: unchanged)."""
    if max_turns is None:
        return conversation
    users = 0
    for i, m in enumerate(conversation.messages):
        if m.role == "user":
            users += 1
            if users > max_turns:
                return Conversation(messages=conversation.messages[:i], source=conversation.source,
                                    source_index=conversation.source_index)
    return conversation


def start(conversation: Conversation) -> TurnState | RegenOutcome:
    """A `TurnState` for a usable conversation, else its failed outcome."""
    reason = structure_error(conversation)
    if reason is not None:
        return failed(row_id(conversation), reason, UNUSABLE)
    return TurnState(conversation)


def failed(rid: str, reason: str, kind: str) -> RegenOutcome:
    """A row that failed: `reason` in full (logged), `kind` short (counted)."""
    return RegenOutcome(row_id=rid, messages=None, error=reason, kind=kind)


def skipped(rid: str, limit: str, detail: str) -> RegenOutcome:
    """A row left out by `limit` (e.g. `regenerate.max_prompt_tokens=256`); `detail` says by how much."""
    return RegenOutcome(row_id=rid, messages=None, error=f"{limit}: {detail}", skipped=limit)


def as_dicts(messages: tuple[Message, ...]) -> list[dict[str, Any]]:
    """Messages in the OpenAI form (a data row's): text, or text and `image_url` parts (urls as the data reader
    resolved them: an absolute path or a data URL), so a regenerated row trains with its images."""
    return [{"role": m.role, "content": m.openai_content()} for m in messages]
