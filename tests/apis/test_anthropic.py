"""Anthropic's side of the boundary: x-api-key as the bearer key, errors rewritten to Anthropic's
shape and statuses, whole or as a stream's closing event."""

from __future__ import annotations

import orjson
import pytest
from starlette.types import Message

from proxy.apis.anthropic import AnthropicErrors, anthropic_error, with_api_key
from proxy.errors import (
    BodyTooLarge,
    GatewayError,
    InsufficientQuota,
    UpstreamTimeout,
    UpstreamUnavailable,
)


def test_x_api_key_is_read_as_a_bearer_key_beside_any_given() -> None:
    scope = {"type": "http", "headers": [(b"x-api-key", b"sk-1")]}
    assert (b"authorization", b"Bearer sk-1") in with_api_key(scope)["headers"]
    both = {"type": "http", "headers": [(b"authorization", b"Bearer sk-2"), (b"x-api-key", b"x")]}
    # Both stay: two different keys are refused as ambiguous (tests/web/test_key_headers.py).
    assert with_api_key(both)["headers"] == [*both["headers"], (b"authorization", b"Bearer x")]
    neither = {"type": "http", "headers": []}
    assert with_api_key(neither) is neither


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (BodyTooLarge("too big"), 413, "request_too_large"),
        (InsufficientQuota("no quota", retry_after_s=5), 429, "rate_limit_error"),
        (UpstreamUnavailable("busy"), 529, "overloaded_error"),
        (UpstreamTimeout("slow"), 504, "timeout_error"),
        (GatewayError("odd"), 500, "api_error"),
    ],
)
def test_gateway_errors_get_anthropics_statuses_and_types(
    error: GatewayError, status: int, kind: str
) -> None:
    got_status, body = anthropic_error(error.status, error.to_json())
    assert got_status == status
    assert orjson.loads(body) == {
        "type": "error",
        "error": {"type": kind, "message": error.message},
    }


@pytest.mark.anyio
async def test_a_whole_error_is_rewritten_and_its_headers_kept() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    wrapped = AnthropicErrors(send)
    error = InsufficientQuota("no quota", retry_after_s=5)
    headers = [(b"content-type", b"application/json"), (b"retry-after", b"5")]
    await wrapped({"type": "http.response.start", "status": 429, "headers": headers})
    assert sent == []  # held until its body is rewritten
    await wrapped({"type": "http.response.body", "body": error.to_json(), "more_body": False})
    start, body = sent
    assert start["status"] == 429
    assert (b"retry-after", b"5") in start["headers"]
    assert (b"content-length", str(len(body["body"])).encode()) in start["headers"]
    assert orjson.loads(body["body"])["error"]["type"] == "rate_limit_error"


@pytest.mark.anyio
async def test_a_stream_cut_by_an_error_ends_in_an_error_event() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    wrapped = AnthropicErrors(send)
    start = [(b"content-type", b"text/event-stream; charset=utf-8")]
    await wrapped({"type": "http.response.start", "status": 200, "headers": start})
    chunk = b'event: ping\ndata: {"type":"ping"}\n\n'
    await wrapped({"type": "http.response.body", "body": chunk, "more_body": True})
    ending = b"data: " + UpstreamTimeout("slow").to_json() + b"\n\n"
    await wrapped({"type": "http.response.body", "body": ending, "more_body": False})
    assert sent[1]["body"] == chunk
    last = sent[2]["body"]
    assert last.startswith(b"event: error\ndata: ")
    payload = orjson.loads(last.split(b"data: ", 1)[1])
    assert payload == {"type": "error", "error": {"type": "api_error", "message": "slow"}}
