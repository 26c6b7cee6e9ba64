"""A backend on 127.0.0.1 whose answers are honest but whose `usage` says what a test sets.

It answers chat completions (stream or not, `n` choices of WORDS words each) with the usage
bytes of `LyingBackend.usage` inserted verbatim: any JSON, believable or not; None leaves the
usage out. `status` other than 200 answers an OpenAI-shaped error instead. `framing` writes a
stream's events as the spec allows but few servers do: "mixed" line ends (LF, then CRLF from the
third event on), or "multiline" (each event's JSON over two `data:` lines).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
from starlette.types import Receive, Scope, Send

from tests.servers import serve

WORDS = 12
WORD = "hello "


class LyingBackend:
    def __init__(self) -> None:
        self.usage: bytes | None = b'{"prompt_tokens": 9, "completion_tokens": 12}'
        self.status = 200
        self.requests = 0
        self.framing = "plain"
        self.last_body = b""  # the last request's body, as the gateway sent it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        self.requests += 1
        self.last_body = body
        if scope["path"] == "/v1/models":
            await send_whole(send, 200, b'{"object": "list", "data": []}', b"application/json")
            return
        request = orjson.loads(body)
        n = request.get("n") or 1
        if self.status != 200:
            error = b'{"error": {"message": "no", "type": "invalid_request_error"}}'
            await send_whole(send, self.status, error, b"application/json")
        elif request.get("stream"):
            events = b"".join(self._framed(self._events(n)))
            await send_whole(send, 200, events, b"text/event-stream")
        else:
            await send_whole(send, 200, self._whole(n), b"application/json")

    def _whole(self, n: int) -> bytes:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": WORD * WORDS},
                "finish_reason": "stop",
            }
            for i in range(n)
        ]
        head = orjson.dumps({"id": "c1", "object": "chat.completion", "model": "m"})[:-1]
        usage = b"" if self.usage is None else b', "usage": ' + self.usage
        return head + b', "choices": ' + orjson.dumps(choices) + usage + b"}"

    def _framed(self, events: Iterator[bytes]) -> Iterator[bytes]:
        for i, event in enumerate(events):
            if self.framing == "mixed" and i >= 2:
                event = event.replace(b"\n", b"\r\n")
            elif self.framing == "multiline" and event.startswith(b'data: {"id":"c1","object"'):
                event = event.replace(b',"object":', b',\ndata: "object":', 1)
            yield event

    def _events(self, n: int) -> Iterator[bytes]:
        def event(choice: int, delta: dict[str, str], finish: str | None = None) -> bytes:
            item = {"index": choice, "delta": delta, "finish_reason": finish}
            chunk = {"id": "c1", "object": "chat.completion.chunk", "choices": [item]}
            return b"data: " + orjson.dumps(chunk) + b"\n\n"

        for choice in range(n):
            yield event(choice, {"role": "assistant", "content": ""})
        for _ in range(WORDS):
            for choice in range(n):
                yield event(choice, {"content": WORD})
        for choice in range(n):
            yield event(choice, {}, "stop")
        if self.usage is not None:
            yield b'data: {"id": "c1", "choices": [], "usage": ' + self.usage + b"}\n\n"
        yield b"data: [DONE]\n\n"


async def read_body(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def send_whole(send: Send, status: int, body: bytes, content_type: bytes) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextmanager
def lying_backend(tls: tuple[Path, Path] | None = None) -> Iterator[tuple[LyingBackend, str]]:
    """The backend and its URL (https with `tls`, a certificate and key)."""
    app = LyingBackend()
    with serve(app, tls=tls) as url:
        yield app, url
