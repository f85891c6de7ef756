"""Which conversations are usable: one rule for training and for regeneration, reported by reason.

A usable conversation is an optional system turn, then user and assistant turns alternating, starting with
the user. Training also needs an assistant turn (something to supervise); regeneration needs a user turn
(something to answer) and answers every user turn, so prompt-only rows are fine for it. A conversation may
end with either role. Rows that break the rule are skipped and counted under the reason's key.
"""

from __future__ import annotations

from typing import Optional, Sequence

from dflash_trainer.data.types import Message

TRAIN = "train"
REGENERATE = "regenerate"

REASONS = {
    "unknown_role": "a turn whose role is not system, user or assistant",
    "no_user_turn": "no user turn to answer",
    "no_assistant_turn": "no assistant turn to supervise (a prompt-only row: answer it with `dflash-train regenerate`)",
    "system_not_first": "a system turn after the first turn",
    "assistant_first": "the first turn (after an optional system turn) is the assistant's, not the user's",
    "roles_not_alternating": "two user turns or two assistant turns in a row",
}
"""Reason key (counted in load reports) -> what it means (regenerate's failure log)."""


def conversation_problem(messages: Sequence[Message], purpose: str) -> Optional[str]:
    """The reason key why `messages` cannot be used for `purpose` (TRAIN or REGENERATE), or None."""
    if any(m.role not in ("system", "user", "assistant") for m in messages):
        return "unknown_role"
    start = 1 if messages and messages[0].role == "system" else 0
    turns = [m.role for m in messages[start:]]
    if "system" in turns:
        return "system_not_first"
    if "user" not in turns:
        return "no_user_turn"
    if turns[0] != "user":
        return "assistant_first"
    if any(a == b for a, b in zip(turns, turns[1:])):
        return "roles_not_alternating"
    if purpose == TRAIN and "assistant" not in turns:
        return "no_assistant_turn"
    return None
