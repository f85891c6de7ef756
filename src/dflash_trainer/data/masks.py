"""Render a conversation with the tokenizer's chat template and mark the assistant tokens to train on.

No `{% generation %}` tags: each assistant reply is located in the rendered text by characters, then
mapped to tokens with the fast tokenizer's offsets.

The supervised span of reply `i` is what the model would generate at serve time after the generation
prompt of `messages[:i]`, through the end-of-turn token. It is found as follows (template-agnostic):
  history = render(messages[:i]); prompt = render(messages[:i], add_generation_prompt=True)
  the full rendering must start with `history`; the generation prompt `gen = prompt - history` is then
  matched against the text that follows, as far as it agrees (cut back to a token boundary of `gen`).
  The reply starts there and ends after the first end-of-turn marker.
So with Qwen3 thinking off the empty `<think>\n\n</think>\n\n` of the last turn belongs to the prompt (not
supervised), with thinking on a think block is supervised, and earlier turns (whose reasoning the template
drops) are supervised as rendered. Every span is checked to contain the reply's text; a reply that cannot
be located, or whose boundary falls inside a token, drops the conversation with a reason: never a wrong mask.
An assistant turn that opens the conversation (ShareGPT's continuation parts) answers no prompt: it stays in
the sequence as context and is not supervised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from dflash_trainer.data.types import Conversation, Message, TokenizedSequence
from dflash_trainer.errors import ConfigError

_PROBE = "PROBE7f3aREPLY"


class Unmaskable(Exception):
    """A conversation that cannot be turned into a training sequence; `reason` is counted in reports, `detail`
    says what in the conversation broke the rule (logged for the first one of each reason)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplySpan:
    """Characters of one supervised reply in the rendered text: [start, end), end-of-turn marker included."""

    start: int
    end: int


def render(tokenizer: PreTrainedTokenizerFast, messages: Sequence[Message], *, thinking: bool,
           add_generation_prompt: bool = False) -> str:
    rows = [{"role": m.role, "content": m.content} for m in messages]
    try:
        text = tokenizer.apply_chat_template(rows, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             enable_thinking=thinking)
    except Exception as e:  # jinja raises anything (e.g. templates that insist on role alternation)
        raise Unmaskable("template_error") from e
    return text


def end_of_turn_marker(tokenizer: PreTrainedTokenizerFast, *, thinking: bool) -> str:
    """The special token the template closes an assistant turn with (`<|im_end|>`, `<|eot_id|>`, ...): the first
    special token after a probe reply."""
    probe = (Message(role="user", content="Q"), Message(role="assistant", content=_PROBE))
    try:
        text = render(tokenizer, probe, thinking=thinking)
    except Unmaskable:
        raise ConfigError("the chat template fails on a plain user/assistant exchange; set data.chat_template") from None
    after = text[text.index(_PROBE) + len(_PROBE):] if _PROBE in text else ""
    specials = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())
    hits = [(after.find(s), -len(s), s) for s in specials if s and after.find(s) >= 0]
    if not hits:
        raise ConfigError(
            "cannot find the end-of-turn token of the chat template (no special token follows an assistant "
            "reply); set data.chat_template to a template that closes turns with a special token"
        )
    return min(hits)[2]


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _prefix_detail(turn: int, history: str, full: str, prompt: str) -> str:
    """What broke prefix stability at assistant turn `turn`: where the turns before it render differently."""
    other, what = (full, "the whole conversation") if not full.startswith(history) else (prompt, "the serve prompt")
    k = _common_prefix(history, other)
    return (f"turn {turn} (assistant): the chat template renders the turns before it differently in {what} "
            f"(from character {k}: {history[k:k + 40]!r} alone, {other[k:k + 40]!r} there). Templates that rewrite "
            "earlier turns when later ones follow (Qwen3 drops earlier reasoning) cannot be masked turn by turn: "
            "set data.chat_template to one that renders earlier turns the same way, or remove what it rewrites "
            "(e.g. the reasoning of earlier replies)")


def _token_boundaries(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return sorted({0, len(text), *(end for _, end in offsets)})


def reply_spans(tokenizer: PreTrainedTokenizerFast, messages: Sequence[Message], full: str, *, thinking: bool,
                end_of_turn: str, limit: int | None = None) -> list[ReplySpan]:
    """The character span of every assistant reply in `full` (the rendered `messages`) that starts before
    `limit` (see the module docstring)."""
    limit = len(full) if limit is None else limit
    spans: list[ReplySpan] = []
    cursor = 0
    for i, message in enumerate(messages):
        if cursor >= limit:
            break
        if message.role != "assistant" or i == 0:  # an opening assistant turn answers no prompt: context only
            continue
        history = render(tokenizer, messages[:i], thinking=thinking)
        if len(history) >= limit:
            break
        prompt = render(tokenizer, messages[:i], thinking=thinking, add_generation_prompt=True)
        if not full.startswith(history) or not prompt.startswith(history) or len(history) < cursor:
            raise Unmaskable("template_not_prefix_stable", _prefix_detail(i, history, full, prompt))
        gen = prompt[len(history):]
        matched = _common_prefix(gen, full[len(history):])
        if matched < len(gen):  # the turn in the text differs from the serve prompt: cut back to a token edge
            matched = max(b for b in _token_boundaries(tokenizer, gen) if b <= matched)
            if matched == 0:
                raise Unmaskable("reply_not_found")
        start = len(history) + matched
        eot = full.find(end_of_turn, start)
        core = message.content.split("</think>")[-1].strip()
        if eot < 0 or core not in full[start:eot]:
            raise Unmaskable("reply_not_found")
        spans.append(ReplySpan(start=start, end=eot + len(end_of_turn)))
        cursor = eot + len(end_of_turn)
    return spans


def _encode_head(tokenizer: PreTrainedTokenizerFast, text: str, *, end_of_turn: str, max_length: int
                 ) -> tuple[list[int], np.ndarray, int]:
    """Token ids and offsets of a prefix of `text` holding at least `max_length` tokens (all of it if shorter),
    and that prefix's length in characters.

    The prefix always ends right after an end-of-turn special token: special tokens are split off before
    pre-tokenization, so its tokens are exactly the first tokens of the whole text. Long conversations are
    not tokenized (or searched for replies) past what `max_length` keeps."""
    guess = max_length * 4  # characters; most tokenizers average 2-5 per token, and the loop doubles it
    while True:
        cut = len(text)
        if guess < len(text):
            found = text.find(end_of_turn, guess)
            cut = len(text) if found < 0 else found + len(end_of_turn)
        enc = tokenizer(text[:cut], add_special_tokens=False, return_offsets_mapping=True)
        if len(enc["input_ids"]) >= max_length or cut == len(text):
            offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)  # (n, 2) char [start, end)
            return enc["input_ids"], offsets, cut
        guess *= 2


def tokenize_conversation(conversation: Conversation, tokenizer: PreTrainedTokenizerFast, *, thinking: bool,
                          end_of_turn: str, max_length: int, min_supervised: int) -> TokenizedSequence:
    """Token ids + assistant-only loss mask, truncated to `max_length`; raises `Unmaskable(reason)`."""
    text = render(tokenizer, conversation.messages, thinking=thinking)
    token_ids, offsets, limit = _encode_head(tokenizer, text, end_of_turn=end_of_turn, max_length=max_length)
    spans = reply_spans(tokenizer, conversation.messages, text, thinking=thinking, end_of_turn=end_of_turn,
                        limit=limit)
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(starts), dtype=bool)
    for span in spans:
        straddles = ((starts < span.start) & (ends > span.start)) | ((starts < span.end) & (ends > span.end))
        if straddles.any():
            raise Unmaskable("reply_boundary_inside_token")
        mask |= (starts >= span.start) & (ends <= span.end) & (ends > starts)
    ids = torch.tensor(token_ids[:max_length], dtype=torch.long)  # (n,)
    loss_mask = torch.from_numpy(mask[:max_length].copy())  # (n,) bool
    if int(loss_mask.sum()) < min_supervised:
        raise Unmaskable("too_few_supervised_tokens")
    cut = len(token_ids) - len(ids)
    if limit < len(text):  # the rest starts after an end-of-turn special token: its tokens are the text's own
        cut += len(tokenizer(text[limit:], add_special_tokens=False)["input_ids"])
    return TokenizedSequence(input_ids=ids, loss_mask=loss_mask, truncated_tokens=cut)
