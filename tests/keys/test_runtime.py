"""Runtime keys through the admin API and `tokenweir keys`: created, used and revoked across two
replicas on one Redis; expiry, per-key limits and the admin key's guard."""

from __future__ import annotations

import calendar
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis

from proxy.app import create_app
from proxy.cli import main
from proxy.clock import FakeClock
from proxy.keys.runtime import KEEP_EXPIRED_S
from proxy.policy import parse_policy
from proxy.policy.units import hash_key
from tests.sdkburst import streams_at_once
from tests.servers import replicas, serve

ADMIN_KEY = "tw-keys-admin"
TENANT_KEY = "tw-keys-yaml"
RECORDS = "tw:{keys}:records"
CHAT: dict[str, Any] = {
    "model": "mock-llm",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 5,
}


def policy_text(backend_url: str, storage: str, limits: str = "{requests_per_minute: 1000}") -> str:
    return f"""storage: {storage}
admin_keys: [{hash_key(ADMIN_KEY)}]
backends: [{{name: mock, url: "{backend_url}/v1", models: [mock-llm]}}]
models: {{mock-llm: {{}}}}
tenants:
  alpha:
    api_keys: [{hash_key(TENANT_KEY)}]
    models: [mock-llm]
    limits: {limits}
"""


def _chat(url: str, key: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(url + "/v1/chat/completions", json=CHAT, headers=headers)


def _keys(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["keys", *argv])
    return code, capsys.readouterr().out


@pytest.fixture
def two_replicas(backend_url: str, redis_url: str, tmp_path: Path) -> Iterator[list[str]]:
    config = tmp_path / "policy.yaml"
    config.write_text(policy_text(backend_url, redis_url))
    with replicas(config, 2) as started:
        yield [url for _, url in started]


def test_a_key_created_on_one_replica_works_on_the_other_and_revocation_reaches_it(
    two_replicas: list[str],
    redis_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    one, other = two_replicas
    monkeypatch.setenv("TOKENWEIR_ADMIN_KEY", ADMIN_KEY)
    code, out = _keys(capsys, "create", "--tenant", "alpha", "--base-url", one, "--json")
    assert code == 0
    created = orjson.loads(out)
    secret, key_id = created["key"], created["id"]
    # Stored hashed: the secret is nowhere in Redis, its SHA-256 is.
    with redis.Redis.from_url(redis_url) as raw:
        stored = b"".join(v for v in raw.hgetall("tw:{keys}:records").values())
    assert secret.encode() not in stored
    assert hash_key(secret).encode() in stored
    _wait(lambda: _chat(other, secret).status_code == 200)
    assert _chat(one, secret).status_code == 200
    code, out = _keys(capsys, "list", "--tenant", "alpha", "--base-url", other)
    assert code == 0
    assert key_id in out
    assert secret not in out
    code, _ = _keys(capsys, "revoke", key_id, "--tenant", "alpha", "--base-url", one)
    assert code == 0
    took_s = _wait(lambda: _chat(other, secret).status_code == 401)
    assert took_s < 2.0  # polled twice a second: within a second, with room for a loaded CI
    assert _chat(one, secret).status_code == 401
    assert _chat(other, TENANT_KEY).status_code == 200  # the YAML key keeps working


def test_a_record_a_replica_cannot_read_is_skipped_and_revocations_still_arrive(
    backend_url: str, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A record this version cannot parse (a newer tokenweir's allowance field, in a rolling
    upgrade) is skipped and logged once per replica; the replica keeps polling, so a key
    revoked elsewhere stops working on it, and its key list still answers."""
    caplog.set_level(logging.ERROR, logger="tokenweir.keys")
    policy = parse_policy(policy_text(backend_url, redis_url), environ={})
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    unreadable = orjson.dumps(
        {"tenant": "alpha", "digest": "sha256:" + "00" * 32, "created": 1, "expires_at": None,
         "allowance": {"usd_per_day": 5}, "name": "from-a-newer-version"}
    )  # fmt: skip
    with serve(create_app(policy)) as one, serve(create_app(policy)) as other:
        created = httpx.post(one + "/admin/keys", json={"tenant": "alpha"}, headers=admin).json()
        _wait(lambda: _chat(other, created["key"]).status_code == 200)
        with redis.Redis.from_url(redis_url) as raw:
            raw.hset("tw:{keys}:records", "key_fromnewer", unreadable)
            raw.incr("tw:{keys}:version")
        revoked = httpx.delete(one + f"/admin/keys/{created['id']}", headers=admin)
        assert revoked.status_code == 200
        _wait(lambda: _chat(other, created["key"]).status_code == 401)
        listed = [httpx.get(url + "/admin/keys", headers=admin) for url in (one, other)]
        assert _chat(other, TENANT_KEY).status_code == 200
    assert [answer.status_code for answer in listed] == [200, 200]
    assert [answer.json()["data"] for answer in listed] == [[], []]
    logged = [r.getMessage() for r in caplog.records if "key_fromnewer" in r.getMessage()]
    assert len(logged) == 2, logged  # once per replica, not on every poll or list
    assert "usd_per_day" in logged[0]


def _wait(check: object, timeout_s: float = 10.0) -> float:
    assert callable(check)
    began = time.monotonic()
    while not check():
        assert time.monotonic() - began < timeout_s
        time.sleep(0.05)
    return time.monotonic() - began


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start_wall=calendar.timegm((2027, 3, 1, 12, 0, 0)))


@pytest.fixture
def gateway(backend_url: str, clock: FakeClock) -> Iterator[httpx.Client]:
    policy = parse_policy(policy_text(backend_url, "memory"), environ={})
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    app = create_app(policy, clock=clock)
    with serve(app) as url, httpx.Client(base_url=url, headers=admin) as http:
        yield http


def test_a_key_expires(gateway: httpx.Client, clock: FakeClock) -> None:
    created = gateway.post("/admin/keys", json={"tenant": "alpha", "expires": "30d"}).json()
    assert created["expires_at"] == int(clock.wall()) + 30 * 86400
    assert _chat(str(gateway.base_url), created["key"]).status_code == 200
    clock.advance(30 * 86400 - 1)
    assert _chat(str(gateway.base_url), created["key"]).status_code == 200
    clock.advance(1)
    assert _chat(str(gateway.base_url), created["key"]).status_code == 401
    listed = gateway.get("/admin/keys", params={"tenant": "alpha"}).json()["data"]
    assert [k["expired"] for k in listed] == [True]


def test_an_expired_key_is_listed_for_30_days_then_forgotten(
    gateway: httpx.Client, clock: FakeClock
) -> None:
    """Expired keys stayed stored and listed for ever (on `memory` storage nothing polls:
    a listing or a create forgets them)."""
    old = gateway.post("/admin/keys", json={"tenant": "alpha", "expires": "1d"}).json()
    lasting = gateway.post("/admin/keys", json={"tenant": "alpha"}).json()
    clock.advance(86400 + KEEP_EXPIRED_S - 1)
    listed = gateway.get("/admin/keys").json()["data"]
    assert [(k["id"], k["expired"]) for k in listed] == [(old["id"], True), (lasting["id"], False)]
    clock.advance(1)
    assert [k["id"] for k in gateway.get("/admin/keys").json()["data"]] == [lasting["id"]]
    assert _chat(str(gateway.base_url), lasting["key"]).status_code == 200


def test_a_replica_forgets_long_expired_keys_from_shared_storage_unasked(
    backend_url: str, redis_url: str, clock: FakeClock
) -> None:
    """No admin call: the replica's poll deletes the record from Redis (it was stored for ever)."""
    policy = parse_policy(policy_text(backend_url, redis_url), environ={})
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    with serve(create_app(policy, clock=clock)) as url:
        made = httpx.post(
            url + "/admin/keys", json={"tenant": "alpha", "expires": "1h"}, headers=admin
        )
        key_id = made.json()["id"]
        kept = httpx.post(url + "/admin/keys", json={"tenant": "alpha"}, headers=admin).json()
        clock.advance(3600 + KEEP_EXPIRED_S)
        with redis.Redis.from_url(redis_url) as raw:
            _wait(lambda: not raw.hexists(RECORDS, key_id))
            assert raw.hexists(RECORDS, kept["id"])
        assert _chat(url, kept["key"]).status_code == 200


def test_a_key_has_its_own_limits_within_its_tenants(gateway: httpx.Client) -> None:
    body = {"tenant": "alpha", "limits": {"requests_per_minute": 1}}
    limited = gateway.post("/admin/keys", json=body).json()
    url = str(gateway.base_url)
    assert _chat(url, limited["key"]).status_code == 200
    refused = _chat(url, limited["key"])
    assert refused.status_code == 429
    assert "this API key" in refused.json()["error"]["message"]
    assert _chat(url, TENANT_KEY).status_code == 200  # the tenant's other keys are not limited
    too_big = gateway.post(
        "/admin/keys", json={"tenant": "alpha", "limits": {"requests_per_minute": 5000}}
    )
    assert too_big.status_code == 400
    assert "above the tenant's 1000" in too_big.json()["error"]["message"]


def test_a_key_has_its_own_daily_tokens(gateway: httpx.Client) -> None:
    body = {"tenant": "alpha", "budget": {"tokens_per_day": 30}}
    limited = gateway.post("/admin/keys", json=body).json()
    url = str(gateway.base_url)
    answers = [_chat(url, limited["key"]).status_code for _ in range(5)]
    assert answers[0] == 200
    assert answers[-1] == 429


def test_only_admins_manage_keys_and_bad_requests_say_why(gateway: httpx.Client) -> None:
    tenant = {"authorization": f"Bearer {TENANT_KEY}"}
    assert gateway.post("/admin/keys", json={"tenant": "alpha"}, headers=tenant).status_code == 403
    assert gateway.get("/admin/keys", headers={"authorization": "Bearer nope"}).status_code == 401
    unknown = gateway.post("/admin/keys", json={"tenant": "nobody"})
    assert unknown.status_code == 400
    assert unknown.json()["error"]["param"] == "tenant"
    typo = gateway.post("/admin/keys", json={"tenant": "alpha", "limits": {"rpm": 1}})
    assert typo.status_code == 400
    assert "limits.rpm" in typo.json()["error"]["message"]
    assert gateway.delete("/admin/keys/key_missing").status_code == 404


@pytest.mark.parametrize(
    "name",
    ["ops\nbot", "tab\there", "\x1b[31mred", "del\x7f", "nel\x85line", "csi\x9b31m", "x" * 201],
)
def test_a_key_name_with_a_control_character_or_too_long_is_refused_and_nothing_made(
    gateway: httpx.Client, name: str
) -> None:
    """A key's name goes into `tokenweir keys list`, the ledger and log lines: a newline or a
    terminal escape (C0, DEL or C1) in it would forge lines there, so it is a 400 naming the
    field, and no key is made."""
    before = gateway.get("/admin/keys").json()
    refused = gateway.post("/admin/keys", json={"tenant": "alpha", "name": name})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "name")
    assert gateway.get("/admin/keys").json() == before
    kept = gateway.post("/admin/keys", json={"tenant": "alpha", "name": "ops bot é 客服"})
    assert kept.status_code == 201
    assert kept.json()["name"] == "ops bot é 客服"


def test_a_keys_own_quota_bounds_an_answer_the_client_left_unbounded(
    gateway: httpx.Client,
) -> None:
    """The tenant has no quota, the key has 5,000 tokens a day, the client sets no max_tokens
    and the backend would write 6,000: the key reserves a bound and the backend is held to it
    (it was reserved but never sent, and the key's day was overspent by one answer)."""
    body = {"tenant": "alpha", "budget": {"tokens_per_day": 5000}}
    limited = gateway.post("/admin/keys", json=body).json()
    chat = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}],
            "mock_completion_tokens": 6000}  # fmt: skip
    answer = httpx.post(
        str(gateway.base_url) + "/v1/chat/completions",
        json=chat,
        headers={"authorization": f"Bearer {limited['key']}"},
        timeout=60,
    )
    assert answer.status_code == 200
    assert answer.json()["usage"]["completion_tokens"] <= 4096
    assert answer.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/embeddings", {"input": "word " * 2000}),
        ("/v1/completions", {"prompt": "word " * 2000, "max_tokens": 5}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 2000}]}),
    ],
)
def test_a_keys_own_quota_counts_the_input_before_the_backend_is_asked(
    gateway: httpx.Client, route: str, body: dict[str, Any]
) -> None:
    """The tenant has no quota or token limit, so its input was not counted: a key with 100
    tokens a day had 2,000 input tokens admitted (reserving 0 of them, or only the answer's
    bound), and its day was overspent by the whole prompt. Such a request can never fit the
    key's day: it is told so, not told to retry when the day resets."""
    limited = gateway.post(
        "/admin/keys", json={"tenant": "alpha", "budget": {"tokens_per_day": 100}}
    ).json()
    answer = httpx.post(
        str(gateway.base_url) + route,
        json={"model": "mock-llm", **body},
        headers={"authorization": f"Bearer {limited['key']}"},
    )
    assert answer.status_code == 429, answer.text
    assert answer.json()["error"]["code"] == "insufficient_quota"
    assert "can never be admitted" in answer.json()["error"]["message"]
    assert answer.headers["x-should-retry"] == "false"  # the openai SDK does not retry it


def test_requests_refused_for_what_a_keys_requests_in_flight_hold_retry_soon(
    gateway: httpx.Client,
) -> None:
    """A key's own 2,000 tokens a day, 12 streams at once reserving 300 tokens each and using
    about 30: the ones that do not fit at first are told to retry in a second and the SDK's
    retries get them through (they were told to wait until midnight, and not to retry)."""
    body = {"tenant": "alpha", "budget": {"tokens_per_day": 2000}}
    key = gateway.post("/admin/keys", json=body).json()["key"]
    body = {**CHAT, "max_tokens": 300, "extra_body": {"mock_completion_tokens": 20}}
    assert all(streams_at_once(f"{gateway.base_url}/v1", key, body, 12))


def test_a_keys_quota_held_by_its_requests_in_flight_is_a_rate_limit(
    gateway: httpx.Client, backend: httpx.Client
) -> None:
    """Refused only for what the key's request in flight holds: `rate_limit_exceeded` with
    `Retry-After: 1`, not `insufficient_quota` (a spent plan, which clients treat as final)."""
    body = {"tenant": "alpha", "budget": {"tokens_per_day": 2000}}
    key = gateway.post("/admin/keys", json=body).json()["key"]
    url, headers = f"{gateway.base_url}/v1/chat/completions", {"authorization": f"Bearer {key}"}
    slow = {**CHAT, "max_tokens": 1800, "mock_delay_ms": 3000}
    sent = backend.get("/mock/stats").json()["requests_total"]
    with ThreadPoolExecutor(1) as pool:
        holding = pool.submit(httpx.post, url, json=slow, headers=headers, timeout=30)
        _wait(lambda: backend.get("/mock/stats").json()["requests_total"] > sent)  # reserved
        refused = httpx.post(url, json={**CHAT, "max_tokens": 300}, headers=headers)
        assert holding.result().status_code == 200
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "Requests in flight hold this API key's own quota" in refused.json()["error"]["message"]
    assert refused.headers["retry-after"] == "1"


def test_a_key_held_to_its_own_limit_leaves_the_tenants_to_its_other_keys(
    backend_url: str, redis_url: str
) -> None:
    """A runtime key limited to 2 requests a minute sends 30: the 28 it is refused take nothing
    from the tenant's 20 a minute, so the tenant's other keys are still served (they took 30,
    and every other key was refused for the rest of the minute). Its refusals show its own
    limit in OpenAI's headers."""
    policy = parse_policy(
        policy_text(backend_url, redis_url, "{requests_per_minute: 20}"), environ={}
    )
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    with serve(create_app(policy)) as url:
        body = {"tenant": "alpha", "limits": {"requests_per_minute": 2}}
        key = httpx.post(url + "/admin/keys", json=body, headers=admin).json()["key"]
        answers = [_chat(url, key) for _ in range(30)]
        other = _chat(url, TENANT_KEY)
    assert [a.status_code for a in answers].count(200) == 2
    assert other.status_code == 200, other.text
    refused = answers[-1]
    assert refused.status_code == 429
    assert refused.headers["x-ratelimit-limit-requests"] == "2"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    # 20, less the key's 2 admitted and this one, plus what refilled meanwhile (1 each 3 s)
    assert int(other.headers["x-ratelimit-remaining-requests"]) >= 17
