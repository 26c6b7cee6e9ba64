"""One request's exchange on a backend connection: the response parsed by httptools (its
callbacks fill the Exchange) and handed to httpx as a byte stream that yields chunks as they
arrive, under the exchange's deadlines and head limits; or, while its reader waits, handed to a
sink in the connection's own callback (`relay_to`)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Final, Protocol

import httptools
import httpx

from proxy.upstream.deadline import Expiry, FirstByteTimeout, ReadDeadline, TotalTimeout
from proxy.upstream.tls import TlsBroken, tls_reason

__all__ = [
    "STALE_RESEND",
    "Exchange",
    "ExchangeLimits",
    "ResponseHeadTooLarge",
    "Sink",
    "StaleConnection",
]

# A consumer slower than the backend (a client that stops reading its stream): stop reading the
# socket above this many buffered bytes (a read or two), so the backend waits, not the gateway's
# memory (a MiB held a stream: a thousand stalled clients took gigabytes).
PAUSE_READING_BYTES: Final = 64 * 1024


@dataclass(slots=True)
class ExchangeLimits:
    """What one exchange may take: its timeouts (seconds, None for none) and the response head's
    size and header count."""

    read_s: float | None
    first_byte_s: float | None
    total_s: float | None
    max_head_bytes: int
    max_headers: int


Sink = Callable[[bytes], bool]
"""Takes a read's body bytes, and says True, or leaves them to the reader (False, having done
nothing). An exception it raises fails the exchange: the reader gets it."""


class ResponseHeadTooLarge(httpx.RemoteProtocolError):
    """The response head passed its byte or header-count cap."""


class Carrier(Protocol):
    """What an exchange needs of its connection (proxy/upstream/connection.py)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def reused(self) -> bool: ...

    def set_reading(self, paused: bool) -> None: ...

    def detach(self, exchange: Exchange, reusable: bool) -> None: ...


class StaleConnection(Exception):
    """A reused keep-alive connection was closed by the server before any response byte."""


STALE_RESEND: Final = "tokenweir.stale_connection.resend"
"""The `trace` event of a request written to a stale connection, about to be sent again on a
new one: the backend did not take it, whatever `send_request_body.complete` said before."""


_SPENT: Final = httptools.HttpResponseParser(object())
"""The parser of every exchange that is over: it has no callbacks, and nothing feeds it."""


class _ExtraResponse(Exception):
    """Stops the parser when bytes follow a complete response."""


class _BadStatus(Exception):
    """Stops the parser at a status below 100: httptools takes any three digits, and would
    take a 0xx answer as interim, its body joining the next answer's."""


class Exchange(httpx.AsyncByteStream):
    """One request's response: the httptools callbacks fill it, httpx iterates it."""

    def __init__(
        self,
        connection: Carrier,
        request: httpx.Request,
        limits: ExchangeLimits,
        keep_alive: bool,
    ) -> None:
        self.request = request
        self.status_code = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.http_version = b"HTTP/1.1"
        self.writing = True
        self._conn = connection
        self._loop = connection.loop
        self._parser = httptools.HttpResponseParser(self)
        self._head_only = request.method == "HEAD"
        self._keep_alive = keep_alive
        self._interim = False
        self._done = False
        self._got_bytes = False
        self._error: Exception | None = None
        self._chunks: list[bytes] = []
        self._chunks_came = False  # a body chunk has come (the deadline was told, once)
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._sink: Sink | None = None
        self._limits = limits
        self._head_bytes = 0
        self._deadline = ReadDeadline(
            self._loop, limits.read_s, limits.first_byte_s, self._timed_out, limits.total_s
        )

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self._done:
            raise _ExtraResponse
        self.headers = []
        self.reason = b""

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            if status < 100:
                raise _BadStatus(f"status {status:03d}")
            self._interim = True  # 1xx: the real response follows
            return
        self.status_code = status
        if self._parser.get_http_version() == "1.0":
            self.http_version = b"HTTP/1.0"
        self.headers_done = True
        if self._head_only:
            self._keep_alive = self._keep_alive and self._parser.should_keep_alive()
            self._done = True

    def on_body(self, body: bytes) -> None:
        if not self._chunks_came:  # the first: the first-byte deadline has passed its test
            self._chunks_came = True
            self._deadline.answered()
        self._chunks.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._keep_alive = self._keep_alive and self._parser.should_keep_alive()
        self._done = True
        self._deadline.answered()

    # fed by the connection

    def feed(self, data: memoryview) -> None:
        self._got_bytes = True
        in_head = not self.headers_done
        buffered = self._buffered
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if not self._done:
                reason = exc.__context__ if isinstance(exc.__context__, _BadStatus) else exc
                self._fail(
                    httpx.RemoteProtocolError(f"malformed response: {reason}", request=self.request)
                )
                return
            self._keep_alive = False  # garbage after a complete response
        except httptools.HttpParserUpgrade:
            self._fail(
                httpx.RemoteProtocolError("unexpected protocol upgrade", request=self.request)
            )
            return
        if self._buffered == buffered:  # no byte of the body: the head, chunk framing, trailers
            if self._past_caps(len(data), in_head):
                return
        else:
            if in_head and self._past_caps(0, in_head):  # the header count
                return
            self._head_bytes = 0
        waiter, sink = self._waiter, self._sink
        if self._done:
            self._finish()
        elif sink is not None and waiter is not None and not waiter.done() and self._sunk(sink):
            return
        elif self._buffered > PAUSE_READING_BYTES and not self._paused:
            self._paused = True
            self._conn.set_reading(True)
        self._wake()

    def relay_to(self, sink: Sink) -> None:
        """From now on, a read that comes while the reader waits (so it holds nothing older) goes
        to `sink` first; the reader wakes only for what the sink leaves, the end, or an error.
        The read deadline moves on with each read the sink takes, as with each the reader takes.
        A reader that stopped reading (done, failed, cancelled) waits no more: the sink is done
        with it too."""
        self._sink = sink

    def _sunk(self, sink: Sink) -> bool:
        chunks = self._chunks
        if not chunks:
            return False
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        try:
            taken = sink(data)
        except Exception as exc:  # the reader's to handle, as if raised where it reads
            self._fail(exc)
            return True
        if taken:
            chunks.clear()
            self._buffered = 0
            self._deadline.waiting()
        return taken

    def _past_caps(self, nbytes: int, in_head: bool) -> bool:
        """Past the caps on what is not body (checked after each read, so httptools holds at
        most one read more than a cap): the count of headers, trailers included, and the bytes
        of reads in a row that bring no byte of the body, `nbytes` more: the head, or after it
        chunk-size lines, their extensions and the trailers, which httptools takes without end
        (the trailers kept, in `headers`). Past one, fail the exchange: the connection drops."""
        limits = self._limits
        self._head_bytes += nbytes
        if len(self.headers) > limits.max_headers:
            what = f"more than {limits.max_headers} headers"
        elif self._head_bytes <= limits.max_head_bytes:
            return False
        elif in_head:
            what = f"a head of more than {limits.max_head_bytes} bytes"
        else:
            what = f"more than {limits.max_head_bytes} bytes of chunk framing or trailers"
        self._fail(ResponseHeadTooLarge(f"the backend sent {what}", request=self.request))
        return True

    def lost(self, exc: Exception | None) -> None:
        """The connection closed under this exchange."""
        if self._done or self._error is not None:
            return
        self._deadline.cancel()
        self._let_go()
        if self.headers_done and exc is None and _delimited_by_close(self):
            self._done = True
        else:
            self._error = self._lost_error(exc)
        self._wake()

    def sent(self) -> None:
        """The request is fully written."""
        self.writing = False
        self._deadline.sent()

    def _lost_error(self, exc: Exception | None) -> Exception:
        request = self.request
        if isinstance(exc, ssl.SSLError):  # a TLS record that could not be read, an alert
            return TlsBroken(tls_reason(exc) or "TLS failed", request=request)
        if self.headers_done:
            if exc is None:
                message = "peer closed connection without sending complete message body"
                return httpx.RemoteProtocolError(message, request=request)
            return httpx.ReadError(str(exc) or type(exc).__name__, request=request)
        if not self._got_bytes and self._conn.reused:
            return StaleConnection()
        if exc is None:
            message = "server disconnected without sending a response"
            return httpx.RemoteProtocolError(message, request=request)
        if self.writing:
            return httpx.WriteError(str(exc) or type(exc).__name__, request=request)
        return httpx.ReadError(str(exc) or type(exc).__name__, request=request)

    # read by the transport and by httpx

    async def wait_headers(self) -> None:
        while True:
            if self._error is not None:  # before headers_done: a head over its caps is void
                raise self._error
            if self.headers_done:
                return
            await self._wait()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                if self._paused:
                    self._paused = False
                    self._conn.set_reading(False)
                return data
            if self._done:
                raise StopAsyncIteration
            if self._error is not None:
                raise self._error
            await self._wait()

    async def aclose(self) -> None:
        self.abort()

    def abort(self) -> None:
        """Give up on the response; unless it already completed, the connection is dropped."""
        if not self._done:
            self._fail(httpx.ReadError("the response was closed early", request=self.request))

    def _finish(self) -> None:
        self._deadline.cancel()
        if self._head_only:
            self._chunks.clear()
        self._conn.detach(self, self._keep_alive and not self.writing)
        self._let_go()

    def _fail(self, error: Exception) -> None:
        if self._error is None:
            self._error = error
        self._deadline.cancel()
        self._conn.detach(self, reusable=False)
        self._let_go()
        self._wake()

    def _let_go(self) -> None:
        """The exchange is over and detached (its connection feeds it no more): drop the parser,
        whose callbacks are this exchange's bound methods (the deadline dropped its own when
        cancelled). Otherwise every exchange is a cycle that only the garbage collector frees,
        with its request, headers and parser."""
        self._parser = _SPENT

    async def _wait(self) -> None:
        """Sleep until the connection delivers something; at most the read deadline."""
        waiter = self._loop.create_future()
        self._waiter = waiter
        self._deadline.waiting()
        try:
            await waiter
        finally:
            self._waiter = None

    def _timed_out(self, kind: Expiry) -> None:
        request = self.request
        if kind == "first_byte":
            message = f"no byte of the answer within {self._limits.first_byte_s:g} s"
            self._fail(FirstByteTimeout(message, request=request))
        elif kind == "total":
            message = f"the answer did not end within {self._limits.total_s:g} s"
            self._fail(TotalTimeout(message, request=request))
        elif self._waiter is not None and not self._waiter.done():
            self._fail(httpx.ReadTimeout("timed out waiting for the backend", request=request))
        # else nobody is waiting (the reader is busy): its next wait starts a new idle deadline

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _delimited_by_close(exchange: Exchange) -> bool:
    """True if the response has no length framing, so the end of the connection ends it."""
    if exchange.status_code in (204, 304):
        return False
    for name, value in exchange.headers:
        lowered = name.lower()
        if lowered == b"content-length":
            return False
        if lowered == b"transfer-encoding" and b"chunked" in value.lower():
            return False
    return True
