"""The quota race: 100 concurrent requests on a 5,000 tokens/day quota, `tokenweir serve
--workers 2` on one Redis. Enforcement, the ledger, `tokenweir report`, `/api/usage` and the
dashboard's quota bar must all show the same spend (refused requests bill nothing)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import orjson

from proxy.app import create_app
from proxy.ledger.present import format_usd
from proxy.policy import load_policy, parse_policy
from proxy.policy.units import hash_key
from proxy.stages.budget import _quotas
from proxy.storage import open_store
from tests.conftest import ADMIN_KEY, BACKEND_KEY
from tests.reliability.state import AUTH, KEY, TENANT, policy_text
from tests.sdkburst import streams_at_once
from tests.servers import free_port, serve, wait_healthy

QUOTA = 5000
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
ENV = {**os.environ, "BACKEND_KEY": BACKEND_KEY}
CHAT = {
    "model": "mock-llm",
    "messages": [{"role": "user", "content": "Tell me about token budgets, briefly."}],
    "max_tokens": 60,
}


def race_policy(backend_url: str, redis_url: str) -> str:
    text = policy_text(backend_url, redis_url).replace(
        "tokens_per_day: 100000000", f"tokens_per_day: {QUOTA}"
    )
    return text.replace("tenants:", f"admin_keys: [{hash_key(ADMIN_KEY)}]\ntenants:")


async def race(url: str, count: int) -> list[int]:
    limits = httpx.Limits(max_connections=count)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30, limits=limits) as http:
        answers = await asyncio.gather(
            *(http.post("/v1/chat/completions", json=CHAT) for _ in range(count))
        )
    return [answer.status_code for answer in answers]


async def enforced(config: Path, redis_url: str) -> tuple[int, int]:
    """(used, reserved) of the tenant's daily quota, as the budget stage reads it."""
    policy = load_policy(config)
    store = open_store(redis_url)
    try:
        quotas = _quotas(TENANT, policy.tenants[TENANT].budget, time.time())
        [(used, reserved)] = await store.read([q.counter for q in quotas])
    finally:
        await store.aclose()
    return used, reserved


def api_usage(url: str) -> dict[str, int]:
    [row] = httpx.get(url + f"/api/usage?since=1d&tenant={TENANT}", headers=ADMIN).json()["data"]
    return row  # type: ignore[no-any-return]


@contextmanager
def two_workers(config: Path) -> Iterator[str]:
    """`tokenweir serve --workers 2` on `config`; yields its URL."""
    port = free_port()
    command = [sys.executable, "-m", "proxy", "serve", "--config", str(config)]
    command += ["--port", str(port), "--workers", "2", "--no-access-log"]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, env=ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server, timeout_s=120)  # two workers start slowly on a loaded machine
        yield url
    finally:
        server.terminate()
        server.communicate(timeout=30)


def settled_usage(url: str, count: int) -> dict[str, int]:
    """/api/usage's row once the ledger holds all `count` requests."""
    deadline = time.monotonic() + 10
    while api_usage(url)["requests"] < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return api_usage(url)


def reported(config: Path) -> dict[str, int]:
    """`tokenweir report`'s row for the tenant."""
    report = subprocess.run(
        [sys.executable, "-m", "proxy", "report", "--config", str(config), "--tenant", TENANT,
         "--since", "1d", "--format", "json"],
        capture_output=True, check=True, timeout=60, env=ENV,
    )  # fmt: skip
    [row] = orjson.loads(report.stdout)["rows"]
    return row  # type: ignore[no-any-return]


def test_a_hundred_requests_race_for_a_small_quota_and_every_view_agrees(
    backend_url: str, redis_url: str, tmp_path: Path
) -> None:
    config = tmp_path / "policy.yaml"
    config.write_text(race_policy(backend_url, redis_url))
    with two_workers(config) as url:
        statuses = asyncio.run(race(url, 100))
        row = settled_usage(url, 100)
        page = httpx.get(url + "/dashboard", headers=ADMIN).text
    assert statuses.count(200) > 10
    assert statuses.count(429) > 10
    assert set(statuses) == {200, 429}
    used, reserved = asyncio.run(enforced(config, redis_url))
    assert reserved == 0  # every request has settled
    assert 0 < used <= QUOTA
    assert row["requests"] == 100
    assert row["rate_limited"] == statuses.count(429)
    assert row["input_tokens"] + row["output_tokens"] == used
    [bar] = re.findall(r'class="qused">([\d,]+) / 5,000 tokens', page)
    assert int(bar.replace(",", "")) == used
    report = reported(config)
    assert report["input_tokens"] + report["output_tokens"] == used
    assert report["requests"] == 100


def test_a_usd_quota_raced_at_prices_of_fractional_nano_usd_agrees_to_the_nano_usd(
    backend_url: str, redis_url: str, tmp_path: Path
) -> None:
    """The same race on a USD quota, at prices whose tokens cost fractions of a nano-USD: the
    quota's use, the ledger (`/api/usage`, `tokenweir report`) and `tokenweir_cost_usd_total`
    hold the same integer nano-USD, and the dashboard shows it to the micro-dollar."""
    limit_nusd = 500_000  # $0.0005: about half the requests fit
    text = race_policy(backend_url, redis_url).replace(
        f"tokens_per_day: {QUOTA}", "usd_per_day: 0.0005"
    )
    text = text.replace(
        "models: {mock-llm: {}}",
        "models: {mock-llm: {price: {input_per_1m: 0.0375, output_per_1m: 0.153001}}}",
    )
    config = tmp_path / "policy.yaml"
    config.write_text(text)
    with two_workers(config) as url:
        statuses = asyncio.run(race(url, 100))
        row = settled_usage(url, 100)
        page = httpx.get(url + "/dashboard", headers=ADMIN).text
        metrics = httpx.get(url + "/metrics", headers=ADMIN).text
    assert statuses.count(200) > 10
    assert set(statuses) <= {200, 429}
    used, reserved = asyncio.run(enforced(config, redis_url))
    assert reserved == 0
    assert 0 < used <= limit_nusd
    assert row["cost_nusd"] == used
    assert reported(config)["cost_nusd"] == used
    series = rf'^tokenweir_cost_usd_total{{.*tenant="{TENANT}".*}} (\S+)$'
    dollars = re.findall(series, metrics, re.M)
    assert dollars
    assert round(sum(float(d) for d in dollars) * 1e9) == used
    [shown] = re.findall(r'class="qused">\$([\d.]+) / \$0.0005 ', page)
    assert shown == format_usd(used).rstrip("0")


def test_requests_refused_for_what_requests_in_flight_hold_retry_soon_and_succeed(
    backend_url: str, redis_url: str
) -> None:
    """12 streams at once on a 2,000 tokens/day quota: each reserves its 300-token allowance, so
    only 6 fit at first, though each uses about 30. The others are told to retry in a second
    (the holds free as those end) and the SDK's own retries get them through; they were told to
    wait until midnight and not to retry (`x-should-retry: false`), and failed."""
    policy = parse_policy(
        race_policy(backend_url, redis_url).replace(str(QUOTA), "2000"), environ={}
    )
    body = {**CHAT, "max_tokens": 300, "extra_body": {"mock_completion_tokens": 20}}
    with serve(create_app(policy)) as url:
        answers = streams_at_once(url + "/v1", KEY, body, 12)
    assert all(answers)
