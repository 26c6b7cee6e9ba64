"""The hand-written OTLP encoder writes what the SDK's own encoder writes, field for field."""

from __future__ import annotations

import openai
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

from proxy.telemetry.otlpwire import encode_spans
from tests.conftest import ALPHA_KEY
from tests.telemetry.conftest import Traced


def decoded(raw: bytes) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest.FromString(raw)


def assert_same_as_the_sdk(spans: list[ReadableSpan]) -> ExportTraceServiceRequest:
    ours = decoded(encode_spans(spans))
    assert ours == sdk_encode(spans)
    return ours


def odd_spans() -> list[ReadableSpan]:
    """Every kind of field and value: events, links, remote parents, errors, odd numbers."""
    exporter = InMemorySpanExporter()
    resource = Resource.create({"service.name": "tokenweir", "deployment": "测试"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("tokenweir", "9.9", schema_url="https://opentelemetry.io/s/1")
    other = provider.get_tracer("other")
    remote = SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C,
        span_id=0xB7AD6B7169203331,
        is_remote=True,
        trace_flags=TraceFlags(1),
        trace_state=TraceState([("vendor", "x-1"), ("rojo", "00f067aa0ba902b7")]),
    )
    with tracer.start_as_current_span(
        "chat qwen",
        context=set_span_in_context(NonRecordingSpan(remote)),
        kind=SpanKind.SERVER,
        links=[Link(remote, {"why": "retry", "n": 2})],
        attributes={
            "text": "你好, world",
            "empty": "",
            "long": "x" * 300,
            "yes": True,
            "no": False,
            "zero": 0,
            "big": 2**62,
            "negative": -5,
            "pi": 3.25,
            "negative_float": -0.0,
            "strings": ("stop", "length"),
            "ints": [1, -2, 300],
            "floats": [0.5],
            "bools": [True, False],
        },
    ) as span:
        span.add_event("first token", {"at": 1.5})
        span.add_event("bare")
        with other.start_as_current_span("POST /chat/completions", kind=SpanKind.CLIENT) as child:
            child.set_status(Status(StatusCode.ERROR, "upstream_timeout"))
        span.set_status(Status(StatusCode.OK))
    tracer.start_span("internal").end()
    return list(exporter.get_finished_spans())


def test_odd_spans_encode_as_the_sdk_encodes_them() -> None:
    spans = odd_spans()
    ours = decoded(encode_spans(spans))
    [resource_spans] = ours.resource_spans
    [link] = [link for ss in resource_spans.scope_spans for span in ss.spans for link in span.links]
    # OTLP's Link has a trace_state; the SDK's encoder leaves it out, this one does not.
    assert link.trace_state == "vendor=x-1,rojo=00f067aa0ba902b7"
    link.trace_state = ""
    assert ours == sdk_encode(spans)
    assert [len(scope.spans) for scope in resource_spans.scope_spans] == [1, 2]
    assert encode_spans([]) == sdk_encode([]).SerializeToString() == b""


def test_the_gateways_own_spans_encode_as_the_sdk_encodes_them(traced: Traced) -> None:
    client = openai.OpenAI(base_url=traced.url + "/v1", api_key=ALPHA_KEY, max_retries=0)
    with client:
        messages = [{"role": "user", "content": "hello"}]
        list(client.chat.completions.create(
            model="mock-llm", messages=messages, max_tokens=5, stream=True,  # type: ignore[arg-type]
        ))  # fmt: skip
        client.chat.completions.create(model="mock-llm", messages=messages, max_tokens=5)  # type: ignore[arg-type]
    spans = traced.spans(4)
    request = assert_same_as_the_sdk(spans)
    names = {s.name for r in request.resource_spans for ss in r.scope_spans for s in ss.spans}
    assert names == {"chat mock-llm", "POST /chat/completions"}
