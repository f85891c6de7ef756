"""A tiny OpenAI-compatible server for tests: /v1/models, /v1/chat/completions and /v1/completions on 127.0.0.1.

Chat replies are `re:<last user content>` (the text of its text parts when it is a list of parts). Behaviour is keyed by the last user message, so tests can make
some prompts fail, fail a few times first, or be slow on their first attempts. Text completions are words drawn
from the request's seed (or what `Behaviour.completion` says). Server-wide faults: `fault` (every request on the
`fault_on` endpoints answers wrongly: an HTTP error, malformed JSON, no choices, no content), `die_after` (the
server stops answering after that many requests: each later connection is closed unanswered) and `reply_model`
(replies name another model).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

WORDS = ("river", "garden", "python", "budget", "poem", "castle", "recipe", "orbit", "violin", "tax", "essay",
         "router", "marathon", "quartz", "novel", "pricing", "glacier", "lemon", "theorem", "harbor")


def seeded_text(body: dict) -> tuple[str, str]:
    """Eight words drawn from the request's seed, ended as a stop."""
    rng = random.Random(body.get("seed", 0))
    return "Tell me about " + " ".join(rng.choice(WORDS) for _ in range(8)) + ".", "stop"


@dataclass
class Behaviour:
    models: tuple[str, ...] = ("tiny-model",)
    fail_first: int = 0
    """Every prompt's first `fail_first` attempts answer 503."""
    always_fail: frozenset[str] = frozenset()
    """Prompts (last user content) that always answer 500."""
    reject: frozenset[str] = frozenset()
    """Prompts that answer 400 (not retryable)."""
    slow_first: int = 0
    """Every prompt's first `slow_first` attempts sleep `slow_s` before answering."""
    slow_s: float = 0.0
    delay_s: float = 0.0
    """Sleep before every answer (to let a test kill a client mid-run)."""
    reasoning: bool = False
    """Return the reasoning apart (`reasoning_content`), as vLLM does with a reasoning parser."""
    completion: Callable[[dict], tuple[str, str]] = seeded_text
    """/v1/completions: the request body -> (text, finish_reason)."""
    completions_404: bool = False
    """Serve no /v1/completions (a server with the chat endpoint only)."""
    fault: str = ""
    """Every request on `fault_on` answers: `http_NNN` (that status), `malformed_json` (200, not JSON),
    `no_choices` (200, a JSON object without choices), `null_content` / `empty_content` (a message or text of
    null / ""), `whitespace_content`."""
    fault_on: frozenset[str] = frozenset({"chat", "completions"})
    die_after: int | None = None
    """After this many POSTs (both endpoints), every connection is closed without an answer (a dead server)."""
    reply_model: str | None = None
    """The `model` replies name (None: the one asked for)."""
    refuse_images: str = ""
    """Non-empty: a chat request with an `image_url` part answers 400 with this message (a text-only model)."""
    posts: int = 0
    attempts: Counter = field(default_factory=Counter)
    requests: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _text(content) -> str:
    """A message's text: the content, or its text parts joined."""
    return content if isinstance(content, str) else "".join(p["text"] for p in content if p["type"] == "text")


def _handler(behaviour: Behaviour):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep test output quiet
            pass

        def _send(self, code: int, obj) -> None:
            self._send_raw(code, json.dumps(obj).encode())

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in behaviour.models]})
            else:
                self._send(404, {"error": "not found"})

        def _send_raw(self, code: int, data: bytes) -> None:
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _dead(self) -> bool:
            """Counts the POST; True (and the connection closed unanswered) once the server is dead."""
            with behaviour.lock:
                behaviour.posts += 1
                dead = behaviour.die_after is not None and behaviour.posts > behaviour.die_after
            if dead:
                self.close_connection = True
            return dead

        def _faulted(self, endpoint: str) -> bool:
            """Answers with `behaviour.fault` (True) when it applies to `endpoint`; content faults are left to the
            caller (False)."""
            fault = behaviour.fault
            if not fault or endpoint not in behaviour.fault_on or fault.endswith("_content"):
                return False
            if fault.startswith("http_"):
                self._send(int(fault[5:]), {"error": "injected"})
            elif fault == "malformed_json":
                self._send_raw(200, b'{"choices": [{"message": ')
            elif fault == "no_choices":
                self._send(200, {"object": "chat.completion", "model": behaviour.models[0]})
            else:
                raise ValueError(f"unknown fault {fault!r}")
            return True

        def _content(self, endpoint: str, text: str) -> str | None:
            if endpoint not in behaviour.fault_on:
                return text
            return {"null_content": None, "empty_content": "", "whitespace_content": " \n "}.get(behaviour.fault, text)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self._dead():
                return
            if self.path == "/v1/completions" and not behaviour.completions_404:
                if not self._faulted("completions"):
                    self._complete_text(body)
                return
            if self.path != "/v1/chat/completions":
                self._send(404, {"error": "not found"})
                return
            if self._faulted("chat"):
                return
            prompt = _text(body["messages"][-1]["content"])
            with behaviour.lock:
                behaviour.requests.append(body)
                behaviour.attempts[prompt] += 1
                attempt = behaviour.attempts[prompt]
            if behaviour.delay_s:
                time.sleep(behaviour.delay_s)
            if attempt <= behaviour.slow_first:
                time.sleep(behaviour.slow_s)
            if behaviour.refuse_images and any(isinstance(m["content"], list) and any(
                    part["type"] == "image_url" for part in m["content"]) for m in body["messages"]):
                self._send(400, {"error": {"message": behaviour.refuse_images, "type": "BadRequestError"}})
            elif prompt in behaviour.reject:
                self._send(400, {"error": "prompt too long"})
            elif prompt in behaviour.always_fail:
                self._send(500, {"error": "internal"})
            elif attempt <= behaviour.fail_first:
                self._send(503, {"error": "overloaded"})
            else:
                message = {"role": "assistant", "content": self._content("chat", f"re:{prompt}")}
                if behaviour.reasoning:
                    message["reasoning_content"] = f"thinking about {prompt}"
                self._send(200, {"model": behaviour.reply_model or body.get("model"),
                                 "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})

        def _complete_text(self, body: dict) -> None:
            with behaviour.lock:
                behaviour.requests.append(body)
            text, finish = behaviour.completion(body)
            self._send(200, {"model": behaviour.reply_model or body.get("model"),
                             "choices": [{"index": 0, "text": self._content("completions", text),
                                          "finish_reason": finish}]})

    return Handler


class FakeServer:
    """`with FakeServer(Behaviour(...)) as server:` serves on `server.url` from a daemon thread."""

    def __init__(self, behaviour: Behaviour | None = None) -> None:
        self.behaviour = behaviour or Behaviour()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.behaviour))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-openai", daemon=True
        )

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
