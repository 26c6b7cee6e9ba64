"""The first-byte timeout against raw servers on 127.0.0.1, over http and https: it bounds the wait
for the answer's first byte (headers alone do not count), then the idle limit takes over."""

from __future__ import annotations

import asyncio
import ssl
import time
from pathlib import Path

import httpx
import pytest

from proxy.upstream.deadline import FirstByteTimeout
from proxy.upstream.transport import PooledTransport
from tests.certs import self_signed
from tests.upstream.rawserver import RawServer, read_request

CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def transport(*, read_s: float, first_byte_s: float | None) -> PooledTransport:
    return PooledTransport(
        connect_timeout_s=2.0,
        read_timeout_s=read_s,
        write_timeout_s=2.0,
        pool_timeout_s=2.0,
        max_connections=4,
        first_byte_timeout_s=first_byte_s,
    )


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_request(reader)
    await reader.read()  # never answers; returns when the client goes away


async def read_body(response: httpx.Response) -> bytes:
    return b"".join([part async for part in response.aiter_raw()])


async def get(pooled: PooledTransport, url: str) -> bytes:
    return await read_body(await pooled.handle_async_request(httpx.Request("GET", url)))


@pytest.mark.anyio
async def test_a_silent_backend_is_cut_at_the_first_byte_timeout_and_disconnected() -> None:
    gone = asyncio.Event()

    async def stall_then_notice(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await stall(reader, w)
        gone.set()

    async with transport(read_s=30, first_byte_s=0.3) as pool, RawServer(stall_then_notice) as raw:
        began = time.monotonic()
        with pytest.raises(FirstByteTimeout, match=r"within 0\.3 s"):
            await pool.handle_async_request(httpx.Request("GET", raw.url))
        assert 0.25 < time.monotonic() - began < 10  # first byte, not the 30 s read timeout
        await asyncio.wait_for(gone.wait(), 2)  # the backend saw the connection close


@pytest.mark.anyio
async def test_headers_alone_are_not_the_first_byte() -> None:
    """A streaming backend sends its headers at once and then works on the first token."""

    async def headers_only(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD)
        await reader.read()

    async with transport(read_s=30, first_byte_s=0.3) as pooled, RawServer(headers_only) as raw:
        began = time.monotonic()
        response = await pooled.handle_async_request(httpx.Request("GET", raw.url))
        with pytest.raises(FirstByteTimeout):
            await read_body(response)
        assert 0.25 < time.monotonic() - began < 10  # first byte, not the 30 s read timeout


@pytest.mark.anyio
async def test_after_the_first_byte_only_the_idle_limit_applies() -> None:
    """Gaps longer than the first-byte timeout are fine once the answer has begun; a first byte
    later than the read timeout is fine too: the first-byte timeout governs that wait."""

    async def slow_but_steady(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD)
        await asyncio.sleep(1.5)  # longer than the read timeout, shorter than the first-byte one
        for part in (b"one,", b"two,", b"three"):
            writer.write(chunk(part))
            await asyncio.sleep(0.1)  # a tenth of the read timeout: holds on a loaded machine
        writer.write(b"0\r\n\r\n")
        await reader.read()

    async with transport(read_s=1.0, first_byte_s=10) as pooled, RawServer(slow_but_steady) as raw:
        response = await pooled.handle_async_request(httpx.Request("GET", raw.url))
        assert await read_body(response) == b"one,two,three"


@pytest.mark.anyio
async def test_a_request_may_carry_its_own_first_byte_timeout() -> None:
    async with transport(read_s=30, first_byte_s=None) as pooled, RawServer(stall) as raw:
        timeouts = {"connect": 2.0, "read": 30.0, "write": 2.0, "pool": 2.0, "first_byte": 0.2}
        request = httpx.Request("GET", raw.url, extensions={"timeout": timeouts})
        began = time.monotonic()
        with pytest.raises(FirstByteTimeout):
            await pooled.handle_async_request(request)
        assert time.monotonic() - began < 10  # first byte, not the 30 s read timeout


@pytest.mark.anyio
async def test_https_backends_get_the_first_byte_timeout_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over TLS as over TCP, for headers and first chunk."""
    cert, key = self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # httpx trusts our certificate
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    sent_headers = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await read_request(reader)
            if b"/headers-then-nothing" in head:
                writer.write(CHUNKED_HEAD)
                sent_headers.set()
            elif b"/quick" in head:
                writer.write(CHUNKED_HEAD + chunk(b"hello") + b"0\r\n\r\n")
            await reader.read()
        finally:
            writer.close()  # Python 3.13 warns of a StreamWriter collected unclosed

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=tls)
    port = server.sockets[0].getsockname()[1]
    try:
        async with transport(read_s=30, first_byte_s=0.3) as pooled:
            for path in ("/nothing", "/headers-then-nothing"):
                began = time.monotonic()
                with pytest.raises(FirstByteTimeout):
                    await get(pooled, f"https://127.0.0.1:{port}{path}")
                assert 0.25 < time.monotonic() - began < 10  # first byte, not the 30 s read timeout
            assert sent_headers.is_set()
            assert await get(pooled, f"https://127.0.0.1:{port}/quick") == b"hello"
    finally:
        server.close()
