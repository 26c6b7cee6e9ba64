"""The shared client to backends: httpx over our pooled transport; httpx errors translated here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from types import TracebackType
from typing import Any, Protocol, TypeAlias

import httpx
import orjson

from proxy.context import Admitted
from proxy.errors import (
    GatewayError,
    UpstreamBadResponse,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.policy.model import Backend, UpstreamSpec
from proxy.upstream.deadline import FirstByteTimeout, TotalTimeout
from proxy.upstream.exactints import as_written
from proxy.upstream.exchange import ResponseHeadTooLarge
from proxy.upstream.prebuilt import declared_length, post_request
from proxy.upstream.rejection import UpstreamRejected, status_error
from proxy.upstream.tls import TlsBroken, tls_reason
from proxy.upstream.transport import PooledTransport

__all__ = [
    "CONNECT_TIMEOUT_CODE",
    "POOL_BUSY",
    "ConnectionsBusy",
    "UpstreamClient",
    "UpstreamOpener",
    "UpstreamRejected",
    "close",
    "raw_reads",
    "read_capped",
    "translate",
]

CONNECT_TIMEOUT_CODE = "upstream_connect_timeout"
# What a probe that found no free connection in the gateway's own pool says: the backend was
# not asked, so the probe learned nothing of it.
POOL_BUSY = "no free connection in the gateway's pool (upstream.max_connections)"

_MAX_ERROR_BODY_BYTES = 64 * 1024
_MAX_PROBE_BODY_BYTES = 1024 * 1024  # a /models list of thousands of models
_MAX_TARGETS = 256

_Target: TypeAlias = tuple[httpx.URL, list[tuple[bytes, bytes]]]


class ConnectionsBusy(UpstreamUnavailable):
    """No connection of the gateway's own pool (`upstream.max_connections`, shared by every
    backend) came free in time: the gateway is full, not the backend, which heard nothing."""


class UpstreamOpener(Protocol):
    """What Forward calls to start the upstream call: `Attempts` (proxy/routing/attempts.py),
    which open it on the request's backend and fail over to another before the first byte."""

    async def open(
        self, ctx: Admitted, body: dict[str, Any], extra_headers: Mapping[str, str] = {}
    ) -> tuple[Backend, httpx.Response]: ...


class UpstreamClient:
    """Sends one request to one backend and hands back the streaming response."""

    def __init__(self, spec: UpstreamSpec, transport: httpx.AsyncBaseTransport | None = None):
        timeout = httpx.Timeout(
            connect=spec.connect_timeout,
            read=spec.read_timeout,
            write=spec.read_timeout,
            pool=spec.pool_timeout,
        )
        if transport is None:
            transport = PooledTransport(
                connect_timeout_s=spec.connect_timeout,
                read_timeout_s=spec.read_timeout,
                write_timeout_s=spec.read_timeout,
                pool_timeout_s=spec.pool_timeout,
                max_connections=spec.max_connections,
                first_byte_timeout_s=spec.first_byte_timeout,
                total_timeout_s=spec.total_timeout,
                max_head_bytes=spec.max_header_bytes,
                max_headers=spec.max_headers,
            )
        self._transport = transport
        self._timeout: dict[str, float | None] = timeout.as_dict()
        self._timeout["first_byte"] = spec.first_byte_timeout
        self._timeout["total"] = spec.total_timeout
        # A backend's own first_byte_timeout: its requests carry a timeout dict of their own,
        # one per value (by the backend's name, a reload that changed it was not applied).
        self._backend_timeouts: dict[float, dict[str, float | None]] = {}
        # (backend url, path, backend key) -> the parsed URL and the headers every call sends.
        self._targets: dict[tuple[str, str, str | None], _Target] = {}
        # For the rare calls that want the client's conveniences (readiness probes); the request
        # path goes to the transport directly: cookies, redirects and auth hooks cost ~12% per
        # request there and a gateway needs none of them.
        self._client = httpx.AsyncClient(timeout=timeout, transport=transport, trust_env=False)
        # (backend name, url) -> its probe under way, which every caller meanwhile shares.
        self._probes: dict[tuple[str, str], asyncio.Task[str | None]] = {}

    async def aclose(self) -> None:
        for task in list(self._probes.values()):
            task.cancel()
        await self._client.aclose()

    async def open(
        self,
        ctx: Admitted,
        backend: Backend,
        body: dict[str, Any],
        extra_headers: Mapping[str, str] = {},
    ) -> httpx.Response:
        """Start the upstream call to `backend`; the caller must `aclose()` the response.
        Non-2xx raise. `extra_headers` (the trace context, `traceparent`) go to the backend as
        they are."""
        request = self._request(
            backend, ctx.upstream_path, ctx.request_id, body, extra_headers, ctx.raw_body
        )
        if ctx.route is not None:
            request.extensions["trace"] = ctx.route.trace
        with translate(backend):
            response = await self._transport.handle_async_request(request)
        response.request = request
        if response.status_code >= 300:
            try:
                with translate(backend):
                    raw = await _read_head(response)
            finally:
                await close(response)
            raise status_error(backend, response, raw)
        return response

    def _request(
        self,
        backend: Backend,
        path: str,
        request_id: str | None,
        body: dict[str, Any],
        extra_headers: Mapping[str, str],
        raw_body: bytes = b"",
    ) -> httpx.Request:
        """The request as `httpx.Request(content=...)` builds it (the same headers in the same
        order), from the backend's URL and fixed headers parsed once: httpx parses the URL and
        normalises every header per request otherwise, ~100 µs of a ~600 µs request. Built by
        `post_request`, past the constructor's checks of parts that are bytes already."""
        api_key = backend.api_key.get_secret_value() if backend.api_key is not None else None
        target = self._targets.get((backend.url, path, api_key))
        if target is None:
            if len(self._targets) >= _MAX_TARGETS:  # old policies' backends, after reloads
                self._targets.clear()
            target = _target(backend.url + path, api_key)
            self._targets[(backend.url, path, api_key)] = target
        url, fixed = target
        content = as_written(orjson.dumps(body), body, raw_body)
        raw = fixed.copy()
        if request_id is not None:
            raw.append((b"x-request-id", request_id.encode("ascii")))
        for name, value in extra_headers.items():
            raw.append((name.encode("ascii"), value.encode("ascii")))
        raw.append((b"Content-Length", str(len(content)).encode("ascii")))
        return post_request(url, raw, content, {"timeout": self._timeouts(backend)})

    def _timeouts(self, backend: Backend) -> dict[str, float | None]:
        first_byte_s = backend.first_byte_timeout
        if first_byte_s is None:
            return self._timeout
        timeouts = self._backend_timeouts.get(first_byte_s)
        if timeouts is None:
            timeouts = {**self._timeout, "first_byte": first_byte_s}
            self._backend_timeouts[first_byte_s] = timeouts
        return timeouts

    async def probe(self, backend: Backend, timeout_s: float) -> str | None:
        """None if `GET {url}/models` answers 200 within the timeout, else what went wrong.
        Callers while a backend's probe is under way share it: a flood of `/readyz` calls is
        one `GET /models` per backend at a time, not one per call (each held a connection of
        the pool the requests use, for up to `timeout_s`)."""
        key = (backend.name, backend.url)
        task = self._probes.get(key)
        if task is None:
            task = asyncio.create_task(self._probe(backend, timeout_s))
            self._probes[key] = task
            task.add_done_callback(lambda done: self._probe_done(key, done))
        return await asyncio.shield(task)  # a caller that leaves does not end it for the rest

    def _probe_done(self, key: tuple[str, str], task: asyncio.Task[str | None]) -> None:
        if self._probes.get(key) is task:
            del self._probes[key]
        if not task.cancelled():
            task.exception()  # seen, should every caller have left

    async def _probe(self, backend: Backend, timeout_s: float) -> str | None:
        """One `GET {url}/models`: None if it answers 200 within the timeout.
        The whole exchange takes at most `timeout_s`; the answer is read (and let go of) read
        by read, up to `_MAX_PROBE_BODY_BYTES`, only so its connection can serve again: a
        backend that trickled its list, or sent gigabytes of it, held `/readyz` and the prober
        for ever, or the whole list in memory for each probe."""
        request = self._client.build_request(
            "GET", backend.url + "/models", headers=_headers(backend, None)
        )
        request.extensions["timeout"] = {**httpx.Timeout(timeout_s).as_dict(), "total": timeout_s}
        try:
            response = await self._client.send(request, stream=True)
            try:
                await _drain(response, _MAX_PROBE_BODY_BYTES)
            finally:
                await close(response)
        except httpx.PoolTimeout:
            return POOL_BUSY
        except httpx.HTTPError as exc:
            return tls_reason(exc) or type(exc).__name__
        return None if response.status_code == 200 else f"HTTP {response.status_code}"


class translate:
    """Turns httpx exceptions raised inside the block into gateway errors naming the backend.
    (A class, not a generator: entered on every request, twice.)"""

    __slots__ = ("_backend",)

    def __init__(self, backend: Backend) -> None:
        self._backend = backend

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, httpx.HTTPError):
            raise _gateway_error(self._backend.name, exc) from exc


def _gateway_error(name: str, exc: httpx.HTTPError) -> GatewayError:
    if isinstance(exc, httpx.PoolTimeout):
        return ConnectionsBusy(f"all connections to backend {name!r} are busy", retry_after_s=1)
    if isinstance(exc, httpx.ConnectTimeout):
        return UpstreamTimeout(
            f"backend {name!r} did not accept the connection in time", code=CONNECT_TIMEOUT_CODE
        )
    if isinstance(exc, FirstByteTimeout):
        return UpstreamTimeout(
            f"backend {name!r} sent no byte of its answer within the first-byte timeout"
        )
    if isinstance(exc, TotalTimeout):
        return UpstreamTimeout(
            f"backend {name!r} did not finish its answer within the total timeout"
        )
    if isinstance(exc, ResponseHeadTooLarge):
        return UpstreamBadResponse(f"backend {name!r}: {exc}")
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"backend {name!r} sent nothing within the read timeout")
    if isinstance(exc, TlsBroken):
        return UpstreamError(f"backend {name!r}: {exc}")
    if isinstance(exc, httpx.ConnectError):
        reason = tls_reason(exc)  # a certificate refused, a failed handshake
        if reason is not None:
            return UpstreamError(f"backend {name!r}: {reason}")
        return UpstreamError(f"backend {name!r} refused the connection")
    return UpstreamError(f"backend {name!r} failed: {type(exc).__name__}")


def _target(url: str, api_key: str | None) -> _Target:
    parsed = httpx.URL(url)
    fixed = [
        (b"Host", parsed.netloc),
        (b"content-type", b"application/json"),
        (b"accept-encoding", b"identity"),
    ]
    if api_key is not None:
        fixed.append((b"authorization", b"Bearer " + api_key.encode("ascii")))
    return parsed, fixed


def _headers(backend: Backend, request_id: str | None) -> dict[str, str]:
    headers = {"content-type": "application/json", "accept-encoding": "identity"}
    if backend.api_key is not None:
        headers["authorization"] = "Bearer " + backend.api_key.get_secret_value()
    if request_id is not None:
        headers["x-request-id"] = request_id
    return headers


async def read_capped(response: httpx.Response, limit_bytes: int) -> bytes | None:
    """The whole body, or None if it is longer than `limit_bytes` (by its Content-Length, before
    reading any of it, or once what came passes the limit). The caller closes the response."""
    declared = declared_length(response.headers)
    if declared is not None and declared > limit_bytes:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in raw_reads(response):
        size += len(chunk)
        if size > limit_bytes:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _drain(response: httpx.Response, limit_bytes: int) -> None:
    """Read the body to its end, keeping none of it; stop past `limit_bytes` (the caller's
    close then drops the connection)."""
    size = 0
    async for chunk in raw_reads(response):
        size += len(chunk)
        if size > limit_bytes:
            return


def raw_reads(response: httpx.Response) -> AsyncIterator[bytes]:
    """The response body's reads as they come, as `aiter_raw` yields them (no decoding), from
    the response's own stream (past aiter_raw's generator and its two context managers); once
    only, as aiter_raw allows. The caller closes the response."""
    if response.is_stream_consumed:
        raise httpx.StreamConsumed()
    response.is_stream_consumed = True
    stream = response.stream
    if not isinstance(stream, httpx.AsyncByteStream):
        raise TypeError("a backend's answer needs an async byte stream")
    return aiter(stream)


async def close(response: httpx.Response) -> None:
    """`response.aclose()` past its context manager (a generator made per call, to name the
    request in an error the close raises): closing the stream gives its connection back, or
    drops it if the body was not read to its end."""
    if response.is_closed:
        return
    response.is_closed = True
    stream = response.stream
    if not isinstance(stream, httpx.AsyncByteStream):
        raise TypeError("a backend's answer needs an async byte stream")
    await stream.aclose()


async def _read_head(response: httpx.Response) -> bytes:
    """An error answer's first bytes: enough for its message, whatever its length."""
    head = b""
    async for chunk in response.aiter_raw():
        head += chunk
        if len(head) >= _MAX_ERROR_BODY_BYTES:
            break
    return head[:_MAX_ERROR_BODY_BYTES]
