"""The SDK span exporter tokenweir's provider uses: spans encoded by otlpwire, posted by otlppost.

Where spans go and how (endpoint, headers, timeout, compression, TLS, retries) is read from
the OTEL_EXPORTER_OTLP_* variables by proxy/telemetry/otlppost.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from proxy.telemetry.otlppost import OtlpPoster
from proxy.telemetry.otlpwire import encode_spans

__all__ = ["OtlpSpanExporter"]


class OtlpSpanExporter(SpanExporter):
    """Called from the BatchSpanProcessor's thread only; `shutdown` may come from another."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._poster = OtlpPoster(environ)
        self.endpoint = self._poster.endpoint

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._poster.send(encode_spans(spans), len(spans)):
            return SpanExportResult.SUCCESS
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self._poster.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
