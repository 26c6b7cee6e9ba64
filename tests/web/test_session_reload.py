"""Dashboard sessions follow a policy reload: a removed key's session ends, a new key logs in."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from proxy.app import create_app
from proxy.policy.units import hash_key
from tests.servers import serve

ADMIN_KEY = "tw-session-admin"
LEAKED_KEY = "tw-session-leaked"
NEW_KEY = "tw-session-newcomer"


def policy_text(backend_url: str, *, leaked: bool, newcomer: bool) -> str:
    text = f"""storage: memory
admin_keys: [{hash_key(ADMIN_KEY)}]
ledger: sqlite:///{{ledger}}
backends: [{{name: mock, url: "{backend_url}/v1", models: [mock-llm]}}]
models: {{mock-llm: {{}}}}
tenants:
"""
    if leaked:
        text += f"  alpha:\n    api_keys: [{hash_key(LEAKED_KEY)}]\n    models: [mock-llm]\n"
    if newcomer:
        text += f"  gamma:\n    api_keys: [{hash_key(NEW_KEY)}]\n    models: [mock-llm]\n"
    return text


@pytest.fixture
def setup(backend_url: str, tmp_path: Path) -> Iterator[tuple[str, Path, str]]:
    config = tmp_path / "policy.yaml"
    ledger = tmp_path / "ledger.db"
    text = policy_text(backend_url, leaked=True, newcomer=False).replace("{ledger}", str(ledger))
    config.write_text(text)
    with serve(create_app(config=config)) as url:
        yield url, config, str(ledger)


@contextmanager
def login(url: str, key: str) -> Iterator[httpx.Client]:
    """A client holding the session cookie that logging in with `key` set."""
    with httpx.Client(base_url=url) as client:
        answer = client.post("/dashboard/login", data={"key": key, "next": "/dashboard"})
        assert answer.status_code == 303, answer.text
        assert answer.headers["location"] == "/dashboard"
        yield client


def reload(url: str, config: Path, backend_url: str, ledger: str, **which: bool) -> None:
    config.write_text(policy_text(backend_url, **which).replace("{ledger}", ledger))
    answer = httpx.post(url + "/admin/reload", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert answer.status_code == 200, answer.text


def test_a_revoked_keys_session_ends_and_a_new_tenant_logs_in(
    setup: tuple[str, Path, str], backend_url: str
) -> None:
    url, config, ledger = setup
    with login(url, LEAKED_KEY) as leaked:
        assert leaked.get("/dashboard").status_code == 200
        assert leaked.get("/api/usage").status_code == 200
        # Before the reload the newcomer's key is unknown.
        refused = httpx.post(url + "/dashboard/login", data={"key": NEW_KEY, "next": "/dashboard"})
        assert refused.status_code == 401

        reload(url, config, backend_url, ledger, leaked=False, newcomer=True)

        gone = leaked.get("/dashboard")
        assert gone.status_code == 303
        assert gone.headers["location"].startswith("/dashboard/login")
        assert leaked.get("/api/usage").status_code == 401
    with login(url, NEW_KEY) as newcomer:
        page = newcomer.get("/dashboard")
        assert page.status_code == 200
        assert 'data-tenant="gamma"' in page.text
        assert newcomer.get("/dashboard/tenants/alpha").status_code == 403
        rows = newcomer.get("/api/usage").json()
        assert rows["tenant"] == "gamma"


def test_a_reload_that_keeps_a_key_keeps_its_session(
    setup: tuple[str, Path, str], backend_url: str
) -> None:
    url, config, ledger = setup
    with login(url, LEAKED_KEY) as kept:
        reload(url, config, backend_url, ledger, leaked=True, newcomer=True)
        assert kept.get("/dashboard").status_code == 200
        assert kept.get("/api/usage").json()["tenant"] == "alpha"


def test_a_runtime_key_is_told_to_use_bearer_not_looped_through_login(
    setup: tuple[str, Path, str],
) -> None:
    url, _, _ = setup
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    created = httpx.post(url + "/admin/keys", json={"tenant": "alpha"}, headers=admin).json()
    with httpx.Client(base_url=url) as client:
        answer = client.post("/dashboard/login", data={"key": created["key"], "next": "/dashboard"})
        assert answer.status_code == 401
        assert "Authorization: Bearer" in answer.text
        assert "tokenweir_session" not in answer.headers.get("set-cookie", "")
    bearer = {"authorization": f"Bearer {created['key']}"}
    assert httpx.get(url + "/api/usage", headers=bearer).json()["tenant"] == "alpha"
