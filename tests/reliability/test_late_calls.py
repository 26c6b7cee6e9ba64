"""A storage call that timed out may still run once a slow Redis catches up. What it takes (a
concurrency slot, a quota reservation) must not stay taken until its lease ends."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.redis_server import RedisProcess, frozen
from tests.reliability.state import AUTH, policy_text, slots_held, tokens_reserved
from tests.servers import replicas


def until(check: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def test_what_a_timed_out_call_takes_late_is_given_back(backend_url: str, tmp_path: Path) -> None:
    redis = RedisProcess()
    redis.start()
    try:
        config = tmp_path / "policy.yaml"
        # One slot, leases of the default 60 s: a slot taken late would refuse for a minute.
        text = policy_text(
            backend_url, redis.url, max_concurrent=1, extra=", on_storage_error: open"
        )
        config.write_text(text)
        with replicas(config, 1) as [(_, url)], httpx.Client(base_url=url, headers=AUTH) as http:
            assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
            with frozen(redis.url, 3):
                # Admitted open after the quota's and the slot's calls time out; both calls
                # are still in Redis' input and run when it wakes.
                assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
            until(lambda: slots_held(redis.url) == 0, "the late slot is released", 6.0)
            until(lambda: tokens_reserved(redis.url) == 0, "the late reservation ends", 6.0)
            began = time.monotonic()
            after = http.post("/v1/chat/completions", json=CHAT)
            assert after.status_code == 200, after.text
            assert time.monotonic() - began < 1.0
    finally:
        redis.close()
