"""A tiny OpenAI-compatible server for tests: /v1/models, /v1/chat/completions and /v1/completions on 127.0.0.1.

Chat replies are `re:<last user content>`. Behaviour is keyed by the last user message, so tests can make
some prompts fail, fail a few times first, or be slow on their first attempts. Text completions are words drawn
from the request's seed (or what `Behaviour.completion` says).
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
    attempts: Counter = field(default_factory=Counter)
    requests: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _handler(behaviour: Behaviour):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep test output quiet
            pass

        def _send(self, code: int, obj) -> None:
            data = json.dumps(obj).encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                pass

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in behaviour.models]})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            if self.path == "/v1/completions" and not behaviour.completions_404:
                self._complete_text(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                return
            if self.path != "/v1/chat/completions":
                self._send(404, {"error": "not found"})
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = body["messages"][-1]["content"]
            with behaviour.lock:
                behaviour.requests.append(body)
                behaviour.attempts[prompt] += 1
                attempt = behaviour.attempts[prompt]
            if behaviour.delay_s:
                time.sleep(behaviour.delay_s)
            if attempt <= behaviour.slow_first:
                time.sleep(behaviour.slow_s)
            if prompt in behaviour.reject:
                self._send(400, {"error": "prompt too long"})
            elif prompt in behaviour.always_fail:
                self._send(500, {"error": "internal"})
            elif attempt <= behaviour.fail_first:
                self._send(503, {"error": "overloaded"})
            else:
                message = {"role": "assistant", "content": f"re:{prompt}"}
                if behaviour.reasoning:
                    message["reasoning_content"] = f"thinking about {prompt}"
                self._send(200, {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})

        def _complete_text(self, body: dict) -> None:
            with behaviour.lock:
                behaviour.requests.append(body)
            text, finish = behaviour.completion(body)
            self._send(200, {"choices": [{"index": 0, "text": text, "finish_reason": finish}]})

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
