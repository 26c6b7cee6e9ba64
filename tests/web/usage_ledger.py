"""A gateway over a SQLite ledger filled with known usage, for the dashboard and usage API tests.

The gateway's clock stands at NOW, so "today", "this month" and "the last 24 h" are fixed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from proxy.app import create_app
from proxy.clock import FakeClock
from proxy.ledger import SqliteLedger, UsageRecord
from proxy.policy import Policy, parse_policy
from proxy.policy.units import hash_key
from tests.conftest import BACKEND_KEY, BETA_KEY, policy_text
from tests.ledger.factory import DAY_S, HOUR_S, T0, record
from tests.servers import serve

CN_TENANT = "客服机器人"
CN_KEY = "tw-test-kefu"
NOW = T0 + 2.5 * HOUR_S
"""2027-01-15 10:30 UTC."""


def records() -> list[UsageRecord]:
    """alpha: 10 requests this morning (2 of them 429s, one 504); the Chinese tenant: 5 an hour
    earlier, over its daily USD budget; beta: 3 yesterday; 2 requests without a valid key."""
    made = [
        record(i, ts=T0 + i * 60, tenant="alpha", input_tokens=100 + i, output_tokens=40 + i)
        for i in range(7)
    ]
    made += [
        record(7, ts=T0 + 420, tenant="alpha", status=429, error="rate_limit_exceeded",
               input_tokens=0, output_tokens=0, cost_nusd=0, ttft_ms=None, tokens_per_s=None),
        record(8, ts=T0 + 480, tenant="alpha", status=429, error="rate_limit_exceeded",
               input_tokens=0, output_tokens=0, cost_nusd=0, ttft_ms=None, tokens_per_s=None),
        record(9, ts=T0 + 540, tenant="alpha", status=504, error="upstream_timeout",
               output_tokens=0, cost_nusd=10_000, ttft_ms=None, tokens_per_s=None),
    ]  # fmt: skip
    made += [
        record(20 + i, ts=T0 - HOUR_S + i, tenant=CN_TENANT, model="mock-small",
               cost_nusd=50_000, cache="hit" if i < 2 else "miss", degraded=("shorten",) * (i == 0))
        for i in range(5)
    ]  # fmt: skip
    made += [
        record(30 + i, ts=T0 - DAY_S - HOUR_S, tenant="beta", model="mock-small") for i in range(3)
    ]
    made += [
        record(40 + i, ts=T0 + 100 + i, tenant=None, model=None, backend=None, status=401,
               error="invalid_api_key", input_tokens=0, output_tokens=0, cost_nusd=0)
        for i in range(2)
    ]  # fmt: skip
    return made


def write_ledger(path: Path, made: list[UsageRecord]) -> None:
    async def write() -> None:
        ledger = SqliteLedger(path)
        await ledger.start()
        for item in made:
            ledger.append(item)
        await ledger.aclose()

    asyncio.run(write())


def dashboard_policy(backend_url: str, ledger: Path) -> Policy:
    """tests/conftest.py's alpha, beta and admin, a Chinese-named tenant, budgets and a ledger."""
    text = policy_text(backend_url, extra=f"ledger: sqlite:///{ledger}\n")
    text = text.replace(
        "tenants:\n",
        f"tenants:\n  {CN_TENANT}:\n    api_keys: [{hash_key(CN_KEY)}]\n    models: [mock-small]\n"
        "    budget: {usd_per_day: 0.0002, tokens_per_month: 1000000}\n",
    )
    text = text.replace(
        "    models: [mock-llm, mock-embed]\n",
        "    models: [mock-llm, mock-embed]\n"
        "    budget: {usd_per_day: 1, usd_per_month: 0.00025}\n",
    )
    environ = {"BACKEND_KEY": BACKEND_KEY, "BETA_KEY": BETA_KEY}
    return parse_policy(text, file="dashboard.yaml", environ=environ)


@contextmanager
def usage_gateway(
    backend_url: str, directory: Path, made: list[UsageRecord] | None = None
) -> Iterator[str]:
    """A gateway on its own ledger of `made` (default `records()`), its clock at NOW; yields
    its base URL."""
    path = directory / "ledger.db"
    write_ledger(path, records() if made is None else made)
    app = create_app(dashboard_policy(backend_url, path), clock=FakeClock(NOW))
    with serve(app) as url:
        yield url
