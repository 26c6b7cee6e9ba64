"""Degradation rules as a client sees them: the header names the rule, shadow changes nothing."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from proxy.app import create_app
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.conftest import ADMIN_KEY
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
    "then", ["{max_output_tokens: 3}", "{model: mock-small}", "{priority: low}"]
)
@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_a_rule_changed_is_not_cached_for_the_request_as_asked(
    backend_url: str, tmp_path: Path, then: str, stream: bool
) -> None:
    """A shortened answer, or another model's, is no answer to the request as asked: stored
    under its key, it was served as a hit (no degraded header) after the load had gone. A rule
    that changes nothing of the answer (priority) leaves it cached."""
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
