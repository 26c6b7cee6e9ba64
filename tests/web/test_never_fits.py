"""Every refusal of a request that can never be admitted, as the real SDKs (their default two
retries) see it: reaching the gateway once. A refusal that a wait fixes is retried."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import anthropic
import httpx
import openai
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.servers import serve

KEY = "tw-never-key"
ADMIN = "tw-never-admin"
BIG = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}


class Counting:
    """Counts the requests that reach the gateway, by path (the SDKs' retries included)."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self.paths: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.paths[scope["path"]] += 1
        await self._app(scope, receive, send)

    @property
    def chats(self) -> int:
        return self.paths["/v1/chat/completions"]


@contextmanager
def _gateway(backend_url: str, tenant: str, backend: str = "{}") -> Iterator[tuple[str, Counting]]:
    text = f"""
admin_keys: [{hash_key(ADMIN)}]
backends: [{{name: mock, url: "{backend_url}/v1", models: [mock-llm], limits: {backend}}}]
models: {{mock-llm: {{price: {{input_per_1m: 1000, output_per_1m: 1000}}}}}}
tenants:
  app:
    api_keys: [{hash_key(KEY)}]
    models: [mock-llm]
{tenant}
"""
    counting = Counting(create_app(parse_policy(text, environ={})))
    with serve(counting) as url:
        yield url, counting


NEVER = {
    "tenant tokens_per_minute": ("    limits: {tokens_per_minute: 100}", "{}"),
    "tenant per-model tokens_per_minute": (
        "    limits: {per_model: {mock-llm: {tokens_per_minute: 100}}}",
        "{}",
    ),
    "tenant tokens_per_day": ("    budget: {tokens_per_day: 100}", "{}"),
    "tenant usd_per_month": ("    budget: {usd_per_month: 0.1}", "{}"),
    "backend tokens_per_minute": ("", "{tokens_per_minute: 100}"),
}


_WINDOW_S = {"tokens_per_minute": 60, "tokens_per_day": 86400, "usd_per_month": 31 * 86400}


@pytest.mark.parametrize("case", sorted(NEVER))
def test_the_openai_sdk_sends_a_request_that_can_never_fit_once(
    backend_url: str, case: str
) -> None:
    tenant, backend = NEVER[case]
    with _gateway(backend_url, tenant, backend) as (url, counting):
        with openai.OpenAI(base_url=url + "/v1", api_key=KEY) as sdk:  # default: 2 retries
            with pytest.raises(openai.APIStatusError) as refused:
                sdk.chat.completions.create(**BIG)  # type: ignore[call-overload]
        assert refused.value.status_code in (429, 503)
        headers = refused.value.response.headers
        assert headers["x-should-retry"] == "false"
        # DESIGN: a Retry-After on every 429 and 503, though no wait makes it fit: the limit's
        # window, or the quota's reset (the SDK obeys x-should-retry over it: sent once).
        assert 1 <= int(headers["retry-after"]) <= _WINDOW_S[case.rsplit(" ", 1)[-1]]
        assert counting.chats == 1


@pytest.mark.parametrize(
    "allowance",
    [{"limits": {"tokens_per_minute": 100}}, {"budget": {"tokens_per_day": 100}}],
)
def test_a_runtime_keys_own_allowance_it_can_never_fit_is_sent_once(
    backend_url: str, allowance: dict[str, object]
) -> None:
    with _gateway(backend_url, "    limits: {tokens_per_minute: 100000}") as (url, counting):
        admin = {"authorization": f"Bearer {ADMIN}"}
        made = httpx.post(url + "/admin/keys", json={"tenant": "app", **allowance}, headers=admin)
        assert made.status_code == 201, made.text
        with openai.OpenAI(base_url=url + "/v1", api_key=made.json()["key"]) as sdk:
            with pytest.raises(openai.RateLimitError, match="never be admitted") as refused:
                sdk.chat.completions.create(**BIG)  # type: ignore[call-overload]
        assert counting.chats == 1
        headers = refused.value.response.headers
        assert headers["x-should-retry"] == "false"
        assert 1 <= int(headers["retry-after"]) <= (60 if "limits" in allowance else 86400)


def test_the_anthropic_sdk_sends_a_request_that_can_never_fit_once(backend_url: str) -> None:
    with _gateway(backend_url, "    limits: {tokens_per_minute: 100}") as (url, counting):
        with anthropic.Anthropic(base_url=url, api_key=KEY) as sdk:  # default: 2 retries
            with pytest.raises(anthropic.RateLimitError):
                sdk.messages.create(**BIG)  # type: ignore[call-overload]
        assert counting.paths["/v1/messages"] == 1


@pytest.mark.parametrize("status", [429, 503])
def test_a_refusal_a_short_wait_fixes_is_retried_by_the_sdk(backend_url: str, status: int) -> None:
    """A degradation rule refusing every request for now, `Retry-After: 1`: the SDK's default
    two retries reach the gateway."""
    rule = f"    degrade: [{{name: busy, when: {{}}, then: {{reject: {status}, retry_after: 1s}}}}]"
    with _gateway(backend_url, rule) as (url, counting):
        with openai.OpenAI(base_url=url + "/v1", api_key=KEY) as sdk:
            with pytest.raises(openai.APIStatusError) as refused:
                sdk.chat.completions.create(**{**BIG, "max_tokens": 5})  # type: ignore[call-overload]
        assert refused.value.status_code == status
        assert refused.value.response.headers["retry-after"] == "1"
        assert "x-should-retry" not in refused.value.response.headers
        assert counting.chats == 3
