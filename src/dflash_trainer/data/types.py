"""Data items that cross module, thread and process boundaries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    role: str
    """system | user | assistant (normalised from the source's speaker names)."""
    content: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Conversation:
    messages: tuple[Message, ...]
    source: str
    """Name of the source it came from (for reports and the mix)."""
    source_index: int
    """Row index inside its source (stable: used for ids and the held-out split)."""
    sample: int = 0
    """Which of several replies regenerated for the same prompts this is (0: the first, or a source row)."""

    def to_json(self) -> dict[str, Any]:
        """The row form of `plan/eval.jsonl` and the tokenized cache's held-out list."""
        return {"messages": [{"role": m.role, "content": m.content} for m in self.messages], "source": self.source,
                "source_index": self.source_index}

    @staticmethod
    def from_json(row: dict[str, Any]) -> "Conversation":
        return Conversation(messages=tuple(Message(role=m["role"], content=m["content"]) for m in row["messages"]),
                            source=row.get("source", ""), source_index=int(row.get("source_index", -1)))


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizedSequence:
    input_ids: torch.Tensor
    """(n,) int64 on CPU: the rendered conversation, truncated to data.max_length."""
    loss_mask: torch.Tensor
    """(n,) bool on CPU: True on assistant reply tokens (and their end-of-turn token)."""
    truncated_tokens: int = 0
    """Tokens of the rendered conversation cut off past data.max_length (0: it fit)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """One packed batch of the epoch plan: what a target forwards and a drafter trains on."""

    job_id: int
    """Stable id, unique across the run (epoch-major): the ledger and RNG key."""
    epoch: int
    bucket_id: int
    """Length bucket the sequences came from."""
    sequence_ids: tuple[int, ...]
    """Indices into the tokenized training set, packed in this order."""
    num_tokens: int
    """Real tokens in the batch (sum of sequence lengths) <= pipeline.token_budget."""
