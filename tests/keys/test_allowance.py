"""A runtime key's own quota holds for the whole of a long request: its reservation is renewed
while the request runs, as the tenant's is, so no other request can spend it meanwhile."""

from __future__ import annotations

import calendar
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from proxy.app import create_app
from proxy.clock import FakeClock
from proxy.policy import parse_policy
from proxy.tools.mock import backend as mockbackend
from tests.keys.test_runtime import ADMIN_KEY, TENANT_KEY, policy_text
from tests.redis_server import RedisProcess, frozen
from tests.servers import serve


@pytest.fixture
def slow_backend() -> Iterator[str]:
    """20 tokens/s: a 900-token stream stays open for 45 seconds."""
    with serve(mockbackend.create_app(ttft_ms=0, tokens_per_second=20)) as url:
        yield url


@pytest.mark.parametrize("storage", ["memory", "redis"])
def test_a_long_stream_keeps_its_keys_quota_reserved(
    slow_backend: str, storage: str, request: pytest.FixtureRequest
) -> None:
    """A key of 1,000 tokens a day; a stream holds 900 of them for longer than the 10 minutes
    a key's reservation lasts: the reservation was never renewed, expired mid-stream, and a
    second 900-token request was admitted on the key while the first still ran."""
    clock = FakeClock(start_wall=calendar.timegm((2027, 3, 1, 12, 0, 0)))
    where = request.getfixturevalue("redis_url") if storage == "redis" else "memory"
    text = policy_text(slow_backend, where) + "upstream: {total_timeout: 2h}\n"
    app = create_app(parse_policy(text, environ={}), clock=clock)
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    with serve(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        body = {"tenant": "alpha", "budget": {"tokens_per_day": 1000}}
        key = http.post("/admin/keys", json=body, headers=admin).json()["key"]
        chat = {
            "model": "mock-llm",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 900,
            "mock_completion_tokens": 900,
        }
        bearer = {"authorization": f"Bearer {key}"}
        opened, done = threading.Event(), threading.Event()

        def long_stream() -> None:
            with http.stream(
                "POST", "/v1/chat/completions", json={**chat, "stream": True}, headers=bearer
            ) as answer:
                assert answer.status_code == 200
                for _ in answer.iter_bytes():
                    opened.set()
                    if done.is_set():
                        return  # the client leaves: the stream ends

        streaming = threading.Thread(target=long_stream)
        streaming.start()
        try:
            assert opened.wait(30)
            assert http.post("/v1/chat/completions", json=chat, headers=bearer).status_code == 429
            for _ in range(4):  # 20 minutes on the gateway's clock, the stream still open
                clock.advance(300)
                time.sleep(0.3)  # the renewals the clock's timers started reach the storage
            short = {**chat, "mock_completion_tokens": 1}  # 900 reserved all the same
            second = http.post("/v1/chat/completions", json=short, headers=bearer)
            assert second.status_code == 429, "the key's quota was spent twice"
            assert "own quota" in second.json()["error"]["message"]
        finally:
            done.set()
            streaming.join(60)


@pytest.mark.parametrize(("policy", "status"), [("open", 200), ("closed", 503)])
def test_a_keys_own_quota_follows_on_storage_error_when_redis_is_slow(
    backend_url: str, policy: str, status: int
) -> None:
    """Redis stops answering: a key with a quota of its own is admitted (`open`) or refused
    with 503 `storage_unavailable` (`closed`), as its tenant's quota would be; it was a 500
    `internal_error` with a traceback in the log either way."""
    redis = RedisProcess()
    redis.start()
    try:
        text = policy_text(backend_url, redis.url, limits=f"{{on_storage_error: {policy}}}")
        app = create_app(parse_policy(text, environ={}))
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        with serve(app) as url, httpx.Client(base_url=url, timeout=30) as http:
            body = {"tenant": "alpha", "budget": {"tokens_per_day": 1000}}
            key = http.post("/admin/keys", json=body, headers=admin).json()["key"]
            chat = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
            with frozen(redis.url, 4):
                answer = http.post(
                    "/v1/chat/completions", json=chat, headers={"authorization": f"Bearer {key}"}
                )
            assert answer.status_code == status, answer.text
            if policy == "closed":
                assert answer.json()["error"]["code"] == "storage_unavailable"
                assert answer.headers["retry-after"] == "1"
            decisions = http.get("/readyz").json()["storage_failure_decisions"]
            assert decisions == {f"key_allowance:{policy}": 1}
    finally:
        redis.close()


@pytest.mark.parametrize("storage", ["memory", "redis"])
def test_requests_a_key_refuses_leave_its_tenants_requests_per_minute_alone(
    backend_url: str, storage: str, request: pytest.FixtureRequest
) -> None:
    """A key allowed one request a minute, retried in a loop: its refused requests used to take
    one each from its tenant's requests_per_minute, so the tenant's other keys got 429s."""
    clock = FakeClock(start_wall=calendar.timegm((2027, 3, 1, 12, 0, 0)))
    where = request.getfixturevalue("redis_url") if storage == "redis" else "memory"
    text = policy_text(backend_url, where, limits="{requests_per_minute: 5}")
    app = create_app(parse_policy(text, environ={}), clock=clock)
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    chat = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        body = {"tenant": "alpha", "limits": {"requests_per_minute": 1}}
        key = http.post("/admin/keys", json=body, headers=admin).json()["key"]
        looping = {"authorization": f"Bearer {key}"}
        assert http.post("/v1/chat/completions", json=chat, headers=looping).status_code == 200
        for _ in range(10):
            refused = http.post("/v1/chat/completions", json=chat, headers=looping)
            assert refused.status_code == 429
            assert "this API key" in refused.json()["error"]["message"]
        other = {"authorization": f"Bearer {TENANT_KEY}"}
        answers = [
            http.post("/v1/chat/completions", json=chat, headers=other).status_code
            for _ in range(5)
        ]
    assert answers == [200, 200, 200, 200, 429]  # the tenant's 5: one used by the key


@pytest.mark.parametrize("storage", ["memory", "redis"])
def test_requests_its_tenant_refuses_leave_a_keys_requests_per_minute_alone(
    backend_url: str, storage: str, request: pytest.FixtureRequest
) -> None:
    """A key allowed 3 requests a minute, under a tenant that runs one at a time: while its
    stream runs, two more are refused by the tenant's max_concurrent and take nothing from the
    key, which has two left after it (they took one each, and the key was 429 after one served
    request)."""
    clock = FakeClock(start_wall=calendar.timegm((2027, 3, 1, 12, 0, 0)))  # no refill
    where = request.getfixturevalue("redis_url") if storage == "redis" else "memory"
    text = policy_text(backend_url, where, limits="{max_concurrent: 1}")
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    chat = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}]}
    stream = {**chat, "stream": True, "max_tokens": 5000, "mock_completion_tokens": 5000}
    app = create_app(parse_policy(text, environ={}), clock=clock)
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        body = {"tenant": "alpha", "limits": {"requests_per_minute": 3}}
        key = http.post("/admin/keys", json=body, headers=admin).json()["key"]
        auth = {"authorization": f"Bearer {key}"}
        with http.stream("POST", "/v1/chat/completions", json=stream, headers=auth) as first:
            lines = first.iter_lines()  # kept: a discarded iterator closes the response
            next(lines)
            refused = [http.post("/v1/chat/completions", json=chat, headers=auth) for _ in "ab"]
        # The stream's slot is given back once the gateway has seen the client leave: until
        # then the tenant's max_concurrent refuses (and, as tested, takes nothing from the key).
        deadline = time.monotonic() + 10
        while True:
            freed = http.post("/v1/chat/completions", json=chat, headers=auth)
            if freed.status_code != 429 or "max_concurrent" not in freed.text:
                break
            assert time.monotonic() < deadline, "the stream's slot was never given back"
            time.sleep(0.05)
        after = [freed] + [http.post("/v1/chat/completions", json=chat, headers=auth) for _ in "bc"]
    assert [answer.status_code for answer in refused] == [429, 429]
    assert "max_concurrent: 1" in refused[0].json()["error"]["message"]
    assert [answer.status_code for answer in after] == [200, 200, 429]
    assert "this API key" in after[-1].json()["error"]["message"]
