"""What a reliability test checks in Redis afterwards, and the policy its gateways run."""

from __future__ import annotations

import redis

from proxy.ledger.rediskeys import stream_key, tag
from proxy.policy.units import hash_key

KEY = "tw-reliability"
AUTH = {"authorization": f"Bearer {KEY}"}
TENANT = "app"


def policy_text(
    backend_url: str,
    storage: str,
    *,
    server: str = "{}",
    upstream: str = "{}",
    extra: str = "",
    max_concurrent: int = 64,
    cache: str = "{}",
) -> str:
    """One tenant: slots, a daily budget and a token rate; on Redis, a Redis ledger too."""
    ledger = "ledger: redis" if storage.startswith("redis") else ""
    return f"""
storage: {storage}
{ledger}
server: {server}
upstream: {upstream}
backends: [{{name: mock, url: "{backend_url}/v1", models: [mock-llm]}}]
models: {{mock-llm: {{}}}}
tenants:
  {TENANT}:
    api_keys: [{hash_key(KEY)}]
    models: [mock-llm]
    budget: {{tokens_per_day: 100000000, max_output_tokens: 30000}}
    limits: {{max_concurrent: {max_concurrent}, tokens_per_minute: 100000000{extra}}}
    cache: {cache}
"""


def slots_held(redis_url: str) -> int:
    """Concurrency slots still leased, over every limit level of every tenant."""
    with redis.Redis.from_url(redis_url) as client:
        return sum(int(client.zcard(key)) for key in client.scan_iter("tw:*:slots"))


def tokens_reserved(redis_url: str) -> int:
    """Quota tokens still reserved by requests that have not settled."""
    with redis.Redis.from_url(redis_url) as client:
        total = 0
        for key in client.scan_iter("tw:*"):
            if client.type(key) == b"hash" and client.hexists(key, "reserved"):
                total += int(client.hget(key, "reserved") or 0)
        return total


def day_quota(redis_url: str) -> tuple[int, int]:
    """The tenant's daily token quota: (used, reserved)."""
    with redis.Redis.from_url(redis_url) as client:
        rows = [client.hmget(k, "used", "reserved") for k in client.scan_iter("tw:*:q:tokens:d:*")]
    return sum(int(u or 0) for u, _ in rows), sum(int(r or 0) for _, r in rows)


def ledger_records(redis_url: str, tenant: str = TENANT) -> int:
    with redis.Redis.from_url(redis_url) as client:
        return int(client.xlen(stream_key(tag(tenant))))
