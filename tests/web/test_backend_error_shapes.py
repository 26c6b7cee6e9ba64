"""A backend's own 4xx reaches the SDKs with the backend's message whatever shape its error body
has: OpenAI's nested `error` object, vLLM's and SGLang's flat `{"object": "error", "message"}`,
or FastAPI's `detail`, through a real gateway in front of a raw-socket backend; a backend's 529
(overloaded) is the gateway's own "unavailable"."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import orjson
import pytest

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.servers import serve
from tests.upstream.hostile import HostileBackend, whole

KEY = "tw-error-shapes"
MODEL = "hostile-llm"
MESSAGES = [{"role": "user", "content": "hi"}]
TOO_LONG = "This model's maximum context length is 4096 tokens. However, you requested 9000 tokens."
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "flat_400": (
        "400 Bad Request",
        {
            "object": "error",
            "message": TOO_LONG,
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        },
    ),
    "flat_429": (
        "429 Too Many Requests",
        {"object": "error", "message": "Slow down.", "code": 429},
    ),
    "detail_422": ("422 Unprocessable Entity", {"detail": "Field 'messages' is required."}),
    "overloaded_529": (
        "529 Site Overloaded",
        {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
    ),
}


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    extra = {name: whole(status, orjson.dumps(body)) for name, (status, body) in SHAPES.items()}
    with HostileBackend(extra) as backend:
        text = f"""
storage: memory
backends: [{{name: raw, url: "{backend.url}/v1", models: [{MODEL}]}}]
models: {{{MODEL}: {{}}}}
tenants:
  app: {{api_keys: [{hash_key(KEY)}], models: [{MODEL}]}}
"""
        with serve(create_app(parse_policy(text, environ={}))) as url:
            yield url


@pytest.mark.parametrize(
    ("shape", "status", "message"),
    [
        ("flat_400", 400, TOO_LONG),
        ("flat_429", 429, "Slow down."),
        ("detail_422", 422, "Field 'messages' is required."),
    ],
)
def test_the_backends_message_reaches_both_sdks(
    gateway: str, shape: str, status: int, message: str
) -> None:
    """Only a nested `error` object was read: vLLM's context-length refusal reached the
    client as "the backend answered 400"."""
    hostile = {"hostile": shape}
    with (
        openai.OpenAI(base_url=gateway + "/v1", api_key=KEY, max_retries=0) as client,
        pytest.raises(openai.APIStatusError) as chat,
    ):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=hostile)
    with (
        anthropic.Anthropic(base_url=gateway, api_key=KEY, max_retries=0) as client,
        pytest.raises(anthropic.APIStatusError) as messages,
    ):
        client.messages.create(model=MODEL, max_tokens=5, messages=MESSAGES, extra_body=hostile)
    assert chat.value.status_code == messages.value.status_code == status
    assert chat.value.message == f"Error code: {status} - {message}"
    assert isinstance(messages.value.body, dict)
    assert messages.value.body["error"]["message"] == message


def test_a_backends_overloaded_529_is_the_gateways_unavailable(gateway: str) -> None:
    """An Anthropic-compatible backend's 529 became a 502 `api_error`: Anthropic's SDK raised
    InternalServerError where the backend said OverloadedError, with no Retry-After."""
    hostile = {"hostile": "overloaded_529"}
    with (
        anthropic.Anthropic(base_url=gateway, api_key=KEY, max_retries=0) as client,
        pytest.raises(anthropic.OverloadedError) as overloaded,
    ):
        client.messages.create(model=MODEL, max_tokens=5, messages=MESSAGES, extra_body=hostile)
    with (
        openai.OpenAI(base_url=gateway + "/v1", api_key=KEY, max_retries=0) as client,
        pytest.raises(openai.InternalServerError) as chat,
    ):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=hostile)
    assert chat.value.status_code == 503
    assert "Overloaded" in overloaded.value.message
    for error in (overloaded.value, chat.value):
        assert int(error.response.headers["retry-after"]) >= 1
