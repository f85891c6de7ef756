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
With thinking on, a final reply whose reasoning the template drops (DeepSeek-V3.1's and Gemma 4's render every reply
without it) drops the conversation too (`template_drops_reasoning`): the target writes that reasoning at serve time.
A reply ends with the first special token after it (`TurnEnds`): the token closing the turn, the final reply's own
where the template gives it another (gpt-oss: `<|end|>`, then `<|return|>` last), or in a template that closes no
turn (GLM-4.5) the next turn's opening token, at which the target stops (an eos id of its generation config); such
a template writes nothing after the final reply, so that token is appended there, as the target writes it, and the
final reply is supervised through it like the others.
An assistant turn that opens the conversation (ShareGPT's continuation parts) answers no prompt: it stays in
the sequence as context and is not supervised.

Bounded cost: a text is tokenized no further than `data.max_length * MAX_CHARS_PER_TOKEN` characters (cut at a
whitespace, so the kept tokens are the ones the whole text gives), however long its turns; tokens past that are
counted by estimate past `COUNT_REST_CHARS`, not tokenized. Plain data never reaches the bound (2-5 characters a
token is typical).

Special-token text in user and system turns (`<|im_end|>\n<|im_start|>assistant`) becomes the real structure
tokens by default, as vLLM and SGLang tokenize a served chat (the template's text, tokenized whole).
`escape_special_tokens=True` (`data.escape_special_tokens`) keeps it plain text instead: only the template writes
structure tokens (the idea of transformers' `sanitize_control_tokens`, with character offsets kept for the mask).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from dflash_trainer.data.types import Conversation, ImageText, Message, TokenizedSequence
from dflash_trainer.errors import ConfigError

_PROBE = "PROBE7f3aREPLY"

MAX_CHARS_PER_TOKEN = 64
"""Characters a token covers on average, generously (text averages 2-5, long code indentation or repeated
punctuation tokens ~16): `max_length` tokens never need more than `max_length` times this many characters, so a
text is never tokenized further (a huge turn is cut there cheaply rather than tokenized whole)."""

COUNT_REST_CHARS = 1 << 20
"""The text past the kept tokens is tokenized to count its tokens (`truncated_tokens`, a report figure) when it is
at most this long (a bounded cost); a longer rest is estimated from the kept part's characters per
token."""


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
           add_generation_prompt: bool = False, images: Optional[ImageText] = None) -> str:
    """`messages` rendered with the chat template; `images`: the processor's text of each image, put in place of the
    placeholder the template writes for it (`vision.py`), as the target's processor does before tokenizing."""
    rows = [{"role": m.role, "content": m.chat_content()} for m in messages]  # image parts as the template takes them
    try:
        text = tokenizer.apply_chat_template(rows, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             enable_thinking=thinking)
    except Exception as e:  # jinja raises anything (e.g. templates that insist on role alternation)
        raise Unmaskable("template_error") from e
    return text if images is None else _put_images(text, images, sum(len(m.images) for m in messages))


def _put_images(text: str, images: ImageText, count: int) -> str:
    """`text` with its `count` image placeholders replaced by the first `count` image texts, in order."""
    pieces = text.split(images.placeholder)
    if len(pieces) - 1 != count:
        raise Unmaskable("image_tokens_mismatch", f"the chat template wrote {len(pieces) - 1} image placeholders "
                         f"{images.placeholder!r} for {count} images: set data.chat_template to the target's image-text "
                         "template, or remove that text from the user turns")
    return pieces[0] + "".join(t + p for t, p in zip(images.texts, pieces[1:]))


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnEnds:
    """The special tokens that end an assistant reply in a chat template (`turn_ends`)."""

    inner: str
    """After a reply that a user turn follows: the token closing the turn (`<|im_end|>`, `<|eot_id|>`, gpt-oss's
    `<|end|>`), or in a template that closes no turn (GLM-4.5) the next turn's opening token (`<|user|>`), where the
    target stops at serve time (an eos id of its generation config)."""
    final: str
    """After a conversation's final reply: the token the target ends its generation with (gpt-oss's `<|return|>`;
    `inner` in most templates). Decoding stops at it (`target/stop_tokens.py`)."""
    appended: bool = False
    """The template writes no token after the final reply (GLM-4.5): `final` (then `inner`) is appended there, as the
    target writes it, and the final reply is supervised through it like the others."""

    @classmethod
    def of(cls, end_of_turn: "str | TurnEnds") -> "TurnEnds":
        """`end_of_turn` as `TurnEnds` (a str: one token that the template writes after every reply)."""
        return end_of_turn if isinstance(end_of_turn, TurnEnds) else cls(inner=end_of_turn, final=end_of_turn)


def _special_after_probe(tokenizer: PreTrainedTokenizerFast, probe: Sequence[Message], *, thinking: bool
                         ) -> Optional[str]:
    """The first special (or added) token the template writes after the probe reply of `probe`, None if none."""
    try:
        text = render(tokenizer, probe, thinking=thinking)
    except Unmaskable:
        raise ConfigError("the chat template fails on a plain user/assistant exchange; set data.chat_template") from None
    after = text[text.index(_PROBE) + len(_PROBE):] if _PROBE in text else ""
    specials = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())
    hits = [(after.find(s), -len(s), s) for s in specials if s and after.find(s) >= 0]
    return min(hits)[2] if hits else None


def turn_ends(tokenizer: PreTrainedTokenizerFast, *, thinking: bool) -> TurnEnds:
    """The tokens that end an assistant reply: the first special token the template writes after a probe reply that a
    user turn follows, and after one that ends the conversation (see `TurnEnds`)."""
    question, reply = Message(role="user", content="Q"), Message(role="assistant", content=_PROBE)
    inner = _special_after_probe(tokenizer, (question, reply, question), thinking=thinking)
    if inner is None:
        raise ConfigError(
            "cannot find the end-of-turn token of the chat template (no special token follows an assistant "
            "reply); set data.chat_template to a template that ends turns with a special token"
        )
    final = _special_after_probe(tokenizer, (question, reply), thinking=thinking)
    return TurnEnds(inner=inner, final=final or inner, appended=final is None)


def end_of_turn_marker(tokenizer: PreTrainedTokenizerFast, *, thinking: bool) -> str:
    """The token that ends an assistant reply that another turn follows (`TurnEnds.inner`)."""
    return turn_ends(tokenizer, thinking=thinking).inner


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
                end_of_turn: str | TurnEnds, limit: int | None = None,
                images: Optional[ImageText] = None) -> list[ReplySpan]:
    """The character span of every assistant reply in `full` (the rendered `messages`, `images` in place, the final
    reply's end appended where the template writes none) that starts before `limit` (see the module docstring)."""
    ends = TurnEnds.of(end_of_turn)
    limit = len(full) if limit is None else limit
    spans: list[ReplySpan] = []
    cursor = 0
    for i, message in enumerate(messages):
        if cursor >= limit:
            break
        if message.role != "assistant" or i == 0:  # an opening assistant turn answers no prompt: context only
            continue
        history = render(tokenizer, messages[:i], thinking=thinking, images=images)
        if len(history) >= limit:
            break
        prompt = render(tokenizer, messages[:i], thinking=thinking, add_generation_prompt=True, images=images)
        if not full.startswith(history) or not prompt.startswith(history) or len(history) < cursor:
            raise Unmaskable("template_not_prefix_stable", _prefix_detail(i, history, full, prompt))
        gen = prompt[len(history):]
        matched = _common_prefix(gen, full[len(history):])
        if matched < len(gen):  # the turn in the text differs from the serve prompt: cut back to a token edge
            matched = max(b for b in _token_boundaries(tokenizer, gen) if b <= matched)
            if matched == 0:
                raise Unmaskable("reply_not_found")
        start = len(history) + matched
        end_of_turn = ends.final if i == len(messages) - 1 else ends.inner
        eot = full.find(end_of_turn, start)
        reasoning, answer = split_reasoning(message.content)
        if eot < 0 or answer not in full[start:eot]:
            raise Unmaskable("reply_not_found")
        if thinking and i == len(messages) - 1 and reasoning not in full[start:eot]:
            raise Unmaskable("template_drops_reasoning", _DROPPED_REASONING)
        spans.append(ReplySpan(start=start, end=eot + len(end_of_turn)))
        cursor = eot + len(end_of_turn)
    return spans


THOUGHT_TAGS = (("<think>", "</think>"), ("<|channel>", "<channel|>"))
"""How a reply marks its reasoning: think tags (Qwen3, DeepSeek, GLM, MiniMax, Nemotron), Gemma 4's thought channel."""


def split_reasoning(content: str) -> tuple[str, str]:
    """(reasoning, answer) of a reply, both stripped: the text inside its reasoning tags and the text after the last
    closing one; ('', the whole reply) when it has none."""
    for opening, closing in THOUGHT_TAGS:
        if closing in content:
            return content.split(closing)[0].split(opening)[-1].strip(), content.split(closing)[-1].strip()
    return "", content.strip()


_DROPPED_REASONING = ("the chat template renders the final reply without its reasoning (as DeepSeek-V3.1's and Gemma "
                      "4's do), while with data.thinking=true the target writes that reasoning at serve time: the "
                      "drafter would never see it. Set data.thinking=false to train for serving with thinking off, or "
                      "data.chat_template to a template that keeps the reasoning of the reply after the last user turn")


# ------------------------------------------------------------------------------------ special-token text


def control_tokens(tokenizer: PreTrainedTokenizerFast) -> tuple[str, ...]:
    """The added tokens that structure a chat: every special one, and the others the chat template writes (Qwen3's
    `<think>`, `<tool_call>`); not whitespace tokens (Gemma's newline), which templates write as plain text."""
    template = str(tokenizer.chat_template or "")
    return tuple(sorted((t.content for t in tokenizer.added_tokens_decoder.values()
                         if t.content.strip() and (t.special or t.content in template)), key=len, reverse=True))


@functools.lru_cache(maxsize=8)
def _control_pattern(tokens: tuple[str, ...]) -> re.Pattern:
    return re.compile("|".join(map(re.escape, tokens)) or "(?!)")  # longest first: a token before its parts


def escaped_spans(tokenizer: PreTrainedTokenizerFast, messages: Sequence[Message], text: str, *,
                  thinking: bool) -> list[tuple[int, int]]:
    """Character spans of `text` (the rendered `messages`) that hold special-token text of a user or system turn:
    the conversation is rendered again with each such text wrapped in two characters found nowhere in it, so the
    ones the template wrote stay apart from the ones the turns brought. A template that changes the marked text
    (splits or strips around it) cannot be escaped: the conversation is dropped, never tokenized half escaped."""
    pattern = _control_pattern(control_tokens(tokenizer))
    if not any(m.role != "assistant" and pattern.search(m.content) for m in messages):
        return []
    if any(m.images for m in messages):  # the markers would move the image parts' character offsets
        raise Unmaskable("special_text_not_escapable", "a conversation with images has special-token text in a user "
                         "or system turn; set data.escape_special_tokens=false, or remove that text from the data")
    seen = set(text).union(*(m.content for m in messages))
    markers = next(((a, b) for a, b in zip(map(chr, range(0xE000, 0xF8FF, 2)), map(chr, range(0xE001, 0xF8FF, 2)))
                    if a not in seen and b not in seen), None)
    if markers is None:  # every private-use character is in the text: nothing can mark it
        raise Unmaskable("special_text_not_escapable", "the conversation uses every private-use character")
    start, end = markers
    marked = tuple(m if m.role == "assistant" else Message(role=m.role, content=pattern.sub(
        lambda t: f"{start}{t.group()}{end}", m.content)) for m in messages)
    rendered = render(tokenizer, marked, thinking=thinking)
    spans, plain, length = [], [], 0
    for piece in re.split(f"({re.escape(start)}(?:{pattern.pattern}){re.escape(end)})", rendered):
        if piece.startswith(start) and piece.endswith(end) and len(piece) > 2:
            piece = piece[1:-1]
            spans.append((length, length + len(piece)))
        plain.append(piece)
        length += len(piece)
    if "".join(plain) != text:
        raise Unmaskable("special_text_not_escapable", "the chat template changes the special-token text of a "
                         "user or system turn (it splits or strips around it); set data.escape_special_tokens=false, "
                         "or remove that text from the data")
    return spans


def _plain_ids(tokenizer: PreTrainedTokenizerFast, piece: str) -> list[int]:
    """Tokens of `piece` as plain text: the tokenizer's normalizer, pre-tokenizer and model, without its added
    tokens (so special-token text is spelt out)."""
    backend = tokenizer.backend_tokenizer
    text = backend.normalizer.normalize_str(piece) if backend.normalizer is not None else piece
    words = [w for w, _ in backend.pre_tokenizer.pre_tokenize_str(text)] if backend.pre_tokenizer is not None else [text]
    return [t.id for w in words for t in backend.model.tokenize(w)]


def _encode_piece(tokenizer: PreTrainedTokenizerFast, text: str, start: int, end: int, *, plain: bool
                  ) -> tuple[list[int], np.ndarray]:
    """Ids and (n, 2) character offsets in `text` of `text[start:end]`, tokenized alone (`plain`: as plain text,
    every token spanning the whole piece). A piece that does not open the text is tokenized after a newline that
    is then removed, so SentencePiece tokenizers add no word-start marker there (as transformers does)."""
    piece = text[start:end]
    if plain:
        ids = _plain_ids(tokenizer, piece)
        newline = _plain_ids(tokenizer, "\n")
        with_newline = _plain_ids(tokenizer, "\n" + piece)
        if start > 0 and with_newline[: len(newline)] == newline:
            ids = with_newline[len(newline):]
        return ids, np.tile(np.asarray([start, end], dtype=np.int64), (len(ids), 1)).reshape(-1, 2)
    if start > 0:
        newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
        enc = tokenizer("\n" + piece, add_special_tokens=False, return_offsets_mapping=True)
        if enc["input_ids"][: len(newline)] == newline:
            offsets = np.asarray(enc["offset_mapping"][len(newline):], dtype=np.int64).reshape(-1, 2)
            return enc["input_ids"][len(newline):], offsets - 1 + start
    enc = tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2) + start


def _encode(tokenizer: PreTrainedTokenizerFast, text: str, end: int, escaped: Sequence[tuple[int, int]] = (),
            start: int = 0) -> tuple[list[int], np.ndarray]:
    """Ids and (n, 2) character offsets (in `text`) of `text[start:end]`; the `escaped` spans in it are tokenized as
    plain text, each apart from the text around it. Without escaped spans: one call of the tokenizer."""
    inside = [(a, b) for a, b in escaped if start <= a and b <= end]
    if not inside:
        enc = tokenizer(text[start:end], add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2) + start
    ids: list[int] = []
    offsets = []
    edges = [start, *(x for span in inside for x in span), end]
    for i, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
        if a < b:
            piece_ids, piece_offsets = _encode_piece(tokenizer, text, a, b, plain=i % 2 == 1)
            ids += piece_ids
            offsets.append(piece_offsets)
    return ids, np.concatenate(offsets) if offsets else np.zeros((0, 2), dtype=np.int64)


def _find_structure(text: str, marker: str, start: int, escaped: Sequence[tuple[int, int]]) -> int:
    """`text.find(marker, start)`, skipping occurrences inside escaped spans (text of a turn, not structure)."""
    found = text.find(marker, start)
    while found >= 0 and any(a <= found < b for a, b in escaped):
        found = text.find(marker, found + 1)
    return found


# ------------------------------------------------------------------------------------------ sequences


@dataclass(frozen=True, slots=True, kw_only=True)
class _Head:
    """The tokens of a prefix of a conversation's text."""

    ids: list[int]
    offsets: np.ndarray
    """(n, 2) int64 character [start, end) of each token."""
    limit: int
    """Characters of the text the tokens cover."""


def _encode_head(tokenizer: PreTrainedTokenizerFast, text: str, *, end_of_turn: str, max_length: int,
                 escaped: Sequence[tuple[int, int]] = ()) -> _Head:
    """Token ids and offsets of a prefix of `text` holding at least `max_length` tokens (all of it if shorter),
    and that prefix's length in characters.

    The prefix ends right after an end-of-turn special token: special tokens are split off before
    pre-tokenization, so its tokens are exactly the first tokens of the whole text. Long conversations are
    not tokenized (or searched for replies) past what `max_length` keeps; when the next end of turn lies past
    `max_length * MAX_CHARS_PER_TOKEN` characters, the prefix ends at a whitespace before that (`_bounded_head`)."""
    guess = max_length * 4  # characters; most tokenizers average 2-5 per token, and the loop doubles it
    while True:
        cut = len(text)
        if guess < len(text):
            found = _find_structure(text, end_of_turn, guess, escaped)
            cut = len(text) if found < 0 else found + len(end_of_turn)
        if cut > max_length * MAX_CHARS_PER_TOKEN:
            return _bounded_head(tokenizer, text, max_length=max_length, escaped=escaped)
        ids, offsets = _encode(tokenizer, text, cut, escaped)
        if len(ids) >= max_length or cut == len(text):
            return _Head(ids=ids, offsets=offsets, limit=cut)
        guess *= 2


def _bounded_head(tokenizer: PreTrainedTokenizerFast, text: str, *, max_length: int,
                  escaped: Sequence[tuple[int, int]]) -> _Head:
    """The tokens of the first `max_length * MAX_CHARS_PER_TOKEN` characters of `text`, cut at the last whitespace
    in its second half: the tokens before a whitespace do not depend on what follows it, so the first
    `max_length` are the whole text's (a half-bound without whitespace is cut where it stands). Fewer than
    `max_length` tokens there: the text is not language; the conversation is dropped."""
    bound = max_length * MAX_CHARS_PER_TOKEN
    cut = max(text.rfind(c, bound // 2, bound) for c in " \n\t")
    cut = bound if cut < 0 else cut
    cut = next((a for a, b in escaped if a < cut < b), cut)  # never inside an escaped span
    ids, offsets = _encode(tokenizer, text, cut, escaped)
    if len(ids) <= max_length:
        raise Unmaskable("too_many_chars_per_token",
                         f"{len(ids)} tokens in the first {cut} characters of a {len(text)}-character conversation, "
                         f"more than {MAX_CHARS_PER_TOKEN} characters a token: not text to train on")
    return _Head(ids=ids, offsets=offsets, limit=cut)


def _rest_tokens(tokenizer: PreTrainedTokenizerFast, text: str, head: _Head, *, max_length: int,
                 escaped: Sequence[tuple[int, int]]) -> int:
    """Tokens of `text` past the head: counted up to `COUNT_REST_CHARS` characters (or the tokenizing bound, if
    larger), else estimated from the head's characters per token (a report figure; it never decides what is
    trained)."""
    rest = len(text) - head.limit
    if rest <= 0:
        return 0
    if rest <= max(COUNT_REST_CHARS, max_length * MAX_CHARS_PER_TOKEN):  # after an end of turn or a whitespace
        return len(_encode(tokenizer, text, len(text), escaped, start=head.limit)[0])
    return round(rest * len(head.ids) / max(head.limit, 1))


def tokenize_conversation(conversation: Conversation, tokenizer: PreTrainedTokenizerFast, *, thinking: bool,
                          end_of_turn: str | TurnEnds, max_length: int, min_supervised: int,
                          escape_special_tokens: bool = False, images: Optional[ImageText] = None) -> TokenizedSequence:
    """Token ids + assistant-only loss mask, truncated to `max_length`; raises `Unmaskable(reason)`.
    `end_of_turn`: what ends a reply (`turn_ends`; a str: one token the template writes after every reply).
    `escape_special_tokens`: keep special-token text of user and system turns plain text (the module docstring).
    `images`: the processor's text of each image (`vision.py`), tokenized in place of the template's placeholders."""
    messages, eot = conversation.messages, TurnEnds.of(end_of_turn)
    text = render(tokenizer, messages, thinking=thinking, images=images)
    escaped = escaped_spans(tokenizer, messages, text, thinking=thinking) if escape_special_tokens else []
    if eot.appended and len(messages) > 1 and messages[-1].role == "assistant":
        text += eot.final
    head = _encode_head(tokenizer, text, end_of_turn=eot.inner, max_length=max_length, escaped=escaped)
    spans = reply_spans(tokenizer, messages, text, thinking=thinking, end_of_turn=eot, limit=head.limit,
                        images=images)
    starts, ends = head.offsets[:, 0], head.offsets[:, 1]
    mask = np.zeros(len(starts), dtype=bool)
    for span in spans:
        straddles = ((starts < span.start) & (ends > span.start)) | ((starts < span.end) & (ends > span.end))
        if straddles.any():
            raise Unmaskable("reply_boundary_inside_token")
        mask |= (starts >= span.start) & (ends <= span.end) & (ends > starts)
    ids = torch.tensor(head.ids[:max_length], dtype=torch.long)  # (n,)
    loss_mask = torch.from_numpy(mask[:max_length].copy())  # (n,) bool
    if int(loss_mask.sum()) < min_supervised:
        raise Unmaskable("too_few_supervised_tokens")
    cut = len(head.ids) - len(ids) + _rest_tokens(tokenizer, text, head, max_length=max_length, escaped=escaped)
    return TokenizedSequence(input_ids=ids, loss_mask=loss_mask, truncated_tokens=cut)
