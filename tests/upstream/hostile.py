"""A hostile backend on 127.0.0.1: a raw asyncio server, on a thread of its own, that misbehaves as
each request's `hostile` field asks (the gateway passes unknown fields through untouched).

`GET /models` and a request without `hostile` get a well-formed OpenAI answer, so a test can
check that the gateway still serves after each misbehaviour.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import orjson
import pytest

from tests.certs import self_signed, server_tls
from tests.upstream.rawserver import RawServer

Reader = asyncio.StreamReader
Writer = asyncio.StreamWriter
Misbehaviour = Callable[["HostileBackend", Writer, dict[str, Any]], Awaitable[None]]

CHAT = {
    "id": "chatcmpl-hostile",
    "object": "chat.completion",
    "created": 1,
    "model": "hostile-llm",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "fine"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}
CHUNK = {
    "id": "chatcmpl-hostile",
    "object": "chat.completion.chunk",
    "created": 1,
    "model": "hostile-llm",
    "choices": [{"index": 0, "delta": {"content": "fine"}, "finish_reason": None}],
}
EMBEDDINGS = {
    "object": "list",
    "data": [{"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}],
    "model": "hostile-llm",
    "usage": {"prompt_tokens": 2, "total_tokens": 2},
}
MODELS = {"object": "list", "data": [{"id": "hostile-llm", "object": "model"}]}
GIVE_UP_S = 25.0
FILLER = b" " * 65536  # whitespace: valid inside a JSON value, so no parser stops early


def head(status: str, *headers: str) -> bytes:
    lines = [f"HTTP/1.1 {status}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def json_answer(status: str, body: bytes, *headers: str) -> bytes:
    return head(status, "content-type: application/json", f"content-length: {len(body)}", *headers)


def event(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class _GaveUp(Exception):
    """An endless misbehaviour ran for GIVE_UP_S: the gateway never cut it off."""


class HostileBackend:
    """The server and what it saw: per misbehaviour, whether the gateway hung up on it, and how
    many bytes it managed to send. `stop` ends every endless misbehaviour at once. `extra`
    adds misbehaviours (a test module's own) to MISBEHAVIOURS; `tls` serves https."""

    def __init__(
        self, extra: dict[str, Misbehaviour] | None = None, tls: ssl.SSLContext | None = None
    ) -> None:
        self.url = ""
        self._tls = tls
        self.misbehaviours = {**MISBEHAVIOURS, **(extra or {})}
        self.stop = threading.Event()
        self.hung_up: dict[str, threading.Event] = {}
        self.sent_bytes: dict[str, int] = {}
        # messages_after_end: set by a test once its client has the event sent after the end;
        # `after_seen_in_time` says whether that came while the stream was still open.
        self.client_has_after = threading.Event()
        self.heads: list[bytes] = []  # each request's head as it came, in order
        self.after_seen_in_time = False
        self._ready = threading.Event()
        self._writers: set[Writer] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="hostile-backend", daemon=True)

    def __enter__(self) -> HostileBackend:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the hostile backend did not start")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop.set()
        if self._loop is not None and self._done is not None:
            self._loop.call_soon_threadsafe(self._done.set)
        self._thread.join(10)

    def saw_hang_up(self, name: str, timeout_s: float = 10.0) -> bool:
        return self.hung_up.setdefault(name, threading.Event()).wait(timeout_s)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        async with RawServer(self._serve, self._tls) as server:
            self.url = server.url
            self._ready.set()
            await self._done.wait()

    async def _serve(self, reader: Reader, writer: Writer) -> None:
        self._writers.add(writer)
        name = ""
        try:
            while not self.stop.is_set():
                request_head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(request_head)
                body = await reader.readexactly(_content_length(request_head))
                if request_head.startswith(b"GET"):
                    models = orjson.dumps(MODELS)
                    await self.send("models", writer, json_answer("200 OK", models) + models)
                    continue
                request = orjson.loads(body)
                name = str(request.get("hostile", "normal"))
                self.sent_bytes[name] = 0
                await self.misbehaviours[name](self, writer, request)
        except _GaveUp:
            pass
        except (ConnectionError, asyncio.IncompleteReadError):
            if name:
                self.hung_up.setdefault(name, threading.Event()).set()
        finally:
            self._writers.discard(writer)

    def cut(self) -> None:
        """Drop every open connection now (a test's guard against a gateway that keeps reading)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._abort_all)

    def _abort_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()

    async def send(self, name: str, writer: Writer, data: bytes) -> None:
        writer.write(data)
        self.sent_bytes[name] = self.sent_bytes.get(name, 0) + len(data)
        await writer.drain()

    async def endless(
        self, name: str, writer: Writer, data: bytes, *, every_s: float = 0.0, limit: int = -1
    ) -> None:
        """`data` again and again (up to `limit` bytes) until `stop`, the gateway hangs up, or
        GIVE_UP_S pass (so that a gateway without deadlines fails a test instead of hanging it)."""
        give_up_at_s = asyncio.get_running_loop().time() + GIVE_UP_S
        while not self.stop.is_set() and (limit < 0 or self.sent_bytes[name] < limit):
            if asyncio.get_running_loop().time() > give_up_at_s:
                writer.transport.abort()
                raise _GaveUp
            await self.send(name, writer, data)
            await asyncio.sleep(every_s)


@contextlib.contextmanager
def hostile_backend(
    scheme: str, directory: Path, extra: dict[str, Misbehaviour] | None = None
) -> Iterator[HostileBackend]:
    """A HostileBackend over `scheme` (http or https); over https its certificate (made in
    `directory`) is trusted through SSL_CERT_FILE, which gateways started meanwhile inherit."""
    if scheme == "http":
        with HostileBackend(extra) as backend:
            yield backend
        return
    cert, key = self_signed(directory)
    with (
        pytest.MonkeyPatch.context() as env,
        HostileBackend(extra, server_tls(cert, key)) as backend,
    ):
        env.setenv("SSL_CERT_FILE", str(cert))
        yield backend


def _content_length(request_head: bytes) -> int:
    for line in request_head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


async def normal(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
    if request.get("stream"):
        body = event(CHUNK) + b"data: [DONE]\n\n"
        sse = head("200 OK", "content-type: text/event-stream", f"content-length: {len(body)}")
        await server.send("normal", writer, sse + body)
    else:
        answer = EMBEDDINGS if "input" in request else CHAT
        body = orjson.dumps(answer)
        await server.send("normal", writer, json_answer("200 OK", body) + body)


def whole(status: str, body: bytes, *headers: str) -> Misbehaviour:
    """A complete answer with a length: a status or a body the gateway must not pass on as is."""

    async def answer(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
        data = json_answer(status, body, *headers) + body
        await server.send(str(request["hostile"]), writer, data)

    return answer


def typed(content_type: str, body: bytes) -> Misbehaviour:
    async def answer(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
        length = f"content-length: {len(body)}"
        data = head("200 OK", f"content-type: {content_type}", length) + body
        await server.send(str(request["hostile"]), writer, data)

    return answer


async def endless_body(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
    """A JSON object that never ends, delimited by the connection's close."""
    name = str(request["hostile"])
    await server.send(name, writer, head("200 OK", "content-type: application/json") + b'{"a": ')
    await server.endless(name, writer, FILLER)


async def huge_body(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
    """800 MB, announced by its Content-Length."""
    name, size = str(request["hostile"]), 800_000_000
    data = head("200 OK", "content-type: application/json", f"content-length: {size}")
    await server.send(name, writer, data + b'{"a": ')
    await server.endless(name, writer, FILLER, limit=size)


async def endless_headers(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
    """One header whose value never ends, sent as fast as the gateway reads."""
    name = str(request["hostile"])
    await server.send(name, writer, b"HTTP/1.1 200 OK\r\nx-endless: ")
    await server.endless(name, writer, b"a" * 65536)


def header_trickle(every_s: float) -> Misbehaviour:
    """A head that would take minutes (but stays under the head's size cap): a byte every
    `every_s`."""

    async def answer(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
        name = str(request["hostile"])
        await server.send(name, writer, b"HTTP/1.1 200 OK\r\n")
        await server.endless(name, writer, b"x", every_s=every_s, limit=40_000)

    return answer


async def many_headers(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
    """Ten thousand tiny headers: a small head in bytes, a huge one in count."""
    lines = [f"x-{i}: 1" for i in range(10_000)]
    await server.send(str(request["hostile"]), writer, head("200 OK", *lines))


def sse_forever(filler: bytes) -> Misbehaviour:
    """A stream that starts well, then sends `filler` (no content) every 0.1 s, forever."""

    async def answer(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
        name = str(request["hostile"])
        data = head("200 OK", "content-type: text/event-stream", "transfer-encoding: chunked")
        await server.send(name, writer, data + _chunk(event(CHUNK)))
        await server.endless(name, writer, _chunk(filler), every_s=0.1)

    return answer


async def slow_tokens(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
    """A real token every 0.2 s, forever: never idle, never done."""
    name = str(request["hostile"])
    data = head("200 OK", "content-type: text/event-stream", "transfer-encoding: chunked")
    await server.send(name, writer, data)
    await server.endless(name, writer, _chunk(event(CHUNK)), every_s=0.2)


async def cut_stream(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
    """Three real tokens, then the connection dropped: a backend dying mid-stream."""
    data = head("200 OK", "content-type: text/event-stream", "transfer-encoding: chunked")
    await server.send("cut_stream", writer, data + _chunk(event(CHUNK)) * 3)
    writer.transport.abort()


async def slow_whole(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
    """A whole answer whose body comes a byte every 0.2 s: never idle, never done."""
    name = str(request["hostile"])
    data = head("200 OK", "content-type: application/json", "content-length: 100000")
    await server.send(name, writer, data + b'{"a": ')
    await server.endless(name, writer, b" ", every_s=0.2)


async def bad_chunks(server: HostileBackend, writer: Writer, request: dict[str, Any]) -> None:
    """A chunk size that is not hex."""
    data = head("200 OK", "content-type: application/json", "transfer-encoding: chunked")
    await server.send(str(request["hostile"]), writer, data + b"zz\r\n{}\r\n0\r\n\r\n")


def _named(payload: dict[str, Any]) -> bytes:
    return b"event: " + str(payload["type"]).encode() + b"\n" + event(payload)


_MESSAGE_EVENTS = [
    {"type": "message_start", "message": {"type": "message", "usage": {"input_tokens": 3}}},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "fine"}},
    {"type": "content_block_stop", "index": 0},
    {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 1}},
    {"type": "message_stop"},
]
_AFTER = {
    "type": "content_block_delta",
    "index": 0,
    "delta": {"type": "text_delta", "text": "after"},
}


async def messages_after_end(server: HostileBackend, writer: Writer, request: Any) -> None:
    """A Messages stream that goes on after its message_stop: a text delta, then pings until
    the test's client has that delta (`client_has_after`) or 2 s pass, then the end."""
    name = str(request["hostile"])
    data = head("200 OK", "content-type: text/event-stream", "transfer-encoding: chunked")
    whole = b"".join(_named(payload) for payload in _MESSAGE_EVENTS)
    await server.send(name, writer, data + _chunk(whole) + _chunk(_named(_AFTER)))
    loop = asyncio.get_running_loop()
    give_up_at_s = loop.time() + 2.0
    while not server.client_has_after.is_set() and loop.time() < give_up_at_s:
        await server.send(name, writer, _chunk(_named({"type": "ping"})))
        await asyncio.sleep(0.05)
    server.after_seen_in_time = server.client_has_after.is_set()
    await server.send(name, writer, b"0\r\n\r\n")


# Streams a backend ends with its own error event, under the 200: Anthropic's (and vLLM's)
# `error` event on Messages; `response.failed` on Responses.
_OVERLOADED = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}


async def messages_cut_after_usage(server: HostileBackend, writer: Writer, request: Any) -> None:
    """A Messages stream dropped after a message_delta whose usage is no count (-1 tokens)."""
    data = head("200 OK", "content-type: text/event-stream", "transfer-encoding: chunked")
    events = [*_MESSAGE_EVENTS[:4], {**_MESSAGE_EVENTS[4], "usage": {"output_tokens": -1}}]
    whole = b"".join(_named(payload) for payload in events)
    await server.send("messages_cut_after_usage", writer, data + _chunk(whole))
    writer.transport.abort()


_STARTED = {"type": "message", "role": "assistant", "content": [], "usage": {"input_tokens": 3}}
# A Messages stream the backend ends cleanly before its message_stop, mid-way through an event.
MESSAGES_ENDED_EARLY = b"".join(
    _named(payload)
    for payload in [{"type": "message_start", "message": _STARTED}, *_MESSAGE_EVENTS[1:3]]
) + (b'event: content_block_delta\ndata: {"type":"content_bl')
MESSAGES_ERROR_EVENT = b"".join(
    _named(payload)
    for payload in [
        {"type": "message_start", "message": _STARTED},
        *_MESSAGE_EVENTS[1:3],
        _OVERLOADED,
    ]
)
_FAILED = {
    "status": "failed",
    "error": {"code": "server_error", "message": "The model failed."},
    "usage": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4},
    "output": [],
}
RESPONSES_FAILED = b"".join(
    _named(payload)
    for payload in [
        {"type": "response.created", "sequence_number": 0, "response": {"status": "in_progress"}},
        {"type": "response.output_text.delta", "sequence_number": 1, "delta": "fine"},
        {"type": "response.failed", "sequence_number": 2, "response": _FAILED},
    ]
)

# A Responses stream the backend ends cleanly before response.completed, mid-way through an event.
RESPONSES_ENDED_EARLY = RESPONSES_FAILED.split(b"event: response.failed")[0] + (
    b'event: response.output_text.delta\ndata: {"type":"response.out'
)

RESPONSE_FAILED_WHOLE = orjson.dumps(
    {"id": "resp_1", "object": "response", "created_at": 1, "model": "hostile-llm", **_FAILED}
)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def retry_after(status: str, value: str) -> Misbehaviour:
    body = orjson.dumps({"error": {"message": "slow down", "type": "rate_limit_error"}})
    return whole(status, body, f"retry-after: {value}")


_CODE_OBJECT = {
    "error": {
        "message": {"text": "nested"},
        "type": ["invalid", "request"],
        "code": {"reason": "bad", "detail": [1, 2]},
        "param": 7,
    }
}

# Deeper than orjson writes (254 levels), well within what it reads (1024).
DEEP = b"[" * 300 + b'"deep"' + b"]" * 300
_DEEP_ERROR = b'{"error": {"message": ' + DEEP + b', "type": "invalid_request_error"}}'

MISBEHAVIOURS: dict[str, Misbehaviour] = {
    "normal": normal,
    "endless_body": endless_body,
    "huge_body": huge_body,
    "endless_headers": endless_headers,
    "header_trickle": header_trickle(0.5),
    "header_flood": header_trickle(0.001),
    "many_headers": many_headers,
    "sse_comments": sse_forever(b": keep-alive\n\n"),
    "sse_blank_lines": sse_forever(b"\n"),
    "slow_tokens": slow_tokens,
    "slow_whole": slow_whole,
    "cut_stream": cut_stream,
    "bad_chunks": bad_chunks,
    "messages_after_end": messages_after_end,
    "messages_cut_after_usage": messages_cut_after_usage,
    "html_200": typed("text/html", b"<html><body>Welcome to nginx!</body></html>"),
    "list_200": whole("200 OK", b"[]"),
    "hello_200": whole("200 OK", b'{"hello": 1}'),
    "choices_not_list": whole("200 OK", b'{"choices": {"0": "x"}}'),
    "json_for_stream": whole("200 OK", orjson.dumps(CHAT)),
    "sse_html_event": typed("text/event-stream", b"data: <html>oops</html>\n\ndata: [DONE]\n\n"),
    "sse_empty": typed("text/event-stream", b""),
    "code_object": whole("400 Bad Request", orjson.dumps(_CODE_OBJECT)),
    "deep_error": whole("400 Bad Request", _DEEP_ERROR),
    "messages_error_event": typed("text/event-stream", MESSAGES_ERROR_EVENT),
    "messages_ended_early": typed("text/event-stream", MESSAGES_ENDED_EARLY),
    "responses_failed": typed("text/event-stream", RESPONSES_FAILED),
    "responses_failed_whole": whole("200 OK", RESPONSE_FAILED_WHOLE),
    "responses_ended_early": typed("text/event-stream", RESPONSES_ENDED_EARLY),
    **{
        f"retry_after_{key}": retry_after(status, value)
        for key, status, value in (
            ("nan", "429 Too Many Requests", "nan"),
            ("inf", "503 Service Unavailable", "inf"),
            ("huge", "429 Too Many Requests", "1e300"),
            ("negative", "503 Service Unavailable", "-5"),
            ("text", "429 Too Many Requests", "soon"),
            ("date", "429 Too Many Requests", "Wed, 21 Oct 2065 07:28:00 GMT"),
            ("seconds", "503 Service Unavailable", "7"),
        )
    },
}
