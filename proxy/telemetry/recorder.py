"""The request path's one seam to telemetry: the pipeline, Forward and Account call these hooks.

Metrics are always on (Prometheus; OTLP, when configured, exports the same aggregates);
tracing only when a tracer provider was configured, and then `ctx.trace` is set. Everything is
recorded exactly once per request, in `finish`, which Account calls from the pipeline's
`finally`.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.clock import Clock
from proxy.context import Admitted, RequestContext
from proxy.ledger import UsageRecord
from proxy.policy import Policy
from proxy.stages import Stage, Traced
from proxy.telemetry.logs import content_fields
from proxy.telemetry.metrics import GatewayMetrics
from proxy.telemetry.sample import model_label, rejection_of, sample_of
from proxy.telemetry.traces import TraceSource, span_attributes
from proxy.telemetry.w3c import passed_on
from proxy.upstream.capture import Capture

__all__ = ["Telemetry"]

# `log_content` keeps a stream's relayed bytes to log its text; a longer answer logs none.
_LOGGED_BYTES = 16 * 1024 * 1024
SETTLE_SPAN = "tokenweir.settle"


class Telemetry:
    def __init__(
        self,
        policy: Policy,
        clock: Clock,
        metrics: GatewayMetrics,
        *,
        tracing: TraceSource | None = None,
    ) -> None:
        self._policy = policy
        self._clock = clock
        self._tracing = tracing
        self._log_content = policy.log_content
        self.metrics = metrics
        self._given_back: tuple[Traced, ...] = ()

    def begin(self, ctx: RequestContext) -> None:
        """A request arrived (before auth)."""
        if self._tracing is not None:
            ctx.trace = self._tracing.begin(ctx)
        if self._log_content:
            ctx.capture = Capture(_LOGGED_BYTES)

    def timed_stages(self, stages: Sequence[Stage]) -> list[Traced | None]:
        """For each of the pipeline's `stages`, itself if it may get a span of its own (so
        `traced` should run it), else None; None for all without tracing. Remembers those whose
        holds the settle call gives back, for the settle span."""
        if self._tracing is None:
            return [None] * len(stages)
        timed = [stage if isinstance(stage, Traced) else None for stage in stages]
        self._given_back = tuple(s for s in timed if s is not None and s.given_back_at_settle)
        return timed

    async def traced(self, ctx: Admitted, stage: Traced) -> None:
        """Run a stage; its span is drawn if it touched storage (only called when `ctx.trace`
        is set). A coroutine of its own: timing the stage in the pipeline's loop instead, with
        a call before and after, counted no fewer instructions (docs/benchmarks.md)."""
        started_s = self._clock.monotonic()
        try:
            await stage(ctx)
        finally:
            if ctx.trace is not None and stage.touched(ctx):
                ctx.trace.stage_ran(stage.span_name, started_s, self._clock.monotonic())

    def upstream_started(self, ctx: RequestContext) -> dict[str, str]:
        """The backend call begins; returns headers for it (W3C `traceparent` when tracing)."""
        if ctx.stream and ctx.inflight_labels is None:
            labels = ctx.inflight_labels = (ctx.tenant_name or "", model_label(ctx, self._policy))
            self.metrics.stream_started(*labels)
        if ctx.trace is None:
            # Not tracing: the client's own trace context goes on as it came (checked and
            # written again: a backend that traces then joins the client's trace).
            return passed_on(ctx.headers) if "traceparent" in ctx.headers else {}
        return ctx.trace.upstream_started(ctx, self._clock.monotonic())

    def upstream_ended(self, ctx: RequestContext, status: int | None, error: str | None) -> None:
        if ctx.trace is not None:
            ctx.trace.upstream_ended(self._clock.monotonic(), status, error)

    def settle_ran(self, ctx: Admitted, started_s: float) -> None:
        """The settle span is drawn when a stage whose holds it gives back touched storage."""
        if ctx.trace is None:
            return
        for stage in self._given_back:  # a loop, not any(): no generator made per request
            if stage.touched(ctx):
                ctx.trace.stage_ran(SETTLE_SPAN, started_s, self._clock.monotonic())
                return

    def finish(self, ctx: RequestContext, usage: UsageRecord) -> None:
        """Record the settled request: metrics, then the trace's end."""
        if ctx.inflight_labels is not None:
            self.metrics.stream_ended(*ctx.inflight_labels)
            ctx.inflight_labels = None
        sample = sample_of(
            ctx, self._policy, usage.cost_nusd, usage.duration_ms / 1000.0, usage.saved_cost_nusd
        )
        self.metrics.record(sample)
        if ctx.trace is not None:
            attributes = None
            if ctx.trace.recording:
                attributes = span_attributes(ctx, usage.tokens_per_s, usage.cost_nusd / 1e9)
            ctx.trace.finish(ctx, self._clock.monotonic(), attributes)

    def unbilled(self, ctx: RequestContext) -> None:
        """A request the gateway answered itself, billing nothing (`count_tokens`): only its
        refusal is counted (no request series: its labels would read as a backend's request)."""
        reason = rejection_of(ctx)
        if reason is not None:
            self.metrics.count_rejected(
                ctx.tenant_name or "", model_label(ctx, self._policy), reason
            )

    def log_fields(self, ctx: RequestContext) -> dict[str, object]:
        """Extra access-log fields: prompt and completion text with `log_content: true`."""
        return content_fields(ctx) if self._log_content else {}
