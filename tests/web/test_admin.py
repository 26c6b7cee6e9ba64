"""The admin routes' answers to paths they do not serve: OpenAI-shaped JSON, never Starlette's
bare redirect, and nothing changed."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from proxy.app import create_app
from proxy.policy import parse_policy
from tests.keys.test_runtime import ADMIN_KEY, policy_text
from tests.servers import serve

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture
def gateway(backend_url: str) -> Iterator[httpx.Client]:
    policy = parse_policy(policy_text(backend_url, "memory"), environ={})
    with serve(create_app(policy)) as url, httpx.Client(base_url=url, headers=ADMIN) as http:
        yield http


def test_an_admin_path_with_a_trailing_slash_is_a_json_404_and_changes_nothing(
    gateway: httpx.Client,
) -> None:
    """`DELETE /admin/keys/` (an empty id) and its neighbours were Starlette's bare 307 to the
    path without the slash, which a client following it would resend (a POST as a GET)."""
    made = gateway.post("/admin/keys", json={"tenant": "alpha"}).json()
    asked = [
        ("DELETE", "/admin/keys/", "names no key"),
        ("DELETE", f"/admin/keys/{made['id']}/", f"without a slash: /admin/keys/{made['id']}."),
        ("GET", "/admin/keys/", "without a slash: /admin/keys."),
        ("POST", "/admin/keys/", "without a slash: /admin/keys."),
        ("POST", "/admin/reload/", "without a slash: /admin/reload."),
    ]
    for method, path, says in asked:
        answer = gateway.request(method, path, json={"tenant": "alpha"})
        assert answer.status_code == 404, (method, path, answer.status_code)
        assert "location" not in answer.headers
        error = answer.json()["error"]
        assert error["code"] == "not_found"
        assert says in error["message"]
    assert gateway.delete("/admin/keys/").json()["error"]["param"] == "id"
    listed = gateway.get("/admin/keys").json()["data"]
    assert [k["id"] for k in listed] == [made["id"]]  # not revoked, nothing made
