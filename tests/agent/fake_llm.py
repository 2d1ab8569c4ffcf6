"""A local OpenAI-compatible chat endpoint for tests: the real `openai` client talks to it over loopback HTTP.

Each request to `POST /v1/chat/completions` takes the next scripted step, then the default responder:

    llm = FakeLLM([ok('{"proposals": [...]}'), status(429), status(500), sleep(3.0, ok("...")), ok("not json")],
                  default=lambda body: ok(...))
    with llm:                       # serves on 127.0.0.1:<free port>
        os.environ["OPENAI_BASE_URL"] = llm.base_url
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


@dataclass(frozen=True)
class Step:
    """One scripted answer: an HTTP status, a message content, and a delay before answering."""

    status: int = 200
    content: str = ""
    delay: float = 0.0
    retry_after: str = "0"  # the Retry-After header of a 429


def ok(content: str | dict) -> Step:
    """A 200 answer whose message content is `content` (a dict is sent as JSON text)."""
    return Step(200, content if isinstance(content, str) else json.dumps(content))


def status(code: int, retry_after: str = "0") -> Step:
    """An error answer with this HTTP status (a 429 carries `retry_after`, 0 by default so tests stay quick)."""
    return Step(code, retry_after=retry_after)


def sleep(seconds: float, then: Step) -> Step:
    """`then`, after `seconds` (longer than the client's timeout: the client gives up and retries)."""
    return Step(then.status, then.content, seconds)


class FakeLLM:
    """A scripted OpenAI-compatible server. `requests` records each request's JSON body and auth header."""

    def __init__(self, script: list[Step] | None = None, default: Callable[[dict], Step] | None = None):
        self.script = list(script or [])
        self.default = default or (lambda body: ok('{"proposals": []}'))
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                with fake._lock:
                    fake.requests.append({"path": self.path, "body": body,
                                          "authorization": self.headers.get("authorization")})
                    step = fake.script.pop(0) if fake.script else None
                step = step or fake.default(body)
                if step.delay:
                    time.sleep(step.delay)
                if step.status != 200:
                    payload = {"error": {"message": f"scripted {step.status}", "type": "server_error",
                                         "code": None}}
                    self._send(step.status, payload, {"retry-after": step.retry_after} if step.status == 429 else {})
                    return
                prompt = sum(len(str(m.get("content", ""))) for m in body.get("messages", [])) // 4
                completion = len(step.content) // 4
                self._send(200, {
                    "id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()),
                    "model": body.get("model", "fake"),
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": step.content}}],
                    "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion},
                })

            def _send(self, code: int, payload: dict, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(code)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> "FakeLLM":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
