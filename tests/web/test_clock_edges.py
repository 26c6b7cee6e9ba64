"""The gateway as time goes by: the wall clock stepping (NTP), days and months ending."""

from __future__ import annotations

import httpx

from proxy.app import create_app
from proxy.clock import FakeClock
from proxy.storage import MemoryStore
from tests.servers import serve
from tests.web.test_budgets import KEY as BUDGET_KEY
from tests.web.test_budgets import budget_policy
from tests.web.test_ratelimits import AUTH, CHAT, limits_policy


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
    clock, store = FakeClock(start_wall=1_798_761_600.0), MemoryStore()  # 2027-01-01 00:00 UTC
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
