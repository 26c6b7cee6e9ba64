"""A quota settle whose Redis call timed out, under a real `tokenweir serve` on a real Redis that
hangs (SIGSTOP) as the request ends: its usage is on the tenant's quota exactly once, whether
the timed-out call ran (Redis woke up) or not (Redis died with it unread, restarted from disk)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from proxy.tools.mock import backend as mockbackend
from tests.redis_server import RedisProcess
from tests.reliability.state import AUTH, day_quota, policy_text
from tests.servers import replicas, serve

BODY = {
    "model": "mock-llm", "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 300, "mock_completion_tokens": 300,
}  # fmt: skip


@pytest.fixture
def durable_redis() -> Iterator[RedisProcess]:
    """A Redis that keeps every write on disk: killed and started again, it has them all."""
    server = RedisProcess(["--appendonly", "yes", "--appendfsync", "always"])
    server.start()
    try:
        yield server
    finally:
        server.resume()
        server.close()


def _wait_for(check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.1)


def _settles(http: httpx.Client) -> dict[str, int]:
    settles: dict[str, int] = http.get("/readyz?backends=skip").json()["quota_settles"]
    return settles


@pytest.mark.parametrize("first_copy", ["ran", "lost"])
def test_a_timed_out_settle_is_booked_exactly_once(
    tmp_path: Path, durable_redis: RedisProcess, first_copy: str
) -> None:
    """Before: a timed-out settle only had its lease released, its usage never booked: a
    request whose settle Redis never ran was missing from the tenant's daily quota."""
    redis, config = durable_redis, tmp_path / "policy.yaml"
    backend = mockbackend.create_app(ttft_ms=0, tokens_per_second=200)
    with serve(backend) as backend_url, ThreadPoolExecutor(1) as pool:
        config.write_text(policy_text(backend_url, redis.url))
        with (
            replicas(config, 1) as [(_, url)],
            httpx.Client(base_url=url, headers=AUTH, timeout=30) as http,
        ):
            answer = pool.submit(http.post, "/v1/chat/completions", json=BODY)
            _wait_for(lambda: day_quota(redis.url)[1] > 0)  # reserved
            redis.pause()  # the settle at the request's end is written, and times out
            used = answer.result(timeout=30).json()["usage"]["total_tokens"]
            _wait_for(lambda: _settles(http)["uncertain"] == 1)
            if first_copy == "ran":
                redis.resume()  # it runs now, its answer long given up
            else:
                redis.kill()  # unread: it never runs; the reservation is on disk
                redis.start()
            _wait_for(lambda: day_quota(redis.url) == (used, 0))
            _wait_for(lambda: _settles(http)["pending"] == 0)
            time.sleep(1.0)  # nothing more lands: counted once, not twice
            assert day_quota(redis.url) == (used, 0)
            settled = _settles(http)
    outcome = "settled_before" if first_copy == "ran" else "booked_late"
    assert settled[outcome] == 1
