"""An exchange's sink (`Exchange.relay_to`): reads that come while the reader waits go to the sink
in the connection's callback; the reader wakes only for what the sink leaves, for an error, and
for the end. Real sockets: PooledTransport against raw asyncio servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from proxy.upstream.exchange import Exchange
from proxy.upstream.transport import PooledTransport
from tests.upstream.rawserver import RawServer, read_request
from tests.upstream.test_transport import anyio_backend

__all__ = ["anyio_backend"]  # both loops, as for the transport's own tests

HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class Parts:
    """A backend that sends its head, then waits for `go` and sends each part after `gap_s`
    (one read each), then ends the body after `gap_s` more, or stalls instead with `stall`.
    (A read that completes the body is the reader's whatever the sink says: it ends the stream.)
    With `first`, that part comes with the head, before `go`."""

    def __init__(
        self, parts: list[bytes], gap_s: float = 0.02, *, stall: bool = False, first: bytes = b""
    ) -> None:
        self.go = asyncio.Event()
        self.first = first
        self._parts = parts
        self._gap_s = gap_s
        self._stall = stall

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(HEAD + (chunk(self.first) if self.first else b""))
        await self.go.wait()
        for part in self._parts:
            await asyncio.sleep(self._gap_s)
            if writer.is_closing():  # the client dropped the connection
                return
            writer.write(chunk(part))
        if self._stall:
            await reader.read()  # until the client goes away
        else:
            await asyncio.sleep(self._gap_s)  # the end is a read of its own too
            writer.write(b"0\r\n\r\n")


def make_transport(read_s: float = 5.0) -> PooledTransport:
    return PooledTransport(
        connect_timeout_s=2.0,
        read_timeout_s=read_s,
        write_timeout_s=read_s,
        pool_timeout_s=5.0,
        max_connections=4,
    )


async def exchange_of(transport: PooledTransport, url: str) -> Exchange:
    """The exchange of a GET to `url` (as the gateway reads it: the transport's own stream)."""
    response = await transport.handle_async_request(httpx.Request("GET", url))
    exchange = response.stream
    assert isinstance(exchange, Exchange)
    return exchange


async def collect(reads: AsyncIterator[bytes]) -> list[bytes]:
    return [data async for data in reads]


@asynccontextmanager
async def relayed(
    backend: Parts, sink: Callable[[bytes], bool], read_s: float = 5.0
) -> AsyncIterator[asyncio.Future[list[bytes]]]:
    """The exchange of a GET to `backend` relaying to `sink` (after the reader's own read of the
    backend's `first` part, if any), and a reader collecting what is left to it, waiting before
    the backend goes on."""
    async with make_transport(read_s) as transport, RawServer(backend) as raw:
        exchange = await exchange_of(transport, raw.url)
        reads = aiter(exchange)
        if backend.first:
            assert await anext(reads) == backend.first
        exchange.relay_to(sink)
        reader = asyncio.ensure_future(collect(reads))
        await asyncio.sleep(0.05)  # the reader is waiting before the next part comes
        backend.go.set()
        yield reader


class Recording:
    """A sink that takes every read."""

    def __init__(self) -> None:
        self.sunk: list[bytes] = []

    def __call__(self, data: bytes) -> bool:
        self.sunk.append(data)
        return True


@pytest.mark.anyio
async def test_reads_while_the_reader_waits_go_to_the_sink_in_order() -> None:
    parts = [b"one", b"two", b"three", b"four"]
    sink = Recording()
    async with relayed(Parts(parts), sink) as reader:
        left = await asyncio.wait_for(reader, 10)
    assert sink.sunk == parts
    assert left == []  # it woke only for the end


@pytest.mark.anyio
async def test_a_read_the_sink_leaves_goes_to_the_reader() -> None:
    backend = Parts([b"taken", b"left", b"taken again"])
    async with relayed(backend, lambda data: data != b"left") as reader:
        assert await asyncio.wait_for(reader, 10) == [b"left"]


@pytest.mark.anyio
async def test_reads_that_come_while_the_reader_is_busy_stay_with_it() -> None:
    """The sink never overtakes what the reader holds: a read that arrives while the reader is
    not waiting is the reader's, whatever the sink would have said."""
    backend = Parts([b"a", b"b", b"c"], gap_s=0.0)
    sink = Recording()
    async with make_transport() as transport, RawServer(backend) as raw:
        exchange = await exchange_of(transport, raw.url)
        exchange.relay_to(sink)
        backend.go.set()
        await asyncio.sleep(0.3)  # everything arrives while nobody waits
        received = await asyncio.wait_for(collect(aiter(exchange)), 10)
    assert sink.sunk == []
    assert b"".join(received) == b"abc"


@pytest.mark.anyio
async def test_an_error_in_the_sink_is_raised_to_the_reader() -> None:
    class Broken(Exception):
        pass

    def sink(data: bytes) -> bool:
        raise Broken(data.decode())

    async with relayed(Parts([b"boom", b"never seen"]), sink) as reader:
        with pytest.raises(Broken, match="boom"):
            await asyncio.wait_for(reader, 10)


@pytest.mark.anyio
async def test_the_read_deadline_moves_on_with_each_read_the_sink_takes() -> None:
    """After a first byte (the idle limit applies from then on), reads every 0.1 s for 2.5 s
    with an idle limit of 1 s: the reader, waiting all along, must not time out; nor would it
    if it had read them itself."""
    sink = Recording()
    backend = Parts([b"tick"] * 25, gap_s=0.1, first=b"first")
    async with relayed(backend, sink, read_s=1.0) as reader:
        assert await asyncio.wait_for(reader, 30) == []
    assert len(sink.sunk) == 25


@pytest.mark.anyio
async def test_a_stall_after_the_sinks_reads_still_times_out() -> None:
    sink = Recording()
    backend = Parts([b"tick"] * 3, gap_s=0.05, stall=True, first=b"first")
    async with relayed(backend, sink, read_s=0.5) as reader:
        with pytest.raises(httpx.ReadTimeout):
            await asyncio.wait_for(reader, 30)
    assert sink.sunk == [b"tick"] * 3
