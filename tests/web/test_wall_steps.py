"""The wall clock stepping (NTP) under a running gateway: limits keep working as time goes on."""

from __future__ import annotations

import httpx

from proxy.app import create_app
from proxy.clock import FakeClock
from tests.servers import serve
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
