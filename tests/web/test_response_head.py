"""The fast lane writes a response's head as this uvicorn's own `send` would, byte for byte, and
leaves the cycle as it would; what it cannot take it leaves to uvicorn's `send`."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, RequestResponseCycle

from proxy.asgi.head import write_head

DEFAULTS = [(b"date", b"Sat, 05 Dec 2026 19:00:00 GMT"), (b"server", b"uvicorn")]
STATE = (
    "response_started", "chunked_encoding", "expected_content_length", "keep_alive",
    "waiting_for_100_continue",
)  # fmt: skip


class Wire(asyncio.Transport):
    """A connection's transport that keeps what is written to it."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def cycle(method: str = "POST", *, keep_alive: bool = True, access_log: bool = False) -> Any:
    wire = Wire()
    return RequestResponseCycle(
        scope={"type": "http", "method": method},  # type: ignore[typeddict-item]
        transport=wire,
        flow=FlowControl(wire),
        logger=logging.getLogger("test"),
        access_logger=logging.getLogger("test.access"),
        access_log=access_log,
        default_headers=list(DEFAULTS),
        message_event=asyncio.Event(),
        expect_100_continue=True,
        keep_alive=keep_alive,
        on_response=lambda: None,
    )


def state(of: Any) -> dict[str, object]:
    return {name: getattr(of, name) for name in STATE}


ANSWER = [(b"content-type", b"application/json"), (b"content-length", b"2")]
CASES = {
    "a whole answer": ("POST", True, 200, ANSWER, b"{}"),
    "a stream, chunked by the server": (
        "POST", True, 200, [(b"content-type", b"text/event-stream")], b"data: 1\n\n",
    ),
    "an HTTP/1.0 client": ("POST", False, 200, ANSWER, b"{}"),
    "the app closing the connection": (
        "POST", True, 429, [(b"Connection", b"keep-alive, Close"), *ANSWER], b"{}",
    ),
    "the app chunking itself": ("POST", True, 200, [(b"Transfer-Encoding", b"chunked")], b""),
    "a HEAD request": ("HEAD", True, 200, [(b"content-type", b"text/plain")], b""),
    "no content": ("POST", True, 204, [(b"x-request-id", b"req_1")], b""),
    "a status without a phrase": ("POST", True, 599, ANSWER, b"{}"),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_the_head_and_the_cycle_are_uvicorns(case: str) -> None:
    asyncio.run(_alike(*CASES[case]))


async def _alike(
    method: str, keep_alive: bool, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    theirs, ours = cycle(method, keep_alive=keep_alive), cycle(method, keep_alive=keep_alive)
    await theirs.send({"type": "http.response.start", "status": status, "headers": headers})
    assert write_head(ours, status, headers)
    assert ours.transport.written == theirs.transport.written
    assert state(ours) == state(theirs)
    for each in (theirs, ours):  # the body goes through uvicorn's send either way
        await each.send({"type": "http.response.body", "body": body, "more_body": False})
    assert ours.transport.written == theirs.transport.written
    assert ours.response_complete
    assert theirs.transport.written.startswith(b"HTTP/1.1 %d" % status)


@pytest.mark.parametrize(
    ("headers", "error"),
    [
        ([(b"x-evil", b"a\r\nset-cookie: b")], "Invalid HTTP header value."),
        ([(b"x bad", b"1")], "Invalid HTTP header name."),
    ],
)
def test_a_header_uvicorn_refuses_is_left_to_uvicorns_send(
    headers: list[tuple[bytes, bytes]], error: str
) -> None:
    asyncio.run(_refused(headers, error))


async def _refused(headers: list[tuple[bytes, bytes]], error: str) -> None:
    ours = cycle()
    assert not write_head(ours, 200, [*ANSWER, *headers])
    assert ours.transport.written == b""
    assert state(ours) == state(cycle())
    with pytest.raises(RuntimeError, match=error):
        await ours.send({"type": "http.response.start", "status": 200, "headers": headers})


@pytest.mark.parametrize(
    ("made", "status", "headers"),
    [
        (lambda: cycle(access_log=True), 200, ANSWER),  # uvicorn logs the line itself
        (cycle, 600, ANSWER),  # no status line of uvicorn's
        (cycle, 200, [(b"content-type", "text/plain")]),  # a value not bytes
    ],
)
def test_what_it_cannot_write_as_uvicorn_would_it_leaves_untouched(
    made: Any, status: int, headers: Any
) -> None:
    ours = made()
    before = state(ours)
    assert not write_head(ours, status, headers)
    assert ours.transport.written == b""
    assert state(ours) == before


def test_a_started_or_gone_response_is_left_to_uvicorns_send() -> None:
    started, gone, waiting = cycle(), cycle(), cycle()
    started.response_started = True
    gone.disconnected = True
    waiting.flow.write_paused = True  # uvicorn's send waits for the client first
    for each in (started, gone, waiting):
        assert not write_head(each, 200, ANSWER)
        assert each.transport.written == b""


def test_it_refuses_exactly_the_bytes_uvicorns_checks_refuse() -> None:
    for byte in bytes(range(256)):
        name, value = b"x-" + bytes([byte]), b"v" + bytes([byte])
        assert write_head(cycle(), 200, [(name, b"1")]) is (HEADER_RE.search(name) is None)
        assert write_head(cycle(), 200, [(b"x", value)]) is (HEADER_VALUE_RE.search(value) is None)
