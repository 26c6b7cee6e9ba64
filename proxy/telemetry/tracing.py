"""Traces on the OpenTelemetry API: one GenAI span per request, child spans for its I/O.

The span `{operation} {model}` (kind SERVER) starts when the request arrived, continues the
client's W3C trace context if it sent one, and ends once, when Account settles the request.
The upstream call is a CLIENT child span whose context goes to the backend as `traceparent`.
Stages that touched storage get child spans drawn afterwards from their measured times. The
SDK (exporters, sampling) is configured where the process starts (proxy/telemetry/sdk.py);
without one the gateway builds no Tracing at all. Prompts and keys are never recorded. This is
the path for any tracer provider; tokenweir's own OTLP export records the same spans without
the SDK's span objects (proxy/telemetry/directtrace.py, chosen by `open_tracing`).
"""

from __future__ import annotations

from opentelemetry.context import Context
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
    TracerProvider,
    TraceState,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy import __version__
from proxy.context import RequestContext
from proxy.telemetry import semconv
from proxy.telemetry.spanattrs import SpanAttributes
from proxy.telemetry.traces import OwnTracing, Timed, TraceSource, span_name
from proxy.telemetry.w3c import remote_parent

__all__ = ["RequestTrace", "Tracing", "open_tracing"]


def open_tracing(provider: TracerProvider) -> TraceSource:
    """The provider's own request tracing if it has one (tokenweir's OTLP export), else spans
    made through the API."""
    if isinstance(provider, OwnTracing):
        return provider.request_tracing()
    return Tracing(provider)


class Tracing:
    """Starts a RequestTrace per request from the tracer provider it was given."""

    def __init__(self, provider: TracerProvider) -> None:
        self._tracer = provider.get_tracer("tokenweir", __version__)
        self._propagator = TraceContextTextMapPropagator()

    def begin(self, ctx: RequestContext) -> RequestTrace:
        parent = _client_context(ctx) if "traceparent" in ctx.headers else None
        return RequestTrace(self._tracer, self._propagator, parent, ctx)


def _client_context(ctx: RequestContext) -> Context:
    """The client's span as the propagator's `extract` finds it, read by w3c.remote_parent
    (as the direct path reads it): `extract` logs a warning for a malformed `tracestate` or
    an oversized header, so any client could write a line into the log with every request."""
    parent = remote_parent(ctx.headers)
    if parent is None:
        return Context()  # as `extract` answers: a new trace, not the current context's
    state = TraceState.from_header([parent.state]) if parent.state else None  # valid: silent
    span = NonRecordingSpan(
        SpanContext(parent.trace_id, parent.span_id, True, TraceFlags(parent.flags), state)
    )
    return set_span_in_context(span)


class RequestTrace:
    """One request's spans. Monotonic times become wall-clock nanoseconds via `received_*`."""

    __slots__ = (
        "_called",
        "_origin_ns",
        "_parent",
        "_propagator",
        "_received_s",
        "_stages",
        "_tracer",
        "span",
        "upstream",
    )

    def __init__(
        self,
        tracer: Tracer,
        propagator: TraceContextTextMapPropagator,
        parent: Context | None,
        ctx: RequestContext,
    ) -> None:
        self._tracer = tracer
        self._propagator = propagator
        self._parent = parent
        self._received_s = ctx.received_s
        self._origin_ns = int(ctx.received_wall * 1e9)
        self._stages: list[Timed] = []
        self.span: Span | None = None
        self.upstream: Span | None = None
        self._called: RequestContext | None = None  # the request whose backend call is open

    def _ns(self, monotonic_s: float) -> int:
        return self._origin_ns + int((monotonic_s - self._received_s) * 1e9)

    def _request_span(self, ctx: RequestContext) -> Span:
        if self.span is None:
            self.span = self._tracer.start_span(
                _name(ctx),
                context=self._parent,
                kind=SpanKind.SERVER,
                start_time=self._origin_ns,
            )
        return self.span

    def stage_ran(self, name: str, started_s: float, ended_s: float) -> None:
        self._stages.append((name, started_s, ended_s))

    def upstream_started(self, ctx: RequestContext, now_s: float) -> dict[str, str]:
        """Open the backend call's span; returns the headers that carry it to the backend."""
        request = self._request_span(ctx)
        headers: dict[str, str] = {}
        if not request.is_recording():  # sampled out: pass the decision on, build nothing more
            self._propagator.inject(headers, set_span_in_context(request))
            return headers
        parent = set_span_in_context(request)
        self._called = ctx
        backend = ctx.backend
        attributes: dict[str, str | int] = {"http.request.method": "POST"}
        if backend is not None:
            attributes["tokenweir.backend"] = backend.name
            attributes["url.full"] = backend.url + ctx.upstream_path
        self.upstream = self._tracer.start_span(
            f"POST {ctx.upstream_path}",
            context=parent,
            kind=SpanKind.CLIENT,
            attributes=attributes,
            start_time=self._ns(now_s),
        )
        self._propagator.inject(headers, set_span_in_context(self.upstream))
        return headers

    def upstream_ended(self, now_s: float, status: int | None, error: str | None) -> None:
        span, self.upstream = self.upstream, None
        ctx, self._called = self._called, None  # no cycle left between the request and its trace
        if span is None:
            return
        if ctx is not None and ctx.backend is not None:
            # The backend that answered: a failover or a fallback model picked it after the
            # span began under the first choice, whose name and URL it kept.
            span.set_attribute("tokenweir.backend", ctx.backend.name)
            span.set_attribute("url.full", ctx.backend.url + ctx.upstream_path)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if error is not None:  # a backend's error code: cut, as on the request span
            span.set_attribute("error.type", semconv.clipped(error))
            span.set_status(Status(StatusCode.ERROR))
        span.end(self._ns(now_s))

    @property
    def recording(self) -> bool:
        """False when the sampler left this request out (its spans record nothing)."""
        return self.span is None or self.span.is_recording()

    def finish(self, ctx: RequestContext, now_s: float, attributes: SpanAttributes | None) -> None:
        """End the request span with its GenAI attributes; draw the storage stages' spans."""
        span = self._request_span(ctx)
        if not span.is_recording():
            span.end(self._ns(now_s))
            return
        span.update_name(_name(ctx))
        if self.upstream is not None:  # the relay did not close it: end it with the request
            self.upstream_ended(now_s, None, ctx.error_code or "incomplete")
        parent = set_span_in_context(span)
        for name, started_s, ended_s in self._stages:
            child = self._tracer.start_span(name, parent, start_time=self._ns(started_s))
            child.end(self._ns(ended_s))
        if attributes is not None:
            span.set_attributes(attributes.as_dict())  # type: ignore[arg-type]
        if ctx.status >= 400 or ctx.error_code:
            span.set_status(Status(StatusCode.ERROR, semconv.clipped(ctx.error_code)))
        span.end(self._ns(now_s))


def _name(ctx: RequestContext) -> str:
    """The request span's name, as the direct path (directtrace.py) names it."""
    model = semconv.clipped(ctx.outgoing.asked_model)
    return span_name(ctx.operation, model, semconv.clipped(ctx.error_code))
