"""tokenweir's own tracer provider, for OTLP export: the SDK's, plus a faster path for the
gateway's request spans.

Anything that asks it for a tracer through the OpenTelemetry API gets the SDK's spans, batched
by the SDK and encoded and posted by tokenweir (proxy/telemetry/otlpexport.py). The gateway's
request spans skip the SDK's span objects: proxy/telemetry/directtrace.py writes them as OTLP
protobuf, sampled by OTEL_TRACES_SAMPLER as the SDK would, and proxy/telemetry/spanbatch.py
batches them by the OTEL_BSP_* variables and posts them with the same OTLP settings.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from proxy import __version__
from proxy.telemetry.directtrace import DirectTracing
from proxy.telemetry.otlpexport import OtlpSpanExporter
from proxy.telemetry.otlppost import OtlpPoster
from proxy.telemetry.samplers import head_sampler
from proxy.telemetry.spanbatch import SpanBatcher, batch_settings
from proxy.telemetry.spanwire import SpanFrame
from proxy.telemetry.traces import TraceSource

__all__ = ["OwnTracerProvider"]


class OwnTracerProvider(TracerProvider):
    def __init__(self, resource: Resource, environ: Mapping[str, str]) -> None:
        super().__init__(resource=resource)
        self.add_span_processor(BatchSpanProcessor(OtlpSpanExporter(environ)))
        frame = SpanFrame(resource.attributes, ("tokenweir", __version__), resource.schema_url)
        self.batcher = SpanBatcher(frame.body, OtlpPoster(environ), batch_settings(environ))
        self._tracing = DirectTracing(self.batcher.add, head_sampler(environ))

    def request_tracing(self) -> TraceSource:
        return self._tracing

    def dropped_spans(self) -> dict[str, int]:
        """The request spans lost so far, by why (proxy/telemetry/spanbatch.py)."""
        return self.batcher.dropped()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self.batcher.flush()
        return super().force_flush(timeout_millis)

    def shutdown(self) -> None:
        self.batcher.shutdown()
        super().shutdown()
