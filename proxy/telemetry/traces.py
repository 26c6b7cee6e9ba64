"""What both span paths share: the hooks a request's trace offers the recorder, the stages that
get child spans, and the request span's attributes.

Two implementations: proxy/telemetry/tracing.py on the OpenTelemetry API (any tracer provider)
and proxy/telemetry/directtrace.py (tokenweir's own OTLP export, no SDK span objects).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import lru_cache
from itertools import chain
from typing import NamedTuple, Protocol, runtime_checkable
from urllib.parse import urlsplit

from proxy.apis import output_fields
from proxy.context import RequestContext
from proxy.telemetry import semconv

__all__ = [
    "IO_STAGES",
    "REPEATING_KEYS",
    "VARYING_KEYS",
    "OwnTracing",
    "SpanAttributes",
    "Timed",
    "TraceHooks",
    "TraceSource",
    "response_fields",
    "span_attributes",
    "stage_spans",
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

    def finish(self, ctx: RequestContext, now_s: float, attributes: SpanAttributes | None) -> None:
        """End the request span with its GenAI attributes (None when it is not recording);
        draw the storage stages' spans."""


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
    return budget is not None and bool(
        budget.tokens_per_day
        or budget.tokens_per_month
        or budget.usd_per_day
        or budget.usd_per_month
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


# Stage class name (or "settle") -> the name of the span drawn for it when it touched storage.
IO_STAGES: dict[str, str] = {
    "Budgets": "tokenweir.budget.reserve",
    "RateLimits": "tokenweir.rate_limit.admit",
    "BackendLimits": "tokenweir.backend_limit.admit",
    "ResponseCache": "tokenweir.cache.lookup",
    "settle": "tokenweir.settle",
}

Timed = tuple[str, float, float]
"""A stage that ran: (stage name, started_s, ended_s)."""


def stage_spans(ctx: RequestContext, stages: list[Timed]) -> list[Timed]:
    """The storage stages' child spans: (span name, started_s, ended_s) for each stage that
    touched storage for this request."""
    if not stages:
        return []
    quota, limits, backend = _has_quota(ctx), _has_limits(ctx), _has_backend_limits(ctx)
    touched = {
        "Budgets": quota,
        "RateLimits": limits,
        "BackendLimits": backend,
        "ResponseCache": ctx.cache != "bypass",
        "settle": quota or limits or backend,
    }
    return [(IO_STAGES[name], start, end) for name, start, end in stages if touched.get(name)]


def response_fields(tail: bytes) -> tuple[str | None, tuple[str, ...]]:
    """The response's model and finish reasons, from its last bytes (no JSON parse)."""
    model = _RESPONSE_MODEL.search(tail)
    reasons = tuple([m.decode() for m in _FINISH_REASON.findall(tail)])
    return (model.group(1).decode("utf-8", "replace") if model else None), reasons


# The request span's attribute keys: first those whose values repeat from request to request
# (the direct path encodes each combination of them once), then those that rarely repeat.
REPEATING_KEYS = (
    "gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model",
    "gen_ai.response.model", "gen_ai.request.max_tokens", "gen_ai.request.stream",
    "gen_ai.response.finish_reasons", "server.address", "server.port",
    "http.response.status_code", "error.type", "tokenweir.tenant", "tokenweir.backend",
    "tokenweir.cache", "tokenweir.degraded", "tokenweir.shaped", "tokenweir.client_disconnected",
)  # fmt: skip
VARYING_KEYS = (
    "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
    "gen_ai.response.time_to_first_chunk", "tokenweir.request_id", "tokenweir.ttft_s",
    "tokenweir.upstream_ttft_s", "tokenweir.tokens_per_second", "tokenweir.gateway_s",
    "tokenweir.cost_usd",
)  # fmt: skip


class SpanAttributes(NamedTuple):
    """The request span's attributes, by REPEATING_KEYS and VARYING_KEYS; None is no value."""

    repeating: tuple[object, ...]
    varying: tuple[object, ...]

    def varying_items(self) -> Iterator[tuple[str, object]]:
        return zip(VARYING_KEYS, self.varying, strict=True)

    def items(self) -> Iterator[tuple[str, object]]:
        """Every (key, value), the None values too."""
        return chain(zip(REPEATING_KEYS, self.repeating, strict=True), self.varying_items())

    def as_dict(self) -> dict[str, object]:
        """The attributes that have a value."""
        return {key: value for key, value in self.items() if value is not None}


def span_attributes(
    ctx: RequestContext, tokens_per_s: float | None, cost_usd: float
) -> SpanAttributes:
    """The request span's attributes: gen_ai.* by the semantic conventions, tokenweir.* ours."""
    meter = ctx.meter
    response_model, reasons = response_fields(ctx.response_tail)
    backend = ctx.backend
    host, port = _server(backend.url) if backend else (None, None)
    repeating = (
        ctx.operation, semconv.PROVIDER, semconv.clipped(ctx.model) or None, response_model,
        _max_tokens(ctx), ctx.stream, reasons or None, host, port, ctx.status or None,
        semconv.clipped(ctx.error_code), ctx.tenant_name, backend.name if backend else None,
        ctx.cache, ",".join(ctx.degraded) or None, ",".join(ctx.shaped) or None,
        ctx.client_disconnected,
    )  # fmt: skip
    ttft_s = meter.ttft_s
    varying = (
        ctx.input_tokens, ctx.output_tokens, ttft_s if ctx.stream else None, ctx.request_id,
        ttft_s, meter.upstream_ttft_s, tokens_per_s, meter.gateway_s, cost_usd,
    )  # fmt: skip
    return SpanAttributes(repeating, varying)


@lru_cache(maxsize=256)
def _server(url: str) -> tuple[str | None, int | None]:
    """A backend's host and port (`server.address`, `server.port`), parsed once per URL."""
    address = urlsplit(url)
    return address.hostname, address.port


def _max_tokens(ctx: RequestContext) -> int | None:
    for field in output_fields(ctx.operation):  # max_output_tokens on the Responses API
        value = ctx.body.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
