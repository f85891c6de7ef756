"""The user turn of a chat template, found from the template itself (no table of template families).

A conversation that ends with a user message holding a sentinel is rendered twice, without and with the
generation prompt. The text before the sentinel is the user-turn prefix: given it, the target writes a user
message (the Magpie method). The first special token after the sentinel (else its first line) is what closes a user turn (where a
written turn ends), and what the generation prompt adds is the assistant's header. Templates that render a user
message's text as it is (ChatML, Llama 3, Qwen3 with thinking on or off, gpt-oss harmony) all work; one that
renders no user message, or fails to render, is refused with the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from transformers import PreTrainedTokenizerBase

from dflash_trainer.data.types import Message
from dflash_trainer.errors import ConfigError
from dflash_trainer.regen.turns import as_dicts

SENTINEL = "Qz7UserTurnSentinelDflash4Kx"
"""Letters and digits only, so that no template escapes, trims or splits it."""

FIX = ("set data.chat_template to a template with a user turn (a builtin: qwen3, llama3, chatml; or a .jinja "
       "file)")


@dataclass(frozen=True, slots=True, kw_only=True)
class UserTurns:
    """How one chat template writes a user turn; `prefix` renders the prompt that asks the target for one."""

    tokenizer: PreTrainedTokenizerBase
    """The target's tokenizer, holding the template."""
    template: str
    """Where the template came from (named in errors)."""
    thinking: bool
    """`enable_thinking` passed to the template (a template that does not read it ignores it)."""
    system: tuple[Message, ...]
    """The system message every conversation starts with (empty: none)."""
    end_of_turn: str
    """Text that closes a user turn, e.g. `<|im_end|>`, `<|eot_id|>`, `<|end|>`: a written turn stops there."""
    end_token_ids: tuple[int, ...]
    """`end_of_turn` as one token of the vocabulary, when it is one (a stop token for decoding)."""
    markers: tuple[str, ...]
    """Text only the template writes (role headers, special tokens): a user turn holding one repeats it."""

    def prefix(self, messages: Sequence[Message]) -> str:
        """The rendered conversation `messages` (the system message included) followed by the opening of a new
        user turn: the prompt that asks the target to write that turn."""
        text = _render(self.tokenizer, messages, template=self.template, thinking=self.thinking, generation=False)
        return text[: text.index(SENTINEL)]


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], *, template: str, thinking: bool,
            generation: bool) -> str:
    """`messages` and a user turn holding the sentinel, rendered; refused when the sentinel is not there."""
    asked = (*messages, Message(role="user", content=SENTINEL))
    try:
        text = tokenizer.apply_chat_template(as_dicts(asked), tokenize=False, add_generation_prompt=generation,
                                             enable_thinking=thinking)
    except Exception as e:  # jinja's TemplateError (raise_exception), or any error inside the template
        raise ConfigError(f"the chat template ({template}) fails to render a conversation that ends with a "
                          f"user turn ({type(e).__name__}: {e}); {FIX}") from None
    if SENTINEL not in text:
        raise ConfigError(f"the chat template ({template}) has no user turn: a conversation that ends with a "
                          f"user message renders without its text, so the target cannot be asked to write one; {FIX}")
    return text


def find_user_turns(tokenizer: PreTrainedTokenizerBase, *, template: str, thinking: bool,
                    system_prompt: str | None) -> UserTurns:
    """The user turn of `tokenizer`'s chat template (`template` names where it came from, for errors)."""
    system = (Message(role="system", content=system_prompt),) if system_prompt else ()
    closed = _render(tokenizer, system, template=template, thinking=thinking, generation=False)
    opened = _render(tokenizer, system, template=template, thinking=thinking, generation=True)
    prefix, closed_after = closed.split(SENTINEL, 1)
    opened_after = opened.split(SENTINEL, 1)[1]
    specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    specials |= set(tokenizer.all_special_tokens)
    end = (_first_special(closed_after, specials) or _first_special(opened_after, specials)
           or _first_line(closed_after) or _first_line(opened_after))
    if not end:
        raise ConfigError(f"the chat template ({template}) writes nothing after a user message, so the end of a "
                          f"written user turn cannot be found; {FIX}")
    vocab = tokenizer.get_vocab()
    header = prefix.rsplit(end, 1)[-1].strip()
    if tokenizer.bos_token and header.startswith(tokenizer.bos_token):
        header = header[len(tokenizer.bos_token):].strip()
    assistant = opened_after[len(closed_after):] if opened_after.startswith(closed_after) else opened_after
    markers = {m for m in (header, assistant.strip(), end) if re.search(r"[^\w\s]", m)}  # never a bare word
    return UserTurns(tokenizer=tokenizer, template=template, thinking=thinking, system=system, end_of_turn=end,
                     end_token_ids=(vocab[end],) if end in vocab else (),
                     markers=tuple(sorted(markers | specials | set(tokenizer.all_special_tokens))))


def _first_special(text: str, specials: set[str]) -> str:
    """The special token that comes first in `text` (the longest where two start together); "" when none does. A
    template that closes no user turn (DeepSeek-V3, GLM-4.5) ends one where its generation prompt's first special token
    (`<｜Assistant｜>`, `<|assistant|>`) starts, which the target writes there."""
    hits = [(text.find(s), -len(s), s) for s in specials if s and s in text]
    return min(hits)[2] if hits else ""


def _first_line(text: str) -> str:
    stripped = text.strip()
    return stripped.split("\n", 1)[0].strip() if stripped else ""
