"""Degradation rules as a client sees them: the header names the rule, shadow changes nothing."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from proxy.app import create_app
from proxy.clock import FakeClock
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.conftest import ADMIN_KEY
from tests.servers import serve
from tests.web.test_ratelimits import AUTH, CHAT, limits_policy_text

KEY, SHADOW_KEY = "tw-degrade-live", "tw-degrade-shadow"


def test_a_fired_rule_is_in_the_header_and_a_shadow_rule_changes_nothing(
    backend_url: str,
) -> None:
    rule = "{name: short, when: {}, then: {max_output_tokens: 5}"
    policy = parse_policy(
        f"""
backends: [{{name: a, url: "{backend_url}/v1", models: [mock-llm]}}]
models: {{mock-llm: {{}}}}
tenants:
  live: {{api_keys: [{hash_key(KEY)}], models: [mock-llm], degrade: [{rule}}}]}}
  shadow:
    api_keys: [{hash_key(SHADOW_KEY)}]
    models: [mock-llm]
    degrade: [{rule}, shadow: true}}]
""",
        environ={},
    )
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
    with serve(create_app(policy)) as url:
        live, shadow = (
            httpx.post(
                url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {k}"}
            )
            for k in (KEY, SHADOW_KEY)
        )
    assert live.headers["x-tokenweir-degraded"] == "short"
    assert live.json()["usage"]["completion_tokens"] == 5
    assert "x-tokenweir-degraded" not in shadow.headers
    assert shadow.headers["x-tokenweir-degraded-shadow"] == "short"
    assert shadow.json()["usage"]["completion_tokens"] == 50


def test_a_looser_cache_bar_looks_again_without_embedding_again(
    backend_url: str, backend: httpx.Client
) -> None:
    loose = "{name: loose, when: {}, then: {similarity: 0.5}}"
    policy = parse_policy(
        f"""
embedder: {{model: mock-embed}}
backends: [{{name: a, url: "{backend_url}/v1", models: [mock-llm, mock-embed]}}]
models: {{mock-llm: {{}}, mock-embed: {{}}}}
tenants:
  live:
    api_keys: [{hash_key(KEY)}]
    models: [mock-llm]
    cache: {{mode: semantic}}
    degrade: [{loose}]
""",
        environ={},
    )
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    with serve(create_app(policy)) as url:
        answer = httpx.post(
            url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
        )
    assert answer.headers["x-tokenweir-cache"] == "miss"
    # The looser bar found nothing: the request went as asked, and no rule is named for it.
    assert "x-tokenweir-degraded" not in answer.headers
    assert backend.get("/mock/stats").json()["requests_total"] == 2  # one embedding, one answer


def _cached_policy(backend_url: str, rule: str) -> str:
    return f"""
admin_keys: [{hash_key(ADMIN_KEY)}]
backends: [{{name: a, url: "{backend_url}/v1", models: [mock-llm, mock-small]}}]
models: {{mock-llm: {{}}, mock-small: {{}}}}
tenants:
  live:
    api_keys: [{hash_key(KEY)}]
    models: [mock-llm]
    cache: {{mode: exact}}
    degrade: [{rule}]
"""


@pytest.mark.parametrize(
    "then",
    [
        "{max_output_tokens: 3}",
        "{model: mock-small}",
        "{priority: low}",
        # a second lookup (a cache rule) after the rule changed the request
        "{max_output_tokens: 3, cache: serve_stale}",
        "{model: mock-small, cache: serve_stale}",
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_a_rule_changed_is_not_cached_for_the_request_as_asked(
    backend_url: str, tmp_path: Path, then: str, stream: bool
) -> None:
    """A shortened answer, or another model's, is no answer to the request as asked: stored
    under its key, it was served as a hit (no degraded header) after the load had gone. A rule
    that changes nothing of the answer (priority) leaves it cached. A rule that also looks
    again (serve_stale) stored the changed answer under the first lookup's key."""
    config = tmp_path / "policy.yaml"
    config.write_text(
        _cached_policy(backend_url, f"{{name: under-load, when: {{}}, then: {then}}}")
    )
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 20, "stream": stream, "temperature": 0}  # fmt: skip
    auth = {"authorization": f"Bearer {KEY}"}
    with serve(create_app(config=config)) as url:
        under_load = httpx.post(url + "/v1/chat/completions", json=body, headers=auth)
        assert under_load.headers["x-tokenweir-degraded"] == "under-load"
        config.write_text(_cached_policy(backend_url, ""))  # the load is gone
        reloaded = httpx.post(
            url + "/admin/reload", headers={"authorization": f"Bearer {ADMIN_KEY}"}
        )
        assert reloaded.status_code == 200, reloaded.text
        after = httpx.post(url + "/v1/chat/completions", json=body, headers=auth)
    assert "x-tokenweir-degraded" not in after.headers
    changed = "priority" not in then
    assert after.headers["x-tokenweir-cache"] == ("miss" if changed else "hit")
    if not stream:
        assert after.json()["usage"]["completion_tokens"] == 20


@pytest.mark.parametrize(
    "then",
    [
        "{cache: serve_stale}",
        "{max_output_tokens: 3, cache: serve_stale}",
        "{model: mock-small, cache: serve_stale}",
    ],
)
def test_a_stale_answer_is_served_when_its_rule_also_shortens_or_moves_the_request(
    backend_url: str, tmp_path: Path, then: str
) -> None:
    """Under load a rule serves expired answers and shortens (or moves) the rest. It looked for
    a stale answer to the shortened request, which is never stored: the request as asked, whose
    answer the cache still held, got a new 3-token one (or the small model's)."""
    clock = FakeClock()
    config = tmp_path / "policy.yaml"
    # The tenant has the rule from the start (its answers are kept two ttls); it fires once the
    # load comes (a reload here: no backend has max_concurrent, so the ratio is never known).
    rule = "{{name: under-load, when: {when}, then: {then}}}"
    config.write_text(
        _cached_policy(backend_url, rule.format(when="{inflight_ratio_above: 0.99}", then=then))
    )
    body = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 20, "temperature": 0}  # fmt: skip
    auth = {"authorization": f"Bearer {KEY}"}
    with serve(create_app(config=config, clock=clock)) as url:
        fresh = httpx.post(url + "/v1/chat/completions", json=body, headers=auth)
        clock.advance(3601)  # the ttl (1h) is over: only a serve_stale rule may answer with it
        config.write_text(_cached_policy(backend_url, rule.format(when="{}", then=then)))
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        assert httpx.post(url + "/admin/reload", headers=admin).status_code == 200
        stale = httpx.post(url + "/v1/chat/completions", json=body, headers=auth)
    assert stale.headers["x-tokenweir-degraded"] == "under-load"
    assert stale.headers["x-tokenweir-cache"] == "hit"
    assert stale.json()["choices"] == fresh.json()["choices"]
    assert stale.json()["model"] == fresh.json()["model"]


SHORT = "[{name: short, when: {}, then: {max_output_tokens: 50}}]"


def test_a_rules_output_bound_is_what_tokens_per_minute_is_charged(
    backend_url: str, backend: httpx.Client
) -> None:
    """A rule bounds every answer to 50 tokens: a request for 2,000 under a 1,000-token minute
    is sent with 50 and charged that. It was charged the 2,000 it asked for, before the rule
    applied: a 429 saying it could never be admitted."""
    text = limits_policy_text(backend_url, "{tokens_per_minute: 1000}", degrade=SHORT)
    with serve(create_app(parse_policy(text, environ={}))) as url:
        answer = httpx.post(
            url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2000}, headers=AUTH
        )
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-tokenweir-degraded"] == "short"
    assert backend.get("/mock/stats").json()["last_request"]["max_tokens"] == 50
    assert int(answer.headers["x-ratelimit-remaining-tokens"]) >= 1000 - 100


def test_a_rules_output_bound_is_what_a_quota_reserves_near_its_limit(
    backend_url: str, redis_url: str
) -> None:
    """Past half the day's 1,000 tokens a rule bounds answers to 50: a request for 500 more is
    sent with 50, which fits. The quota reserved the 500 before the rule applied, and refused
    it (429 insufficient_quota) just where the rule was meant to let it through shortened."""
    near_limit = SHORT.replace("when: {}", "when: {budget_used_above: 0.5}")
    text = limits_policy_text(
        backend_url, "{}", redis_url, budget="{tokens_per_day: 1000}", degrade=near_limit
    )
    policy = parse_policy(text, environ={})
    with serve(create_app(policy)) as url, httpx.Client(base_url=url, headers=AUTH) as http:
        spent = http.post(
            "/v1/chat/completions", json={**CHAT, "max_tokens": 600, "mock_completion_tokens": 600}
        )
        near = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 500})
    assert "x-tokenweir-degraded" not in spent.headers
    assert near.status_code == 200, near.text
    assert near.headers["x-tokenweir-degraded"] == "short"
    assert near.json()["usage"]["completion_tokens"] <= 50
