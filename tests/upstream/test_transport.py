"""PooledTransport against real servers on 127.0.0.1: uvicorn, the mock backend, raw asyncio."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import socket
import time
import weakref
from collections.abc import AsyncIterator, Iterator

import anyio
import httpx
import pytest
from starlette.types import Receive, Scope, Send

from proxy.tools.mock import backend as mockbackend
from proxy.tools.mock.asgi import read_body, respond, run_lifespan
from proxy.upstream.transport import PooledTransport
from tests.servers import serve
from tests.upstream.loops import anyio_backend  # noqa: F401 (the fixture)
from tests.upstream.rawserver import Handler, RawServer, read_request

TEXT = ((b"content-type", b"text/plain"),)
OK_HELLO = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"


def make_client(
    *, max_connections: int = 16, read_s: float = 5.0, pool_s: float = 5.0
) -> httpx.AsyncClient:
    """The client the gateway builds: its own timeouts match the transport's."""
    transport = PooledTransport(
        connect_timeout_s=2.0,
        read_timeout_s=read_s,
        write_timeout_s=read_s,
        pool_timeout_s=pool_s,
        max_connections=max_connections,
    )
    timeout = httpx.Timeout(read_s, connect=2.0, pool=pool_s)
    return httpx.AsyncClient(transport=transport, timeout=timeout)


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """/port: the client's port; /echo: the body back; /chunked: three parts, no length."""
    if scope["type"] == "lifespan":
        await run_lifespan(receive, send)
        return
    body = await read_body(receive)
    if scope["path"] == "/port":
        await respond(send, 200, str(scope["client"][1]).encode(), TEXT)
    elif scope["path"] == "/chunked":
        await send({"type": "http.response.start", "status": 200, "headers": list(TEXT)})
        for part in (b"one,", b"two,", b"three"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    else:
        await respond(send, 200, body, TEXT)


@pytest.fixture(scope="module")
def app_url() -> Iterator[str]:
    with serve(app) as url:
        yield url


async def answer_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        await read_request(reader)
        writer.write(OK_HELLO)


@pytest.mark.anyio
async def test_sequential_requests_share_one_connection(app_url: str) -> None:
    async with make_client() as client:
        ports = {(await client.get(app_url + "/port")).text for _ in range(5)}
    assert len(ports) == 1


@pytest.mark.anyio
async def test_content_length_chunked_and_close_delimited_bodies(app_url: str) -> None:
    async def close_delimited(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil ")
        await writer.drain()
        writer.write(b"the end")

    async with make_client() as client, RawServer(close_delimited) as raw:
        echoed = await client.post(app_url + "/echo", content=b"x" * 100_000)
        chunked = await client.get(app_url + "/chunked")
        until_close = await client.get(raw.url)
    assert echoed.content == b"x" * 100_000
    assert (echoed.http_version, echoed.reason_phrase) == ("HTTP/1.1", "OK")
    assert chunked.headers["transfer-encoding"] == "chunked"
    assert chunked.text == "one,two,three"
    assert until_close.text == "until the end"


@pytest.mark.anyio
async def test_streamed_request_body_is_sent_chunked(app_url: str) -> None:
    async def parts() -> AsyncIterator[bytes]:
        for part in (b"alpha ", b"", b"beta"):
            yield part

    async with make_client() as client:
        response = await client.post(app_url + "/echo", content=parts())
    assert response.text == "alpha beta"


@pytest.mark.anyio
async def test_chunks_arrive_while_the_response_is_still_being_sent() -> None:
    first_seen = asyncio.Event()

    async def two_parts(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await first_seen.wait()  # the second part exists only once the client has the first
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")

    async with make_client() as client, RawServer(two_parts) as raw:
        async with client.stream("GET", raw.url) as response:
            received = []
            async for chunk in response.aiter_raw():
                received.append(chunk)
                first_seen.set()
    assert received == [b"first", b"second"]


async def wait_for_stat(client: httpx.AsyncClient, url: str, name: str, within_s: float) -> float:
    """Seconds until the mock backend's counter `name` is at least 1."""
    started = time.perf_counter()
    while (await client.get(url + "/mock/stats")).json()[name] < 1:
        elapsed_s = time.perf_counter() - started
        assert elapsed_s < within_s, f"{name} still 0 after {elapsed_s * 1000:.0f} ms"
        await anyio.sleep(0.005)
    return time.perf_counter() - started


@pytest.mark.anyio
async def test_closing_a_stream_early_cancels_it_on_the_backend() -> None:
    body = {
        "model": "mock-llm",
        "messages": [{"role": "user", "content": "tell a long story"}],
        "stream": True,
        "mock_completion_tokens": 100_000,
    }
    with serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=500)) as url:
        async with make_client() as client:
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as stream:
                lines = stream.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
            await wait_for_stat(client, url, "streams_cancelled", within_s=0.5)
            stats = (await client.get(url + "/mock/stats")).json()
    assert stats["streams_completed"] == 0
    assert stats["tokens_sent"] < 1000


@pytest.mark.anyio
async def test_idle_connection_closed_by_the_server_is_replaced() -> None:
    closed = asyncio.Event()

    async def one_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK_HELLO)  # keep-alive by default, then the server changes its mind
        await writer.drain()
        writer.close()
        closed.set()

    async with make_client() as client, RawServer(one_answer) as raw:
        assert (await client.get(raw.url)).text == "hello"
        await closed.wait()
        await anyio.sleep(0.05)  # the client's loop sees the FIN while the connection is idle
        assert (await client.get(raw.url)).text == "hello"
    assert raw.connections == 2


def hang_up_on_second_request() -> Handler:
    """The first connection closes just as its second request comes in; later ones answer."""
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await read_request(reader)
        writer.write(OK_HELLO)
        if connections == 1:
            await read_request(reader)
            return
        await answer_forever(reader, writer)

    return handler


@pytest.mark.anyio
async def test_keepalive_race_is_retried_once_on_a_fresh_connection() -> None:
    async with make_client() as client, RawServer(hang_up_on_second_request()) as raw:
        first = await client.post(raw.url, content=b"body")
        second = await client.post(raw.url, content=b"body")
    assert (first.text, second.text) == ("hello", "hello")
    assert raw.connections == 2


@pytest.mark.anyio
async def test_keepalive_race_with_a_streamed_body_is_not_retried() -> None:
    async def parts() -> AsyncIterator[bytes]:
        yield b"body"

    async with make_client() as client, RawServer(hang_up_on_second_request()) as raw:
        await client.post(raw.url, content=b"body")
        with pytest.raises(httpx.RemoteProtocolError, match="not resent"):
            await client.post(raw.url, content=parts())
    assert raw.connections == 1


@pytest.mark.anyio
async def test_head_response_leaves_the_connection_reusable() -> None:
    async def head_then_get(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        await answer_forever(reader, writer)

    async with make_client() as client, RawServer(head_then_get) as raw:
        head = await client.head(raw.url)
        get = await client.get(raw.url)
    assert (head.headers["content-length"], head.content) == ("1000", b"")
    assert get.text == "hello"
    assert raw.connections == 1


@pytest.mark.anyio
async def test_connection_close_interim_responses_and_expiry_open_new_connections() -> None:
    async def varied(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + OK_HELLO)
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 3\r\n\r\nbye")
        await read_request(reader)

    transport = PooledTransport(
        connect_timeout_s=2.0,
        read_timeout_s=2.0,
        write_timeout_s=2.0,
        pool_timeout_s=2.0,
        max_connections=4,
        keepalive_expiry_s=0.05,
    )
    async with httpx.AsyncClient(transport=transport) as client, RawServer(varied) as raw:
        interim = await client.get(raw.url)
        closing = await client.get(raw.url)
        first = await client.get(raw.url)
        await anyio.sleep(0.1)  # longer than the keep-alive expiry
        assert (await client.get(raw.url)).status_code == 200
    assert (interim.status_code, interim.text, closing.text) == (200, "hello", "bye")
    assert first.status_code == 200
    assert raw.connections == 3


@pytest.mark.anyio
async def test_a_full_pool_hands_slots_to_requests_for_another_origin() -> None:
    finish = asyncio.Event()

    async def partial(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345")
        if b.connections == 1:
            await reader.read()  # until the client leaves
            return
        await finish.wait()
        writer.write(b"67890")
        await answer_forever(reader, writer)

    async def queued_get(url: str) -> asyncio.Future[httpx.Response]:
        waiting = asyncio.ensure_future(client.get(url))
        await anyio.sleep(0.05)
        assert not waiting.done(), "the only connection is busy"
        return waiting

    async with (
        make_client(max_connections=1) as client,
        RawServer(answer_forever) as a,
        RawServer(partial) as b,
    ):
        assert (await client.get(a.url)).text == "hello"
        async with client.stream("GET", b.url):  # evicts the idle connection to a
            waiting = await queued_get(a.url)
        assert (await waiting).text == "hello"  # closing b's stream early freed the slot
        async with client.stream("GET", b.url) as held:
            waiting = await queued_get(a.url)
            finish.set()  # b's response completes: its connection is closed for the waiter
            assert (await waiting).text == "hello"
            assert await held.aread() == b"1234567890"
    assert (a.connections, b.connections) == (3, 2)


@pytest.mark.anyio
async def test_server_not_reading_the_body_raises_write_timeout() -> None:
    timed_out = asyncio.Event()

    async def not_reading(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await timed_out.wait()
        while await reader.read(1 << 20):
            pass

    async with make_client(read_s=0.2) as client, RawServer(not_reading) as raw:
        with pytest.raises(httpx.WriteTimeout):
            await client.post(raw.url, content=b"x" * (64 * 1024 * 1024))
        timed_out.set()


@pytest.mark.anyio
async def test_pool_limit_raises_pool_timeout_until_a_connection_is_freed() -> None:
    async def first_never_ends(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if raw.connections == 1:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345")
            await reader.read()
        await answer_forever(reader, writer)

    async with (
        make_client(max_connections=1, pool_s=0.2) as client,
        RawServer(first_never_ends) as raw,
    ):
        async with client.stream("GET", raw.url) as held:
            started = time.perf_counter()
            with pytest.raises(httpx.PoolTimeout):
                await client.get(raw.url)
            assert time.perf_counter() - started >= 0.15
            assert held.status_code == 200
        assert (await client.get(raw.url)).text == "hello"
    assert raw.connections == 2


@pytest.mark.anyio
async def test_refused_connection_raises_connect_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with make_client() as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{port}/")


async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_request(reader)
    await reader.read()  # never answers; returns when the client goes away


@pytest.mark.anyio
async def test_silent_server_raises_read_timeout() -> None:
    async with make_client(read_s=0.1) as client, RawServer(stall) as raw:
        with pytest.raises(httpx.ReadTimeout):
            await client.get(raw.url)


@pytest.mark.anyio
async def test_stall_mid_body_raises_read_timeout() -> None:
    async def half(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n12345")
        await reader.read()

    async with make_client(read_s=0.1) as client, RawServer(half) as raw:
        async with client.stream("GET", raw.url) as response:
            chunks = response.aiter_raw()
            assert await anext(chunks) == b"12345"
            with pytest.raises(httpx.ReadTimeout):
                await anext(chunks)


@pytest.mark.anyio
async def test_cancelled_request_drops_the_connection_at_once() -> None:
    """Cancelled once the server holds the request (not on a timer, which a loaded machine
    may reach before the connection is even made), the client closes the connection: the
    server reads its end instead of waiting forever."""
    arrived, gone = asyncio.Event(), asyncio.Event()

    async def notice_disconnect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        arrived.set()
        await reader.read()  # never answers; returns when the client goes away
        gone.set()

    async with make_client() as client, RawServer(notice_disconnect) as raw:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(client.get, raw.url)
                with anyio.fail_after(10):
                    await arrived.wait()
                scope.cancel()
        with anyio.fail_after(5):
            await gone.wait()


@pytest.mark.anyio
async def test_server_dying_mid_body_raises_remote_protocol_error() -> None:
    async def die(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")

    async with make_client() as client, RawServer(die) as raw:
        with pytest.raises(httpx.RemoteProtocolError, match="complete message body"):
            await client.get(raw.url)


@pytest.mark.anyio
async def test_malformed_or_missing_response_raises_remote_protocol_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"this is not HTTP\r\n\r\n")

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async with make_client() as client, RawServer(garbage) as bad, RawServer(hang_up) as mute:
        with pytest.raises(httpx.RemoteProtocolError, match="malformed"):
            await client.get(bad.url)
        with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
            await client.get(mute.url)


@pytest.mark.anyio
async def test_slow_consumer_pauses_the_socket_and_still_gets_every_byte() -> None:
    size = 32 * 1024 * 1024
    payload = bytes(range(256)) * (size // 256)
    backlog: list[int] = []

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + payload)
        await asyncio.sleep(0.2)
        backlog.append(writer.transport.get_write_buffer_size())
        await writer.drain()

    async with make_client() as client, RawServer(flood) as raw:
        async with client.stream("GET", raw.url) as response:
            chunks = response.aiter_raw()
            digest = hashlib.sha256(await anext(chunks))
            await anyio.sleep(0.3)  # not reading: the transport stops reading the socket
            largest = 0
            async for chunk in chunks:
                digest.update(chunk)
                largest = max(largest, len(chunk))
    assert digest.digest() == hashlib.sha256(payload).digest()
    assert backlog[0] > size // 2, "the server could send most of the body to a paused reader"
    assert largest < 4 * 1024 * 1024


@pytest.mark.anyio
async def test_closing_the_transport_fails_open_responses_instead_of_truncating_them() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nfirst part")
        await reader.read()

    client = make_client()
    async with RawServer(endless) as raw:
        async with client.stream("GET", raw.url) as response:
            chunks = response.aiter_raw()
            assert await anext(chunks) == b"first part"
            await client.aclose()
            with pytest.raises(httpx.ReadError):
                await anext(chunks)
        with pytest.raises(RuntimeError):
            await client.get(raw.url)


@pytest.mark.anyio
async def test_two_hundred_concurrent_requests_share_a_bounded_pool(app_url: str) -> None:
    async with make_client(max_connections=32) as client:
        answers = await asyncio.gather(*(client.get(app_url + "/port") for _ in range(200)))
    assert all(answer.status_code == 200 for answer in answers)
    assert len({answer.text for answer in answers}) <= 32


@pytest.mark.anyio
async def test_transport_timeouts_apply_without_a_client() -> None:
    transport = PooledTransport(
        connect_timeout_s=1.0,
        read_timeout_s=0.1,
        write_timeout_s=1.0,
        pool_timeout_s=1.0,
        max_connections=2,
    )
    async with transport, RawServer(stall) as raw:
        with pytest.raises(httpx.ReadTimeout):
            await transport.handle_async_request(httpx.Request("GET", raw.url))


@pytest.mark.anyio
async def test_https_to_a_closed_port_is_a_connect_error_and_ftp_unsupported() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with make_client() as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"https://127.0.0.1:{port}/")
        with pytest.raises(httpx.UnsupportedProtocol):
            await client.get("ftp://127.0.0.1/")


async def half_an_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers /whole whole, /close with a body that the connection's end ends; to any other
    path, a head and half the body, then nothing more."""
    while True:
        head = await read_request(reader)
        if head.startswith(b"GET /whole "):
            writer.write(OK_HELLO)
        elif head.startswith(b"GET /close "):
            writer.write(b"HTTP/1.1 200 OK\r\n\r\nbye")
            writer.close()
            return
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello")


@pytest.mark.anyio
async def test_an_exchange_that_ends_is_freed_without_the_garbage_collector() -> None:
    """The response's parser and its deadline call back into the exchange: once it is over,
    both let go of it, so it is freed (with its request, headers and parser) as soon as the
    response is dropped, not at some later pass of the collector."""
    transport = PooledTransport(
        connect_timeout_s=2.0, read_timeout_s=5.0, write_timeout_s=5.0, pool_timeout_s=5.0,
        max_connections=4,
    )  # fmt: skip
    gc.disable()
    try:
        async with RawServer(half_an_answer) as raw:
            # read whole (twice: a reused connection), ended by a close, or dropped half-way
            for path in ("/whole", "/whole", "/close", "/half"):
                request = httpx.Request("GET", raw.url + path)
                response = await transport.handle_async_request(request)
                exchange = weakref.ref(response.stream)
                if path != "/half":
                    assert await response.aread() == (b"bye" if path == "/close" else b"hello")
                await response.aclose()
                del request, response
                assert exchange() is None, f"{path}: the exchange is only freed by the collector"
        await transport.aclose()
    finally:
        gc.enable()
