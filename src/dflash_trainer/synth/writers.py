"""The target writes user turns and answers, through the backends of `regenerate` (`regen/local.py`,
`regen/openai.py`).

A user turn is the continuation of a rendered user-turn prefix, sampled at the `synthesize` settings and cut
at the template's end of turn: locally by a `LocalBackend` set to those settings (sharing the target with the
one that answers), over HTTP through the completions endpoint. An answer is what `regenerate` would write:
the same backend, at the `regenerate` settings. Either call returns, per item, the text or the outcome that
says why there is none (a length limit: `skipped`; a failed request: `error`).
"""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Sequence, TypeVar

from transformers import PreTrainedTokenizerBase

from dflash_trainer.data.types import Message
from dflash_trainer.regen.openai import OpenAIBackend, RequestFailed
from dflash_trainer.regen.turns import Continuation, RegenOutcome, failed, skipped
from dflash_trainer.synth.template import UserTurns

if TYPE_CHECKING:  # the HTTP path never imports torch
    from dflash_trainer.regen.local import LocalBackend

T = TypeVar("T")

REFUSED = "refused by the server (HTTP 400, e.g. over its context length)"


class Writer(Protocol):
    """Asks the target for user turns and for answers; `keys` name the requests (`synth:<k>/user<t>`)."""

    def write_turns(self, prefixes: Sequence[str], keys: Sequence[str]) -> list[Continuation | RegenOutcome]: ...

    def answer(self, conversations: Sequence[tuple[Message, ...]], keys: Sequence[str]) -> list[str | RegenOutcome]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """How user turns are sampled (the `synthesize` section)."""

    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int


def cut_at_end(turn: Continuation, end_of_turn: str) -> Continuation:
    """`turn` cut before the template's end of turn, when that is text the decoder did not stop at (an end of
    turn of several tokens)."""
    at = turn.text.find(end_of_turn)
    return turn if at < 0 else Continuation(text=turn.text[:at], finished=True)


def chunk_seed(seed: int, keys: Sequence[str]) -> int:
    """The seed of a chunk of requests, from its first key: a resumed chunk samples as the first try did."""
    return zlib.crc32(f"{seed}:{keys[0] if keys else ''}".encode()) & 0x7FFFFFFF


class LocalWriter:
    """The target on this machine: `prompts` continues prefixes at the synthesize settings (its stop tokens
    include the template's end of turn), `answers` answers as regenerate does."""

    def __init__(self, *, prompts: LocalBackend, answers: LocalBackend, turns: UserTurns, seed: int,
                 answer_seed: int) -> None:
        self.prompts = prompts
        self.answers = answers
        self.turns = turns
        self.seed = seed
        self.answer_seed = answer_seed

    def write_turns(self, prefixes: Sequence[str], keys: Sequence[str]) -> list[Continuation | RegenOutcome]:
        encoded = [self.prompts.encode_text(key, prefix) for key, prefix in zip(keys, prefixes)]
        asked = [i for i, e in enumerate(encoded) if not isinstance(e, RegenOutcome)]
        self.prompts.reseed(chunk_seed(self.seed, keys))
        found = dict(zip(asked, self.prompts.continue_ids([encoded[i] for i in asked])))
        return [cut_at_end(found[i], self.turns.end_of_turn) if i in found else e for i, e in enumerate(encoded)]

    def answer(self, conversations: Sequence[tuple[Message, ...]], keys: Sequence[str]) -> list[str | RegenOutcome]:
        self.answers.reseed(chunk_seed(self.answer_seed, keys))
        return self.answers.reply(list(zip(keys, conversations)))


class OpenAIWriter:
    """An OpenAI-compatible server: user turns through its completions endpoint (the prefix rendered and
    tokenized here), answers through its chat endpoint; `backend.concurrency` requests in flight."""

    def __init__(self, *, backend: OpenAIBackend, tokenizer: PreTrainedTokenizerBase, turns: UserTurns,
                 sampling: Sampling) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.turns = turns
        self.sampling = sampling

    def write_turns(self, prefixes: Sequence[str], keys: Sequence[str]) -> list[Continuation | RegenOutcome]:
        s = self.sampling

        def one(prefix: str, key: str) -> Continuation | RegenOutcome:
            ids = self.tokenizer(prefix, add_special_tokens=False)["input_ids"]
            try:
                turn = self.backend.complete_text(
                    ids, max_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                    stop=(self.turns.end_of_turn,), stop_token_ids=self.turns.end_token_ids, request_key=key)
            except RequestFailed as e:
                return _no_reply(key, e)
            return cut_at_end(turn, self.turns.end_of_turn)

        return self._map(one, prefixes, keys)

    def answer(self, conversations: Sequence[tuple[Message, ...]], keys: Sequence[str]) -> list[str | RegenOutcome]:
        def one(messages: tuple[Message, ...], key: str) -> str | RegenOutcome:
            try:
                return self.backend.complete(messages, key)
            except RequestFailed as e:
                return _no_reply(key, e)

        return self._map(one, conversations, keys)

    def _map(self, fn: Callable[..., T], items: Sequence, keys: Sequence[str]) -> list[T]:
        pool = ThreadPoolExecutor(max_workers=self.backend.concurrency, thread_name_prefix="synth-http")
        try:
            return list(pool.map(fn, items, keys))
        finally:  # Ctrl-C: requests not yet sent are cancelled; those in flight end by their timeout
            pool.shutdown(wait=False, cancel_futures=True)


def _no_reply(key: str, error: RequestFailed) -> RegenOutcome:
    if error.refused:
        return skipped(key, REFUSED, str(error))
    return failed(key, str(error), error.kind)
