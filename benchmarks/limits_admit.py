"""Rate-limit admission cost: one admit round trip (rpm + tpm buckets + a slot pool), p50/p99.

    python benchmarks/limits_admit.py [--requests 20000] [--tenants 100] [--uvloop]
                                      [--redis-url URL]

Each request is admitted, then its slot released and its tokens settled, one at a time across
`--tenants` tenants (so the buckets never run dry); only `admit` is timed. Redis: a private
redis-server on a free port unless `--redis-url` is given (that database is flushed).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import redis
from harness import redis_for

from proxy.storage.limits import Bucket, LimitStore, SlotPool
from proxy.storage.memory.limits import MemoryLimitStore
from proxy.storage.redis.limits import RedisLimitStore


def limits(tenant: str) -> tuple[list[Bucket], list[SlotPool]]:
    prefix = f"tw:{{{tenant}}}:rl"
    buckets = [
        Bucket(f"{prefix}:rpm", capacity=600_000, refill_per_s=10_000.0),
        Bucket(f"{prefix}:tpm", capacity=60_000_000, refill_per_s=1_000_000.0),
    ]
    return buckets, [SlotPool(f"{prefix}:slots", size=64)]


async def admit_latencies_us(store: LimitStore, requests: int, tenants: int) -> list[float]:
    cards = [(f"tw:{{t{i}}}", *limits(f"t{i}")) for i in range(tenants)]
    latencies = []
    for n in range(requests):
        scope, buckets, slots = cards[n % tenants]
        lease = f"req-{n}"
        now = time.time()
        began = time.perf_counter_ns()
        admission = await store.admit(
            scope, buckets, [1, 1500], slots, lease_id=lease, lease_until=now + 60, now=now
        )
        latencies.append((time.perf_counter_ns() - began) / 1000)
        assert admission.admitted
        await store.release(scope, slots, lease_id=lease)
        await store.settle(scope, buckets[1], -1000, now=now)
    await store.aclose()
    return latencies


def summary(latencies: list[float]) -> str:
    cuts = statistics.quantiles(latencies, n=100)
    return f"p50 {cuts[49]:7.1f} µs   p99 {cuts[98]:7.1f} µs   ({len(latencies):,} admits)"


async def main(args: argparse.Namespace) -> None:
    memory = await admit_latencies_us(MemoryLimitStore(), args.requests, args.tenants)
    print(f"memory: admit {summary(memory)}")
    with redis_for(args.redis_url) as url:
        with redis.Redis.from_url(url) as admin:
            admin.flushdb()
        await admit_latencies_us(RedisLimitStore(url), 200, args.tenants)  # load the scripts
        remote = await admit_latencies_us(RedisLimitStore(url), args.requests, args.tenants)
    print(f"redis:  admit {summary(remote)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--redis-url", help="default: a private redis-server on a free port")
    parser.add_argument("--uvloop", action="store_true", help="the gateway's event loop")
    options = parser.parse_args()
    if options.uvloop:
        import uvloop

        uvloop.run(main(options))
    else:
        asyncio.run(main(options))
