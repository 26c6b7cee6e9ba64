"""https backends (PooledTransport over TLS) against raw TLS servers on
127.0.0.1: a broken TLS record and a head past its caps end the exchange with the errors the
plain-http transport raises, never a bare `ssl.SSLError`."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from proxy.upstream.exchange import ResponseHeadTooLarge
from proxy.upstream.tls import TlsBroken, tls_reason
from proxy.upstream.transport import PooledTransport
from tests.certs import self_signed, server_tls
from tests.upstream.loops import anyio_backend  # noqa: F401 (the fixture)
from tests.upstream.rawserver import RawServer, read_request

CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
# A TLS application-data record the client's keys cannot open; then plain text where a record
# should be: the two ways a broken or hostile backend corrupts a TLS stream.
BAD_RECORD = b"\x17\x03\x03\x00\x10" + b"A" * 16
NOT_TLS = b"HTTP/1.1 200 OK\r\n\r\n"

Writer = asyncio.StreamWriter
Answer = Callable[[Writer], Awaitable[None]]


@pytest.fixture
def tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[Answer], RawServer]:
    """A raw https server (trusted through SSL_CERT_FILE) that reads a request, runs `answer`."""
    cert, key = self_signed(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))

    def server(answer: Answer) -> RawServer:
        async def handler(reader: asyncio.StreamReader, writer: Writer) -> None:
            await read_request(reader)
            await answer(writer)
            await reader.read()

        return RawServer(handler, server_tls(cert, key))

    return server


def transport(max_head_bytes: int = 64 * 1024, max_headers: int = 256) -> PooledTransport:
    return PooledTransport(
        connect_timeout_s=5.0,
        read_timeout_s=10.0,
        write_timeout_s=5.0,
        pool_timeout_s=5.0,
        max_connections=4,
        max_head_bytes=max_head_bytes,
        max_headers=max_headers,
    )


async def get(pooled: PooledTransport, url: str) -> bytes:
    response = await pooled.handle_async_request(httpx.Request("GET", url))
    try:
        return b"".join([part async for part in response.aiter_raw()])
    finally:
        await response.aclose()


def raw_write(writer: Writer, data: bytes) -> None:
    """`data` on the socket beneath TLS, as no TLS peer would send it."""
    os.write(writer.get_extra_info("socket").fileno(), data)


def bad_record_before_head(garbage: bytes) -> Answer:
    async def answer(writer: Writer) -> None:
        raw_write(writer, garbage)

    return answer


def bad_record_mid_body(garbage: bytes) -> Answer:
    async def answer(writer: Writer) -> None:
        writer.write(CHUNKED + b"5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)  # the first chunk is read on its own
        raw_write(writer, garbage)

    return answer


@pytest.mark.anyio
@pytest.mark.parametrize("garbage", [BAD_RECORD, NOT_TLS], ids=["bad-record", "not-tls"])
@pytest.mark.parametrize("when", [bad_record_before_head, bad_record_mid_body])
async def test_a_broken_tls_record_is_an_httpx_error_that_names_it(
    tls: Callable[[Answer], RawServer], when: Callable[[bytes], Answer], garbage: bytes
) -> None:
    """httpcore raised the bare ssl.SSLError: the gateway answered 500 before the head, and
    mid-stream dropped the client's connection with no error event."""
    async with transport() as pooled, tls(when(garbage)) as raw:
        with pytest.raises(TlsBroken, match=r"^TLS failed: ") as caught:
            await get(pooled, raw.url)
    assert isinstance(caught.value, httpx.ReadError)


def head_of(*headers: bytes) -> Answer:
    async def answer(writer: Writer) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n")

    return answer


async def endless_head(writer: Writer) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nx-endless: ")
    for _ in range(400):  # 26 MB, unless the client hangs up
        writer.write(b"a" * 65536)
        await writer.drain()


async def endless_chunk_line(writer: Writer) -> None:
    writer.write(CHUNKED + b"5\r\nhello\r\n5;x=")
    for _ in range(400):
        writer.write(b"a" * 65536)
        await writer.drain()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (head_of(*[b"x-%d: 1" % i for i in range(300)]), "more than 256 headers"),
        (head_of(b"x-big: " + b"a" * 80_000), "a head of more than 65536 bytes"),
        (endless_head, "a head of more than 65536 bytes"),
    ],
    ids=["300-headers", "80-kB-head", "endless-head"],
)
async def test_a_head_past_its_caps_is_refused_as_over_plain_http(
    tls: Callable[[Answer], RawServer], answer: Answer, message: str
) -> None:
    """h11 took 10,000 headers (the answer then waited out the read timeout), and an endless
    head failed as any broken answer, not as `upstream.max_header_bytes`' 502."""
    async with transport() as pooled, tls(answer) as raw:
        with pytest.raises(ResponseHeadTooLarge, match=message):
            await get(pooled, raw.url)


@pytest.mark.anyio
async def test_an_endless_chunk_size_line_is_refused_as_over_plain_http(
    tls: Callable[[Answer], RawServer],
) -> None:
    async with transport() as pooled, tls(endless_chunk_line) as raw:
        response = await pooled.handle_async_request(httpx.Request("GET", raw.url))
        with pytest.raises(ResponseHeadTooLarge, match="bytes of chunk framing or trailers"):
            await response.aread()
        await response.aclose()


@pytest.mark.anyio
async def test_a_head_within_its_caps_is_taken(tls: Callable[[Answer], RawServer]) -> None:
    async def answer(writer: Writer) -> None:
        headers = b"".join(b"x-%d: %s\r\n" % (i, b"a" * 200) for i in range(250))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n" + headers + b"\r\nok")

    async with transport() as pooled, tls(answer) as raw:
        assert await get(pooled, raw.url) == b"ok"


async def no_answer(writer: Writer) -> None:
    writer.close()


async def cut_body(writer: Writer) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nabc")
    await writer.drain()
    writer.close()


@pytest.mark.anyio
@pytest.mark.parametrize("answer", [no_answer, cut_body])
async def test_an_error_httpx_raised_is_raised_as_it_is(
    tls: Callable[[Answer], RawServer], answer: Answer
) -> None:
    """Raised `from` itself, its cause was itself: the probe's search of the causes for a TLS
    reason (/readyz of a backend that cut its /models answer) spun for ever."""
    async with transport() as pooled, tls(answer) as raw:
        with pytest.raises(httpx.RemoteProtocolError) as caught:
            await get(pooled, raw.url)
    assert caught.value.__cause__ is not caught.value
    assert tls_reason(caught.value) is None
