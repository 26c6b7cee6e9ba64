"""Upstream stream-through: send the request to the chosen backend and relay its answer as it comes.

Writes status, input_tokens, output_tokens, usage_from_backend, upstream_completed and the meter.
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx
from starlette.types import Send

from proxy.clock import Clock
from proxy.context import RequestContext
from proxy.errors import GatewayError, UpstreamError
from proxy.policy.model import Backend
from proxy.stages.usage import take_usage as _take_usage
from proxy.stages.usage import usage_of as _usage_of
from proxy.telemetry.recorder import Telemetry
from proxy.upstream.client import UpstreamOpener, translate
from proxy.upstream.sse import SSEForwarder

__all__ = ["SSE_HEADERS", "Forward"]

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class Forward:
    def __init__(self, upstream: UpstreamOpener, clock: Clock, telemetry: Telemetry) -> None:
        self._upstream = upstream
        self._clock = clock
        self._telemetry = telemetry

    async def __call__(self, ctx: RequestContext, send: Send) -> None:
        body = _asking_for_usage(ctx.body) if ctx.stream else ctx.body
        ctx.meter.sending_upstream(self._clock.monotonic())
        trace_headers = self._telemetry.upstream_started(ctx)
        try:
            backend, response = await self._upstream.open(ctx, body, trace_headers)
        except GatewayError as exc:
            self._telemetry.upstream_ended(ctx, None, exc.code or exc.type)
            raise
        try:
            if ctx.stream:
                await self._relay_stream(ctx, backend, response, send)
            else:
                await self._relay_whole(ctx, backend, response, send)
        finally:
            # Closing a half-read response drops its connection, which stops the backend.
            with anyio.CancelScope(shield=True):
                await response.aclose()
            error = None if ctx.upstream_completed else ctx.error_code or "incomplete"
            self._telemetry.upstream_ended(ctx, response.status_code, error)

    async def _relay_stream(
        self, ctx: RequestContext, backend: Backend, response: httpx.Response, send: Send
    ) -> None:
        monotonic = self._clock.monotonic
        meter = ctx.meter
        sse = SSEForwarder(keep_usage=ctx.client_wants_usage)
        ending = before_last = last = b""
        capture = ctx.capture
        try:
            with translate(backend):
                async for raw in response.aiter_raw():
                    meter.read(monotonic())
                    out, token_events = sse.feed(raw)
                    if out:
                        if not ctx.status:
                            await self._start(ctx, send, SSE_HEADERS)
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                        meter.wrote(monotonic(), token_events)
                        before_last, last = last, out
                        if capture is not None:
                            capture.add(out)
            ending = sse.finish()
            if capture is not None:
                capture.add(ending)
            ctx.upstream_completed = True
        except UpstreamError as exc:
            if not ctx.status:
                raise  # nothing sent yet: the client gets a proper error status instead
            ctx.error_code = exc.code
            # An OpenAI-shaped error event, and no [DONE]: the client must not take it as complete.
            ending = b"data: " + exc.to_json() + b"\n\n"
        if not ctx.status:
            await self._start(ctx, send, SSE_HEADERS)
        ctx.answered = True
        ctx.response_tail = before_last + last + ending
        _take_usage(ctx, sse.usage)
        await send({"type": "http.response.body", "body": ending, "more_body": False})

    async def _relay_whole(
        self, ctx: RequestContext, backend: Backend, response: httpx.Response, send: Send
    ) -> None:
        with translate(backend):
            raw = await response.aread()
        ctx.meter.read(self._clock.monotonic())
        ctx.upstream_completed = True
        if ctx.capture is not None:
            ctx.capture.add(raw)
        ctx.response_tail = raw
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
        ]
        await self._start(ctx, send, headers)
        ctx.answered = True
        _take_usage(ctx, _usage_of(raw))
        await send({"type": "http.response.body", "body": raw, "more_body": False})
        ctx.meter.wrote(self._clock.monotonic(), 1)

    async def _start(
        self, ctx: RequestContext, send: Send, headers: list[tuple[bytes, bytes]]
    ) -> None:
        ctx.status = 200
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*headers, *ctx.gateway_headers()],
            }
        )


def _asking_for_usage(body: dict[str, Any]) -> dict[str, Any]:
    """The body with `stream_options.include_usage` on: the backend's usage is the bill."""
    options = body.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    options["include_usage"] = True
    return {**body, "stream_options": options}
