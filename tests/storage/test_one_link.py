"""A gateway on Redis storage opens its storage once: whose each stored response is and which
dashboard sessions ended go over the link the quota, limit and cache stores share, through a
real gateway on a private redis-server, counted with CLIENT LIST."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import httpx
import openai
import pytest
import redis

from proxy import services
from proxy.app import create_app
from proxy.keys.runtime import RuntimeKeys
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.redis_server import private_redis
from tests.servers import serve
from tests.web.storedbackend import MODEL, stored_backend

KEY = "tw-one-link-alice"
COOKIE = "tokenweir_session"


def _connections(url: str) -> int:
    """The clients Redis has, this one asking left out."""
    with redis.Redis.from_url(url) as admin:
        return sum(client["cmd"] != "client|list" for client in admin.client_list())


def test_stored_responses_and_logouts_open_no_redis_connection_of_their_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each had a redis-py pool of its own: two connections more than the stores' link."""
    monkeypatch.setenv("TOKENWEIR_SESSION_SECRET", "test-one-link-secret")
    with private_redis() as redis_url, stored_backend() as backend:
        text = f"""
storage: {redis_url}
ledger: sqlite:///{tmp_path / "ledger.db"}
backends: [{{name: shared, url: "{backend.url}/v1", models: [{MODEL}]}}]
models: {{{MODEL}: {{}}}}
tenants:
  alice:
    api_keys: [{hash_key(KEY)}]
    models: [{MODEL}]
    limits: {{requests_per_minute: 1000}}
"""
        policy = parse_policy(text, file="one-link.yaml", environ={})
        with (
            serve(create_app(policy)) as url,
            openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as alice,
        ):
            # The rate limit is on the stores' link: it is open from the first request.
            alice.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            opened = _connections(redis_url)
            made = alice.responses.create(model=MODEL, input="remember me")
            again = alice.responses.create(model=MODEL, input="?", previous_response_id=made.id)
            assert again.output_text == "Earlier you said: remember me"
            login = {"key": KEY, "next": "/dashboard"}
            cookie = httpx.post(url + "/dashboard/login", data=login).cookies[COOKIE]
            assert httpx.get(url + "/api/usage", cookies={COOKIE: cookie}).status_code == 200
            httpx.post(url + "/dashboard/logout", cookies={COOKIE: cookie})
            assert httpx.get(url + "/api/usage", cookies={COOKIE: cookie}).status_code == 401
            assert _connections(redis_url) == opened


ADMIN_KEY = "tw-one-link-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def test_a_gateway_with_every_redis_feature_holds_two_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Runtime keys and the Redis ledger each opened two connections of their own to the
    storage's Redis (a multiplexed one and redis-py's pool): five in all. On the storage's link
    there are two: its multiplexed connection for every script and poll, and one of redis-py's
    pool for the reads whose replies redis-py parses (the keys' records, the ledger's queries,
    INFO). The ledger's last records are written before the link closes, and closing leaves no
    connection open."""
    # The keys' poll reads the records after each change, through the pool too: were it to
    # overlap one of the test's reads the pool would open a second connection. Polling hourly,
    # the test's reads are the only ones, one at a time (this process's changes hold at once).
    monkeypatch.setattr(services, "RuntimeKeys", partial(RuntimeKeys, refresh_s=3600))
    with private_redis() as redis_url, stored_backend() as backend:
        text = f"""
storage: {redis_url}
ledger: redis
admin_keys: [{hash_key(ADMIN_KEY)}]
backends: [{{name: shared, url: "{backend.url}/v1", models: [{MODEL}]}}]
models: {{{MODEL}: {{}}}}
tenants:
  alice:
    api_keys: [{hash_key(KEY)}]
    models: [{MODEL}]
    limits: {{requests_per_minute: 1000}}
    cache: {{mode: exact}}
"""
        policy = parse_policy(text, file="one-link.yaml", environ={})
        with (
            serve(create_app(policy)) as url,
            httpx.Client(base_url=url, headers=ADMIN) as admin,
        ):
            made = admin.post("/admin/keys", json={"tenant": "alice"}).json()
            runtime = openai.OpenAI(base_url=url + "/v1", api_key=made["key"], max_retries=0)
            for _ in range(2):  # the second is the cache's
                answer = runtime.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0
                )
                assert answer.choices[0].message.content == "ok"
            assert len(backend.bodies) == 1
            assert [k["id"] for k in admin.get("/admin/keys").json()["data"]] == [made["id"]]
            assert admin.get("/api/usage").status_code == 200  # the ledger's query
            assert admin.get("/readyz").status_code == 200  # asks the ledger's maxmemory-policy
            assert admin.delete(f"/admin/keys/{made['id']}").status_code == 200
            with pytest.raises(openai.AuthenticationError):
                runtime.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}]
                )
            assert _connections(redis_url) == 2
        assert _connections(redis_url) == 0
        with redis.Redis.from_url(redis_url) as check:
            assert check.xlen("tw:{alice}:ledger:records") == 2  # the miss and the hit


def test_a_ledger_on_another_redis_writes_there_on_connections_of_its_own() -> None:
    """Only a ledger on the storage's own URL rides on the storage's link: one on another
    Redis writes its records there, and the storage's Redis holds none of them."""
    with private_redis() as storage_url, private_redis() as ledger_url, stored_backend() as backend:
        text = f"""
storage: {storage_url}
ledger: {ledger_url}
backends: [{{name: shared, url: "{backend.url}/v1", models: [{MODEL}]}}]
models: {{{MODEL}: {{}}}}
tenants:
  alice: {{api_keys: [{hash_key(KEY)}], models: [{MODEL}]}}
"""
        policy = parse_policy(text, file="two-redis.yaml", environ={})
        with (
            serve(create_app(policy)) as url,
            openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as alice,
        ):
            alice.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        with redis.Redis.from_url(ledger_url) as ledger, redis.Redis.from_url(storage_url) as kept:
            assert ledger.xlen("tw:{alice}:ledger:records") == 1
            assert kept.keys("*ledger*") == []
