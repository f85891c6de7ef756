"""HTTP backend: an OpenAI-compatible server (vLLM / SGLang `serve`) answers through /v1/chat/completions
(and continues rendered text through /v1/completions, which `synthesize` uses to sample user turns).

Stdlib only (`urllib`). `concurrency` daemon worker threads each take a whole conversation and answer
its user turns in order; a bounded number of conversations is in flight, so a Ctrl-C loses only those.
Requests time out after `request_timeout_s` and are retried with exponential backoff (and jitter) on
5xx / 408 / 429, timeouts, connection errors and malformed replies; other 4xx answers fail the row at once, and so
does a chat reply with no content (it would be an empty assistant turn; asked again, the same request gets the
same). Each failure has a kind (`regen/failures.py`) that the commands count. A reply naming another model than
the one asked for is taken (proxies rename models) and warned about once.

Image parts of user turns go to the server as OpenAI `image_url` parts: a local file as a `data:` URL of its bytes
(the server need not see this machine's files), a data URL as it is. A server that refuses images (a text-only
model, or images turned off) stops the run with one error naming the server, the model and the fix, rather than
failing every image row one by one.
"""

from __future__ import annotations

import http.client
import json
import logging
import queue
import random
import re
import socket
import threading
import urllib.error
import urllib.request
import zlib
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

from dflash_trainer.data.images import UnreadableImage, image_data_url
from dflash_trainer.data.types import Conversation, Message
from dflash_trainer.errors import ConfigError, DataError
from dflash_trainer.regen.failures import (BAD_SHAPE, CONNECTION, EMPTY_REPLY, MALFORMED_JSON, NO_CHOICES, OTHER,
                                           REFUSED, STOPPED, TIMEOUT, http_kind)
from dflash_trainer.regen.turns import Continuation, RegenOutcome, TurnState, as_dicts, failed, start

log = logging.getLogger(__name__)

RETRY_STATUS = (408, 429)
"""Client-side statuses worth retrying (besides every 5xx)."""
QUEUE_POLL_S = 0.5
"""Timeout of each queue wait, so a stop request or Ctrl-C is noticed."""


class RequestFailed(Exception):
    """A request failed for good (not retryable, or out of retries); the row is logged as failed."""

    def __init__(self, message: str, *, kind: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        """Why, short (`regen/failures.py`): counted per kind in the commands' summaries."""
        self.status = status
        """The HTTP status the server refused it with (None: it failed otherwise: retries spent, a bad reply)."""

    @property
    def refused(self) -> bool:
        """The server refused this request (HTTP 400: e.g. a prompt over its context length), not failed."""
        return self.kind == REFUSED


IMAGE_REFUSAL_STATUS = (400, 415, 422)
"""Statuses with which servers refuse content they cannot take (422: a request schema without image parts)."""
REFUSED_LATER_TURN = "HTTP 400 from the server at a later turn (e.g. over its context length)"
"""The cut of a conversation whose later turn the server refused (the turns before it are kept)."""


_IMAGES_REFUSED = re.compile(
    r"not an? (multi-?modal|vision|image)|image input is not supported|at most \d+ image|image_url|"
    r"(not|n't) (support|accept|take|handle|process)\w*\W+(\w+\W+){0,3}(image|vision|multi-?modal)|"
    r"(image|vision|multi-?modal)\w*\W+(\w+\W+){0,4}(not supported|unsupported|not enabled|disabled)", re.I)
"""A refusal that names the images (vLLM: `M is not a multimodal model`, `At most 0 image(s) may be provided`;
SGLang: `image input is not supported for this model`; OpenAI: `image_url is only supported by certain models`)."""
_LENGTH_REFUSED = re.compile(r"context length|maximum model length|too long", re.I)
"""A length refusal, which names image tokens on an image-text server but is a row's limit, not the server's."""


def images_refused(detail: str) -> bool:
    """Whether a refusal of a request with images says the server takes no images (or not that many)."""
    return bool(_IMAGES_REFUSED.search(detail)) and not _LENGTH_REFUSED.search(detail)


class ImagesRefused(ConfigError):
    """The server refused a prompt's images: its model takes none (or not that many); the whole run stops."""


class _Retryable(Exception):
    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


T = TypeVar("T")


def request_seed(seed: int, request_key: str) -> int:
    """The seed of one sampled request: the samples of one prompt differ, and a rerun asks for the same ones."""
    return zlib.crc32(f"{seed}:{request_key}".encode()) & 0x7FFFFFFF


def _message(payload: dict[str, Any]) -> str:
    """The reply; a reply with no content is a failure, never an empty assistant turn in the data."""
    message = payload["choices"][0]["message"]
    if not isinstance(message.get("content") or "", str):  # content parts, or another shape: not a chat reply
        raise TypeError("content is not text")
    text = reply_text(message)
    if not text.strip():
        raise RequestFailed(f"the server answered with no content (message: {str(message)[:200]})",
                            kind=EMPTY_REPLY)
    return text


def _continuation(payload: dict[str, Any]) -> Continuation:
    choice = payload["choices"][0]
    if not isinstance(choice["text"], str):  # null: no text at all (an empty string is a turn the filters judge)
        raise TypeError("no text")
    return Continuation(text=choice["text"], finished=choice.get("finish_reason") != "length")


def _shape_kind(payload: dict[str, Any]) -> str:
    """Why a reply could not be read: it has no choices, or its choice lacks the message or text."""
    choices = payload.get("choices")
    return NO_CHOICES if not isinstance(choices, list) or not choices else BAD_SHAPE


def base_url(url: str) -> str:
    """`http://host:port/v1` from what users paste (with or without /v1 or /chat/completions)."""
    url = url.rstrip("/")
    for suffix in ("/chat/completions", "/models"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url if url.endswith("/v1") else url + "/v1"


def request_messages(messages: tuple[Message, ...]) -> list[dict[str, Any]]:
    """Messages as the chat endpoint takes them: text, or text and `image_url` parts, each image a data URL (a file's
    bytes, read now); a DataError names an image that can no longer be read."""
    rows = as_dicts(messages)
    for row in rows:
        if isinstance(row["content"], list):
            for part in row["content"]:
                if part["type"] == "image_url":
                    try:
                        part["image_url"] = {"url": image_data_url(part["image_url"]["url"])}
                    except UnreadableImage as e:
                        raise DataError(f"an image of the prompt cannot be read any more ({e}); restore it, or "
                                        "leave its row out, and rerun") from None
    return rows


def reply_text(message: dict[str, Any]) -> str:
    """The assistant message verbatim: a reasoning field split off by the server goes back into a think block."""
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        return f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"
    return content


class OpenAIBackend:
    """Answers conversations through an OpenAI-compatible chat completions endpoint."""

    def __init__(
        self,
        *,
        url: str,
        model: str,
        max_new_tokens: int,
        temperature: float,
        thinking: bool,
        concurrency: int,
        top_p: float = 1.0,
        seed: int = 0,
        request_timeout_s: float,
        max_retries: int,
        retry_backoff_s: float,
    ) -> None:
        self.url = base_url(url)
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
        self.thinking = thinking
        self.concurrency = concurrency
        self.timeout = request_timeout_s
        self.max_retries = max_retries
        self.backoff = retry_backoff_s
        self._stop = threading.Event()
        self._renamed = False
        """A reply named another model (warned about once)."""
        self._renamed_lock = threading.Lock()

    def check_model(self) -> None:
        """Refuse to start when the server is unreachable or does not serve `model`."""
        try:
            with urllib.request.urlopen(f"{self.url}/models", timeout=self.timeout) as resp:
                listing = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
            raise ConfigError(
                f"cannot list models at {self.url}/models ({e}); start the server or fix regenerate.url"
            ) from None
        served = [m.get("id") for m in listing.get("data", [])]
        if self.model not in served:
            raise ConfigError(
                f"the server at {self.url} serves {served}, not {self.model!r}; set regenerate.model to the "
                "served name (default: target.path) or serve that model"
            )

    def complete(self, messages: tuple[Message, ...], request_key: str = "") -> str:
        """One reply, retried on transient errors; raises RequestFailed when it cannot be had. A sampled
        request carries a seed of its own, drawn from `seed` and `request_key` (row id and turn): the samples
        of one prompt differ, and a rerun asks for the same ones."""
        request: dict[str, Any] = {
            "model": self.model,
            "messages": request_messages(messages),
            "max_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "chat_template_kwargs": {"enable_thinking": self.thinking},
        }
        if self.temperature > 0:
            request["top_p"] = self.top_p
            request["seed"] = request_seed(self.seed, request_key)
        try:
            return self._ask("chat/completions", request, _message)
        except RequestFailed as e:
            if e.status in IMAGE_REFUSAL_STATUS and any(m.images for m in messages) and images_refused(str(e)):
                raise ImagesRefused(
                    f"the server at {self.url} (model {self.model!r}) refused a prompt's images ({e}). Serve an "
                    "image-text model there (e.g. Qwen3-VL; vLLM: raise --limit-mm-per-prompt if it says how many "
                    "images it takes) and rerun, or set regenerate.drop_images=true to regenerate the text rows only "
                    "(the image rows are then left out, counted); the rows written so far are kept") from None
            raise

    def complete_text(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        request_key: str = "",
    ) -> Continuation:
        """What the model writes after `prompt` (token ids of text rendered here, so the server adds no second
        BOS and applies no template), through the completions endpoint; retried as `complete` is. Special
        tokens stay in the text (a turn that writes a role marker must be seen), and `stop_token_ids` (vLLM and
        SGLang read them) end it at a template's end-of-turn token that is not the model's eos."""
        request: dict[str, Any] = {
            "model": self.model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "stop": list(stop),
            "skip_special_tokens": False,
        }
        if stop_token_ids:
            request["stop_token_ids"] = list(stop_token_ids)
        if temperature > 0:
            request["top_p"] = top_p
            request["seed"] = request_seed(seed, request_key)
        return self._ask("completions", request, _continuation)

    def _ask(self, endpoint: str, request: dict[str, Any], parse: Callable[[dict[str, Any]], T]) -> T:
        """POST `request` to `endpoint` and `parse` the answer, retrying transient errors (a malformed answer is
        one); raises RequestFailed when it cannot be had."""
        body = json.dumps(request).encode()
        last, kind = "", OTHER
        for attempt in range(self.max_retries + 1):
            if attempt:
                delay = self.backoff * 2 ** (attempt - 1) * (0.5 + random.random())
                if self._stop.wait(delay):
                    raise RequestFailed("stopped", kind=STOPPED)
            try:
                payload = self._post(endpoint, body)
                self._note_model(payload)
                try:
                    return parse(payload)
                except (KeyError, IndexError, TypeError):
                    raise _Retryable(f"unexpected {endpoint} response: {str(payload)[:300]}",
                                     kind=_shape_kind(payload)) from None
            except _Retryable as e:
                last, kind = str(e), e.kind
                log.debug("request attempt %d failed: %s", attempt + 1, last)
        raise RequestFailed(f"gave up after {self.max_retries + 1} attempts; last error: {last}", kind=kind)

    def _note_model(self, payload: dict[str, Any]) -> None:
        """Warn once when the reply names another model than the one asked for: a proxy may rename a model, but
        a server answering with another one writes another target's replies."""
        answered = payload.get("model")
        if not isinstance(answered, str) or answered == self.model or self._renamed:
            return
        with self._renamed_lock:  # the worker threads may all see it at once
            if self._renamed:
                return
            self._renamed = True
        log.warning("the server at %s answered as model %r, not %r as asked (further replies are not checked): "
                    "fine if a proxy renames the model; otherwise the data holds another model's replies. Point "
                    "regenerate.url at a server of %r", self.url, answered, self.model, self.model)

    def _post(self, endpoint: str, body: bytes) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.url}/{endpoint}", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as resp:
                payload = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode("utf-8", errors="replace")
            if e.code >= 500 or e.code in RETRY_STATUS:
                raise _Retryable(f"HTTP {e.code}: {detail}", kind=http_kind(e.code)) from None
            raise RequestFailed(f"HTTP {e.code}: {detail}", kind=http_kind(e.code), status=e.code) from None
        except (TimeoutError, socket.timeout) as e:
            raise _Retryable(f"timed out after {self.timeout}s ({e})", kind=TIMEOUT) from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (TimeoutError, socket.timeout)):  # the connection itself timed out
                raise _Retryable(f"timed out after {self.timeout}s ({e.reason})", kind=TIMEOUT) from None
            raise _Retryable(f"connection error: {e}", kind=CONNECTION) from None
        except (ConnectionError, http.client.HTTPException, OSError) as e:
            raise _Retryable(f"connection error: {e}", kind=CONNECTION) from None
        except ValueError as e:
            raise _Retryable(f"malformed JSON response: {e}", kind=MALFORMED_JSON) from None
        if not isinstance(payload, dict):
            raise _Retryable(f"unexpected {endpoint} response: {str(payload)[:300]}", kind=NO_CHOICES)
        return payload

    def _answer(self, conversation: Conversation) -> RegenOutcome:
        state = start(conversation)
        if isinstance(state, RegenOutcome):
            return state
        assert isinstance(state, TurnState)
        turn = 0
        while (prompt := state.next_prompt()) is not None:
            try:
                state.add_reply(self.complete(prompt, f"{state.row_id}/{turn}"))
            except RequestFailed as e:
                if e.refused and state.replied:  # the conversation ends before the turn the server refused
                    log.debug("row %s cut before user turn %d: %s", state.row_id, turn, e)
                    return state.outcome(cut=REFUSED_LATER_TURN)
                return failed(state.row_id, f"user turn {turn}: {e}", e.kind)
            turn += 1
        return state.outcome()

    def _worker(self, inbox: queue.Queue, outbox: queue.Queue) -> None:
        while not self._stop.is_set():
            try:
                conv = inbox.get(timeout=QUEUE_POLL_S)
            except queue.Empty:
                continue
            if conv is None:  # end of stream
                return
            try:
                outbox.put(("ok", self._answer(conv)))
            except BaseException as e:  # re-raised in the consuming thread
                self._stop.set()  # the run ends: no worker takes another conversation
                outbox.put(("error", e))

    def run(self, conversations: Iterable[Conversation]) -> Iterator[RegenOutcome]:
        """Outcomes as they finish. At most 2 * concurrency conversations are in flight."""
        self._stop.clear()
        inbox: queue.Queue = queue.Queue()
        outbox: queue.Queue = queue.Queue()
        threads = [
            threading.Thread(target=self._worker, args=(inbox, outbox), name=f"regen-http-{i}", daemon=True)
            for i in range(self.concurrency)
        ]
        for t in threads:
            t.start()
        source = iter(conversations)
        in_flight, exhausted = 0, False
        try:
            while True:
                while not exhausted and in_flight < 2 * self.concurrency:
                    conv = next(source, None)
                    if conv is None:
                        exhausted = True
                    else:
                        inbox.put(conv)
                        in_flight += 1
                if in_flight == 0:
                    return
                try:
                    kind, value = outbox.get(timeout=QUEUE_POLL_S)
                except queue.Empty:
                    continue
                in_flight -= 1
                if kind == "error":
                    raise value
                yield value
        finally:
            self._stop.set()  # workers exit after their current request; daemon threads never block exit
            for _ in threads:
                inbox.put(None)
