"""The default bench transport: HTTP/1.1 keep-alive connections on asyncio, parsed by httptools.

Each read goes from `data_received` straight into the sink: no task switch per SSE event.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from time import perf_counter
from typing import cast
from urllib.parse import urlsplit

import httptools

from proxy.tools.bench.transport import ResponseSink, TransportFailure

__all__ = ["MAX_HEAD_BYTES", "WireTransport"]

_CLOSE_WAIT_S = 2.0
# A response's status line and headers may take this many bytes (the gateway's own default
# upstream cap): the parser holds an unfinished header whole, so an endless one grew without end.
MAX_HEAD_BYTES = 64 * 1024


class _Connection(asyncio.Protocol):
    """One socket; carries one exchange at a time and reports its end through a future."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._sink: ResponseSink | None = None
        self._done: asyncio.Future[bool] | None = None
        self._now_s = 0.0
        self._body_until_eof = False
        self._headers_done = False
        self._interim = False
        self._head_bytes = 0
        self.lost: asyncio.Future[None] = loop.create_future()
        self.received = False

    @property
    def closed(self) -> bool:
        return self.lost.done()

    def send(self, request: bytes, sink: ResponseSink) -> asyncio.Future[bool]:
        """Write one request; the future gives keep-alive when its response is complete."""
        if self._transport is None or self._done is not None:
            raise TransportFailure("connection", "connection not ready for a request")
        self._sink, self._done = sink, self._loop.create_future()
        self._body_until_eof, self._headers_done, self.received = True, False, False
        self._interim, self._head_bytes = False, 0
        self._transport.write(request)
        return self._done

    def close(self) -> None:
        self._sink, self._done = None, None
        if self._transport is not None:
            self._transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._sink is None:  # bytes outside any exchange: the stream is out of step
            self.close()
            return
        self.received = True
        self._now_s = perf_counter()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"bad HTTP response: {exc}")
            self.close()
            return
        if not self._headers_done:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._fail(f"bad HTTP response: a head of more than {MAX_HEAD_BYTES:,} bytes")
                self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._sink is not None and self._body_until_eof and self._headers_done:
            self._finish(keep_alive=False)
        else:
            self._fail(f"connection closed: {exc}" if exc else "connection closed by the server")
        if not self.lost.done():
            self.lost.set_result(None)

    # httptools parser callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self._body_until_eof = False

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # interim (100 Continue, 103 Early Hints)
            self._interim, self._body_until_eof = True, True
            return
        self._headers_done = True
        if self._sink is not None:
            self._sink.on_status(status)

    def on_body(self, body: bytes) -> None:
        if self._sink is not None:
            self._sink.on_body(body, self._now_s)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._finish(keep_alive=self._parser.should_keep_alive())

    def _finish(self, *, keep_alive: bool) -> None:
        done, self._sink, self._done = self._done, None, None
        if done is not None and not done.done():
            done.set_result(keep_alive)

    def _fail(self, detail: str) -> None:
        done, self._sink, self._done = self._done, None, None
        if done is not None and not done.done():
            done.set_exception(TransportFailure("connection", detail))


class WireTransport:
    """Posts to one URL over reused HTTP/1.1 connections, one connection per request in flight."""

    __slots__ = ("_all", "_head", "_host", "_idle", "_port", "_server_hostname", "_ssl")

    def __init__(self, url: str, *, api_key: str | None) -> None:
        parts = urlsplit(url)
        if parts.hostname is None:
            raise ValueError(f"no host in {url!r}")
        https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if https else 80)
        self._ssl = ssl.create_default_context() if https else None
        self._server_hostname = parts.hostname if https else None
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [
            f"POST {target} HTTP/1.1",
            f"Host: {parts.netloc.rpartition('@')[2]}",
            "User-Agent: tokenweir-bench",
            "Accept: text/event-stream, application/json",
            "Accept-Encoding: identity",
            "Content-Type: application/json",
        ]
        if api_key:
            lines.append(f"Authorization: Bearer {api_key}")
        self._head = ("\r\n".join(lines) + "\r\nContent-Length: ").encode("latin-1")
        self._idle: list[_Connection] = []
        self._all: set[_Connection] = set()

    async def exchange(self, body: bytes, sink: ResponseSink) -> None:
        request = b"%b%d\r\n\r\n%b" % (self._head, len(body), body)
        for fresh in (False, True):
            connection, reused = await self._acquire(fresh=fresh)
            try:
                keep_alive = await connection.send(request, sink)
            except TransportFailure:
                connection.close()
                # A kept-alive socket the server closed while idle: retry once on a new one.
                if reused and not connection.received:
                    continue
                raise
            except BaseException:
                connection.close()
                raise
            if keep_alive and not connection.closed:
                self._idle.append(connection)
            else:
                connection.close()
            return

    async def _acquire(self, *, fresh: bool) -> tuple[_Connection, bool]:
        while self._idle and not fresh:
            connection = self._idle.pop()
            if not connection.closed:
                return connection, True
        loop = asyncio.get_running_loop()
        try:
            _, connection = await loop.create_connection(
                lambda: _Connection(loop),
                self._host,
                self._port,
                ssl=self._ssl,
                server_hostname=self._server_hostname,
            )
        except OSError as exc:
            raise TransportFailure("connection", f"{type(exc).__name__}: {exc}") from None
        self._all = {known for known in self._all if not known.closed}
        self._all.add(connection)
        return connection, False

    async def aclose(self) -> None:
        """Close every connection and wait until their sockets are released."""
        self._idle.clear()
        for connection in self._all:
            connection.close()
        lost = [connection.lost for connection in self._all]
        self._all = set()
        if lost:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*lost), _CLOSE_WAIT_S)
