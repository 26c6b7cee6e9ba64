"""The same per-request figures as OpenTelemetry metrics, for an OTLP exporter (when configured).

Built only when the process configured a meter provider (proxy/telemetry/sdk.py); Prometheus
needs none of this. Instruments carry the GenAI names and the spec's bucket boundaries.
"""

from __future__ import annotations

from opentelemetry.metrics import Histogram, MeterProvider

from proxy import __version__
from proxy.telemetry import semconv
from proxy.telemetry.sample import RequestSample

__all__ = ["OtelMetrics"]


# (name, unit, description, bucket boundaries) of each histogram, keyed as `_record` uses them.
_HISTOGRAMS: dict[str, tuple[str, str, str, tuple[float, ...]]] = {
    "tokens": ("gen_ai.client.token.usage", "{token}", "Input and output tokens per request.",
               semconv.TOKENS),
    "client_duration": ("gen_ai.client.operation.duration", "s",
                        "Backend call: sent to last byte read.", semconv.DURATION_S),
    "client_ttfc": ("gen_ai.client.operation.time_to_first_chunk", "s",
                    "Streams: sent to first chunk.", semconv.DURATION_S),
    "client_tpoc": ("gen_ai.client.operation.time_per_output_chunk", "s",
                    "Streams: gap between chunks.", semconv.CHUNK_S),
    "server_duration": ("gen_ai.server.request.duration", "s",
                        "Received to last byte written.", semconv.DURATION_S),
    "server_ttft": ("gen_ai.server.time_to_first_token", "s",
                    "Received to first token written.", semconv.SERVER_TTFT_S),
    "server_tpot": ("gen_ai.server.time_per_output_token", "s",
                    "Per output token after the first.", semconv.CHUNK_S),
    "overhead": ("tokenweir.gateway.overhead", "s", "Time spent in the gateway's own code.",
                 semconv.OVERHEAD_S),
}  # fmt: skip


class OtelMetrics:
    def __init__(self, provider: MeterProvider) -> None:
        meter = provider.get_meter("tokenweir", __version__)
        self._histograms: dict[str, Histogram] = {
            key: meter.create_histogram(
                name, unit, description, explicit_bucket_boundaries_advisory=bounds
            )
            for key, (name, unit, description, bounds) in _HISTOGRAMS.items()
        }
        self._requests = meter.create_counter("tokenweir.requests", "{request}")
        self._cost = meter.create_counter("tokenweir.cost", "USD")

    def record(self, sample: RequestSample) -> None:
        tenant, operation, model, backend, status = sample.labels
        attributes: dict[str, str] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": semconv.PROVIDER,
            "gen_ai.request.model": model,
            "tokenweir.tenant": tenant,
            "tokenweir.backend": backend,
            "tokenweir.status_class": status,
            "tokenweir.cache": sample.cache,
        }
        if sample.error_type:
            attributes["error.type"] = sample.error_type
        self._requests.add(1, attributes)
        self._cost.add(sample.cost_usd, attributes)
        histograms = self._histograms
        for kind, tokens in (("input", sample.input_tokens), ("output", sample.output_tokens)):
            if tokens is not None:
                histograms["tokens"].record(tokens, {**attributes, "gen_ai.token.type": kind})
        for key, value in (
            ("server_duration", sample.duration_s),
            ("overhead", sample.gateway_s),
            ("client_duration", sample.upstream_s),
            ("client_ttfc", sample.upstream_ttft_s),
            ("server_ttft", sample.ttft_s),
            ("server_tpot", sample.time_per_token_s),
        ):
            if value is not None:
                histograms[key].record(value, attributes)
        if sample.gaps is not None:
            # One value per stream, its median gap: the SDK has no bulk record, and one record()
            # per gap (~20-40 µs each) held the event loop ~10 ms after a 256-token stream.
            # /metrics (Prometheus) counts every gap.
            median = sample.gaps.quantile_s(0.5)
            if median is not None:
                histograms["client_tpoc"].record(median, attributes)
