"""OTLP span encoding: tokenweir's encoder against the OpenTelemetry SDK's, on the gateway's spans.

    python benchmarks/otlp_encode.py [--requests 2000] [--repeats 7]

Builds `--requests` requests' worth of spans the way the gateway does (a SERVER request span
with the ~27 GenAI and tokenweir attributes, a CLIENT backend-call span), then times encoding
them all for OTLP/HTTP protobuf: `proxy.telemetry.otlpwire.encode_spans` and the SDK's
`encode_spans(...).SerializePartialToString()`. Reports the best of `--repeats` per request, and
checks the two outputs decode to the same message.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, set_span_in_context

from proxy.telemetry.otlpwire import encode_spans

# Shaped like span_attributes() of proxy/telemetry/tracing.py for a finished stream.
REQUEST_ATTRIBUTES: dict[str, str | int | float | bool | tuple[str, ...]] = {
    "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
    "gen_ai.request.model": "qwen2.5-7b-instruct", "gen_ai.response.model": "qwen2.5-7b-instruct",
    "gen_ai.request.max_tokens": 256, "gen_ai.request.stream": True,
    "gen_ai.usage.input_tokens": 512, "gen_ai.usage.output_tokens": 256,
    "gen_ai.response.time_to_first_chunk": 0.0123, "gen_ai.response.finish_reasons": ("stop",),
    "server.address": "10.0.0.7", "server.port": 8000, "http.response.status_code": 200,
    "tokenweir.request_id": "req_5f0c3a1e9b8d4c2aa1b2c3d4e5f60718", "tokenweir.tenant": "support",
    "tokenweir.backend": "vllm-a", "tokenweir.cache": "miss", "tokenweir.ttft_s": 0.0131,
    "tokenweir.upstream_ttft_s": 0.0119, "tokenweir.tokens_per_second": 748.2,
    "tokenweir.gateway_s": 0.00041, "tokenweir.cost_usd": 0.000154,
    "tokenweir.client_disconnected": False,
}  # fmt: skip


def gateway_spans(requests: int) -> list[ReadableSpan]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("tokenweir", "0")
    for _ in range(requests):
        request = tracer.start_span("chat qwen2.5-7b-instruct", kind=SpanKind.SERVER)
        upstream = tracer.start_span(
            "POST /chat/completions", set_span_in_context(request), kind=SpanKind.CLIENT,
            attributes={"http.request.method": "POST", "tokenweir.backend": "vllm-a",
                        "url.full": "http://10.0.0.7:8000/v1/chat/completions"},
        )  # fmt: skip
        upstream.set_attribute("http.response.status_code", 200)
        upstream.end()
        request.set_attributes(REQUEST_ATTRIBUTES)
        request.end()
    return list(exporter.get_finished_spans())


def best_us_per_request(encode: Callable[[], bytes], requests: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        encode()
        best = min(best, time.perf_counter() - began)
    return best / requests * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    spans = gateway_spans(args.requests)
    ours = ExportTraceServiceRequest.FromString(encode_spans(spans))
    if ours != sdk_encode(spans):
        raise SystemExit("the two encoders disagree")
    wire = best_us_per_request(lambda: encode_spans(spans), args.requests, args.repeats)
    sdk = best_us_per_request(
        lambda: sdk_encode(spans).SerializePartialToString(), args.requests, args.repeats
    )
    print(
        f"| encoder | µs per request (2 spans) |\n|---|---:|\n| tokenweir otlpwire | {wire:.1f} |"
    )
    print(f"| OpenTelemetry SDK | {sdk:.1f} |\n\nratio: {wire / sdk:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
