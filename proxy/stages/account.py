"""Settle a finished request once: usage (see stages/usage.py), quota, ledger, access log,
metrics and trace.

Writes input_tokens, output_tokens and usage_source (and counted_input_tokens when the backend
reported none it could believe). Never records keys, nor prompts and answers unless the policy
says `log_content: true`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Collection, Sequence
from typing import Protocol, runtime_checkable

from proxy.clock import Clock
from proxy.context import Admitted, RequestContext
from proxy.cost import PriceTable
from proxy.ledger import Ledger, UsageRecord
from proxy.stages.usage import bill, count_unreported_input
from proxy.telemetry.logs import ACCESS_LOGGER, json_line, log_access_line, utc_ms
from proxy.telemetry.recorder import Telemetry
from proxy.telemetry.semconv import MAX_TEXT_CHARS, clipped
from proxy.together import in_turn
from proxy.tokens import TokenCounters

__all__ = ["ACCESS_LOGGER", "UNKNOWN_MODEL", "Account", "Settler", "settlers_of"]

UNKNOWN_MODEL = "<unknown>"
"""How a model name the policy does not know (a 404) is recorded: never the client's string."""


@runtime_checkable
class Settler(Protocol):
    """A stage that holds something for a request (a slot, a reservation) until it ends."""

    def holding(self, ctx: Admitted) -> bool:
        """True if `ctx` holds something of this stage's, for `settle` to give back."""

    def settle(self, ctx: Admitted) -> Awaitable[None]:
        """Give it back: the storage calls are made when this is called (so Redis gets every
        stage's in one call), the awaitable ends when they are done."""


def settlers_of(stages: Sequence[object]) -> list[Settler]:
    """The stages that hold something until a request ends, in the order they give it back:
    the last taken first."""
    return [stage for stage in reversed(stages) if isinstance(stage, Settler)]


class Account:
    def __init__(
        self,
        clock: Clock,
        holds: Sequence[Settler],
        prices: PriceTable,
        ledger: Ledger | None,
        telemetry: Telemetry,
        logger: logging.Logger | None = None,
        counters: TokenCounters | None = None,
        models: Collection[str] | None = None,
    ) -> None:
        """`counters` count what the backend did not report; `models` (the policy's) are the
        names recorded as they are, any other is UNKNOWN_MODEL (without `models`, any name
        longer than MAX_TEXT_CHARS is)."""
        self._clock = clock
        self._counters = counters
        self._models = frozenset(models) if models is not None else None
        self._holds = tuple(holds)
        self._prices = prices
        self._ledger = ledger
        self._telemetry = telemetry
        self._log = logger or logging.getLogger(ACCESS_LOGGER)

    async def release(self, ctx: RequestContext) -> None:
        """Settle what the request holds (slots, reservations, its cache entry), once.

        The pipeline calls this just before the last byte of an answer, so a client that sends
        its next request as soon as this one ends finds its slot free and its answer cached.
        """
        if ctx.released:
            return
        ctx.released = True
        # A bill that cannot be worked out (a bug) leaves what the request holds to be given
        # back all the same (the tenant's slot would be taken for good), then is raised.
        failed: Exception | None = None
        try:
            await self._bill(ctx)
        except Exception as exc:
            failed = exc
        if not isinstance(ctx, Admitted):  # refused at auth: it holds nothing
            if failed is not None:
                raise failed
            return
        settling_s = self._clock.monotonic()
        # Every stage makes its storage calls before any is waited for: with Redis they go out
        # as one call, and the answer's end waits for that one round trip. A stage whose settle
        # raises at once (a bug) leaves the others to give back what they hold, then is raised.
        settling: list[Awaitable[None]] = []
        for hold in self._holds:
            if hold.holding(ctx):
                try:
                    settling.append(hold.settle(ctx))
                except Exception as exc:
                    failed = failed or exc
        await in_turn(settling)
        self._telemetry.settle_ran(ctx, settling_s)
        if failed is not None:
            raise failed

    async def _bill(self, ctx: RequestContext) -> None:
        counter = None
        if self._counters is not None and self._known(ctx.model):
            counter = self._counters.for_model(ctx.model)
            if ctx.outcome.backend_usage is None and ctx.counted_input_tokens is None:
                await count_unreported_input(ctx, self._counters)
        bill(ctx, counter)

    async def __call__(self, ctx: RequestContext) -> None:
        try:
            await self.release(ctx)
        finally:  # a release that failed (a bug) still leaves the request in the ledger
            usage = self.usage_record(ctx)
            if self._ledger is not None:
                self._ledger.append(usage)
            self._telemetry.finish(ctx, usage)
            if self._log.isEnabledFor(logging.INFO):
                line = self._access_line(ctx, usage)
                line.update(self._telemetry.log_fields(ctx))
                log_access_line(self._log, json_line(line))

    def unbilled(self, ctx: RequestContext, operation: str) -> None:
        """A request the gateway answered itself, without a backend or a bill (`count_tokens`,
        as `operation` in its access line): no ledger record; its refusal is counted."""
        self._telemetry.unbilled(ctx)
        if self._log.isEnabledFor(logging.INFO):
            line = self._access_line(ctx, self.usage_record(ctx))
            line["operation"] = operation
            log_access_line(self._log, json_line(line))

    def usage_record(self, ctx: RequestContext) -> UsageRecord:
        meter = ctx.meter
        input_tokens, output_tokens = ctx.input_tokens or 0, ctx.output_tokens or 0
        return UsageRecord(
            ts=ctx.received_wall,
            request_id=ctx.request_id,
            tenant=ctx.tenant_name,
            model=self._recorded_model(ctx.model),
            backend=ctx.backend.name if ctx.backend else None,
            operation=ctx.operation,
            stream=ctx.stream,
            status=ctx.status,
            error=clipped(ctx.error_code),
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            cost_nusd=self._prices.cost_nusd(ctx.model, input_tokens, output_tokens),
            cache=ctx.cache,
            ttft_ms=_ms(meter.ttft_s),
            tokens_per_s=_round(meter.tokens_per_s(output_tokens, ctx.choices)),
            duration_ms=_ms(self._clock.monotonic() - ctx.received_s) or 0.0,
            shaped=tuple(ctx.outgoing.shaped),
            degraded=tuple(ctx.degraded),
            client_disconnected=ctx.outcome.client_disconnected,
            saved_input_tokens=ctx.saved_input_tokens,
            saved_output_tokens=ctx.saved_output_tokens,
            saved_cost_nusd=self._saved_cost_nusd(ctx),
            usage_source=ctx.usage_source,
            counted_input_tokens=ctx.counted_input_tokens or 0,
            key_id=ctx.key_id,
            user=ctx.end_user,
            tags=ctx.tags,
            supersedes=ctx.checkpointed,
        )

    def _known(self, model: str) -> bool:
        if self._models is None:
            return len(model) <= MAX_TEXT_CHARS
        return model in self._models

    def _recorded_model(self, model: str) -> str | None:
        if not model:
            return None
        return model if self._known(model) else UNKNOWN_MODEL

    def _saved_cost_nusd(self, ctx: RequestContext) -> int:
        """What a cache hit spared; nothing to price for every other request."""
        if not (ctx.saved_input_tokens or ctx.saved_output_tokens):
            return 0
        return self._prices.cost_nusd(ctx.model, ctx.saved_input_tokens, ctx.saved_output_tokens)

    def _access_line(self, ctx: RequestContext, usage: UsageRecord) -> dict[str, object]:
        meter = ctx.meter
        return {
            "ts": utc_ms(usage.ts),
            "request_id": usage.request_id,
            "tenant": usage.tenant,
            "key_id": usage.key_id,
            "user": usage.user,
            "tags": list(usage.tags) or None,
            "operation": usage.operation,
            "model": usage.model,
            "model_requested": _model_requested(ctx, usage.model),
            "backend": usage.backend,
            "stream": usage.stream,
            "status": usage.status,
            "error": usage.error,
            "cache": usage.cache,
            "input_tokens": ctx.input_tokens,
            "output_tokens": ctx.output_tokens,
            "usage_source": usage.usage_source,
            "usage": usage.usage_source,  # the field's name before usage_source; same value
            "usage_rejected": ctx.outcome.usage_rejected or None,
            "counted_input_tokens": ctx.counted_input_tokens,
            "cost_usd": usage.cost_nusd / 1e9,
            "shaped": ctx.outgoing.shaped or None,
            "degraded": ctx.degraded or None,
            "degraded_shadow": ctx.degraded_shadow or None,
            "ttft_ms": usage.ttft_ms,
            "upstream_ttft_ms": _ms(meter.upstream_ttft_s),
            "itl_p50_ms": _ms(meter.gaps.quantile_s(0.5)),
            "itl_p99_ms": _ms(meter.gaps.quantile_s(0.99)),
            "itl_max_ms": _ms(meter.gaps.max_s if meter.gaps.count else None),
            "tokens_per_s": usage.tokens_per_s,
            "duration_ms": usage.duration_ms,
            "gateway_ms": _ms(meter.gateway_s),
            "completed": ctx.outcome.completed or (ctx.cached is not None and ctx.outcome.answered),
            "client_disconnected": usage.client_disconnected,
        }


def _ms(seconds: float | None) -> float | None:
    """Milliseconds to the microsecond. `round(x * 1e6) / 1e3`, not `round(x * 1e3, 3)`: the
    same value for every duration but one within a rounding error of a half-microsecond tie, at
    a quarter of the cost (`round` to digits formats the number as text)."""
    return None if seconds is None else round(seconds * 1e6) / 1e3


def _round(value: float | None) -> float | None:
    """To one decimal, as `_ms` rounds."""
    return None if value is None else round(value * 10.0) / 10.0


def _model_requested(ctx: RequestContext, recorded: str | None) -> str | None:
    """The model the client asked for, where the record names another: a 404's unknown name
    (cut), or the model a fallback or a degradation rule sent the request to instead."""
    asked = ctx.outgoing.asked_model
    if recorded == UNKNOWN_MODEL:
        return clipped(ctx.model)
    return asked if recorded and asked != recorded else None
