"""What one exchange may take, against raw servers on 127.0.0.1: the response head's size and count
caps (on chunk framing and trailers too), a first-byte deadline that bytes trickled into the
head cannot move, and a total deadline that a steady answer cannot outrun; each ends the
exchange and drops the connection."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from pathlib import Path

import httpx
import pytest

from proxy.upstream.deadline import FirstByteTimeout, TotalTimeout
from proxy.upstream.exchange import ResponseHeadTooLarge
from proxy.upstream.transport import PooledTransport
from tests.certs import self_signed
from tests.upstream.rawserver import Handler, RawServer, read_request


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def transport(
    *,
    read_s: float = 30.0,
    first_byte_s: float | None = None,
    total_s: float | None = None,
    max_head_bytes: int = 64 * 1024,
    max_headers: int = 256,
) -> PooledTransport:
    return PooledTransport(
        connect_timeout_s=2.0,
        read_timeout_s=read_s,
        write_timeout_s=2.0,
        pool_timeout_s=2.0,
        max_connections=4,
        first_byte_timeout_s=first_byte_s,
        total_timeout_s=total_s,
        max_head_bytes=max_head_bytes,
        max_headers=max_headers,
    )


async def read_body(response: httpx.Response) -> bytes:
    return b"".join([part async for part in response.aiter_raw()])


async def get(pooled: PooledTransport, url: str) -> bytes:
    return await read_body(await pooled.handle_async_request(httpx.Request("GET", url)))


def sends_forever(data: bytes, every_s: float, gone: asyncio.Event, first: bytes = b"") -> Handler:
    """A handler that writes `first`, then `data` every `every_s` until the client hangs up."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(first)
        try:
            for _ in range(int(30 / max(every_s, 0.001))):
                writer.write(data)
                await writer.drain()
                await asyncio.sleep(every_s)
        except ConnectionError:
            gone.set()

    return handler


@pytest.mark.anyio
async def test_a_head_trickled_within_the_read_timeout_is_cut_at_it() -> None:
    """No first_byte_timeout: the read timeout bounds the wait for the first byte as a whole,
    not each header byte (a byte every 0.1 s would otherwise hold the exchange for ever)."""
    gone = asyncio.Event()
    handler = sends_forever(b"x", 0.1, gone, first=b"HTTP/1.1 200 OK\r\n")
    async with transport(read_s=0.5) as pooled, RawServer(handler) as raw:
        began = time.monotonic()
        with pytest.raises(FirstByteTimeout):
            await get(pooled, raw.url)
        assert time.monotonic() - began < 5
        await asyncio.wait_for(gone.wait(), 5)


@pytest.mark.anyio
async def test_header_bytes_sent_without_pause_cannot_move_the_first_byte_deadline() -> None:
    """Bytes every millisecond leave the reader no moment to be caught waiting."""
    gone = asyncio.Event()
    handler = sends_forever(b"x", 0.001, gone, first=b"HTTP/1.1 200 OK\r\n")
    async with (
        transport(first_byte_s=0.3, max_head_bytes=1 << 30) as pooled,
        RawServer(handler) as raw,
    ):
        began = time.monotonic()
        with pytest.raises(FirstByteTimeout):
            await get(pooled, raw.url)
        assert time.monotonic() - began < 5
        await asyncio.wait_for(gone.wait(), 5)


@pytest.mark.anyio
async def test_a_head_past_its_byte_cap_fails_and_drops_the_connection() -> None:
    gone = asyncio.Event()
    handler = sends_forever(b"a" * 4096, 0, gone, first=b"HTTP/1.1 200 OK\r\nx-endless: ")
    async with transport(max_head_bytes=16 * 1024) as pooled, RawServer(handler) as raw:
        with pytest.raises(ResponseHeadTooLarge, match="more than 16384 bytes"):
            await get(pooled, raw.url)
        await asyncio.wait_for(gone.wait(), 5)


@pytest.mark.anyio
async def test_too_many_headers_fail_even_in_a_small_head() -> None:
    async def many(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        lines = b"".join(b"x-%d: 1\r\n" % i for i in range(300))
        writer.write(b"HTTP/1.1 200 OK\r\n" + lines + b"content-length: 2\r\n\r\nok")
        await reader.read()

    async with transport(max_headers=100) as pooled, RawServer(many) as raw:
        with pytest.raises(ResponseHeadTooLarge, match="more than 100 headers"):
            await get(pooled, raw.url)
    async with transport(max_headers=400) as pooled, RawServer(many) as raw:
        assert await get(pooled, raw.url) == b"ok"


CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("first", "data"),
    [
        pytest.param(CHUNKED + b"0\r\n", b"x-t: 1\r\n" * 512, id="countless-trailers"),
        pytest.param(CHUNKED + b"0\r\nx-t: ", b"a" * 4096, id="endless-trailer"),
        pytest.param(CHUNKED + b"5;", b"a" * 4096, id="endless-chunk-extension"),
        pytest.param(CHUNKED, b"0" * 4096, id="endless-chunk-size"),
    ],
)
async def test_endless_chunk_framing_or_trailers_fail_and_drop_the_connection(
    first: bytes, data: bytes
) -> None:
    """After the head, bytes that are no body byte (httptools takes them without end, and keeps
    the trailers) are capped as the head is: they took memory without bound (4 GB in 8 s of
    trailers) until the total deadline."""
    gone = asyncio.Event()

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """`first`, a pause (the head comes in a read of its own), then 4 MB of `data`, no end."""
        await read_request(reader)
        writer.write(first)
        await asyncio.sleep(0.1)
        with contextlib.suppress(ConnectionError):
            for _ in range(4 * 1024 * 1024 // len(data)):
                writer.write(data)
                await writer.drain()
            await reader.read()
        gone.set()

    async with (
        transport(max_head_bytes=16 * 1024, total_s=5) as pooled,
        RawServer(flood) as raw,
    ):
        with pytest.raises(ResponseHeadTooLarge, match="more than"):
            await get(pooled, raw.url)
        await asyncio.wait_for(gone.wait(), 5)


@pytest.mark.anyio
async def test_framing_and_trailers_between_body_bytes_are_not_capped() -> None:
    """The cap counts reads in a row without a body byte: a long answer of tiny chunks, with
    trailers, has far more framing than the cap in all."""
    chunks = b"1\r\nx\r\n" * 20_000 + b"0\r\nx-t: 1\r\n\r\n"

    async def tiny_chunks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunks)
        await reader.read()

    async with transport(max_head_bytes=1024) as pooled, RawServer(tiny_chunks) as raw:
        assert await get(pooled, raw.url) == b"x" * 20_000


@pytest.mark.anyio
async def test_a_steady_answer_is_cut_at_the_total_timeout() -> None:
    """A chunk every 0.05 s: never idle, never done."""
    gone = asyncio.Event()
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    handler = sends_forever(b"2\r\nok\r\n", 0.05, gone, first=head)
    async with transport(read_s=1, total_s=0.5) as pooled, RawServer(handler) as raw:
        began = time.monotonic()
        response = await pooled.handle_async_request(httpx.Request("GET", raw.url))
        with pytest.raises(TotalTimeout, match=r"within 0\.5 s"):
            await read_body(response)
        assert 0.45 < time.monotonic() - began < 5
        await asyncio.wait_for(gone.wait(), 5)


@pytest.mark.anyio
async def test_an_answer_that_ends_in_time_reuses_its_connection() -> None:
    """The total deadline of a finished exchange is cancelled: it cannot fire on the next one."""

    async def quick(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    async with transport(total_s=0.3) as pooled, RawServer(quick) as raw:
        for _ in range(3):
            assert await get(pooled, raw.url) == b"ok"
            await asyncio.sleep(0.2)
        assert raw.connections == 1


@pytest.mark.anyio
async def test_https_answers_get_the_total_timeout_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # httpx trusts our certificate
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    gone = asyncio.Event()
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    server = await asyncio.start_server(
        sends_forever(b"2\r\nok\r\n", 0.05, gone, first=head), "127.0.0.1", 0, ssl=tls
    )
    port = server.sockets[0].getsockname()[1]
    try:
        async with transport(read_s=1, total_s=0.5) as pooled:
            began = time.monotonic()
            with pytest.raises(TotalTimeout):
                await get(pooled, f"https://127.0.0.1:{port}/")
            assert 0.45 < time.monotonic() - began < 5
    finally:
        server.close()
        await server.wait_closed()
