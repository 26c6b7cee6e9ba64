"""Where a gateway process starts: the OpenTelemetry SDK, set up from the standard OTEL_* variables.

Library code uses only the API; this module, imported only when `otel_wanted()` says the
environment asks for traces or metrics, needs the `otel` extra. Exporters are OTLP over
HTTP/protobuf (`OTEL_EXPORTER_OTLP_ENDPOINT`, `..._TRACES_ENDPOINT`, `..._HEADERS`, ...) or
`console`. Spans go out through tokenweir's own OTLP exporter (proxy/telemetry/otlpexport.py:
the same protobuf at a fraction of the SDK exporter's CPU); metrics through the SDK's. The SDK
itself reads sampling (`OTEL_TRACES_SAMPLER`), batching (`OTEL_BSP_*`), the export interval
and `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from proxy import __version__
from proxy.telemetry.otelenv import exporters_wanted
from proxy.telemetry.otlpexport import OtlpSpanExporter

__all__ = ["OtelSdk", "start_sdk"]

_log = logging.getLogger("tokenweir")


@dataclass(frozen=True, slots=True)
class OtelSdk:
    """The providers this process configured; `shutdown()` flushes what is still batched."""

    tracer_provider: TracerProvider | None
    meter_provider: MeterProvider | None

    def shutdown(self) -> None:
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()


def start_sdk(environ: Mapping[str, str]) -> OtelSdk:
    traces, metrics = exporters_wanted(environ)
    protocol = environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    if protocol != "http/protobuf":
        _log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s: tokenweir exports http/protobuf", protocol)
    resource = Resource.create(
        {"service.name": environ.get("OTEL_SERVICE_NAME", "tokenweir"),
         "service.version": __version__}
    )  # fmt: skip
    tracer_provider = meter_provider = None
    if traces is not None:
        span_exporter: SpanExporter = (
            ConsoleSpanExporter() if traces == "console" else OtlpSpanExporter(environ)
        )
        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    if metrics is not None:
        metric_exporter: MetricExporter = (
            ConsoleMetricExporter() if metrics == "console" else OTLPMetricExporter()
        )
        reader = PeriodicExportingMetricReader(metric_exporter)
        meter_provider = MeterProvider(metric_readers=[reader], resource=resource)
    _log.info("OpenTelemetry: traces %s, metrics %s", traces or "off", metrics or "off")
    return OtelSdk(tracer_provider, meter_provider)
