"""What both span paths share: the hooks a request's trace offers the recorder, the stages that
get child spans, and the request span's attributes.

Two implementations: proxy/telemetry/tracing.py on the OpenTelemetry API (any tracer provider)
and proxy/telemetry/directtrace.py (tokenweir's own OTLP export, no SDK span objects).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit

from proxy.apis import output_fields
from proxy.context import RequestContext, TraceHooks
from proxy.errors import ModelNotFound
from proxy.telemetry import semconv
from proxy.telemetry.spanattrs import SpanAttributes

__all__ = [
    "CountsDrops",
    "OwnTracing",
    "Timed",
    "TraceSource",
    "response_fields",
    "span_attributes",
    "span_name",
]


class TraceSource(Protocol):
    def begin(self, ctx: RequestContext) -> TraceHooks: ...


@runtime_checkable
class OwnTracing(Protocol):
    """A tracer provider that records the gateway's request spans its own way."""

    def request_tracing(self) -> TraceSource: ...


@runtime_checkable
class CountsDrops(Protocol):
    """A tracer provider that counts the request spans it lost, by why."""

    def dropped_spans(self) -> dict[str, int]: ...


_FINISH_REASON = re.compile(rb'"finish_reason":\s*"([a-z_]{1,32})"')
# A Messages answer's is its `stop_reason` (end_turn, max_tokens, tool_use, ...); on chat, vLLM's
# `stop_reason` is the stop string that matched, no reason.
_STOP_REASON = re.compile(rb'"stop_reason":\s*"([a-z_]{1,32})"')
_RESPONSE_MODEL = re.compile(rb'"model":\s*"([^"\\]{1,200})"')


Timed = tuple[str, float, float]
"""A child span of the request's: (span name, started_s, ended_s)."""


def response_fields(tail: bytes, operation: str) -> tuple[str | None, tuple[str, ...]]:
    """The response's model and finish reasons, from its last bytes (no JSON parse)."""
    model = _RESPONSE_MODEL.search(tail)
    found = (_STOP_REASON if operation == "messages" else _FINISH_REASON).findall(tail)
    reasons = tuple([m.decode() for m in found])
    return (model.group(1).decode("utf-8", "replace") if model else None), reasons


def span_attributes(
    ctx: RequestContext, tokens_per_s: float | None, cost_usd: float
) -> SpanAttributes:
    """The request span's attributes: gen_ai.* by the semantic conventions, tokenweir.* ours."""
    meter = ctx.meter
    response_model, reasons = response_fields(ctx.outcome.tail, ctx.operation)
    if response_model is None and ctx.status == 200:
        # Not in the answer's last bytes (a Messages stream names it in its first event, a
        # stream its client left): the model that served it, a fallback's as the ledger's.
        response_model = ctx.model
    backend = ctx.backend
    host, port = _server(backend.url) if backend else (None, None)
    repeating = (
        ctx.operation, semconv.PROVIDER, semconv.clipped(ctx.outgoing.asked_model) or None,
        semconv.clipped(response_model),
        _max_tokens(ctx), ctx.stream, reasons or None, host, port, ctx.status or None,
        semconv.clipped(ctx.error_code), ctx.tenant_name, backend.name if backend else None,
        ctx.cache, ",".join(ctx.degraded) or None, ",".join(ctx.outgoing.shaped) or None,
        ctx.outcome.client_disconnected,
    )  # fmt: skip
    ttft_s = meter.ttft_s
    varying = (
        ctx.input_tokens, ctx.output_tokens, ttft_s if ctx.stream else None, ctx.request_id,
        ttft_s, meter.upstream_ttft_s, tokens_per_s, meter.gateway_s, cost_usd,
    )  # fmt: skip
    return SpanAttributes(repeating, varying)


def span_name(operation: object, model: object, error: object) -> str:
    """`{operation} {gen_ai.request.model}`, the semantic conventions' name; a model the policy
    does not know (its 404) leaves the name the operation's alone: a client inventing names
    made a span name (a trace store's indexed operation) of each."""
    if not model or error == ModelNotFound.code:
        return str(operation)
    return f"{operation} {model}"


@lru_cache(maxsize=256)
def _server(url: str) -> tuple[str | None, int | None]:
    """A backend's host and port (`server.address`, `server.port`), parsed once per URL."""
    address = urlsplit(url)
    return address.hostname, address.port


def _max_tokens(ctx: RequestContext) -> int | None:
    """The client's output limit, if an int64 (an OTLP int attribute): a refused request's
    2**63 went out as -2**63."""
    body = ctx.body
    for field in output_fields(ctx.operation):  # max_output_tokens on the Responses API
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            return value if _INT64_MIN <= value <= _INT64_MAX else None
    return None


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
