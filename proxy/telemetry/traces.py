"""What both span paths share: the hooks a request's trace offers the recorder, the stages that
get child spans, and the request span's attributes.

Two implementations: proxy/telemetry/tracing.py on the OpenTelemetry API (any tracer provider)
and proxy/telemetry/directtrace.py (tokenweir's own OTLP export, no SDK span objects).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit

from proxy.apis import output_fields
from proxy.context import RequestContext
from proxy.telemetry import semconv

__all__ = [
    "IO_STAGES",
    "OwnTracing",
    "TraceHooks",
    "TraceSource",
    "response_fields",
    "span_attributes",
]


class TraceHooks(Protocol):
    """One request's spans, as the recorder drives them (monotonic times, seconds)."""

    @property
    def recording(self) -> bool:
        """False when the sampler left this request out (its spans record nothing)."""

    def stage_ran(self, name: str, started_s: float, ended_s: float) -> None: ...

    def upstream_started(self, ctx: RequestContext, now_s: float) -> dict[str, str]:
        """Open the backend call's span; returns the headers that carry it to the backend."""

    def upstream_ended(self, now_s: float, status: int | None, error: str | None) -> None: ...

    def finish(self, ctx: RequestContext, now_s: float, attributes: Mapping[str, object]) -> None:
        """End the request span with its GenAI attributes; draw the storage stages' spans."""


class TraceSource(Protocol):
    def begin(self, ctx: RequestContext) -> TraceHooks: ...


@runtime_checkable
class OwnTracing(Protocol):
    """A tracer provider that records the gateway's request spans its own way."""

    def request_tracing(self) -> TraceSource: ...


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
IO_STAGES: dict[str, tuple[str, Callable[[RequestContext], bool]]] = {
    "Budgets": ("tokenweir.budget.reserve", _has_quota),
    "RateLimits": ("tokenweir.rate_limit.admit", _has_limits),
    "BackendLimits": ("tokenweir.backend_limit.admit", _has_backend_limits),
    "ResponseCache": ("tokenweir.cache.lookup", lambda ctx: ctx.cache != "bypass"),
    "settle": (
        "tokenweir.settle",
        lambda ctx: _has_quota(ctx) or _has_limits(ctx) or _has_backend_limits(ctx),
    ),
}


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
