"""Settle a finished request once: usage (backend's, else counted events) and the access log line.

Writes output_tokens when the backend sent no usage. Never records prompts or keys.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import orjson

from proxy.clock import Clock
from proxy.context import RequestContext
from proxy.stages.budget import Budgets

__all__ = ["ACCESS_LOGGER", "Account"]

ACCESS_LOGGER = "tokenweir.access"


class Account:
    def __init__(
        self, clock: Clock, budgets: Budgets, logger: logging.Logger | None = None
    ) -> None:
        self._clock = clock
        self._budgets = budgets
        self._log = logger or logging.getLogger(ACCESS_LOGGER)

    async def __call__(self, ctx: RequestContext) -> None:
        if ctx.output_tokens is None and ctx.operation != "embeddings":
            ctx.output_tokens = ctx.meter.token_events
        if ctx.input_tokens is None:
            ctx.input_tokens = ctx.counted_input_tokens
        await self._budgets.settle(ctx)
        if self._log.isEnabledFor(logging.INFO):
            self._log.info(orjson.dumps(self.record(ctx)).decode())

    def record(self, ctx: RequestContext) -> dict[str, object]:
        meter = ctx.meter
        output = ctx.output_tokens or 0
        return {
            "ts": datetime.fromtimestamp(ctx.received_wall, UTC).isoformat(timespec="milliseconds"),
            "request_id": ctx.request_id,
            "tenant": ctx.tenant_name,
            "operation": ctx.operation,
            "model": ctx.model or None,
            "backend": ctx.backend.name if ctx.backend else None,
            "stream": ctx.stream,
            "status": ctx.status,
            "error": ctx.error_code,
            "cache": ctx.cache,
            "input_tokens": ctx.input_tokens,
            "output_tokens": ctx.output_tokens,
            "usage": "backend" if ctx.usage_from_backend else "counted",
            "shaped": ctx.shaped or None,
            "ttft_ms": _ms(meter.ttft_s),
            "upstream_ttft_ms": _ms(meter.upstream_ttft_s),
            "itl_p50_ms": _ms(meter.gaps.quantile_s(0.5)),
            "itl_p99_ms": _ms(meter.gaps.quantile_s(0.99)),
            "itl_max_ms": _ms(meter.gaps.max_s if meter.gaps.count else None),
            "tokens_per_s": _round(meter.tokens_per_s(output)),
            "duration_ms": _ms(self._clock.monotonic() - ctx.received_s),
            "gateway_ms": _ms(meter.gateway_s),
            "completed": ctx.upstream_completed,
            "client_disconnected": ctx.client_disconnected,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
