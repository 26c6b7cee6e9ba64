"""A revoked runtime key leaves nothing behind in `memory` storage: its rate buckets and its
quota scope are dropped once Redis would have expired them (a gateway that creates and revokes
keys all day grew by each key's state for as long as it ran)."""

from __future__ import annotations

import calendar
from typing import Any

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.app import create_app
from proxy.clock import FakeClock
from proxy.policy import parse_policy
from tests.keys.test_runtime import ADMIN_KEY, TENANT_KEY, policy_text
from tests.servers import serve

CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


class _Watched:
    """The app as served, noting the gateway its requests run on (to read its storage)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.gateway: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.gateway = scope["state"]["gateway"]
        await self.app(scope, receive, send)


def _held_for(gateway: Any, key_id: str) -> list[str]:
    """What the memory stores hold under the key's scope: bucket levels, slot pools, leases."""
    storage = gateway.services.storage
    held = [*storage.limits._levels, *storage.limits._pools, *storage.quotas._leases]
    return [name for name in held if key_id in name]


def test_a_revoked_keys_buckets_and_leases_are_dropped(backend_url: str) -> None:
    clock = FakeClock(start_wall=calendar.timegm((2027, 3, 1, 12, 0, 0)))
    app = _Watched(create_app(parse_policy(policy_text(backend_url, "memory")), clock=clock))
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        allowance = {"budget": {"tokens_per_day": 10**6}, "limits": {"requests_per_minute": 60}}
        made = http.post("/admin/keys", json={"tenant": "alpha", **allowance}, headers=ADMIN)
        key, key_id = made.json()["key"], made.json()["id"]
        bearer = {"authorization": f"Bearer {key}"}
        assert http.post("/v1/chat/completions", json=CHAT, headers=bearer).status_code == 200
        assert _held_for(app.gateway, key_id)  # its requests-per-minute bucket, drawn on
        assert http.delete(f"/admin/keys/{key_id}", headers=ADMIN).status_code == 200
        clock.advance(2 * 3600.0)  # refilled an hour and more ago: Redis would have expired it
        tenant = {"authorization": f"Bearer {TENANT_KEY}"}
        assert http.post("/v1/chat/completions", json=CHAT, headers=tenant).status_code == 200
        assert _held_for(app.gateway, key_id) == []
