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
from collections.abc import Callable

from proxy.context import RequestContext
from proxy.policy.model import Backend
from proxy.telemetry import semconv
from proxy.telemetry.attrwire import AttributeWriter
from proxy.telemetry.samplers import HeadSampler
from proxy.telemetry.spanattrs import REPEATING_KEYS, SpanAttributes
from proxy.telemetry.spanwire import (
    CLIENT,
    INTERNAL,
    SERVER,
    UNSET,
    encode_span,
    error_status,
    span_ids,
)
from proxy.telemetry.traces import Timed
from proxy.telemetry.w3c import RANDOM_TRACE_ID, SAMPLED, RemoteParent, remote_parent, trace_headers

__all__ = ["DirectTrace", "DirectTracing"]

_UPSTREAM_ERROR = error_status(None)
_KEPT_CALLS = 1024


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
        self.attributes = AttributeWriter()
        self._calls: dict[tuple[object, ...], tuple[str, bytes]] = {}

    def begin(self, ctx: RequestContext) -> DirectTrace:
        parent = remote_parent(ctx.headers) if "traceparent" in ctx.headers else None
        return DirectTrace(self, parent, ctx)

    def call(
        self, backend: Backend | None, path: str, status: int | None, error: str | None
    ) -> tuple[str, bytes]:
        """A backend call span's name and attributes (method, backend, URL, status, error),
        the same for every call to that backend's path that ends alike: encoded once."""
        key = (backend.name, backend.url, path, status, error) if backend else (path, status, error)
        found = self._calls.get(key)
        if found is None:
            values: dict[str, object] = {"http.request.method": "POST"}
            if backend is not None:
                values["tokenweir.backend"] = backend.name
                values["url.full"] = backend.url + path
            values["http.response.status_code"] = status
            values["error.type"] = error
            found = (f"POST {path}", self.attributes.pairs(values.items()))
            if len(self._calls) >= _KEPT_CALLS:
                self._calls.clear()
            self._calls[key] = found
        return found

    def span_id(self) -> int:
        span_id = self.bits(64)
        while not span_id:  # 0 is the invalid id
            span_id = self.bits(64)
        return span_id


class _Call:
    """The backend call's span, open until the relay ends it."""

    __slots__ = ("backend", "end_ns", "error", "path", "span_id", "start_ns", "status")

    def __init__(self, span_id: int, ctx: RequestContext, start_ns: int) -> None:
        self.span_id = span_id
        self.backend = ctx.backend
        self.path = ctx.upstream_path
        self.start_ns = start_ns
        self.end_ns = 0
        self.status: int | None = None
        self.error: str | None = None


class DirectTrace:
    """One request's spans. Monotonic times become wall-clock nanoseconds via `received_*`."""

    __slots__ = (
        "_flags",
        "_origin_ns",
        "_parent",
        "_received_s",
        "_stages",
        "_trace_id",
        "_tracing",
        "_upstream",
        "recording",
        "span_id",
    )

    def __init__(self, tracing: DirectTracing, parent: RemoteParent | None, ctx: RequestContext):
        self._tracing = tracing
        self._parent = parent
        self._received_s = ctx.received_s
        self._origin_ns = int(ctx.received_wall * 1e9)
        self._stages: list[Timed] = []
        self._upstream: _Call | None = None
        if parent is None:
            trace_id = tracing.bits(128)
            while not trace_id:
                trace_id = tracing.bits(128)
            flags = RANDOM_TRACE_ID  # as the SDK's RandomIdGenerator declares its ids
        else:
            trace_id, flags = parent.trace_id, parent.flags & RANDOM_TRACE_ID
        self._trace_id = trace_id
        self.recording = tracing.sampler.sampled(trace_id, parent)
        self._flags = flags | SAMPLED if self.recording else flags
        self.span_id = tracing.span_id()

    def _ns(self, monotonic_s: float) -> int:
        return self._origin_ns + int((monotonic_s - self._received_s) * 1e9)

    def stage_ran(self, name: str, started_s: float, ended_s: float) -> None:
        self._stages.append((name, started_s, ended_s))

    def upstream_started(self, ctx: RequestContext, now_s: float) -> dict[str, str]:
        state = self._parent.state if self._parent is not None else ""
        if not self.recording:  # sampled out: pass the decision on, build nothing more
            return trace_headers(self._trace_id, self.span_id, self._flags, state)
        call = self._upstream = _Call(self._tracing.span_id(), ctx, self._ns(now_s))
        return trace_headers(self._trace_id, call.span_id, self._flags, state)

    def upstream_ended(self, now_s: float, status: int | None, error: str | None) -> None:
        call = self._upstream
        if call is None or call.end_ns:
            return
        call.end_ns = self._ns(now_s)
        call.status, call.error = status, error

    def finish(self, ctx: RequestContext, now_s: float, attributes: SpanAttributes | None) -> None:
        """Write the request's spans (the backend call, the storage stages, the request) and
        queue them for export."""
        if not self.recording or attributes is None:
            return
        call = self._upstream
        if call is not None and not call.end_ns:  # the relay did not close it: end it now
            self.upstream_ended(now_s, None, ctx.error_code or "incomplete")
        parent = self._parent
        trace = span_ids(self._trace_id, parent.state if parent is not None else "")
        spans = [] if call is None else [self._call_span(trace, call)]
        for name, started_s, ended_s in self._stages:
            spans.append(encode_span(
                trace, self._tracing.span_id(), self.span_id, name, INTERNAL,
                self._ns(started_s), self._ns(ended_s), b"",
            ))  # fmt: skip
        writer = self._tracing.attributes
        values = writer.group(REPEATING_KEYS, attributes.repeating)
        failed = ctx.status >= 400 or ctx.error_code
        spans.append(encode_span(
            trace, self.span_id, parent.span_id if parent is not None else 0,
            f"{ctx.operation} {semconv.clipped(ctx.model)}".rstrip(), SERVER,
            self._origin_ns, self._ns(now_s), values + writer.pairs(attributes.varying_items()),
            error_status(semconv.clipped(ctx.error_code)) if failed else UNSET,
            parent is not None,
        ))  # fmt: skip
        self._tracing.queue(spans)

    def _call_span(self, trace: tuple[bytes, bytes], call: _Call) -> bytes:
        name, values = self._tracing.call(call.backend, call.path, call.status, call.error)
        return encode_span(
            trace, call.span_id, self.span_id, name, CLIENT, call.start_ns, call.end_ns,
            values, UNSET if call.error is None else _UPSTREAM_ERROR,
        )  # fmt: skip
