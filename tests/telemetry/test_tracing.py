"""One GenAI span per request, child spans for its I/O, trace context carried to the backend."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from proxy.app import create_app
from proxy.tools.mock import backend as mockbackend
from tests.conftest import ALPHA_KEY, make_policy
from tests.servers import serve
from tests.telemetry.conftest import (
    CACHED_KEY,
    GAMMA_KEY,
    LIMITED_KEY,
    HeaderRecorder,
    Traced,
)

SECRET_PROMPT = "my-confidential-prompt-4412"
MESSAGES = [{"role": "user", "content": SECRET_PROMPT}]


def by_name(spans: list[ReadableSpan]) -> dict[str, ReadableSpan]:
    return {span.name: span for span in spans}


def assert_nothing_secret(spans: list[ReadableSpan]) -> None:
    for span in spans:
        text = repr(dict(span.attributes or {}))
        assert SECRET_PROMPT not in text
        assert ALPHA_KEY not in text
        assert GAMMA_KEY not in text
        assert "backend-secret-key" not in text


def sdk(traced: Traced, key: str = ALPHA_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=traced.url + "/v1", api_key=key, max_retries=0)


def test_stream_span_with_genai_attributes_and_upstream_child(traced: Traced) -> None:
    with sdk(traced) as client:
        list(client.chat.completions.create(
            model="mock-llm", messages=MESSAGES, max_tokens=20, stream=True,
        ))  # fmt: skip
    spans = by_name(traced.spans(2))
    request, upstream = spans["chat mock-llm"], spans["POST /chat/completions"]
    assert request.kind is SpanKind.SERVER
    assert upstream.kind is SpanKind.CLIENT
    assert upstream.parent is not None
    assert upstream.parent.span_id == request.context.span_id
    attributes = dict(request.attributes or {})
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.provider.name"] == "openai"
    assert attributes["gen_ai.request.model"] == "mock-llm"
    assert attributes["gen_ai.response.model"] == "mock-llm"
    assert attributes["gen_ai.request.max_tokens"] == 20
    assert attributes["gen_ai.request.stream"] is True
    assert attributes["gen_ai.usage.output_tokens"] == 20
    assert isinstance(attributes["gen_ai.usage.input_tokens"], int)
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["server.address"] == "127.0.0.1"
    assert isinstance(attributes["server.port"], int)
    assert attributes["tokenweir.tenant"] == "alpha"
    assert attributes["tokenweir.backend"] == "mock-a"
    assert attributes["tokenweir.cache"] == "bypass"
    for timing in ("gen_ai.response.time_to_first_chunk", "tokenweir.ttft_s",
                   "tokenweir.gateway_s"):  # fmt: skip
        assert isinstance(attributes[timing], float), timing
    # Absent when the text reached the gateway in one read (no span to divide by), which a
    # loaded machine does to 20 tokens sent at 2,000/s.
    assert isinstance(attributes.get("tokenweir.tokens_per_second", 0.0), float)
    assert "error.type" not in attributes
    assert request.status.status_code is StatusCode.UNSET
    assert request.end_time is not None
    assert upstream.end_time is not None
    assert request.start_time is not None
    assert upstream.start_time is not None
    assert request.start_time <= upstream.start_time <= upstream.end_time <= request.end_time
    # The backend got the upstream span's context as W3C traceparent.
    [headers] = traced.backend.seen
    trace_id, span_id = f"{request.context.trace_id:032x}", f"{upstream.context.span_id:016x}"
    assert headers["traceparent"].startswith(f"00-{trace_id}-{span_id}-")
    assert_nothing_secret(list(spans.values()))


def test_non_stream_span(traced: Traced) -> None:
    with sdk(traced) as client:
        client.completions.create(model="mock-llm", prompt=SECRET_PROMPT, max_tokens=7)
    spans = by_name(traced.spans(2))
    attributes = dict(spans["text_completion mock-llm"].attributes or {})
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.request.stream"] is False
    assert attributes["gen_ai.usage.output_tokens"] == 7
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert "gen_ai.response.time_to_first_chunk" not in attributes
    assert spans["POST /completions"].attributes["http.response.status_code"] == 200  # type: ignore[index]
    assert_nothing_secret(list(spans.values()))


def test_rejected_request_has_an_error_span_and_no_upstream(traced: Traced) -> None:
    body = {"model": "mock-llm", "messages": MESSAGES}
    headers = {"authorization": "Bearer wrong-key"}
    assert (
        httpx.post(traced.url + "/v1/chat/completions", json=body, headers=headers).status_code
        == 401
    )
    [span] = traced.spans(1)
    assert span.name == "chat"
    assert span.attributes is not None
    assert span.attributes["error.type"] == "invalid_api_key"
    assert span.attributes["http.response.status_code"] == 401
    assert span.status.status_code is StatusCode.ERROR
    assert "wrong-key" not in repr(dict(span.attributes))
    assert traced.backend.seen == []


def test_backend_error_marks_both_spans(traced: Traced) -> None:
    with sdk(traced) as client, pytest.raises(openai.APIStatusError) as failed:
        client.chat.completions.create(
            model="mock-llm", messages=MESSAGES, extra_body={"mock_fail": 500}
        )
    assert failed.value.status_code == 502
    spans = by_name(traced.spans(2))
    request, upstream = spans["chat mock-llm"], spans["POST /chat/completions"]
    assert request.status.status_code is StatusCode.ERROR
    assert upstream.status.status_code is StatusCode.ERROR
    assert request.attributes is not None
    assert request.attributes["error.type"] == "upstream_error"


def test_stream_that_dies_mid_way_is_an_error(traced: Traced) -> None:
    body = {"model": "mock-llm", "messages": MESSAGES, "stream": True, "max_tokens": 50,
            "mock_fail_after_tokens": 5}  # fmt: skip
    headers = {"authorization": f"Bearer {ALPHA_KEY}"}
    with httpx.stream("POST", traced.url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        r.read()
    spans = by_name(traced.spans(2))
    request, upstream = spans["chat mock-llm"], spans["POST /chat/completions"]
    assert request.status.status_code is StatusCode.ERROR
    assert upstream.status.status_code is StatusCode.ERROR
    assert request.attributes is not None
    assert request.attributes["gen_ai.usage.output_tokens"] == 5


def test_disconnected_stream_still_ends_its_span(traced: Traced) -> None:
    body = {"model": "mock-llm", "messages": MESSAGES, "stream": True, "max_tokens": 20_000,
            "mock_completion_tokens": 20_000}  # fmt: skip
    headers = {"authorization": f"Bearer {ALPHA_KEY}"}
    with httpx.stream("POST", traced.url + "/v1/chat/completions", json=body, headers=headers) as r:
        lines = r.iter_lines()
        for _ in range(10):
            next(lines)
    spans = by_name(traced.spans(2))
    request, upstream = spans["chat mock-llm"], spans["POST /chat/completions"]
    assert request.attributes is not None
    assert request.attributes["tokenweir.client_disconnected"] is True
    assert 0 < request.attributes["gen_ai.usage.output_tokens"] < 20_000  # type: ignore[operator]
    assert upstream.status.status_code is StatusCode.ERROR


def test_client_trace_context_is_continued(traced: Traced) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"authorization": f"Bearer {ALPHA_KEY}",
               "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}  # fmt: skip
    body = {"model": "mock-llm", "messages": MESSAGES, "max_tokens": 3}
    httpx.post(traced.url + "/v1/chat/completions", json=body, headers=headers).raise_for_status()
    spans = traced.spans(2)
    assert {f"{span.context.trace_id:032x}" for span in spans} == {trace_id}
    assert traced.backend.seen[0]["traceparent"].split("-")[1] == trace_id


def test_a_malformed_tracestate_is_dropped_without_a_log_line(
    traced: Traced, caplog: pytest.LogCaptureFixture
) -> None:
    """Any client could write its own text into the gateway's log once a request through the
    propagator's warnings; the trace is still continued, without the tracestate."""
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"authorization": f"Bearer {ALPHA_KEY}",
               "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01",
               "tracestate": "injected text from a client"}  # fmt: skip
    body = {"model": "mock-llm", "messages": MESSAGES, "max_tokens": 3}
    with caplog.at_level(logging.WARNING):
        response = httpx.post(traced.url + "/v1/chat/completions", json=body, headers=headers)
        spans = traced.spans(2)
    assert response.status_code == 200
    assert [r for r in caplog.records if "injected text" in r.getMessage()] == []
    assert {f"{span.context.trace_id:032x}" for span in spans} == {trace_id}
    assert "tracestate" not in traced.backend.seen[0]


def test_a_refused_max_tokens_beyond_int64_is_no_span_attribute(traced: Traced) -> None:
    """OTLP's int attributes are int64: 2**63 went out as -2**63 on the refused request's span."""
    body = {"model": "mock-llm", "messages": MESSAGES, "max_tokens": 2**63}
    headers = {"authorization": f"Bearer {ALPHA_KEY}"}
    response = httpx.post(traced.url + "/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 400
    [span] = traced.spans(1)
    assert span.attributes is not None
    assert "gen_ai.request.max_tokens" not in span.attributes
    assert span.attributes["http.response.status_code"] == 400


def test_storage_stages_get_child_spans(traced: Traced) -> None:
    with sdk(traced, GAMMA_KEY) as client:
        client.chat.completions.create(model="mock-llm", messages=MESSAGES, max_tokens=3)
    spans = by_name(traced.spans(5))
    request = spans["chat mock-llm"]
    for name in ("tokenweir.budget.reserve", "tokenweir.rate_limit.admit", "tokenweir.settle"):
        child = spans[name]
        assert child.parent is not None
        assert child.parent.span_id == request.context.span_id
    assert request.attributes is not None
    assert request.attributes["tokenweir.tenant"] == "gamma"


def test_a_request_the_rate_limit_refuses_still_has_its_stage_span(traced: Traced) -> None:
    """The refusing stage raises; its span is drawn all the same (and the budget's, before it),
    and the backend is not called."""
    body = {"model": "mock-llm", "messages": MESSAGES, "max_tokens": 3}
    headers = {"authorization": f"Bearer {LIMITED_KEY}"}
    url = traced.url + "/v1/chat/completions"
    assert httpx.post(url, json=body, headers=headers).status_code == 200
    deadline = time.monotonic() + 5  # the request span ends last: then all of it is in
    while "chat mock-llm" not in by_name(traced.spans(0)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    traced.exporter.clear()
    traced.backend.seen.clear()
    assert httpx.post(url, json=body, headers=headers).status_code == 429
    spans = by_name(traced.spans(3))
    request = spans["chat mock-llm"]
    assert request.attributes is not None
    assert request.attributes["error.type"] == "rate_limit_exceeded"
    for name in ("tokenweir.budget.reserve", "tokenweir.rate_limit.admit"):
        assert spans[name].parent is not None
        assert spans[name].parent.span_id == request.context.span_id
    assert "POST /chat/completions" not in spans
    assert traced.backend.seen == []


def test_a_cache_hit_has_a_lookup_span_and_no_backend_call(traced: Traced) -> None:
    with sdk(traced, CACHED_KEY) as client:
        for _ in range(2):
            client.chat.completions.create(
                model="mock-llm", messages=MESSAGES, max_tokens=3, temperature=0
            )
    spans = traced.spans(6)
    requests = [s for s in spans if s.name == "chat mock-llm"]
    assert [r.attributes["tokenweir.cache"] for r in requests] == ["miss", "hit"]  # type: ignore[index]
    hit = requests[1]
    children = [
        s for s in spans if s.parent is not None and s.parent.span_id == hit.context.span_id
    ]
    assert [c.name for c in children] == ["tokenweir.cache.lookup"]
    # Only the miss reached the backend (a body-less GET, seen once under load, is no call).
    posts = [h for h in traced.backend.seen if h.get("content-type") == "application/json"]
    assert len(posts) == 1
    assert_nothing_secret(spans)


@pytest.fixture(scope="module")
def untraced() -> Iterator[tuple[str, HeaderRecorder]]:
    """A gateway with no tracing set up, in front of a backend that records headers."""
    backend = HeaderRecorder(mockbackend.create_app(ttft_ms=0, tokens_per_second=2000))
    with serve(backend) as backend_url, serve(create_app(make_policy(backend_url))) as url:
        yield url, backend


@pytest.mark.parametrize(
    ("sent", "passed"),
    [
        (
            {
                "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "tracestate": "vendor=abc,other=1",
            },
            {
                "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "tracestate": "vendor=abc,other=1",
            },
        ),
        (
            {
                "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
                "tracestate": "injected text from a client",
            },
            {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"},
        ),
        ({"traceparent": "00-not-a-trace-01"}, {}),
    ],
)
def test_without_tracing_the_clients_trace_context_reaches_the_backend(
    untraced: tuple[str, HeaderRecorder], sent: dict[str, str], passed: dict[str, str]
) -> None:
    """A gateway that does not trace stays out of the client's trace: a backend that traces
    (vLLM with OpenTelemetry) continues it; a malformed context is not passed on."""
    url, backend = untraced
    backend.seen.clear()
    headers = {"authorization": f"Bearer {ALPHA_KEY}", **sent}
    body = {"model": "mock-llm", "messages": MESSAGES, "max_tokens": 3}
    httpx.post(url + "/v1/chat/completions", json=body, headers=headers).raise_for_status()
    seen = backend.seen[0]
    assert {k: v for k, v in seen.items() if k in ("traceparent", "tracestate")} == passed


def test_a_tracer_provider_of_ones_own_gets_the_spans_under_the_clients_parent() -> None:
    """The docs say to pass your own tracer provider as `create_app(otel=...)`: a bare one
    failed the gateway's startup (AttributeError: no `tracer_provider`)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with (
        serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=2000)) as backend_url,
        serve(create_app(make_policy(backend_url), otel=provider)) as url,
    ):
        body = {"model": "mock-llm", "messages": MESSAGES, "max_tokens": 3}
        headers = {"authorization": f"Bearer {ALPHA_KEY}", "traceparent": parent}
        answer = httpx.post(url + "/v1/chat/completions", json=body, headers=headers)
        assert answer.status_code == 200
        deadline = time.monotonic() + 10
        while len(exporter.get_finished_spans()) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    provider.shutdown()
    spans = by_name(list(exporter.get_finished_spans()))
    request = spans["chat mock-llm"]
    assert request.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert request.parent is not None
    assert request.parent.span_id == 0xB7AD6B7169203331
    assert spans["POST /chat/completions"].parent.span_id == request.context.span_id  # type: ignore[union-attr]
