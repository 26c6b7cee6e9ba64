"""An answer's head reaches the client in one TCP segment with its first body bytes
(proxy/asgi/held.py), under the same uvicorn protocol `tokenweir serve` runs: a whole answer in
one segment, a stream's head with its first chunk; a stream's later chunks go out as they come."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import orjson
import pytest

from proxy.app import create_app
from proxy.tools.mock import backend as mockbackend
from tests.conftest import ALPHA_KEY, make_policy
from tests.servers import serve

# struct tcp_info (linux/tcp.h): tcpi_data_segs_in, the segments received that carried data.
_DATA_SEGS_IN = struct.Struct("=I")
_DATA_SEGS_IN_AT = 152


def data_segments_in(sock: socket.socket) -> int:
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    if len(info) < _DATA_SEGS_IN_AT + 4:
        pytest.fail("this kernel's TCP_INFO has no tcpi_data_segs_in (Linux 4.6+)")
    (count,) = _DATA_SEGS_IN.unpack_from(info, _DATA_SEGS_IN_AT)
    return int(count)


@pytest.fixture
def connection(gateway_url: str) -> Iterator[socket.socket]:
    with connected(gateway_url) as sock:
        yield sock


@pytest.fixture(scope="module")
def slow_gateway_url() -> Iterator[str]:
    """A gateway before a backend that streams a token a second."""
    with serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=1)) as backend_url:
        with serve(create_app(make_policy(backend_url))) as url:
            yield url


@contextmanager
def connected(url: str) -> Iterator[socket.socket]:
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=30) as sock:
        yield sock


def ask(
    sock: socket.socket, body: bytes, *, close: bool = False, key: str = ALPHA_KEY
) -> tuple[bytes, bytes]:
    """One POST to the chat route on `sock`; the answer's head and body (by content-length, or
    chunked until its last chunk)."""
    post(sock, body, close=close, key=key)
    received = b""
    while b"\r\n\r\n" not in received:
        received += receive(sock)
    answer_head, _, rest = received.partition(b"\r\n\r\n")
    fields = dict(
        line.split(b": ", 1) for line in answer_head.lower().split(b"\r\n")[1:] if b": " in line
    )
    if b"content-length" in fields:
        while len(rest) < int(fields[b"content-length"]):
            rest += receive(sock)
    else:
        while not rest.endswith(b"0\r\n\r\n"):
            rest += receive(sock)
    return answer_head, rest


def post(sock: socket.socket, body: bytes, *, close: bool = False, key: str = ALPHA_KEY) -> None:
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
        b"authorization: Bearer %s\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n%s\r\n"
    ) % (key.encode(), len(body), b"connection: close\r\n" if close else b"")
    sock.sendall(head + body)


def receive(sock: socket.socket) -> bytes:
    data = sock.recv(1 << 16)
    if not data:
        pytest.fail("the gateway closed the connection before the answer was whole")
    return data


def chat(**fields: Any) -> bytes:
    return orjson.dumps({
        "model": "mock-llm", "messages": [{"role": "user", "content": "Tell me about weirs."}],
        "max_tokens": 8, **fields,
    })  # fmt: skip


def test_whole_answers_each_arrive_in_one_segment(connection: socket.socket) -> None:
    ask(connection, chat())  # the connection's first exchange: its quick acks settle
    before = data_segments_in(connection)
    answers = [ask(connection, chat()) for _ in range(10)]
    assert data_segments_in(connection) - before == 10  # two a answer, head and body, before
    for head, body in answers:
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"\r\ncontent-length: %d" % len(body) in head
        assert orjson.loads(body)["object"] == "chat.completion"


def test_a_refusal_after_auth_arrives_in_one_segment(connection: socket.socket) -> None:
    ask(connection, chat())
    before = data_segments_in(connection)
    head, body = ask(connection, chat(temperature="hot"))
    assert data_segments_in(connection) - before == 1
    assert head.startswith(b"HTTP/1.1 400 ")
    assert orjson.loads(body)["error"]["param"] == "temperature"


def test_a_refusal_at_auth_arrives_in_one_segment(connection: socket.socket) -> None:
    ask(connection, chat())
    before = data_segments_in(connection)
    head, body = ask(connection, chat(), key="sk-not-a-key")
    assert data_segments_in(connection) - before == 1
    assert head.startswith(b"HTTP/1.1 401 ")
    assert orjson.loads(body)["error"]["code"] == "invalid_api_key"


def test_a_whole_answer_on_a_closing_connection_is_written_before_the_close(
    connection: socket.socket,
) -> None:
    head, body = ask(connection, chat(), close=True)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"\r\nconnection: close" in head
    assert orjson.loads(body)["object"] == "chat.completion"
    assert connection.recv(1) == b""  # then the gateway closed it


def test_a_streams_chunks_are_not_held(connection: socket.socket) -> None:
    ask(connection, chat())
    before = data_segments_in(connection)
    head, body = ask(connection, chat(stream=True, max_tokens=400, mock_completion_tokens=400))
    assert b"\r\ntransfer-encoding: chunked" in head
    assert body.count(b"data: ") > 400  # a chunk a token, the last one's, then [DONE]
    assert b"data: [DONE]" in body
    # 0.2 s of tokens go out as they come (held to the end they would be one or two segments)
    assert data_segments_in(connection) - before >= 4


def test_a_streams_head_arrives_with_its_first_chunk(slow_gateway_url: str) -> None:
    with connected(slow_gateway_url) as sock:
        ask(sock, chat(max_tokens=1, mock_completion_tokens=1))
        before = data_segments_in(sock)
        post(sock, chat(stream=True, max_tokens=2, mock_completion_tokens=2))
        received = b""
        while b"\r\n\r\n" not in received or b"\n\n" not in received.partition(b"\r\n\r\n")[2]:
            received += receive(sock)  # the head, then the first event whole
        # the next token comes a second later: what came so far came in one segment
        assert data_segments_in(sock) - before == 1  # the head alone first, before
        head, _, body = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"data: {" in body
