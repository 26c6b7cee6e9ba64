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
from typing import Any

from proxy.context import RequestContext
from proxy.policy.model import Backend
from proxy.telemetry import semconv
from proxy.telemetry.attrwire import AttributeWriter
from proxy.telemetry.samplers import HeadSampler
from proxy.telemetry.spanattrs import REPEATING_KEYS, VARYING_KEYS, SpanAttributes
from proxy.telemetry.spanwire import (
    CLIENT,
    END_TIME,
    INTERNAL,
    LOCAL_PARENT,
    PARENT_ID,
    REMOTE_PARENT,
    SERVER,
    SPAN_ID,
    UNSET,
    ChildLayout,
    child_layout,
    error_status,
    framed_span,
    span_head,
    span_ids,
)
from proxy.telemetry.traces import Timed, span_name
from proxy.telemetry.w3c import RANDOM_TRACE_ID, SAMPLED, RemoteParent, remote_parent, trace_headers

__all__ = ["DirectTrace", "DirectTracing"]

_UPSTREAM_ERROR = error_status(None)
_KEPT = 1024  # layouts of backend calls and stages, and the request span's repeating part
_KEPT_LENGTHS = 64  # lengths of the ids between a child span's own and its head
_STAGE_TAIL = UNSET + LOCAL_PARENT  # a stage span has no attributes, and no status
# Where the request span's name and status come from among its repeating values.
_OPERATION, _MODEL, _STATUS, _ERROR = (
    REPEATING_KEYS.index(key)
    for key in ("gen_ai.operation.name", "gen_ai.request.model", "http.response.status_code",
                "error.type")
)  # fmt: skip
Encoded = tuple[bytes, bytes, bytes]
"""What spans alike share: span_head(), the attributes and the status, encoded once."""


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
        self._requests: dict[tuple[object, ...], Encoded] = {}
        # The layouts of the child spans (a backend call's, by its key; a storage stage's, by
        # its name), by the length of what comes between a child's id and its head: 10 bytes
        # (its parent's id) but for a client's tracestate.
        self.layouts: dict[int, dict[object, ChildLayout]] = {}

    def begin(self, ctx: RequestContext) -> DirectTrace:
        parent = remote_parent(ctx.headers) if "traceparent" in ctx.headers else None
        return DirectTrace(self, parent, ctx)

    def call(
        self, backend: Backend | None, path: str, status: int | None, error: str | None
    ) -> Encoded:
        """A backend call span's name, attributes (method, backend, URL, status, error) and
        status, the same for every call to that backend's path that ends alike."""
        values: dict[str, object] = {"http.request.method": "POST"}
        if backend is not None:
            values["tokenweir.backend"] = backend.name
            values["url.full"] = backend.url + path
        values["http.response.status_code"] = status
        values["error.type"] = error
        return (span_head(f"POST {path}", CLIENT), self.attributes.pairs(values.items()),
                UNSET if error is None else _UPSTREAM_ERROR)  # fmt: skip

    def call_layout(
        self,
        between: int,
        backend: Backend | None,
        path: str,
        status: int | None,
        error: str | None,
    ) -> ChildLayout:
        """The layout of a backend call's span: the same for every call that ends alike."""
        key = (backend.name, backend.url, path, status, error) if backend else (path, status, error)
        layouts = self.layouts.get(between) or self._layouts(between)
        found = layouts.get(key)
        if found is None:
            head, values, status_field = self.call(backend, path, status, error)
            found = child_layout(head, values + status_field + LOCAL_PARENT, between)
            _keep(layouts, key, found)
        return found

    def stage_layout(self, between: int, name: str) -> ChildLayout:
        """The layout of a storage stage's span, by its name."""
        layouts = self.layouts.get(between) or self._layouts(between)
        found = layouts.get(name)
        if found is None:
            found = child_layout(span_head(name, INTERNAL), _STAGE_TAIL, between)
            _keep(layouts, name, found)
        return found

    def _layouts(self, between: int) -> dict[object, ChildLayout]:
        if len(self.layouts) >= _KEPT_LENGTHS:  # a client's tracestates of every length
            self.layouts.clear()
        found: dict[object, ChildLayout] = {}
        self.layouts[between] = found
        return found

    def request(self, repeating: tuple[object, ...]) -> Encoded:
        """The request span's name, repeating attributes and status: all follow from the
        repeating values (operation, model, status, error among them), so each combination is
        encoded once. The type at each place must not change (True == 1 would find 1's)."""
        found = self._requests.get(repeating)
        if found is None:
            model, status, error = repeating[_MODEL], repeating[_STATUS], repeating[_ERROR]
            failed = (isinstance(status, int) and status >= 400) or bool(error)
            found = (
                span_head(span_name(repeating[_OPERATION], model, error), SERVER),
                self.attributes.pairs(zip(REPEATING_KEYS, repeating, strict=True)),
                error_status(str(error) if error else None) if failed else UNSET,
            )
            _keep(self._requests, repeating, found)
        return found

    def span_id(self) -> int:
        span_id = self.bits(64)
        while not span_id:  # 0 is the invalid id
            span_id = self.bits(64)
        return span_id


def _keep(kept: dict[Any, Any], key: object, found: object) -> None:
    if len(kept) >= _KEPT:
        kept.clear()
    kept[key] = found


class DirectTrace:
    """One request's spans. Monotonic times become wall-clock nanoseconds via `received_*`.
    The backend call's span is open from upstream_started (`_call_id` set) to upstream_ended
    (`_call_end_ns` set)."""

    __slots__ = (
        "_call_end_ns",
        "_call_error",
        "_call_id",
        "_call_start_ns",
        "_call_status",
        "_flags",
        "_origin_ns",
        "_parent",
        "_path",
        "_received_s",
        "_stages",
        "_trace_id",
        "_tracing",
        "recording",
        "span_id",
    )
    _path: str
    _call_status: int | None
    _call_error: str | None

    def __init__(self, tracing: DirectTracing, parent: RemoteParent | None, ctx: RequestContext):
        self._tracing = tracing
        self._parent = parent
        self._received_s = ctx.received_s
        self._origin_ns = int(ctx.received_wall * 1e9)
        self._stages: list[Timed] | None = None
        self._call_id = self._call_start_ns = self._call_end_ns = 0
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
        self.span_id = tracing.bits(64) or tracing.span_id()  # span_id(), its call saved

    def _ns(self, monotonic_s: float) -> int:
        return self._origin_ns + int((monotonic_s - self._received_s) * 1e9)

    def stage_ran(self, name: str, started_s: float, ended_s: float) -> None:
        if self._stages is None:
            self._stages = []
        self._stages.append((name, started_s, ended_s))

    def upstream_started(self, ctx: RequestContext, now_s: float) -> dict[str, str]:
        state = self._parent.state if self._parent is not None else ""
        if not self.recording:  # sampled out: pass the decision on, build nothing more
            return trace_headers(self._trace_id, self.span_id, self._flags, state)
        tracing = self._tracing
        self._call_id = tracing.bits(64) or tracing.span_id()
        self._call_start_ns = self._ns(now_s)
        self._path = ctx.upstream_path
        self._call_status = self._call_error = None
        return trace_headers(self._trace_id, self._call_id, self._flags, state)

    def upstream_ended(self, now_s: float, status: int | None, error: str | None) -> None:
        if not self._call_id or self._call_end_ns:
            return
        self._call_end_ns = self._ns(now_s)
        self._call_status, self._call_error = status, semconv.clipped(error)

    def finish(self, ctx: RequestContext, now_s: float, attributes: SpanAttributes | None) -> None:
        """Write the request's spans (the backend call, the storage stages, the request) and
        queue them for export."""
        if not self.recording or attributes is None:
            return
        tracing, parent, span_id = self._tracing, self._parent, self.span_id
        ids = span_ids(self._trace_id, parent.state if parent is not None else "")
        # What the children share: the trace id (then their own id's tag), and what comes
        # between their id and their head (the tracestate, if any, and this span's id).
        trace, between = ids[0] + SPAN_ID, ids[1] + PARENT_ID + span_id.to_bytes(8, "big")
        length = len(between)
        layouts = tracing.layouts.get(length) or {}
        spans = []
        if self._call_id:
            if not self._call_end_ns:  # the relay did not close it: end it now
                self.upstream_ended(now_s, None, ctx.error_code or "incomplete")
            pack, frame, head, tail = tracing.call_layout(  # the backend that answered
                length, ctx.backend, self._path, self._call_status, self._call_error
            )
            spans.append(pack(
                frame, trace, self._call_id.to_bytes(8, "big"), between, head,
                self._call_start_ns, END_TIME, self._call_end_ns, tail,
            ))  # fmt: skip
        # The stages' spans: _ns and span_id inlined (a request has four or five).
        origin_ns, received_s, bits = self._origin_ns, self._received_s, tracing.bits
        for name, started_s, ended_s in self._stages or ():
            pack, frame, head, tail = layouts.get(name) or tracing.stage_layout(length, name)
            spans.append(pack(
                frame, trace, (bits(64) or tracing.span_id()).to_bytes(8, "big"), between, head,
                origin_ns + int((started_s - received_s) * 1e9), END_TIME,
                origin_ns + int((ended_s - received_s) * 1e9), tail,
            ))  # fmt: skip
        head, values, status = tracing.request(attributes.repeating)
        # zip with no strict=: the keyword makes the call half as dear again, and the lengths
        # are SpanAttributes', fixed.
        values += tracing.attributes.pairs(zip(VARYING_KEYS, attributes.varying))  # noqa: B905
        spans.append(framed_span(
            ids, span_id, parent.span_id if parent is not None else 0, head, origin_ns,
            self._ns(now_s), values, status, REMOTE_PARENT if parent is not None else LOCAL_PARENT,
        ))  # fmt: skip
        tracing.queue(spans)
