"""A reload that removes a tenant revokes its runtime keys on every replica: a later tenant of the
same name does not inherit them."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from proxy.policy.units import hash_key
from tests.keys.relay import HeldCommand
from tests.servers import replicas

ADMIN = {"authorization": "Bearer tw-offboard-admin"}
CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def _policy_text(backend_url: str, storage: str, alpha_key: str | None) -> str:
    text = f"""storage: {storage}
admin_keys: [{hash_key("tw-offboard-admin")}]
backends: [{{name: mock, url: "{backend_url}/v1", models: [mock-llm]}}]
models: {{mock-llm: {{}}}}
tenants:
  beta:
    api_keys: [{hash_key("tw-offboard-beta")}]
    models: [mock-llm]
"""
    if alpha_key is not None:
        text += f"  alpha:\n    api_keys: [{hash_key(alpha_key)}]\n    models: [mock-llm]\n"
    return text


def _chat(url: str, key: str) -> int:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(url + "/v1/chat/completions", json=CHAT, headers=headers).status_code


def _wait(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """A deadline for what the other replica learns by polling, not a measurement."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _reload(url: str) -> None:
    answer = httpx.post(url + "/admin/reload", headers=ADMIN)
    assert answer.json()["status"] == "reloaded", answer.text


def test_a_removed_tenants_runtime_keys_do_not_come_back_with_a_new_tenant_of_its_name(
    backend_url: str, redis_url: str, tmp_path: Path
) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text(_policy_text(backend_url, redis_url, "tw-offboard-alpha-1"))
    with replicas(config, 2) as started:
        one, other = (url for _, url in started)
        made = [
            httpx.post(one + "/admin/keys", json={"tenant": t}, headers=ADMIN).json()
            for t in ("alpha", "beta")
        ]
        (alpha_id, alpha_secret), (beta_id, beta_secret) = ((m["id"], m["key"]) for m in made)
        _wait(lambda: _chat(other, alpha_secret) == 200)
        # Tenant alpha is offboarded, by a reload of one replica.
        config.write_text(_policy_text(backend_url, redis_url, None))
        _reload(one)
        _wait(lambda: _chat(other, alpha_secret) == 401)  # revoked there too
        listed = httpx.get(other + "/admin/keys", headers=ADMIN).json()["data"]
        assert [k["id"] for k in listed] == [beta_id]
        # A new customer named alpha is onboarded, with a key of its own.
        config.write_text(_policy_text(backend_url, redis_url, "tw-offboard-alpha-2"))
        _reload(one)
        _reload(other)
        assert _chat(one, "tw-offboard-alpha-2") == 200
        for url in (one, other):
            assert _chat(url, alpha_secret) == 401  # the previous customer's key stays dead
            assert _chat(url, beta_secret) == 200  # other tenants' keys are untouched
    assert alpha_id not in {k["id"] for k in listed}


def test_a_key_created_while_a_reload_removes_its_tenant_does_not_survive(
    backend_url: str, redis_url: str, tmp_path: Path
) -> None:
    """The create checked the tenant, the reload removed it and revoked its keys (none stored
    yet), then the key was stored: a 201, and the key came back to life for the next tenant of
    that name. Now the create is a 400 and the key is gone."""
    relay = HeldCommand(redis_url, b"\r\nput\r\n")  # the key's write, before Redis runs it
    relay.armed.set()
    config = tmp_path / "policy.yaml"
    config.write_text(_policy_text(backend_url, relay.url, "tw-offboard-alpha-1"))
    try:
        with replicas(config, 1) as [(_, url)], ThreadPoolExecutor(1) as pool:
            creating = pool.submit(
                httpx.post, url + "/admin/keys", json={"tenant": "alpha"}, headers=ADMIN
            )
            assert relay.held.wait(10)  # the tenant was checked; the key is on its way
            config.write_text(_policy_text(backend_url, relay.url, None))
            _reload(url)
            relay.released.set()
            created = creating.result(timeout=30)
            assert created.status_code == 400, created.text
            assert created.json()["error"]["param"] == "tenant"
            config.write_text(_policy_text(backend_url, relay.url, "tw-offboard-alpha-2"))
            _reload(url)
            listed = httpx.get(url + "/admin/keys", headers=ADMIN).json()["data"]
            assert listed == []
    finally:
        relay.close()
