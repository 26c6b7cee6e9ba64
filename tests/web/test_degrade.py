"""Degradation rules as a client sees them: the header names the rule, shadow changes nothing."""

from __future__ import annotations

import httpx

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.servers import serve

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
    assert answer.headers["x-tokenweir-degraded"] == "loose"
    assert backend.get("/mock/stats").json()["requests_total"] == 2  # one embedding, one answer
