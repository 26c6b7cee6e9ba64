"""The x-ratelimit-* headers on answers the rate-limit stage never reached, through the gateway."""

from __future__ import annotations

import httpx
import pytest

from proxy.app import create_app
from proxy.policy import parse_policy
from tests.servers import serve
from tests.web.test_ratelimits import AUTH, CHAT, limits_policy_text


@pytest.mark.parametrize("storage", ["memory", "redis"])
def test_a_quota_refusal_shows_the_rate_limits_as_they_stand(
    backend_url: str, redis_url: str, storage: str
) -> None:
    """A tenant with rate limits gets OpenAI's headers on a quota's 429 too, the buckets as the
    refused request left them (it took nothing). They were missing: the quota refuses before
    the rate limits are asked, and a client reading them saw none on that one answer."""
    limits = "{requests_per_minute: 100, tokens_per_minute: 10000}"
    text = limits_policy_text(
        backend_url, limits, redis_url if storage == "redis" else storage,
        budget="{tokens_per_day: 100}",
    )  # fmt: skip
    body = {**CHAT, "max_tokens": 50, "mock_completion_tokens": 50}
    policy = parse_policy(text, environ={})
    with serve(create_app(policy)) as url, httpx.Client(base_url=url, headers=AUTH) as http:
        spent = http.post("/v1/chat/completions", json=body)
        refused = http.post("/v1/chat/completions", json=body)
    assert spent.status_code == 200, spent.text
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "insufficient_quota"
    assert refused.headers["x-ratelimit-limit-requests"] == "100"
    assert refused.headers["x-ratelimit-limit-tokens"] == "10000"
    # Nothing taken: no fewer requests left than after the answer before it.
    remaining = int(spent.headers["x-ratelimit-remaining-requests"])
    assert int(refused.headers["x-ratelimit-remaining-requests"]) >= remaining
    assert refused.headers["x-ratelimit-reset-requests"].endswith(("ms", "s"))
    assert int(refused.headers["x-ratelimit-remaining-tokens"]) > 9_800
