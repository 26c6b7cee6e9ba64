"""`/metrics` (and `/readyz`) show the ledger's own figures: records written, dropped and not
written yet, and failed writes, so an operator can alert on usage records at risk (they were in
the logs only).
A real gateway over the mock backend, its ledger on a private Redis that the test stops."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from proxy.app import create_app
from proxy.policy import Policy, parse_policy
from proxy.policy.units import hash_key
from tests.redis_server import RedisProcess
from tests.servers import serve

KEY = "tw-ledger-metrics"
CHAT = {"model": "mock-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
_WAIT_S = 60.0  # a limit on a loaded 2-core machine, not a measurement


def _policy(ledger_url: str, backend_url: str) -> Policy:
    text = f"""
storage: memory
ledger: {ledger_url}
backends: [{{name: mock, url: "{backend_url}/v1", models: [mock-llm]}}]
models: {{mock-llm: {{}}}}
tenants: {{t: {{api_keys: [{hash_key(KEY)}], models: [mock-llm]}}}}
"""
    return parse_policy(text, file="ledger-metrics.yaml", environ={})


def _ledger_figures(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("tokenweir_ledger_")
    }


def _until(url: str, holds: Callable[[dict[str, float]], bool]) -> dict[str, float]:
    deadline = time.monotonic() + _WAIT_S
    while True:
        figures = _ledger_figures(url)
        if holds(figures) or time.monotonic() > deadline:
            return figures
        time.sleep(0.1)


def test_metrics_show_what_the_ledger_wrote_and_what_it_holds(backend_url: str) -> None:
    redis = RedisProcess()
    redis.start()
    try:
        policy = _policy(redis.url, backend_url)
        auth = {"authorization": f"Bearer {KEY}"}
        with serve(create_app(policy)) as url:
            for _ in range(3):
                assert httpx.post(url + "/v1/chat/completions", json=CHAT, headers=auth).is_success
            written = _until(url, lambda f: f.get("tokenweir_ledger_records_written_total") == 3)
            assert written == {
                "tokenweir_ledger_records_written_total": 3,
                "tokenweir_ledger_records_dropped_total": 0,
                "tokenweir_ledger_write_failures_total": 0,
                "tokenweir_ledger_records_buffered": 0,
            }
            redis.stop()  # the ledger's store goes away; requests are still served
            for _ in range(2):
                assert httpx.post(url + "/v1/chat/completions", json=CHAT, headers=auth).is_success
            held = _until(url, lambda f: f.get("tokenweir_ledger_write_failures_total", 0) >= 1)
            assert held["tokenweir_ledger_write_failures_total"] >= 1
            assert held["tokenweir_ledger_records_buffered"] == 2
            assert held["tokenweir_ledger_records_written_total"] == 3
            ready = httpx.get(url + "/readyz?backends=skip", timeout=10)
            assert ready.status_code == 200  # a ledger whose store is down serves on
            ledger = ready.json()["ledger"]
            assert (ledger["written"], ledger["buffered"], ledger["dropped"]) == (3, 2, 0)
            assert ledger["write_failures"] >= 1
            redis.start()  # back: the held records are written
            back = _until(url, lambda f: f.get("tokenweir_ledger_records_written_total") == 5)
            assert back["tokenweir_ledger_records_written_total"] == 5
            assert back["tokenweir_ledger_records_buffered"] == 0
    finally:
        redis.close()


def test_readyz_says_when_the_ledgers_redis_may_evict_its_records(backend_url: str) -> None:
    """A Redis under an eviction policy deletes ledger records and totals when it is full:
    /readyz names the policy (it said nothing of it, whatever Redis was told)."""
    redis = RedisProcess()
    redis.start()
    try:
        policy = _policy(redis.url, backend_url)
        with serve(create_app(policy)) as url, Redis.from_url(redis.url) as admin:
            ready = httpx.get(url + "/readyz?backends=skip", timeout=10)
            assert ready.status_code == 200
            assert ready.json()["ledger"]["evicting"] is None
            admin.config_set("maxmemory-policy", "volatile-lru")  # every ledger key has a TTL
            ready = httpx.get(url + "/readyz?backends=skip", timeout=10)
            assert ready.status_code == 200  # informative, as the ledger's other figures
            assert ready.json()["ledger"]["evicting"] == "volatile-lru"
    finally:
        redis.close()
