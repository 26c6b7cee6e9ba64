"""The request span names the model the client asked for and the one that answered, as the
OpenTelemetry GenAI conventions say, on both span paths; a model name a client invents never
becomes a span name; the access log names the model asked for wherever another served."""

from __future__ import annotations

import logging
import random
import string
import time
from collections.abc import Iterator

import anthropic
import httpx
import orjson
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.app import create_app
from proxy.context import RequestContext, TraceHooks
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from proxy.telemetry.sdk import OtelSdk
from proxy.tools.mock import backend as mockbackend
from tests.conftest import ALPHA_KEY, make_policy
from tests.servers import free_port, serve
from tests.telemetry.conftest import Traced
from tests.telemetry.twopaths import RECEIVED_S, context, finish, via_api, via_direct

HEADERS = {"authorization": f"Bearer {ALPHA_KEY}"}
ACCESS = "tokenweir.access"


@pytest.fixture(scope="module")
def fallback_gateway() -> Iterator[Traced]:
    """`big`'s only backend is down, so `small` serves it; `mock-llm` is served as asked."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    down = f"http://127.0.0.1:{free_port()}"  # nobody listens
    backend = mockbackend.create_app(ttft_ms=0, tokens_per_second=2000)
    with serve(backend) as backend_url:
        text = f"""
upstream: {{probe_interval: 0}}
backends:
  - {{name: down, url: "{down}/v1", models: [big]}}
  - {{name: mock, url: "{backend_url}/v1", models: [small, mock-llm]}}
models: {{big: {{fallback_models: [small]}}, small: {{}}, mock-llm: {{}}}}
tenants:
  t: {{api_keys: [{hash_key(ALPHA_KEY)}], models: [big, mock-llm]}}
"""
        policy = parse_policy(text, environ={})
        with serve(create_app(policy, otel=OtelSdk(provider, None))) as url:
            yield Traced(url, exporter, None)  # type: ignore[arg-type]
    provider.shutdown()


@pytest.fixture
def traced(fallback_gateway: Traced) -> Traced:
    fallback_gateway.exporter.clear()
    return fallback_gateway


def spans_of(traced: Traced, request_id: str) -> tuple[ReadableSpan, list[ReadableSpan]]:
    """The request's span and its backend call spans, once written (just after the client has
    its answer; a span of an earlier test's request may still come after it)."""
    deadline = time.monotonic() + 10
    while True:
        spans = traced.exporter.get_finished_spans()
        mine = [s for s in spans if (s.attributes or {}).get("tokenweir.request_id") == request_id]
        if mine or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    [span] = mine
    calls = [s for s in spans if s.parent is not None and s.parent.span_id == span.context.span_id]
    return span, [s for s in calls if s.kind.name == "CLIENT"]


def access_line(caplog: pytest.LogCaptureFixture, request_id: str) -> dict[str, object]:
    """The request's access line, once written (just after the client has its answer)."""
    deadline = time.monotonic() + 10
    while True:
        lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS]
        mine = [line for line in lines if line["request_id"] == request_id]
        if mine or time.monotonic() > deadline:
            [line] = mine
            return line
        time.sleep(0.02)


def test_a_fallback_names_the_model_asked_for_and_the_one_that_answered(
    traced: Traced, caplog: pytest.LogCaptureFixture
) -> None:
    """The span said the client had asked for the fallback (`chat small`, request.model
    small): nothing anywhere said it had asked for `big`."""
    caplog.set_level(logging.INFO, logger=ACCESS)
    body = {"model": "big", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    answer = httpx.post(traced.url + "/v1/chat/completions", json=body, headers=HEADERS)
    assert answer.json()["model"] == "small"
    span, [call] = spans_of(traced, answer.headers["x-request-id"])
    assert span.name == "chat big"
    assert span.attributes is not None
    assert span.attributes["gen_ai.request.model"] == "big"
    assert span.attributes["gen_ai.response.model"] == "small"
    line = access_line(caplog, answer.headers["x-request-id"])
    assert (line["model"], line["model_requested"]) == ("small", "big")
    # The backend call's span named the backend tried first (down) with the answer's 200.
    assert call.attributes is not None
    assert call.attributes["tokenweir.backend"] == "mock"
    assert call.attributes["http.response.status_code"] == 200


def test_a_messages_stream_names_the_model_that_answered(traced: Traced) -> None:
    """A Messages stream names its model in its first event only, never in the last bytes the
    span read it from: its span had no `gen_ai.response.model`."""
    body = {"model": "mock-llm", "max_tokens": 100, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    with httpx.stream("POST", traced.url + "/v1/messages", json=body, headers=HEADERS) as answer:
        assert b"event: message_stop" in answer.read()
    span, _ = spans_of(traced, answer.headers["x-request-id"])
    assert span.name == "messages mock-llm"
    assert span.attributes is not None
    assert span.attributes["gen_ai.response.model"] == "mock-llm"
    assert span.attributes["gen_ai.response.finish_reasons"] == ("max_tokens",)


def test_a_messages_answer_has_its_stop_reason_as_finish_reason(traced: Traced) -> None:
    """A Messages answer says why it ended in `stop_reason`: its span had no finish reasons."""
    with anthropic.Anthropic(base_url=traced.url, api_key=ALPHA_KEY, max_retries=0) as client:
        raw = client.messages.with_raw_response.create(
            model="mock-llm", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
        )
    assert raw.parse().stop_reason == "max_tokens"
    span, _ = spans_of(traced, raw.headers["x-request-id"])
    assert span.attributes is not None
    assert span.attributes["gen_ai.response.finish_reasons"] == ("max_tokens",)


def test_invented_model_names_make_one_span_name(traced: Traced) -> None:
    """Each unknown model a client sent made a span name of its own (`chat x7Gq...`), a new
    operation in a trace store for every name: 10,000 names, 10,000 operations."""
    names = {"".join(random.choices(string.ascii_letters, k=16)) for _ in range(20)}  # noqa: S311
    spans = []
    for name in names:
        body = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
        answer = httpx.post(traced.url + "/v1/chat/completions", json=body, headers=HEADERS)
        assert answer.status_code == 404
        spans.append(spans_of(traced, answer.headers["x-request-id"])[0])
    assert {span.name for span in spans} == {"chat"}
    assert {span.attributes["gen_ai.request.model"] for span in spans} == names  # type: ignore[index]


def _unknown_model(trace: TraceHooks, ctx: RequestContext) -> dict[str, str]:
    ctx.outgoing.model = ctx.outgoing.asked_model = "made-up-by-a-client"
    ctx.outcome.status, ctx.outcome.error_code = 404, "model_not_found"
    finish(trace, ctx, RECEIVED_S + 0.001)
    return {}


def _fell_back(trace: TraceHooks, ctx: RequestContext) -> dict[str, str]:
    headers = trace.upstream_started(ctx, RECEIVED_S + 0.0005)
    ctx.outgoing.set_model("mock-small")  # its backend down: the fallback model's answers
    assert ctx.backend is not None
    ctx.backend = ctx.backend.model_copy(update={"name": "mock-b", "url": "http://10.0.0.2/v1"})
    ctx.outcome.status, ctx.input_tokens, ctx.output_tokens = 200, 3, 4
    trace.upstream_ended(RECEIVED_S + 0.002, 200, None)
    finish(trace, ctx, RECEIVED_S + 0.0021)
    return headers


@pytest.mark.parametrize(
    ("drive", "name", "asked", "answered"),
    [(_unknown_model, "chat", "made-up-by-a-client", None),
     (_fell_back, "chat mock-llm", "mock-llm", "mock-small")],
    ids=["unknown-model", "fallback"],
)  # fmt: skip
def test_both_span_paths_name_the_request_alike(
    drive: object, name: str, asked: str, answered: str | None
) -> None:
    policy = make_policy("http://127.0.0.1:9")

    def new_ctx() -> RequestContext:
        return context(policy, "alpha", {})

    outcomes = [via(dict(), 7, new_ctx, drive) for via in (via_api, via_direct)]  # type: ignore[arg-type]
    assert outcomes[0].spans == outcomes[1].spans
    request = ExportTraceServiceRequest.FromString(outcomes[1].spans)
    [span] = [s for s in request.resource_spans[0].scope_spans[0].spans if s.kind == 2]
    attributes = {a.key: a.value.string_value for a in span.attributes}
    assert span.name == name
    assert attributes["gen_ai.request.model"] == asked
    assert attributes.get("gen_ai.response.model") == answered
    calls = [s for s in request.resource_spans[0].scope_spans[0].spans if s.kind == 3]
    for call in calls:  # the backend that answered, not the one the call began with
        backend = {a.key: a.value.string_value for a in call.attributes}["tokenweir.backend"]
        assert backend == "mock-b"
