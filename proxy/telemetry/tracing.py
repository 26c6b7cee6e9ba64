"""Traces, on the OpenTelemetry API only: one GenAI span per request, child spans for its I/O.

The span `{operation} {model}` (kind SERVER) starts when the request arrived, continues the
client's W3C trace context if it sent one, and ends once, when Account settles the request.
The upstream call is a CLIENT child span whose context goes to the backend as `traceparent`.
Stages that touched storage get child spans drawn afterwards from their measured times. The
SDK (exporters, sampling) is configured where the process starts (proxy/telemetry/sdk.py);
without one the gateway builds no Tracing at all. Prompts and keys are never recorded.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.trace import (
    Span,
    SpanKind,
    Status,
    StatusCode,
    Tracer,
    TracerProvider,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy import __version__
from proxy.apis import output_fields
from proxy.context import RequestContext
from proxy.telemetry import semconv

__all__ = ["RequestTrace", "Tracing", "response_fields", "span_attributes"]

_FINISH_REASON = re.compile(rb'"finish_reason":\s*"([a-z_]{1,32})"')
_RESPONSE_MODEL = re.compile(rb'"model":\s*"([^"\\]{1,200})"')


def _has_quota(ctx: RequestContext) -> bool:
    budget = ctx.tenant.budget if ctx.tenant else None
    return budget is not None and any(
        (budget.tokens_per_day, budget.tokens_per_month, budget.usd_per_day, budget.usd_per_month)
    )


def _has_limits(ctx: RequestContext) -> bool:
    limits = ctx.tenant.limits if ctx.tenant else None
    return limits is not None and bool(
        limits.requests_per_minute
        or limits.tokens_per_minute
        or limits.max_concurrent
        or limits.per_model
    )


def _has_backend_limits(ctx: RequestContext) -> bool:
    limits = ctx.backend.limits if ctx.backend else None
    return limits is not None and bool(
        limits.requests_per_minute or limits.tokens_per_minute or limits.max_concurrent
    )


# Stage class name -> (span name, "did it touch storage for this request?").
_IO_STAGES: dict[str, tuple[str, Callable[[RequestContext], bool]]] = {
    "Budgets": ("tokenweir.budget.reserve", _has_quota),
    "RateLimits": ("tokenweir.rate_limit.admit", _has_limits),
    "BackendLimits": ("tokenweir.backend_limit.admit", _has_backend_limits),
    "ResponseCache": ("tokenweir.cache.lookup", lambda ctx: ctx.cache != "bypass"),
    "settle": (
        "tokenweir.settle",
        lambda ctx: _has_quota(ctx) or _has_limits(ctx) or _has_backend_limits(ctx),
    ),
}


class Tracing:
    """Starts a RequestTrace per request from the tracer provider it was given."""

    def __init__(self, provider: TracerProvider) -> None:
        self._tracer = provider.get_tracer("tokenweir", __version__)
        self._propagator = TraceContextTextMapPropagator()

    def begin(self, ctx: RequestContext) -> RequestTrace:
        parent = self._propagator.extract(ctx.headers) if "traceparent" in ctx.headers else None
        return RequestTrace(self._tracer, self._propagator, parent, ctx)


class RequestTrace:
    """One request's spans. Monotonic times become wall-clock nanoseconds via `received_*`."""

    __slots__ = (
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
        self._stages: list[tuple[str, float, float]] = []
        self.span: Span | None = None
        self.upstream: Span | None = None

    def _ns(self, monotonic_s: float) -> int:
        return self._origin_ns + int((monotonic_s - self._received_s) * 1e9)

    def _request_span(self, ctx: RequestContext) -> Span:
        if self.span is None:
            self.span = self._tracer.start_span(
                f"{ctx.operation} {semconv.clipped(ctx.model)}".rstrip(),
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
        if span is None:
            return
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if error is not None:
            span.set_attribute("error.type", error)
            span.set_status(Status(StatusCode.ERROR))
        span.end(self._ns(now_s))

    @property
    def recording(self) -> bool:
        """False when the sampler left this request out (its spans record nothing)."""
        return self.span is None or self.span.is_recording()

    def finish(self, ctx: RequestContext, now_s: float, attributes: Mapping[str, object]) -> None:
        """End the request span with its GenAI attributes; draw the storage stages' spans."""
        span = self._request_span(ctx)
        if not span.is_recording():
            span.end(self._ns(now_s))
            return
        span.update_name(f"{ctx.operation} {semconv.clipped(ctx.model)}".rstrip())
        if self.upstream is not None:  # the relay did not close it: end it with the request
            self.upstream_ended(now_s, None, ctx.error_code or "incomplete")
        parent = set_span_in_context(span)
        for name, started_s, ended_s in self._stages:
            io = _IO_STAGES.get(name)
            if io is not None and io[1](ctx):
                child = self._tracer.start_span(io[0], parent, start_time=self._ns(started_s))
                child.end(self._ns(ended_s))
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})  # type: ignore[misc]
        if ctx.status >= 400 or ctx.error_code:
            span.set_status(Status(StatusCode.ERROR, semconv.clipped(ctx.error_code)))
        span.end(self._ns(now_s))


def response_fields(tail: bytes) -> tuple[str | None, list[str]]:
    """The response's model and finish reasons, from its last bytes (no JSON parse)."""
    model = _RESPONSE_MODEL.search(tail)
    reasons = [m.decode() for m in _FINISH_REASON.findall(tail)]
    return (model.group(1).decode("utf-8", "replace") if model else None), reasons


def span_attributes(
    ctx: RequestContext, tokens_per_s: float | None, cost_usd: float
) -> dict[str, object]:
    """The request span's attributes: gen_ai.* by the semantic conventions, tokenweir.* ours."""
    meter = ctx.meter
    response_model, reasons = response_fields(ctx.response_tail)
    backend = ctx.backend
    address = urlsplit(backend.url) if backend else None
    return {
        "gen_ai.operation.name": ctx.operation,
        "gen_ai.provider.name": semconv.PROVIDER,
        "gen_ai.request.model": semconv.clipped(ctx.model) or None,
        "gen_ai.response.model": response_model,
        "gen_ai.request.max_tokens": _max_tokens(ctx),
        "gen_ai.request.stream": ctx.stream,
        "gen_ai.usage.input_tokens": ctx.input_tokens,
        "gen_ai.usage.output_tokens": ctx.output_tokens,
        "gen_ai.response.time_to_first_chunk": meter.ttft_s if ctx.stream else None,
        "gen_ai.response.finish_reasons": reasons or None,
        "server.address": address.hostname if address else None,
        "server.port": address.port if address else None,
        "http.response.status_code": ctx.status or None,
        "error.type": semconv.clipped(ctx.error_code),
        "tokenweir.request_id": ctx.request_id,
        "tokenweir.tenant": ctx.tenant_name,
        "tokenweir.backend": backend.name if backend else None,
        "tokenweir.cache": ctx.cache,
        "tokenweir.degraded": ",".join(ctx.degraded) or None,
        "tokenweir.shaped": ",".join(ctx.shaped) or None,
        "tokenweir.ttft_s": meter.ttft_s,
        "tokenweir.upstream_ttft_s": meter.upstream_ttft_s,
        "tokenweir.tokens_per_second": tokens_per_s,
        "tokenweir.gateway_s": meter.gateway_s,
        "tokenweir.cost_usd": cost_usd,
        "tokenweir.client_disconnected": ctx.client_disconnected,
    }


def _max_tokens(ctx: RequestContext) -> int | None:
    for field in output_fields(ctx.operation):  # max_output_tokens on the Responses API
        value = ctx.body.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
