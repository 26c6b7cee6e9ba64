"""Where a gateway process starts: the OpenTelemetry SDK, set up from the standard OTEL_* variables.

Library code uses only the API; this module, imported only when `otel_wanted()` says the
environment asks for traces or metrics, needs the `otel` extra. Exporters are OTLP over
HTTP/protobuf (`OTEL_EXPORTER_OTLP_ENDPOINT`, `..._TRACES_ENDPOINT`, `..._HEADERS`, ...) or
`console`. Spans go out through tokenweir's own OTLP exporter (proxy/telemetry/otlpexport.py:
the same protobuf at a fraction of the SDK exporter's CPU); metrics are the `/metrics`
aggregates, handed to the SDK's metric exporter every `OTEL_METRIC_EXPORT_INTERVAL`
milliseconds (proxy/telemetry/otlpmetrics.py). The SDK itself reads sampling
(`OTEL_TRACES_SAMPLER`), batching (`OTEL_BSP_*`) and `OTEL_SERVICE_NAME` /
`OTEL_RESOURCE_ATTRIBUTES`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from proxy import __version__
from proxy.telemetry.metrics import BudgetLeft, GatewayMetrics
from proxy.telemetry.otelenv import exporters_wanted
from proxy.telemetry.otlpexport import OtlpSpanExporter
from proxy.telemetry.otlpmetrics import MetricsPush

__all__ = ["OtelSdk", "start_sdk"]

_log = logging.getLogger("tokenweir")


def _resource(environ: Mapping[str, str]) -> Resource:
    """Each process is its own instance (`--workers N` pushes N cumulative streams, which a
    collector must keep apart to add them up); OTEL_RESOURCE_ATTRIBUTES may override any of it."""
    return Resource.create(
        {"service.name": environ.get("OTEL_SERVICE_NAME", "tokenweir"),
         "service.version": __version__, "service.instance.id": uuid.uuid4().hex}
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class OtelSdk:
    """What this process configured; `shutdown()` flushes the spans still batched (metrics are
    flushed by their MetricsPush when the gateway closes)."""

    tracer_provider: TracerProvider | None = None
    metric_exporter: MetricExporter | None = None
    metric_interval_s: float = 60.0
    resource: Resource = field(default_factory=lambda: _resource({}))

    def metrics_push(
        self, metrics: GatewayMetrics, budgets: Callable[[], Awaitable[Sequence[BudgetLeft]]]
    ) -> MetricsPush | None:
        if self.metric_exporter is None:
            return None
        return MetricsPush(
            metrics, budgets, self.metric_exporter, self.resource, self.metric_interval_s
        )

    def shutdown(self) -> None:
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()


def start_sdk(environ: Mapping[str, str]) -> OtelSdk:
    traces, metrics = exporters_wanted(environ)
    protocol = environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    if protocol != "http/protobuf":
        _log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s: tokenweir exports http/protobuf", protocol)
    resource = _resource(environ)
    tracer_provider = metric_exporter = None
    if traces is not None:
        span_exporter: SpanExporter = (
            ConsoleSpanExporter() if traces == "console" else OtlpSpanExporter(environ)
        )
        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    if metrics is not None:
        metric_exporter = ConsoleMetricExporter() if metrics == "console" else OTLPMetricExporter()
    interval_ms = float(environ.get("OTEL_METRIC_EXPORT_INTERVAL") or 60000)
    _log.info("OpenTelemetry: traces %s, metrics %s", traces or "off", metrics or "off")
    return OtelSdk(tracer_provider, metric_exporter, interval_ms / 1000.0, resource)
