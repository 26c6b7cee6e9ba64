"""The gateway as time goes by: the wall clock stepping (NTP), days and months ending."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from proxy.app import create_app
from proxy.clock import FakeClock
from proxy.policy import parse_policy
from proxy.storage import Counter, MemoryStore
from tests.keys.test_runtime import ADMIN_KEY as RUNTIME_ADMIN_KEY
from tests.keys.test_runtime import _chat as runtime_chat
from tests.keys.test_runtime import policy_text as runtime_policy_text
from tests.servers import serve
from tests.web.test_budgets import KEY as BUDGET_KEY
from tests.web.test_budgets import budget_policy, budget_policy_text
from tests.web.test_cache import ask as cache_ask
from tests.web.test_cache import gateway as cache_gateway
from tests.web.test_ratelimits import AUTH, CHAT, limits_policy

NEW_YEAR = 1_798_761_600.0  # 2027-01-01 00:00 UTC
TAGS = ("d:20261231", "m:202612", "d:20270101", "m:202701")


def test_a_wall_clock_stepped_back_does_not_stall_a_rate_limit_past_its_minute(
    backend_url: str,
) -> None:
    clock = FakeClock()
    policy = limits_policy(backend_url, "{requests_per_minute: 2}")
    with serve(create_app(policy, clock=clock)) as url, httpx.Client(base_url=url) as http:
        for _ in range(2):
            assert http.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code == 200
        clock.step_wall(-3600.0)  # NTP takes the wall clock back an hour
        refused = http.post("/v1/chat/completions", json=CHAT, headers=AUTH)
        assert refused.status_code == 429
        wait_s = int(refused.headers["retry-after"])
        assert 1 <= wait_s <= 60
        clock.advance(wait_s + 1.0)  # the client waits as told, not an hour
        again = http.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert again.status_code == 200, again.text


def test_a_memory_gateway_forgets_each_days_quota_counters_once_the_day_is_over(
    backend_url: str,
) -> None:
    # The counters are per day and per month, as in Redis, where each expires after its period:
    # a gateway serving for a year must not keep 365 of them per tenant and per key.
    clock, store = FakeClock(start_wall=NEW_YEAR), MemoryStore()
    policy = budget_policy(backend_url, "{tokens_per_day: 100000, tokens_per_month: 1000000}")
    with serve(create_app(policy, clock=clock, store=store)) as url, httpx.Client() as http:
        for _ in range(60):
            answer = http.post(
                url + "/v1/chat/completions",
                json=CHAT | {"model": "mock-llm"},
                headers={"authorization": f"Bearer {BUDGET_KEY}"},
            )
            assert answer.status_code == 200, answer.text
            clock.advance(86400.0)
    assert len(store._slots) <= 4  # yesterday's and today's day, last month's and this one's


@pytest.mark.parametrize("on_redis", [False, True], ids=["memory", "redis"])
def test_a_request_across_new_year_midnight_is_billed_once_to_the_day_and_month_it_began(
    backend_url: str, backend: httpx.Client, request: pytest.FixtureRequest, on_redis: bool
) -> None:
    budget = "{tokens_per_day: 1000, tokens_per_month: 100000}"
    storage = request.getfixturevalue("redis_url") if on_redis else "memory"
    policy = parse_policy(budget_policy_text(backend_url, budget, storage), environ={})
    clock, store = FakeClock(start_wall=NEW_YEAR - 10.0), None if on_redis else MemoryStore()
    body = CHAT | {"model": "mock-llm", "max_tokens": 500, "mock_delay_ms": 3000}
    with serve(create_app(policy, clock=clock, store=store)) as url, httpx.Client() as http:
        headers = {"authorization": f"Bearer {BUDGET_KEY}"}
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(
                http.post, url + "/v1/chat/completions", json=body, headers=headers
            )
            while backend.get("/mock/stats").json()["inflight"] < 1:  # reserved on Dec 31
                time.sleep(0.01)
            clock.advance(20.0)  # it answers on Jan 1
            assert answer.result().status_code == 200
        used = answer.result().json()["usage"]["total_tokens"]
        readings = quota_counters(store or storage)
        assert readings == [(used, 0), (used, 0), (0, 0), (0, 0)]
        # Jan 1 starts with its whole day: a request reserving over 900 of its 1000 fits.
        body = CHAT | {"model": "mock-llm", "max_tokens": 900}
        assert (
            http.post(url + "/v1/chat/completions", json=body, headers=headers).status_code == 200
        )


def quota_counters(store: MemoryStore | str) -> list[tuple[int, int]]:
    """(used, reserved) of the tenant's counters named by TAGS, from the store or Redis URL."""
    keys = [f"tw:{{support-bot}}:q:tokens:{tag}" for tag in TAGS]
    if isinstance(store, MemoryStore):
        return asyncio.run(store.read([Counter(key, 0, 0) for key in keys]))
    with redis.Redis.from_url(store) as admin:
        found = [admin.hmget(key, "used", "reserved") for key in keys]
    return [(int(used or 0), int(reserved or 0)) for used, reserved in found]


def test_a_wall_clock_stepped_back_does_not_keep_a_cached_answer_past_its_ttl(
    backend_url: str,
) -> None:
    clock = FakeClock()
    with cache_gateway(backend_url, "memory", "{mode: exact, ttl: 10m}", clock=clock) as url:
        assert cache_ask(url).headers["x-tokenweir-cache"] == "miss"
        clock.advance(60)
        clock.step_wall(-3600.0)  # NTP takes the wall clock back an hour
        clock.advance(600)  # the answer is older than its ttl
        assert cache_ask(url).headers["x-tokenweir-cache"] == "miss"
        assert cache_ask(url).headers["x-tokenweir-cache"] == "hit"  # the new one is kept


class MidnightOnRead(FakeClock):
    """A fake clock whose wall clock, once armed, passes midnight just after it is next read:
    that read (the request's arrival) and the request's later ones fall on either side of it,
    as on a busy gateway."""

    __slots__ = ("armed",)

    def __init__(self, start_wall: float) -> None:
        super().__init__(start_wall)
        self.armed = False

    def wall(self) -> float:
        now = super().wall()
        if self.armed:
            self.armed = False
            self.step_wall(NEW_YEAR + 0.001 - now)
        return now


def test_a_request_received_just_before_midnight_is_on_the_quota_of_the_day_of_its_record(
    backend_url: str,
) -> None:
    """The ledger dates a request by when it was received; the quota by when the budget stage
    ran, a few reads of the clock later. A request received at 23:59:59.999 on Dec 31 was in
    the ledger's 2026 and on the quotas of Jan 1 2027: the day's and the month's spend on the
    dashboard disagreed with the quotas, which charged the new day and month for the old one's
    request. Now both go by when the request was received (docs/policy.md says so)."""
    budget = "{tokens_per_day: 1000, tokens_per_month: 100000}"
    policy = parse_policy(budget_policy_text(backend_url, budget, "memory"), environ={})
    clock, store = MidnightOnRead(start_wall=NEW_YEAR - 0.001), MemoryStore()
    with serve(create_app(policy, clock=clock, store=store)) as url, httpx.Client() as http:
        clock.armed = True
        answer = http.post(
            url + "/v1/chat/completions",
            json=CHAT | {"model": "mock-llm", "max_tokens": 5},
            headers={"authorization": f"Bearer {BUDGET_KEY}"},
        )
    assert answer.status_code == 200, answer.text
    used = answer.json()["usage"]["total_tokens"]
    assert quota_counters(store) == [(used, 0), (used, 0), (0, 0), (0, 0)]


def test_a_runtime_keys_own_quota_is_that_of_the_day_the_request_was_received(
    backend_url: str,
) -> None:
    """As the tenant's quotas: a key's own tokens_per_day counted a request received a moment
    before midnight on the new day's counter, beside the old day's ledger record."""
    policy = parse_policy(runtime_policy_text(backend_url, "memory"), environ={})
    clock, store = MidnightOnRead(start_wall=NEW_YEAR - 0.001), MemoryStore()
    admin = {"authorization": f"Bearer {RUNTIME_ADMIN_KEY}"}
    with serve(create_app(policy, clock=clock, store=store)) as url, httpx.Client() as http:
        body = {"tenant": "alpha", "budget": {"tokens_per_day": 1000}}
        created = http.post(url + "/admin/keys", json=body, headers=admin).json()
        clock.armed = True
        answer = runtime_chat(url, created["key"])
    assert answer.status_code == 200, answer.text
    used = answer.json()["usage"]["total_tokens"]
    keys = [f"tw:{{alpha}}:key:{created['id']}:q:tokens:d:{day}" for day in (20261231, 20270101)]
    assert asyncio.run(store.read([Counter(key, 0, 0) for key in keys])) == [(used, 0), (0, 0)]
