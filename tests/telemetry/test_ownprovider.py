"""tokenweir's own OTLP export records the same spans as the SDK path, through a real collector."""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
import openai
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from proxy.app import create_app
from proxy.telemetry.ownprovider import OwnTracerProvider
from proxy.telemetry.sdk import start_sdk
from proxy.tools.mock import backend as mockbackend
from tests.conftest import ALPHA_KEY, make_policy
from tests.servers import serve
from tests.telemetry.collector import collector
from tests.telemetry.conftest import GAMMA, GAMMA_KEY, HeaderRecorder

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
# Figures that differ from one run to the next; their presence and type are compared.
VARYING = {
    "tokenweir.request_id", "gen_ai.response.time_to_first_chunk", "tokenweir.ttft_s",
    "tokenweir.upstream_ttft_s", "tokenweir.gateway_s",
}  # fmt: skip
# Absent when a stream's tokens all reach the gateway in one read (no time between the first
# and the last to divide by), which a loaded machine can make happen on either path.
TIMING_DEPENDENT = {"tokenweir.tokens_per_second"}


@dataclass
class Run:
    spans: list[Span]
    backend_headers: list[dict[str, str]]
    started_ns: int
    ended_ns: int


def requests(url: str) -> None:
    """A stream, a non-stream call, a tenant with storage stages, a rejection, a backend error
    and a continued trace."""
    messages = [{"role": "user", "content": "hi"}]
    with openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0) as client:
        list(client.chat.completions.create(
            model="mock-llm", messages=messages, max_tokens=5, stream=True,  # type: ignore[arg-type]
        ))  # fmt: skip
        client.completions.create(model="mock-llm", prompt="hi", max_tokens=4)
        with pytest.raises(openai.APIStatusError):
            client.chat.completions.create(
                model="mock-llm",
                messages=messages,
                extra_body={"mock_fail": 500},  # type: ignore[arg-type]
            )
        client.chat.completions.create(
            model="mock-llm", messages=messages, max_tokens=3,  # type: ignore[arg-type]
            extra_headers={"traceparent": PARENT, "tracestate": "rojo=1"},
        )  # fmt: skip
    with openai.OpenAI(base_url=url + "/v1", api_key=GAMMA_KEY, max_retries=0) as client:
        client.chat.completions.create(model="mock-llm", messages=messages, max_tokens=3)  # type: ignore[arg-type]
    body = {"model": "mock-llm", "messages": messages}
    answer = httpx.post(url + "/v1/chat/completions", json=body, headers={"authorization": "x"})
    assert answer.status_code == 401


@pytest.fixture(scope="module")
def runs() -> dict[str, Run]:
    backend = HeaderRecorder(mockbackend.create_app(ttft_ms=0, tokens_per_second=2000))
    found: dict[str, Run] = {}
    with serve(backend) as backend_url, collector() as server:
        policy = make_policy(backend_url, extra=GAMMA)
        endpoint = f"http://127.0.0.1:{server.server_port}"
        for path in ("sdk", "direct"):
            environ = {
                "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none",
                "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "TOKENWEIR_TRACE_PATH": path,
            }  # fmt: skip
            sdk = start_sdk(environ)
            assert isinstance(sdk.tracer_provider, OwnTracerProvider) is (path == "direct")
            backend.seen.clear()
            started_ns = time.time_ns()
            with serve(create_app(policy, otel=sdk)) as url:
                requests(url)
            sdk.shutdown()  # posts every span still batched
            ended_ns = time.time_ns()
            spans = [s for _, r in server.spans() for rs in r.resource_spans
                     for ss in rs.scope_spans for s in ss.spans]  # fmt: skip
            with server.lock:
                server.posts.clear()
            found[path] = Run(spans, list(backend.seen), started_ns, ended_ns)
    return found


def shape(spans: list[Span]) -> list[tuple[object, ...]]:
    """Each span as what a user would read in a trace viewer, without ids and times."""
    by_id = {span.span_id: span for span in spans}
    shapes = []
    for span in spans:
        parent = by_id.get(span.parent_span_id)
        values = {a.key: a.value for a in span.attributes if a.key not in TIMING_DEPENDENT}
        fixed = sorted((k, str(v)) for k, v in values.items() if k not in VARYING)
        varying = sorted((k, v.WhichOneof("value")) for k, v in values.items() if k in VARYING)
        shapes.append((
            span.name, span.kind, parent.name if parent else bool(span.parent_span_id),
            span.status.code, span.status.message, span.trace_state, span.flags,
            tuple(fixed), tuple(varying),
        ))  # fmt: skip
    return sorted(shapes, key=repr)


def test_both_paths_deliver_the_same_spans(runs: dict[str, Run]) -> None:
    direct, sdk = runs["direct"], runs["sdk"]
    assert len(direct.spans) == len(sdk.spans) == 14  # 6 requests, 5 backend calls, 3 stages
    assert shape(direct.spans) == shape(sdk.spans)
    names = {span.name for span in direct.spans}
    assert {"tokenweir.budget.reserve", "tokenweir.settle", "chat", "text_completion mock-llm",
            "POST /chat/completions"} <= names  # fmt: skip


@pytest.mark.parametrize("path", ["sdk", "direct"])
def test_times_lie_within_the_request(runs: dict[str, Run], path: str) -> None:
    run = runs[path]
    by_id = {span.span_id: span for span in run.spans}
    for span in run.spans:
        assert run.started_ns <= span.start_time_unix_nano <= span.end_time_unix_nano
        assert span.end_time_unix_nano <= run.ended_ns
        parent = by_id.get(span.parent_span_id)
        if parent is not None:
            assert parent.start_time_unix_nano <= span.start_time_unix_nano
            assert span.end_time_unix_nano <= parent.end_time_unix_nano


@pytest.mark.parametrize("path", ["sdk", "direct"])
def test_the_backend_is_told_the_backend_calls_span(runs: dict[str, Run], path: str) -> None:
    run = runs[path]
    calls = {span.span_id.hex(): span for span in run.spans if span.kind == Span.SPAN_KIND_CLIENT}
    posts = [h for h in run.backend_headers if "traceparent" in h]
    assert len(posts) == len(calls) == 5
    for headers in posts:
        _, trace_id, span_id, flags = headers["traceparent"].split("-")
        assert calls[span_id].trace_id.hex() == trace_id
        assert int(flags, 16) & 1 == 1
    continued = [h for h in posts if h["traceparent"].split("-")[1] == PARENT.split("-")[1]]
    assert [h["tracestate"] for h in continued] == ["rojo=1"]


def test_sampled_out_requests_are_not_exported_and_say_so_upstream() -> None:
    backend = HeaderRecorder(mockbackend.create_app(ttft_ms=0, tokens_per_second=2000))
    with serve(backend) as backend_url, collector() as server:
        sdk = start_sdk({
            "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
            "OTEL_TRACES_SAMPLER": "parentbased_always_off",
        })  # fmt: skip
        with serve(create_app(make_policy(backend_url), otel=sdk)) as url:
            with openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0) as client:
                for headers in ({}, {"traceparent": PARENT}):
                    client.chat.completions.create(
                        model="mock-llm", messages=[{"role": "user", "content": "hi"}],  # type: ignore[list-item]
                        max_tokens=3, extra_headers=headers,
                    )  # fmt: skip
        sdk.shutdown()
        spans = [s for _, r in server.spans() for rs in r.resource_spans
                 for ss in rs.scope_spans for s in ss.spans]  # fmt: skip
    sampled_out, continued = (h["traceparent"] for h in backend.seen)
    assert int(sampled_out.rsplit("-", 1)[1], 16) & 1 == 0
    assert continued.split("-")[1] == PARENT.split("-")[1]
    assert int(continued.rsplit("-", 1)[1], 16) & 1 == 1
    assert sorted(s.name for s in spans) == ["POST /chat/completions", "chat mock-llm"]
    assert {s.trace_id.hex() for s in spans} == {PARENT.split("-")[1]}


def test_other_users_of_the_provider_get_ordinary_sdk_spans() -> None:
    with collector() as server:
        sdk = start_sdk({
            "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
        })  # fmt: skip
        assert sdk.tracer_provider is not None
        tracer = sdk.tracer_provider.get_tracer("an-instrumentation", "2.0")
        with tracer.start_as_current_span("work", attributes={"k": "v"}):
            pass
        sdk.shutdown()
        [(_, request)] = server.spans()
    [scope_spans] = request.resource_spans[0].scope_spans
    assert scope_spans.scope.name == "an-instrumentation"
    assert [(s.name, s.attributes[0].value.string_value) for s in scope_spans.spans] == [
        ("work", "v")
    ]
