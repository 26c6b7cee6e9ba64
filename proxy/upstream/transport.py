"""`PooledTransport`: an httpx transport for HTTP/1.1 backends, over TCP or TLS (https), with an
O(1) connection pool (LIFO idle connections per origin, one global connection limit)."""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Mapping
from typing import Any, Final

import httpx

from proxy.upstream.connection import Connection, Origin
from proxy.upstream.exchange import STALE_RESEND, ExchangeLimits, StaleConnection
from proxy.upstream.prebuilt import response_of
from proxy.upstream.tls import backend_ssl_context

__all__ = ["PooledTransport"]

_DEFAULT_PORTS: Final = {"http": 80, "https": 443}
# One read from a socket; the buffer is shared by all of a pool's connections.
_READ_BUFFER_BYTES: Final = 64 * 1024
# Bodies smaller than this are copied into the same write as the head (one send, one segment).
_COALESCE_BYTES: Final = 256 * 1024

_Waiter = tuple[Origin, "asyncio.Future[Connection | None]"]


class _Pool:
    """Open connections, at most `max_connections`; idle ones per origin, newest reused first."""

    def __init__(self, max_connections: int, keepalive_expiry_s: float) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self._max = max_connections
        self._expiry_s = keepalive_expiry_s
        self._open = 0  # connecting, busy and idle: each holds one slot
        self._idle: dict[Origin, dict[Connection, None]] = {}
        self._waiters: deque[_Waiter] = deque()
        self._connections: set[Connection] = set()
        self._closed = False
        self._read_buffer = memoryview(bytearray(_READ_BUFFER_BYTES))
        self._tls: ssl.SSLContext | None = None  # built on the first https connection (~ms)

    async def acquire(
        self, origin: Origin, timeouts: Mapping[str, float | None], request: httpx.Request
    ) -> Connection:
        """An idle connection to `origin`, or a new one once a slot is free."""
        connection = self._pop_idle(origin)
        if connection is not None:
            return connection
        return await self.acquire_new(origin, timeouts, request)

    async def acquire_new(
        self, origin: Origin, timeouts: Mapping[str, float | None], request: httpx.Request
    ) -> Connection:
        if self._closed:
            raise RuntimeError("the transport is closed")
        if self._open >= self._max:
            self._evict_idle()
        if self._open < self._max:
            self._open += 1
        else:
            handed = await self._wait(origin, timeouts.get("pool"), request)
            if handed is not None:
                return handed
        return await self._connect(origin, timeouts.get("connect"), request)

    def release(self, connection: Connection) -> None:
        waiter = self._first_waiter()
        if waiter is not None and waiter[0] == connection.origin:
            self._waiters.popleft()
            connection.reused = True
            waiter[1].set_result(connection)
        elif waiter is not None or self._closed:
            connection.close()  # its slot goes to the waiter, which wants another origin
        else:
            connection.reused = True
            connection.idle_since_s = connection.loop.time()
            idle = self._idle.setdefault(connection.origin, {})
            idle[connection] = None
            oldest = next(iter(idle))
            if connection.idle_since_s - oldest.idle_since_s >= self._expiry_s:
                oldest.close()

    def closed(self, connection: Connection) -> None:
        self._connections.discard(connection)
        idle = self._idle.get(connection.origin)
        if idle:
            idle.pop(connection, None)
        self._free_slot()

    def close(self) -> None:
        self._closed = True
        for connection in list(self._connections):
            connection.close()

    def _pop_idle(self, origin: Origin) -> Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        connection, _ = idle.popitem()
        if connection.loop.time() - connection.idle_since_s < self._expiry_s:
            return connection
        # The newest idle connection expired, so every older one did too.
        connection.close()
        for stale in list(idle):
            stale.close()
        return None

    def _evict_idle(self) -> None:
        """Close the oldest idle connection of any origin, freeing its slot."""
        for idle in self._idle.values():
            if idle:
                next(iter(idle)).close()
                return

    def _first_waiter(self) -> _Waiter | None:
        waiters = self._waiters
        while waiters and waiters[0][1].done():
            waiters.popleft()  # timed out or cancelled
        return waiters[0] if waiters else None

    def _free_slot(self) -> None:
        waiter = self._first_waiter()
        if waiter is None:
            self._open -= 1
        else:
            self._waiters.popleft()
            waiter[1].set_result(None)

    async def _wait(
        self, origin: Origin, timeout_s: float | None, request: httpx.Request
    ) -> Connection | None:
        """Queue for a slot: resolves to a handed-over idle connection or None (connect anew)."""
        handed: asyncio.Future[Connection | None] = asyncio.get_running_loop().create_future()
        self._waiters.append((origin, handed))
        try:
            async with asyncio.timeout(timeout_s):
                return await handed
        except BaseException as exc:
            if handed.done() and not handed.cancelled():
                self._give_back(handed.result())
            else:
                handed.cancel()
            if isinstance(exc, TimeoutError):
                message = f"no connection became free within {timeout_s} s"
                raise httpx.PoolTimeout(message, request=request) from None
            raise

    def _give_back(self, handed: Connection | None) -> None:
        if handed is None:
            self._free_slot()
        else:
            self.release(handed)

    async def _connect(
        self, origin: Origin, timeout_s: float | None, request: httpx.Request
    ) -> Connection:
        """Open a connection on a slot already counted in `_open`."""
        loop = asyncio.get_running_loop()
        connection = Connection(self, origin, loop, self._read_buffer)
        try:
            if self._closed:
                raise RuntimeError("the transport is closed")
            host, port, tls = origin
            if tls and self._tls is None:
                self._tls = backend_ssl_context()
                self._tls.set_alpn_protocols(["http/1.1"])  # as httpx offered: no h2 chosen
            async with asyncio.timeout(timeout_s):
                await loop.create_connection(
                    lambda: connection,
                    host,
                    port,
                    ssl=self._tls if tls else None,
                    server_hostname=host if tls else None,
                )
        except BaseException as exc:
            if connection.connected:
                connection.close()
            else:
                self._free_slot()
            if isinstance(exc, TimeoutError):
                message = f"no connection to {origin[0]}:{origin[1]} within {timeout_s} s"
                raise httpx.ConnectTimeout(message, request=request) from exc
            if isinstance(exc, OSError):
                raise httpx.ConnectError(str(exc), request=request) from exc
            raise
        self._connections.add(connection)
        return connection


class PooledTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 to backends on asyncio + httptools, over TLS for https (certificates checked
    as `proxy.upstream.tls` says).

    Timeouts come from each request's ``timeout`` extension, which `httpx.AsyncClient` always
    sets (its own `timeout=`, default 5 s); the constructor's apply to requests without one.
    Besides httpx's four keys it may hold ``first_byte``: the longest wait, from sending the
    request, for the first byte of the answer's body (see `proxy.upstream.deadline`).
    Request bodies given as an async stream are sent as they come (chunked if the request says
    so) but are not replayed: only `bytes` bodies are retried after a keep-alive race.
    """

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        write_timeout_s: float,
        pool_timeout_s: float,
        max_connections: int,
        keepalive_expiry_s: float = 30.0,
        first_byte_timeout_s: float | None = None,
        total_timeout_s: float | None = None,
        max_head_bytes: int = 64 * 1024,
        max_headers: int = 256,
    ) -> None:
        self._timeouts: dict[str, float | None] = {
            "connect": connect_timeout_s,
            "read": read_timeout_s,
            "write": write_timeout_s,
            "pool": pool_timeout_s,
            "first_byte": first_byte_timeout_s,
            "total": total_timeout_s,
        }
        self._max_head_bytes = max_head_bytes
        self._max_headers = max_headers
        self._pool = _Pool(max_connections, keepalive_expiry_s)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        timeouts: Mapping[str, Any] = request.extensions.get("timeout") or self._timeouts
        default_port = _DEFAULT_PORTS.get(url.scheme)
        if default_port is None:
            message = f"unsupported URL scheme {url.scheme!r}"
            raise httpx.UnsupportedProtocol(message, request=request)
        origin = (url.host, url.port or default_port, default_port == 443)
        head, body, keep_alive = _encode_head(request)
        limits = ExchangeLimits(
            timeouts.get("read"),
            _first_byte_s(timeouts),
            timeouts.get("total"),
            self._max_head_bytes,
            self._max_headers,
        )
        connection = await self._pool.acquire(origin, timeouts, request)
        try:
            return await _exchange(connection, request, head, body, keep_alive, limits, timeouts)
        except StaleConnection:
            if body is None:
                message = (
                    "the server closed the keep-alive connection; a streamed body is not resent"
                )
                raise httpx.RemoteProtocolError(message, request=request) from None
        # The server closed the reused connection before reading anything: safe to send again.
        # It did not take the request: not sent (`trace`) until the new connection has it.
        trace = request.extensions.get("trace")
        if trace is not None:
            await trace(STALE_RESEND, {"request": request})
        connection = await self._pool.acquire_new(origin, timeouts, request)
        try:
            return await _exchange(connection, request, head, body, keep_alive, limits, timeouts)
        except StaleConnection:  # only a reused connection can be stale; kept for completeness
            message = "server disconnected without sending a response"
            raise httpx.RemoteProtocolError(message, request=request) from None

    async def aclose(self) -> None:
        self._pool.close()
        await asyncio.sleep(0)  # let the aborted sockets' connection_lost callbacks run


def _first_byte_s(timeouts: Mapping[str, float | None]) -> float | None:
    """The first-byte deadline: `first_byte` if set, else the read timeout, counted from the
    request (so a head trickled a byte at a time cannot stretch it)."""
    first_byte_s = timeouts.get("first_byte")
    return timeouts.get("read") if first_byte_s is None else first_byte_s


async def _exchange(
    connection: Connection,
    request: httpx.Request,
    head: bytes,
    body: bytes | None,
    keep_alive: bool,
    limits: ExchangeLimits,
    timeouts: Mapping[str, float | None],
) -> httpx.Response:
    exchange = connection.start(request, limits, keep_alive)
    try:
        await _send(connection, request, head, body, timeouts.get("write"))
        exchange.sent()
        trace = request.extensions.get("trace")
        if trace is not None:  # the one event of httpcore's `trace` extension reported here
            await trace("http11.send_request_body.complete", {"request": request})
        await exchange.wait_headers()
    except BaseException:
        exchange.abort()  # cancelled or failed mid-exchange: nobody else will close it
        raise
    extensions = {"http_version": exchange.http_version, "reason_phrase": exchange.reason}
    return response_of(exchange.status_code, exchange.headers, exchange, extensions)


async def _send(
    connection: Connection,
    request: httpx.Request,
    head: bytes,
    body: bytes | None,
    timeout_s: float | None,
) -> None:
    if body is not None:
        if len(body) < _COALESCE_BYTES:
            connection.write(head + body)
        else:
            connection.write(head)
            connection.write(body)
        await connection.drain(timeout_s, request)
        return
    stream = request.stream
    if not isinstance(stream, httpx.AsyncByteStream):
        raise TypeError("PooledTransport needs an async request body stream")
    chunked = "chunked" in request.headers.get("transfer-encoding", "").lower()
    connection.write(head)
    async for chunk in stream:
        if chunk:
            connection.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
            await connection.drain(timeout_s, request)
    if chunked:
        connection.write(b"0\r\n\r\n")
    await connection.drain(timeout_s, request)


def _encode_head(request: httpx.Request) -> tuple[bytes, bytes | None, bool]:
    """The request line and headers; the body if it is in memory; whether keep-alive is allowed."""
    raw = request.headers.raw
    parts = [request.method.encode("ascii"), b" ", request.url.raw_path, b" HTTP/1.1\r\n"]
    keep_alive = True
    for name, value in raw:
        parts += (name, b": ", value, b"\r\n")
        if len(name) == 10 and name.lower() == b"connection":
            keep_alive = value.lower() != b"close"
    parts.append(b"\r\n")
    head = b"".join(parts)
    lines = len(raw) + 2
    if head.count(b"\n") != lines or head.count(b"\r") != lines:
        raise httpx.LocalProtocolError("line break in a request header", request=request)
    try:
        body: bytes | None = request.content
    except httpx.RequestNotRead:
        body = None
    return head, body, keep_alive
