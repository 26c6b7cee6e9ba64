"""One HTTP/1.1 connection to a backend (an asyncio protocol), feeding the exchange running on it
(proxy.upstream.exchange). Used by `proxy.upstream.transport`, which owns the pool."""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
from typing import Protocol, cast

import httpx

from proxy.upstream.exchange import Exchange, ExchangeLimits, StaleConnection

__all__ = ["Connection", "Origin", "Owner"]

Origin = tuple[str, int, bool]
"""Host, port, and whether the connection speaks TLS (an https backend)."""


class Owner(Protocol):
    """The pool a connection reports to."""

    def release(self, connection: Connection) -> None:
        """The connection finished an exchange and may be reused."""

    def closed(self, connection: Connection) -> None:
        """The connection closed; called exactly once, after it was connected."""


class Connection(asyncio.BufferedProtocol):
    """A TCP connection carrying one exchange at a time; idle between exchanges.

    Reads land in `read_buffer`, which all connections of a pool share: each read is parsed
    (and its bytes copied out by httptools) before the loop reads from any other socket.
    """

    def __init__(
        self,
        owner: Owner,
        origin: Origin,
        loop: asyncio.AbstractEventLoop,
        read_buffer: memoryview,
    ) -> None:
        self.origin = origin
        self.loop = loop
        self.reused = False
        self.idle_since_s = 0.0
        self.is_closed = False
        self._owner = owner
        self._transport: asyncio.Transport | None = None
        self._exchange: Exchange | None = None
        self._write_paused = False
        self._read_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._buffer = read_buffer
        self._poll: select.poll | None = None  # the socket, for `_unread`

    @property
    def connected(self) -> bool:
        return self._transport is not None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self._poll = select.poll()
            self._poll.register(sock.fileno(), select.POLLIN)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        exchange = self._exchange
        if exchange is None:
            self.close()  # an idle connection must stay silent: whatever this is, drop it
        else:
            exchange.feed(self._buffer[:nbytes])

    def eof_received(self) -> bool | None:
        return None  # half-closed by the server: close our side too, connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._mark_closed()
        exchange, self._exchange = self._exchange, None
        if exchange is not None:
            exchange.lost(exc)
        self._wake_writer()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_writer()

    def start(self, request: httpx.Request, limits: ExchangeLimits, keep_alive: bool) -> Exchange:
        """Attach a new exchange; the caller writes the request next."""
        if self.reused and not self.is_closed and self._unread():
            self.close()
        if self.is_closed:
            raise StaleConnection
        exchange = Exchange(self, request, limits, keep_alive)
        self._exchange = exchange
        return exchange

    def _unread(self) -> bool:
        """Whether the socket holds bytes the loop has not read yet. On a connection between
        exchanges they are an answer nobody asked for (a backend's late duplicate, say) or the
        server's close: the loop would have dropped the connection on reading them, but a
        request taking it first would get them as its own answer. A poll, as httpcore's
        `has_expired` does; what comes after it is the next request's answer for any client."""
        poll = self._poll
        return poll is not None and bool(poll.poll(0))

    def write(self, data: bytes) -> None:
        if self._transport is not None and not self.is_closed:
            self._transport.write(data)

    async def drain(self, timeout_s: float | None, request: httpx.Request) -> None:
        """Wait while the socket's write buffer is over its high-water mark."""
        if not self._write_paused or self.is_closed:
            return
        self._drained = self.loop.create_future()
        try:
            async with asyncio.timeout(timeout_s):
                await self._drained
        except TimeoutError:
            raise httpx.WriteTimeout("timed out sending the request", request=request) from None
        finally:
            self._drained = None

    def set_reading(self, paused: bool) -> None:
        if self._transport is not None and paused != self._read_paused:
            self._read_paused = paused
            if paused:
                self._transport.pause_reading()
            else:
                self._transport.resume_reading()

    def detach(self, exchange: Exchange, reusable: bool) -> None:
        """The exchange is over: back to the pool if `reusable`, else closed at once."""
        if self._exchange is not exchange:
            return
        self._exchange = None
        if reusable and not self.is_closed:
            self.set_reading(False)
            self._owner.release(self)
        else:
            self.close()

    def close(self) -> None:
        """Drop the connection now (no flush, no wait): the server sees the disconnect at once."""
        exchange, self._exchange = self._exchange, None
        if self._transport is not None and not self.is_closed:
            self._transport.abort()
        self._mark_closed()
        if exchange is not None:  # the pool is closing: this is no end of a close-delimited body
            exchange.lost(ConnectionAbortedError("the transport was closed"))

    def _mark_closed(self) -> None:
        if not self.is_closed:
            self.is_closed = True
            if self._transport is not None:
                self._owner.closed(self)

    def _wake_writer(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
