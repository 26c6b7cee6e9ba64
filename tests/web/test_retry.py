"""Retry semantics as the real openai SDK reads them: x-should-retry, retry-after-ms."""

from __future__ import annotations

import calendar
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.app import create_app
from proxy.clock import FakeClock
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.servers import serve

KEY = "tw-retry-key"
CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


class Counting:
    """Counts the chat requests that reach the gateway (the SDK's retries included)."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self.chats = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/chat/completions":
            self.chats += 1
        await self._app(scope, receive, send)


def _policy_text(backend_url: str, tenant: str) -> str:
    return f"""
backends: [{{name: mock, url: "{backend_url}/v1", models: [mock-llm]}}]
models: {{mock-llm: {{}}}}
tenants:
  app:
    api_keys: [{hash_key(KEY)}]
    models: [mock-llm]
{tenant}
"""


@pytest.fixture
def quota_near_reset(backend_url: str) -> Iterator[tuple[str, Counting]]:
    """A daily quota used up 90 s before midnight UTC: its reset is over a minute away."""
    day = calendar.timegm((2027, 3, 1, 0, 0, 0))
    clock = FakeClock(start_wall=day - 90)
    text = _policy_text(backend_url, "    budget: {tokens_per_day: 40}")
    counting = Counting(create_app(parse_policy(text, environ={}), clock=clock))
    with serve(counting) as url:
        yield url, counting


def test_sdk_does_not_retry_a_quota_that_resets_in_over_a_minute(
    quota_near_reset: tuple[str, Counting],
) -> None:
    url, counting = quota_near_reset
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEY}"}) as http:
        answers = [http.post("/v1/chat/completions", json=CHAT) for _ in range(6)]
    assert answers[0].status_code == 200
    refused = answers[-1]
    assert refused.status_code == 429
    assert refused.headers["x-should-retry"] == "false"
    assert 89_000 <= int(refused.headers["retry-after-ms"]) <= 90_000
    assert refused.headers["retry-after"] == "90"
    before = counting.chats
    sdk = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=2)
    began = time.monotonic()
    with sdk, pytest.raises(openai.RateLimitError, match="quota"):
        sdk.chat.completions.create(**CHAT)  # type: ignore[call-overload]
    assert counting.chats - before == 1  # one request, no retries
    assert time.monotonic() - began < 30  # it did not wait for the reset


def test_a_request_larger_than_tokens_per_minute_is_not_retryable(backend_url: str) -> None:
    text = _policy_text(backend_url, "    limits: {tokens_per_minute: 100}")
    counting = Counting(create_app(parse_policy(text, environ={})))
    big = {**CHAT, "max_tokens": 500}
    with serve(counting) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=2)
        with sdk, pytest.raises(openai.RateLimitError) as refused:
            sdk.chat.completions.create(**big)  # type: ignore[call-overload]
    assert "can never be admitted" in refused.value.message
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert counting.chats == 1


def test_a_near_rate_limit_says_retry_after_in_ms_too(backend_url: str) -> None:
    text = _policy_text(backend_url, "    limits: {requests_per_minute: 1}")
    with (
        serve(create_app(parse_policy(text, environ={}))) as url,
        httpx.Client(base_url=url, headers={"authorization": f"Bearer {KEY}"}) as http,
    ):
        http.post("/v1/chat/completions", json=CHAT)
        refused = http.post("/v1/chat/completions", json=CHAT)
    assert refused.status_code == 429
    seconds, ms = int(refused.headers["retry-after"]), int(refused.headers["retry-after-ms"])
    assert 50_000 <= ms <= 60_000
    assert seconds == -(-ms // 1000)
    assert "x-should-retry" not in refused.headers  # a minute away at most: the SDK may retry


@pytest.mark.parametrize("status", [429, 503])
def test_sdk_does_not_retry_a_backend_that_asks_for_over_a_minute(
    backend_url: str, status: int
) -> None:
    """A backend's own 429 or 503 with `Retry-After: 3600`, passed on: the SDK, which ignores
    a Retry-After over a minute and retries at once, is told not to. (A 429 came without
    `x-should-retry: false`, a 503 with it: the SDK sent a backend that asked for an hour's
    rest two more requests within two seconds.)"""
    counting = Counting(create_app(parse_policy(_policy_text(backend_url, ""), environ={})))
    asking = {"mock_fail": status, "mock_retry_after_s": 3600}
    with serve(counting) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=2)
        with sdk, pytest.raises(openai.APIStatusError) as refused:
            sdk.chat.completions.create(**CHAT, extra_body=asking)  # type: ignore[call-overload]
    assert refused.value.status_code == status
    assert refused.value.response.headers["retry-after"] == "3600"
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert counting.chats == 1
