"""Where a gateway process starts: the OpenTelemetry SDK, set up from the standard OTEL_* variables.

Library code uses only the API; this module, imported only when `otel_wanted()` says the
environment asks for traces or metrics, needs the `otel` extra. Exporters are OTLP over
HTTP/protobuf (`OTEL_EXPORTER_OTLP_ENDPOINT`, `..._TRACES_ENDPOINT`, `..._HEADERS`, ...) or
`console`. Spans go out through tokenweir's own OTLP export (proxy/telemetry/ownprovider.py:
the same protobuf at a fraction of the SDK's CPU; `TOKENWEIR_TRACE_PATH=sdk`, or a span
attribute limit set in OTEL_*, sends them through the SDK's span objects and batch processor
instead, which tokenweir's exporter still encodes and posts); metrics are the `/metrics`
aggregates, handed to the SDK's metric exporter every `OTEL_METRIC_EXPORT_INTERVAL`
milliseconds (proxy/telemetry/otlpmetrics.py). Sampling (`OTEL_TRACES_SAMPLER`), batching
(`OTEL_BSP_*`) and `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES` work as in the SDK.
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
from proxy.telemetry.ownprovider import OwnTracerProvider

__all__ = ["OtelSdk", "start_sdk"]

_log = logging.getLogger("tokenweir")
_TRACE_PATH = "TOKENWEIR_TRACE_PATH"
# The SDK cuts attributes by these; the direct path writes them whole, so leaves them to it.
_ATTRIBUTE_LIMITS = (
    "OTEL_ATTRIBUTE_COUNT_LIMIT",
    "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
    "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT",
    "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
)


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
        tracer_provider = _tracer_provider(traces, resource, environ)
    if metrics is not None:
        metric_exporter = ConsoleMetricExporter() if metrics == "console" else OTLPMetricExporter()
    interval_ms = float(environ.get("OTEL_METRIC_EXPORT_INTERVAL") or 60000)
    _log.info("OpenTelemetry: traces %s, metrics %s", traces or "off", metrics or "off")
    return OtelSdk(tracer_provider, metric_exporter, interval_ms / 1000.0, resource)


def _tracer_provider(traces: str, resource: Resource, environ: Mapping[str, str]) -> TracerProvider:
    if traces == "otlp" and _direct_spans(environ):
        return OwnTracerProvider(resource, environ)
    exporter: SpanExporter = (
        ConsoleSpanExporter() if traces == "console" else OtlpSpanExporter(environ)
    )
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _direct_spans(environ: Mapping[str, str]) -> bool:
    """May the gateway's request spans skip the SDK's span objects?"""
    path = environ.get(_TRACE_PATH, "direct").strip().lower() or "direct"
    if path not in ("direct", "sdk"):
        raise ValueError(f"{_TRACE_PATH}={path!r}: tokenweir knows direct, sdk")
    limits = [name for name in _ATTRIBUTE_LIMITS if environ.get(name)]
    if path == "direct" and limits:
        _log.info("%s set: the gateway's spans go through the SDK, which applies it", limits[0])
    return path == "direct" and not limits
