"""A storage call that timed out may still run once a slow Redis catches up. What it takes (a
concurrency slot, a quota reservation) must not stay taken until its lease ends."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from proxy.policy.units import hash_key
from tests.redis_server import RedisProcess, frozen
from tests.reliability.cutproxy import CutProxy
from tests.reliability.state import AUTH, ledger_records, policy_text, slots_held, tokens_reserved
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


BACKEND_LIMITED = """
storage: {storage}
backends:
  - {{name: mock, url: "{backend_url}/v1", models: [mock-llm], limits: {{max_concurrent: 1}}}}
models: {{mock-llm: {{}}}}
tenants:
  app:
    api_keys: [{key}]
    models: [mock-llm]
"""


@pytest.mark.parametrize("limited", ["tenant", "backend"])
def test_a_client_that_leaves_during_admission_leaves_nothing_held(
    backend_url: str, tmp_path: Path, limited: str
) -> None:
    """The client leaves while the admission's call waits on a slow Redis: the call still runs
    when Redis wakes. What it takes (a slot, a reservation) is given back, not kept for the
    minute of its lease, when the next request would find the gateway full."""
    redis = RedisProcess()
    redis.start()
    try:
        config = tmp_path / "policy.yaml"
        if limited == "tenant":
            config.write_text(policy_text(backend_url, redis.url, max_concurrent=1))
        else:  # only the route stage's admission on the backend's own slots calls Redis
            key = hash_key(AUTH["authorization"].removeprefix("Bearer "))
            text = BACKEND_LIMITED.format(storage=redis.url, backend_url=backend_url, key=key)
            config.write_text(text)
        with replicas(config, 1) as [(_, url)], httpx.Client(base_url=url, headers=AUTH) as http:
            assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
            with frozen(redis.url, 2), pytest.raises(httpx.ReadTimeout):
                http.post("/v1/chat/completions", json=CHAT, timeout=0.5)  # and leaves
            until(lambda: slots_held(redis.url) == 0, "the slot is given back", 6.0)
            until(lambda: tokens_reserved(redis.url) == 0, "the reservation ends", 6.0)
            after = http.post("/v1/chat/completions", json=CHAT)
            assert after.status_code == 200, after.text
    finally:
        redis.close()


def test_what_a_call_takes_before_its_connection_is_lost_is_given_back(
    backend_url: str, tmp_path: Path
) -> None:
    """The admission's call reached Redis and ran, and its connection was lost before the
    reply came back (as a Redis restarting under load does to calls in flight): the request is
    admitted open, and what the call took was kept until its lease ended (here 5 minutes), so a
    tenant at max_concurrent was refused all that time. It is given back as a timed-out call's."""
    redis = RedisProcess()
    redis.start()
    try:
        with CutProxy(redis.port) as relay:
            config = tmp_path / "policy.yaml"
            relayed = f"redis://127.0.0.1:{relay.port}/0"
            extra = ", on_storage_error: open, lease_ttl: 5m"
            config.write_text(policy_text(backend_url, relayed, max_concurrent=1, extra=extra))
            with (
                replicas(config, 1) as [(_, url)],
                httpx.Client(base_url=url, headers=AUTH) as http,
            ):
                assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
                until(lambda: ledger_records(redis.url) == 1, "the first is recorded", 10.0)
                relay.cut_next()
                assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
                until(lambda: slots_held(redis.url) == 0, "the slot is given back", 10.0)
                until(lambda: tokens_reserved(redis.url) == 0, "the reservation ends", 10.0)
                assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
    finally:
        redis.close()
