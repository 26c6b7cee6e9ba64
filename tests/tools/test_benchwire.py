"""The raw HTTP/1.1 bench transport against small asyncio servers that misbehave on purpose."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from proxy.tools.bench.config import chat_completions_url
from proxy.tools.bench.transport import TransportFailure
from proxy.tools.bench.wire import MAX_HEAD_BYTES, WireTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Sink:
    def __init__(self) -> None:
        self.status = 0
        self.body = b""
        self.reads = 0

    def on_status(self, status: int) -> None:
        self.status = status

    def on_body(self, data: bytes, now_s: float) -> None:
        self.body += data
        self.reads += 1


async def read_request(
    reader: asyncio.StreamReader, heads: list[bytes] | None = None
) -> tuple[bytes, bytes] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    if heads is not None:
        heads.append(head)
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head, await reader.readexactly(length)


def chunked(*parts: bytes) -> bytes:
    encoded = b"".join(b"%x\r\n%b\r\n" % (len(part), part) for part in parts)
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + encoded + b"0\r\n\r\n"


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[str]:
    """Yields the chat URL; the handler is told each connection's 1-based index."""
    count = 0

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        count += 1
        try:
            await handler(reader, writer, count)
        finally:
            writer.close()

    listener = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    async with listener:
        yield f"http://127.0.0.1:{port}/v1/chat/completions"


def keep_alive_sse(heads: list[bytes], connections: list[int]) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        connections.append(n)
        while await read_request(reader, heads) is not None:
            writer.write(chunked(b"data: 1\n\n", b"data: [DONE]\n\n"))
            await writer.drain()

    return handle


def answer_each(handler: Handler, requests: int, *, api_key: str | None = None) -> None:
    """Send `requests` requests through one transport; each must get `data: 1` and [DONE]."""

    async def scenario() -> None:
        async with server(handler) as url:
            transport = WireTransport(url, api_key=api_key)
            for _ in range(requests):
                sink = Sink()
                await transport.exchange(b'{"x":1}', sink)
                assert (sink.status, sink.body) == (200, b"data: 1\n\ndata: [DONE]\n\n")
            await transport.aclose()

    asyncio.run(scenario())


def test_requests_reuse_one_kept_alive_connection() -> None:
    heads: list[bytes] = []
    connections: list[int] = []

    answer_each(keep_alive_sse(heads, connections), 3, api_key="sk-test")
    assert connections == [1]
    assert len(heads) == 3
    assert heads[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer sk-test\r\n" in heads[0]
    assert b"\r\nContent-Length: 7\r\n" in heads[0]
    assert b"\r\nHost: 127.0.0.1:" in heads[0]


def test_a_connection_closed_while_idle_is_retried_on_a_new_one() -> None:
    connections: list[int] = []

    async def first_answers_once(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
    ) -> None:
        connections.append(n)
        await read_request(reader)
        writer.write(chunked(b"data: [DONE]\n\n"))
        await writer.drain()
        if n == 1:
            await read_request(reader)  # the server gives up on this socket without answering
            return
        while await read_request(reader) is not None:
            writer.write(chunked(b"data: [DONE]\n\n"))

    async def scenario() -> None:
        async with server(first_answers_once) as url:
            transport = WireTransport(url, api_key=None)
            await transport.exchange(b"{}", Sink())
            sink = Sink()
            await transport.exchange(b"{}", sink)
            assert sink.body == b"data: [DONE]\n\n"
            await transport.aclose()

    asyncio.run(scenario())
    assert connections == [1, 2]


def test_a_body_cut_short_is_a_connection_failure() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
        await writer.drain()

    async def scenario() -> None:
        async with server(cut) as url:
            transport = WireTransport(url, api_key=None)
            sink = Sink()
            with pytest.raises(TransportFailure) as failure:
                await transport.exchange(b"{}", sink)
            assert failure.value.kind == "connection"
            assert sink.body == b"data: 1\n\n", "what arrived before the cut was delivered"
            await transport.aclose()

    asyncio.run(scenario())


def test_a_body_delimited_by_close_is_complete() -> None:
    async def close_delimited(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int
    ) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\ndata: 1\n\n")
        await writer.drain()
        writer.write(b"data: [DONE]\n\n")

    async def scenario() -> None:
        async with server(close_delimited) as url:
            transport = WireTransport(url, api_key=None)
            sink = Sink()
            await transport.exchange(b"{}", sink)
            assert sink.body == b"data: 1\n\ndata: [DONE]\n\n"
            await transport.aclose()

    asyncio.run(scenario())


def test_interim_responses_before_the_answer_are_skipped() -> None:
    """RFC 9110 15.2: a client must parse 1xx responses it did not ask for. Each request here
    was once an `http_100` error and its real answer dropped as bytes out of step."""
    connections: list[int] = []

    async def interim_first(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
    ) -> None:
        connections.append(n)
        while await read_request(reader) is not None:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
            writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n")
            writer.write(chunked(b"data: 1\n\n", b"data: [DONE]\n\n"))
            await writer.drain()

    answer_each(interim_first, 2)
    assert connections == [1]


def test_an_endless_head_is_a_connection_failure_not_a_growing_buffer() -> None:
    """A header that never ended was held whole by the parser until the request's timeout: 20 s
    of it took 320 MB and a core. Now a head past MAX_HEAD_BYTES fails at once."""

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Junk: ")
        with contextlib.suppress(ConnectionError):
            while True:
                writer.write(b"a" * 65536)
                await writer.drain()

    async def scenario() -> None:
        async with server(endless) as url:
            transport = WireTransport(url, api_key=None)
            with pytest.raises(TransportFailure) as failure:
                async with asyncio.timeout(5):
                    await transport.exchange(b"{}", Sink())
            assert failure.value.kind == "connection"
            assert f"a head of more than {MAX_HEAD_BYTES:,} bytes" in failure.value.detail
            await transport.aclose()

    asyncio.run(scenario())


def test_timeout_mid_response_leaves_the_transport_usable() -> None:
    async def slow_then_fast(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int
    ) -> None:
        await read_request(reader)
        if n == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            await writer.drain()
            await reader.read()  # never finishes; waits for the client to go
            return
        writer.write(chunked(b"data: [DONE]\n\n"))
        await writer.drain()

    async def scenario() -> None:
        async with server(slow_then_fast) as url:
            transport = WireTransport(url, api_key=None)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.1):
                    await transport.exchange(b"{}", Sink())
            sink = Sink()
            await transport.exchange(b"{}", sink)
            assert sink.body == b"data: [DONE]\n\n"
            await transport.aclose()

    asyncio.run(scenario())


def test_refused_connection() -> None:
    async def scenario() -> None:
        async with server(keep_alive_sse([], [])) as url:
            pass  # closed again: its port now refuses
        transport = WireTransport(url, api_key=None)
        with pytest.raises(TransportFailure, match="connection"):
            await transport.exchange(b"{}", Sink())
        await transport.aclose()

    asyncio.run(scenario())


def test_a_query_in_the_base_url_reaches_the_server() -> None:
    # Azure OpenAI needs ?api-version=...: --base-url once lost its query on the way.
    heads: list[bytes] = []

    async def scenario() -> None:
        async with server(keep_alive_sse(heads, [])) as url:
            base = url.removesuffix("/chat/completions") + "?api-version=2024-10-21"
            transport = WireTransport(chat_completions_url(base), api_key=None)
            await transport.exchange(b"{}", Sink())
            await transport.aclose()

    asyncio.run(scenario())
    assert heads[0].startswith(b"POST /v1/chat/completions?api-version=2024-10-21 HTTP/1.1\r\n")
