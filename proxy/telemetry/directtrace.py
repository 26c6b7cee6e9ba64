"""The gateway's request spans recorded without the SDK, for tokenweir's own OTLP export.

The same spans as proxy/telemetry/tracing.py makes through the OpenTelemetry API (a SERVER span
per request, a CLIENT child for the backend call whose context goes out as `traceparent`,
children for the storage stages, the same ids, sampling, names, times, attributes and status),
but a request's state is one slotted object, ids are plain ints, and its spans are written as
OTLP protobuf when it finishes and handed to the batcher: no Span, Context or attribute
cleaning per span. Called from the gateway's event loop.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

from proxy.context import RequestContext
from proxy.telemetry import semconv
from proxy.telemetry.samplers import HeadSampler
from proxy.telemetry.spanwire import (
    CLIENT,
    INTERNAL,
    SERVER,
    UNSET,
    encode_span,
    error_status,
    span_ids,
)
from proxy.telemetry.traces import IO_STAGES
from proxy.telemetry.w3c import RANDOM_TRACE_ID, SAMPLED, RemoteParent, remote_parent, trace_headers

__all__ = ["DirectTrace", "DirectTracing"]

_UPSTREAM_ERROR = error_status(None)


class DirectTracing:
    """Starts a DirectTrace per request; `bits` is the id source (random.getrandbits, the
    SDK's RandomIdGenerator's; tests pass a seeded one)."""

    def __init__(
        self,
        queue: Callable[[list[bytes]], None],
        sampler: HeadSampler,
        bits: Callable[[int], int] = random.getrandbits,
    ) -> None:
        self.queue = queue
        self.sampler = sampler
        self.bits = bits

    def begin(self, ctx: RequestContext) -> DirectTrace:
        parent = remote_parent(ctx.headers) if "traceparent" in ctx.headers else None
        return DirectTrace(self, parent, ctx)


class _Call:
    """The backend call's span, open until the relay ends it."""

    __slots__ = ("attributes", "end_ns", "name", "span_id", "start_ns", "status")

    def __init__(self, span_id: int, name: str, start_ns: int, attributes: dict[str, object]):
        self.span_id = span_id
        self.name = name
        self.start_ns = start_ns
        self.end_ns = 0
        self.attributes = attributes
        self.status = UNSET


def _span_id(bits: Callable[[int], int]) -> int:
    span_id = bits(64)
    while not span_id:  # 0 is the invalid id
        span_id = bits(64)
    return span_id


class DirectTrace:
    """One request's spans. Monotonic times become wall-clock nanoseconds via `received_*`."""

    __slots__ = (
        "_bits",
        "_flags",
        "_origin_ns",
        "_parent",
        "_queue",
        "_received_s",
        "_stages",
        "_trace_id",
        "_upstream",
        "_upstream_open",
        "recording",
        "span_id",
    )

    def __init__(self, tracing: DirectTracing, parent: RemoteParent | None, ctx: RequestContext):
        bits = self._bits = tracing.bits
        self._queue = tracing.queue
        self._parent = parent
        self._received_s = ctx.received_s
        self._origin_ns = int(ctx.received_wall * 1e9)
        self._stages: list[tuple[str, float, float]] = []
        self._upstream: _Call | None = None
        self._upstream_open = False
        if parent is None:
            trace_id = bits(128)
            while not trace_id:
                trace_id = bits(128)
            flags = RANDOM_TRACE_ID  # as the SDK's RandomIdGenerator declares its ids
        else:
            trace_id, flags = parent.trace_id, parent.flags & RANDOM_TRACE_ID
        self._trace_id = trace_id
        self.recording = tracing.sampler.sampled(trace_id, parent)
        self._flags = flags | SAMPLED if self.recording else flags
        self.span_id = _span_id(bits)

    def _ns(self, monotonic_s: float) -> int:
        return self._origin_ns + int((monotonic_s - self._received_s) * 1e9)

    def stage_ran(self, name: str, started_s: float, ended_s: float) -> None:
        self._stages.append((name, started_s, ended_s))

    def upstream_started(self, ctx: RequestContext, now_s: float) -> dict[str, str]:
        state = self._parent.state if self._parent is not None else ""
        if not self.recording:  # sampled out: pass the decision on, build nothing more
            return trace_headers(self._trace_id, self.span_id, self._flags, state)
        span_id = _span_id(self._bits)
        backend = ctx.backend
        attributes: dict[str, object] = {"http.request.method": "POST"}
        if backend is not None:
            attributes["tokenweir.backend"] = backend.name
            attributes["url.full"] = backend.url + ctx.upstream_path
        self._upstream = _Call(span_id, f"POST {ctx.upstream_path}", self._ns(now_s), attributes)
        self._upstream_open = True
        return trace_headers(self._trace_id, span_id, self._flags, state)

    def upstream_ended(self, now_s: float, status: int | None, error: str | None) -> None:
        upstream = self._upstream
        if upstream is None or not self._upstream_open:
            return
        self._upstream_open = False
        upstream.end_ns = self._ns(now_s)
        if status is not None:
            upstream.attributes["http.response.status_code"] = status
        if error is not None:
            upstream.attributes["error.type"] = error
            upstream.status = _UPSTREAM_ERROR

    def finish(self, ctx: RequestContext, now_s: float, attributes: Mapping[str, object]) -> None:
        """Write the request's spans (the backend call, the storage stages, the request) and
        queue them for export."""
        if not self.recording:
            return
        if self._upstream_open:  # the relay did not close it: end it with the request
            self.upstream_ended(now_s, None, ctx.error_code or "incomplete")
        parent = self._parent
        trace = span_ids(self._trace_id, parent.state if parent is not None else "")
        spans = []
        call = self._upstream
        if call is not None:
            spans.append(encode_span(
                trace, call.span_id, self.span_id, call.name, CLIENT, call.start_ns, call.end_ns,
                call.attributes, call.status,
            ))  # fmt: skip
        for name, started_s, ended_s in self._stages:
            io = IO_STAGES.get(name)
            if io is not None and io[1](ctx):
                spans.append(encode_span(
                    trace, _span_id(self._bits), self.span_id, io[0], INTERNAL,
                    self._ns(started_s), self._ns(ended_s), None,
                ))  # fmt: skip
        failed = ctx.status >= 400 or ctx.error_code
        spans.append(encode_span(
            trace, self.span_id, parent.span_id if parent is not None else 0,
            f"{ctx.operation} {semconv.clipped(ctx.model)}".rstrip(), SERVER,
            self._origin_ns, self._ns(now_s), attributes,
            error_status(semconv.clipped(ctx.error_code)) if failed else UNSET,
            parent is not None,
        ))  # fmt: skip
        self._queue(spans)
