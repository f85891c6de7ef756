"""Data items that cross module, thread and process boundaries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageRef:
    """An image part of a turn (`data/images.py` resolved and decoded it once when the row was read)."""

    url: str
    """An absolute file path or a `data:image/...;base64,` URL."""
    at: int
    """Where the image stands in its turn: the character offset in `Message.content` (the text parts joined)."""
    sha256: str = ""
    """Digest of the image file's bytes ("" for a data URL, which the data file's own digest covers): a tokenized
    cache whose images changed on disk is rebuilt."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    role: str
    """system | user | assistant (normalised from the source's speaker names)."""
    content: str
    """The turn's text (its text parts joined)."""
    images: tuple[ImageRef, ...] = ()
    """Image parts of a user turn, in order (empty for text turns)."""

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The content as a chat template takes it: the text, or (with images) OpenAI-style parts in order, each
        image an `{"type": "image", "image": url}` part."""
        if not self.images:
            return self.content
        parts: list[dict[str, Any]] = []
        start = 0
        for image in self.images:
            if image.at > start:
                parts.append({"type": "text", "text": self.content[start : image.at]})
            parts.append({"type": "image", "image": image.url})
            start = image.at
        if start < len(self.content):
            parts.append({"type": "text", "text": self.content[start:]})
        return parts

    def openai_content(self) -> str | list[dict[str, Any]]:
        """The content as a data row gives it: the text, or OpenAI-style text and `image_url` parts."""
        if not self.images:
            return self.content
        return [{"type": "image_url", "image_url": {"url": p["image"]}} if p["type"] == "image" else p
                for p in self.chat_content()]


def _message_from_json(row: dict[str, Any]) -> Message:
    """A message as `Conversation.to_json` writes it: text content, or text and `image_url` parts."""
    content = row["content"]
    if isinstance(content, str):
        return Message(role=row["role"], content=content)
    text: list[str] = []
    images = []
    for part in content:
        if part["type"] == "image_url":
            images.append(ImageRef(url=part["image_url"]["url"], at=sum(map(len, text))))
        elif part["type"] == "text":
            text.append(part["text"])
        else:
            raise ValueError(f"a content part of type {part['type']!r}, neither text nor image_url")
    return Message(role=row["role"], content="".join(text), images=tuple(images))


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageText:
    """What the target's processor writes for each image of a conversation in place of the template's placeholder
    (`vision.py`); `masks.render` substitutes it."""

    placeholder: str
    """What the chat template writes for one image."""
    texts: tuple[str, ...]
    """The text of each image of the conversation, in order."""


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
        """The row form of `plan/eval.jsonl` and the tokenized cache's held-out list (image parts as OpenAI-style
        `image_url` parts)."""
        return {"messages": [{"role": m.role, "content": m.openai_content()} for m in self.messages],
                "source": self.source, "source_index": self.source_index}

    @staticmethod
    def from_json(row: dict[str, Any]) -> "Conversation":
        """The conversation `to_json` wrote (image parts back as `ImageRef`s, their urls as written)."""
        return Conversation(messages=tuple(_message_from_json(m) for m in row["messages"]),
                            source=row.get("source", ""), source_index=int(row.get("source_index", -1)))

    @property
    def has_images(self) -> bool:
        return any(m.images for m in self.messages)


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizedSequence:
    input_ids: torch.Tensor
    """(n,) int64 on CPU: the rendered conversation, truncated to data.max_length."""
    loss_mask: torch.Tensor
    """(n,) bool on CPU: True on assistant reply tokens (and their end-of-turn token)."""
    truncated_tokens: int = 0
    """Tokens of the rendered conversation cut off past data.max_length (0: it fit)."""
    images: tuple[ImageRef, ...] = ()
    """The images whose tokens it holds, in order (empty for a text sequence): what the tokenized cache stores of
    them, and what `data/vision.image_inputs` makes `pixel_values` from."""
    pixel_values: Optional[torch.Tensor] = None
    """(P, D) float32 on CPU: the pixel rows of the sequence's images as the target's image processor makes them
    (Qwen-VL's patches; a row per image for Gemma 3: `vision.py`), image after image; None for a text sequence, and
    for one fresh from tokenizing (the training set makes them when a sequence is read)."""
    image_grid_thw: Optional[torch.Tensor] = None
    """(num_images, 3) int64 on CPU: each image's grid (Qwen-VL's patch grid (time, height, width)); its product is
    the image's rows of `pixel_values`."""

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
