"""A Messages or Responses stream's own output count, beside the backend's usage, end to end: a
backend on 127.0.0.1 that streams a word a read, each followed by an empty delta in a read of its
own, and reports its usage honestly."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import orjson
import pytest
from starlette.types import Receive, Scope, Send

from proxy.policy.units import hash_key
from tests.web.agentgateway import exact_gateway
from tests.web.test_billing import ledger_records

KEY = "tw-agent-stream-counts"
WORDS = 6
QUESTION = [{"role": "user", "content": "Say hello six times."}]


def _event(payload: dict[str, object]) -> bytes:
    return (
        b"event: " + str(payload["type"]).encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"
    )


def _messages_delta(text: str) -> bytes:
    delta = {"type": "text_delta", "text": text}
    return _event({"type": "content_block_delta", "index": 0, "delta": delta})


def _responses_delta(text: str) -> bytes:
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    return _event({"type": "response.output_text.delta", **where, "delta": text})


def _messages_ends() -> tuple[bytes, bytes]:
    usage = {"input_tokens": 9, "output_tokens": 1}
    message = {"id": "m1", "type": "message", "role": "assistant", "content": [], "usage": usage}
    block = {"type": "text", "text": ""}
    start = _event({"type": "message_start", "message": message})
    start += _event({"type": "content_block_start", "index": 0, "content_block": block})
    end = _event({"type": "content_block_stop", "index": 0})
    delta = {"stop_reason": "end_turn"}
    end += _event({"type": "message_delta", "delta": delta, "usage": {"output_tokens": WORDS}})
    return start, end + _event({"type": "message_stop"})


def _responses_ends() -> tuple[bytes, bytes]:
    response: dict[str, object] = {"id": "r1", "object": "response", "output": [], "usage": None}
    start = _event({"type": "response.created", "response": response | {"status": "in_progress"}})
    usage = {"input_tokens": 9, "output_tokens": WORDS, "total_tokens": 9 + WORDS}
    done = response | {"status": "completed", "usage": usage}
    return start, _event({"type": "response.completed", "response": done})


async def _backend(scope: Scope, receive: Receive, send: Send) -> None:
    """A word a read, then an empty delta in a read of its own; the usage honest."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    messages = scope["path"] == "/v1/messages"
    start, end = _messages_ends() if messages else _responses_ends()
    delta = _messages_delta if messages else _responses_delta
    headers = [(b"content-type", b"text/event-stream")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": start, "more_body": True})
    for _ in range(WORDS):
        for text in (" hello", ""):
            await send({"type": "http.response.body", "body": delta(text), "more_body": True})
            await asyncio.sleep(0.1)
    await send({"type": "http.response.body", "body": end})


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    ledger = Path(tmp_path_factory.mktemp("agent-counts")) / "ledger.db"
    tenants = f"  alpha: {{api_keys: [{hash_key(KEY)}], models: [exact-llm]}}\n"
    with exact_gateway(_backend, ledger, tenants) as url:
        yield url, ledger


def _billed(ledger: Path, request_id: str) -> tuple[int, str | None]:
    """The request's final record: a stream of over a second leaves a checkpoint first (its
    usage so far, 4 'counted' on a loaded machine), which the final one replaces when written."""
    deadline = time.monotonic() + 10
    while True:
        [record] = [r for r in ledger_records(ledger, 1) if r.request_id == request_id]
        if not record.checkpoint or time.monotonic() > deadline:
            return record.output_tokens, record.usage_source
        time.sleep(0.05)


def test_empty_messages_deltas_are_not_billed_over_an_honest_usage(
    gateway: tuple[str, Path],
) -> None:
    """Each empty delta counted as a token: the gateway's count (12) overruled the backend's
    honest 6 and was billed."""
    url, ledger = gateway
    client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    with (
        client,
        client.messages.stream(model="exact-llm", max_tokens=50, messages=QUESTION) as stream,
    ):
        request_id = stream.response.headers["x-request-id"]
        assert "".join(stream.text_stream) == " hello" * WORDS
    assert _billed(ledger, request_id) == (WORDS, "backend")


def test_empty_responses_deltas_are_not_billed_over_an_honest_usage(
    gateway: tuple[str, Path],
) -> None:
    url, ledger = gateway
    body = {"model": "exact-llm", "input": QUESTION, "stream": True, "max_output_tokens": 50}
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", url + "/v1/responses", json=body, headers=headers) as answer:
        assert answer.status_code == 200
        text = answer.read().decode()
        request_id = answer.headers["x-request-id"]
    assert text.count('"delta":" hello"') == WORDS
    assert _billed(ledger, request_id) == (WORDS, "backend")


@pytest.mark.parametrize("first_read", [0, 3, 12])
def test_empty_deltas_beside_text_in_one_read_are_not_billed(
    tmp_path: Path, first_read: int
) -> None:
    """The same stream in one or two reads (as a loaded machine coalesces them): each empty
    delta sharing a read with text counted as a token, billing 12 for the backend's honest 6."""

    async def coalescing(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        start, end = _responses_ends()
        deltas = [_responses_delta(text) for _ in range(WORDS) for text in (" hello", "")]
        events = [start, *deltas, end]
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if first_read:
            first = b"".join(events[:first_read])
            await send({"type": "http.response.body", "body": first, "more_body": True})
            await asyncio.sleep(0.1)
        await send({"type": "http.response.body", "body": b"".join(events[first_read:])})

    ledger = tmp_path / "ledger.db"
    tenants = f"  alpha: {{api_keys: [{hash_key(KEY)}], models: [exact-llm]}}\n"
    body = {"model": "exact-llm", "input": QUESTION, "stream": True, "max_output_tokens": 50}
    headers = {"authorization": f"Bearer {KEY}"}
    with (
        exact_gateway(coalescing, ledger, tenants) as url,
        httpx.stream("POST", url + "/v1/responses", json=body, headers=headers) as answer,
    ):
        text = answer.read().decode()
        request_id = answer.headers["x-request-id"]
    assert text.count('"delta":" hello"') == WORDS
    assert _billed(ledger, request_id) == (WORDS, "backend")
