"""https backends: httpx's own transport (httpcore, h11), held to what the pooled transport holds
plain-http backends to: the first-byte and total deadlines, the caps on the response head, and
errors the gateway knows (httpcore lets an `ssl.SSLError` of a bad record through as it is)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final

import httpx

from proxy.upstream.deadline import DelegatedDeadlines
from proxy.upstream.exchange import ResponseHeadTooLarge
from proxy.upstream.tls import TlsBroken, backend_ssl_context, causes, tls_reason

__all__ = ["DelegatedStream", "DelegatedTransport"]

# What h11 holds of one incomplete event (a head, a chunk-size line, the trailers) before it
# fails with its "Receive buffer too long" (httpcore's MAX_INCOMPLETE_EVENT_SIZE).
_H11_BUFFER_BYTES: Final = 100 * 1024
_H11_TOO_LONG: Final = 431  # the `error_status_hint` of that error, and of no other


class DelegatedTransport:
    """Sends https requests on httpx's transport, built on the first (an SSL context costs
    milliseconds); its pool has the pooled transport's limits, apart from it."""

    def __init__(self, limits: httpx.Limits, max_head_bytes: int, max_headers: int) -> None:
        self._limits = limits
        self._max_head_bytes = max_head_bytes
        self._max_headers = max_headers
        self._transport: httpx.AsyncHTTPTransport | None = None

    async def handle(
        self, request: httpx.Request, timeouts: Mapping[str, Any], first_byte_s: float | None
    ) -> httpx.Response:
        if self._transport is None:
            self._transport = httpx.AsyncHTTPTransport(
                verify=backend_ssl_context(), limits=self._limits
            )
        request.extensions.setdefault("timeout", dict(timeouts))
        now_s = asyncio.get_running_loop().time()
        total_s = timeouts.get("total")
        deadlines = DelegatedDeadlines(
            None if first_byte_s is None else now_s + first_byte_s,
            None if total_s is None else now_s + total_s,
            first_byte_s,
            total_s,
            request,
        )
        try:
            async with deadlines.first_byte():
                response = await self._transport.handle_async_request(request)
        except (ssl.SSLError, httpx.RemoteProtocolError) as exc:
            known = _known(exc, request, self._head_limit(), in_head=True)
            if known is None:
                raise
            raise known from exc
        stream = DelegatedStream(response.stream, deadlines, self._head_limit())
        response.stream = stream
        too_large = self._head_too_large(response)
        if too_large is not None:
            await stream.aclose()  # unread: the connection is dropped, as the pooled one drops it
            raise ResponseHeadTooLarge(f"the backend sent {too_large}", request=request)
        return response

    async def aclose(self) -> None:
        if self._transport is not None:
            await self._transport.aclose()

    def _head_limit(self) -> int:
        return min(self._max_head_bytes, _H11_BUFFER_BYTES)

    def _head_too_large(self, response: httpx.Response) -> str | None:
        """The caps the pooled transport checks as the head comes, checked once it came (h11
        took at most its buffer's 100 KiB of it). O(headers): ~1 µs a request."""
        raw = response.headers.raw
        if len(raw) > self._max_headers:
            return f"more than {self._max_headers} headers"
        head_bytes = 17 + len(response.extensions.get("reason_phrase", b""))  # the status line
        for name, value in raw:
            head_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if head_bytes > self._max_head_bytes:
            return f"a head of more than {self._max_head_bytes} bytes"
        return None


class DelegatedStream(httpx.AsyncByteStream):
    """httpx's own response stream, whose first chunk must come by the first-byte deadline and
    whose end must come by the total one; its errors made ones the gateway knows."""

    def __init__(self, inner: object, deadlines: DelegatedDeadlines, head_limit: int) -> None:
        if not isinstance(inner, httpx.AsyncByteStream):
            raise TypeError("an async transport answers with an async byte stream")
        self._inner = inner
        self._deadlines = deadlines
        self._head_limit = head_limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        chunks = aiter(self._inner)
        try:
            async with self._deadlines.first_byte():
                first = await anext(chunks, b"")
            if not first:
                return
            yield first
            while True:
                async with self._deadlines.total():
                    chunk = await anext(chunks, b"")
                if not chunk:
                    return
                yield chunk
        except (ssl.SSLError, httpx.RemoteProtocolError) as exc:
            known = _known(exc, self._deadlines.request, self._head_limit, in_head=False)
            if known is None:
                raise
            raise known from exc

    async def aclose(self) -> None:
        await self._inner.aclose()


def _known(
    exc: ssl.SSLError | httpx.RemoteProtocolError,
    request: httpx.Request,
    head_limit: int,
    *,
    in_head: bool,
) -> httpx.HTTPError | None:
    """`exc` as the pooled transport would have raised it: a broken TLS record a `TlsBroken`, h11's
    full buffer (an endless head, chunk-size line or trailers) a `ResponseHeadTooLarge`; None if
    it is one already (raised again as it is: `raise exc from exc` would make its cause itself,
    and a walk along the causes endless)."""
    if isinstance(exc, ssl.SSLError):
        return TlsBroken(tls_reason(exc) or "TLS failed", request=request)
    for cause in causes(exc):
        if getattr(cause, "error_status_hint", None) == _H11_TOO_LONG:
            what = "a head of more than" if in_head else "more than"
            after = "" if in_head else " of chunk framing or trailers"
            message = f"the backend sent {what} {head_limit} bytes{after}"
            return ResponseHeadTooLarge(message, request=request)
    return None
