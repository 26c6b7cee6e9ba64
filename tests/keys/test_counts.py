"""A runtime key's own requests_per_minute bounds its token counts too, through the real
anthropic SDK: a key held to a few requests a minute cannot keep the gateway tokenizing bodies."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from proxy.app import create_app
from proxy.policy import parse_policy
from tests.keys.test_runtime import ADMIN_KEY, TENANT_KEY, policy_text
from tests.servers import serve

HELLO = [{"role": "user", "content": "Name three rivers of Europe."}]


@pytest.mark.parametrize("storage", ["memory", "redis"])
def test_a_keys_own_requests_per_minute_takes_its_token_counts(
    backend_url: str, storage: str, request: pytest.FixtureRequest
) -> None:
    """The count took one request from the tenant's requests_per_minute, never from the key's:
    a key of 2 a minute counted without end (and sent its messages after its counts)."""
    where = request.getfixturevalue("redis_url") if storage == "redis" else "memory"
    app = create_app(parse_policy(policy_text(backend_url, where), environ={}))
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    with serve(app) as url:
        wanted = {"tenant": "alpha", "limits": {"requests_per_minute": 2}}
        key = httpx.post(url + "/admin/keys", json=wanted, headers=admin).json()["key"]
        with anthropic.Anthropic(base_url=url, api_key=key, max_retries=0) as client:
            counts = [client.messages.count_tokens(model="mock-llm", messages=HELLO) for _ in "ab"]
            assert counts[0].input_tokens == counts[1].input_tokens > 0
            with pytest.raises(anthropic.RateLimitError) as refused:
                client.messages.count_tokens(model="mock-llm", messages=HELLO)
            with pytest.raises(anthropic.RateLimitError):  # the counts took the key's minute
                client.messages.create(model="mock-llm", max_tokens=5, messages=HELLO)
        with anthropic.Anthropic(base_url=url, api_key=TENANT_KEY, max_retries=0) as tenant:
            assert tenant.messages.count_tokens(model="mock-llm", messages=HELLO).input_tokens
    assert "this API key's own (requests_per_minute: limit 2" in str(refused.value)
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 60


def test_a_count_answers_with_the_rate_limit_headers_it_took_from(backend_url: str) -> None:
    """Every answer has OpenAI's rate-limit headers and x-tokenweir-cache; a count had neither
    (it took from requests_per_minute all the same), its 429 neither."""
    text = policy_text(backend_url, "memory", limits="{requests_per_minute: 2}")
    with serve(create_app(parse_policy(text, environ={}))) as url:
        with anthropic.Anthropic(base_url=url, api_key=TENANT_KEY, max_retries=0) as client:
            counted = [
                client.messages.with_raw_response.count_tokens(model="mock-llm", messages=HELLO)
                for _ in "ab"
            ]
            with pytest.raises(anthropic.RateLimitError) as refused:
                client.messages.count_tokens(model="mock-llm", messages=HELLO)
    answers = [raw.headers for raw in counted] + [refused.value.response.headers]
    assert [h["x-ratelimit-remaining-requests"] for h in answers] == ["1", "0", "0"]
    assert {h["x-ratelimit-limit-requests"] for h in answers} == {"2"}
    assert all(h["x-ratelimit-reset-requests"] and h["x-request-id"] for h in answers)
    assert {h["x-tokenweir-cache"] for h in answers} == {"bypass"}
