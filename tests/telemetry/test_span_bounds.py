"""A backend's error code and model name reach the trace cut to 64 characters, on the backend
call's span as on the request's, through a real gateway and a real collector, on both span paths."""

from __future__ import annotations

import time
from contextlib import nullcontext

import openai
import orjson
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.app import create_app
from proxy.telemetry.sdk import start_sdk
from proxy.telemetry.semconv import MAX_TEXT_CHARS
from tests.conftest import ALPHA_KEY, make_policy
from tests.servers import serve
from tests.telemetry.collector import collector

CODE = "c" * 1999  # under the 2,000 characters the client is given
MODEL = "m" * 200  # as long as the gateway reads from a response


def answering(status: int, answer: dict[str, object]) -> ASGIApp:
    """A backend that answers every call `status` with JSON `answer`."""

    async def backend(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = orjson.dumps(answer)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return backend


refusing_backend = answering(
    400, {"error": {"message": "no", "type": "invalid_request_error", "code": CODE}}
)
long_model_backend = answering(200, {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
})  # fmt: skip


def spans_of_a_refused_request(path: str) -> list[Span]:
    return spans_of_a_request(path, refusing_backend, refused=True)


def spans_of_a_request(path: str, backend: ASGIApp, *, refused: bool = False) -> list[Span]:
    with serve(backend) as backend_url, collector() as server:
        environ = {
            "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
            "TOKENWEIR_TRACE_PATH": path,
        }  # fmt: skip
        sdk = start_sdk(environ)
        with serve(create_app(make_policy(backend_url), otel=sdk)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key=ALPHA_KEY, max_retries=0)
            with client, pytest.raises(openai.BadRequestError) if refused else nullcontext() as no:
                answer = client.chat.completions.create(
                    model="mock-llm", messages=[{"role": "user", "content": "hi"}]
                )
                assert answer.model == MODEL  # the client is given the backend's answer whole
        if no is not None:
            assert no.value.code == CODE  # the client is given the backend's code whole
        sdk.shutdown()  # posts every span still batched
        deadline = time.monotonic() + 10
        while not server.spans():
            assert time.monotonic() < deadline, "no spans reached the collector"
            time.sleep(0.05)
        return [
            s for _, r in server.spans() for rs in r.resource_spans
            for ss in rs.scope_spans for s in ss.spans
        ]  # fmt: skip


@pytest.mark.parametrize("path", ["sdk", "direct"])
def test_a_backends_long_error_code_is_cut_on_every_span(path: str) -> None:
    spans = {span.name: span for span in spans_of_a_refused_request(path)}
    for name in ("chat mock-llm", "POST /chat/completions"):
        attributes = {a.key: a.value.string_value for a in spans[name].attributes}
        error = attributes["error.type"]
        assert error.startswith("ccc"), (name, error)
        assert len(error) <= MAX_TEXT_CHARS, (name, len(error))
        assert len(spans[name].status.message) <= MAX_TEXT_CHARS


@pytest.mark.parametrize("path", ["sdk", "direct"])
def test_a_backends_long_model_name_is_cut_on_the_span(path: str) -> None:
    """The response's model, read from its last bytes, was kept up to 200 characters."""
    [request] = [
        s for s in spans_of_a_request(path, long_model_backend) if s.name.startswith("chat")
    ]
    model = {a.key: a.value.string_value for a in request.attributes}["gen_ai.response.model"]
    assert model.startswith("mmm")
    assert len(model) <= MAX_TEXT_CHARS
