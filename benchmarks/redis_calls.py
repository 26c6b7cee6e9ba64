"""Redis calls on the request path: redis-py's connection pool against the multiplexed client.

    python benchmarks/redis_calls.py [--calls 20000] [--concurrency 64] [--repeats 5]

Starts a private redis-server and sends `--calls` rate-limit admissions (the store's own
admit.lua script: a requests-per-minute bucket and a concurrency slot pool, one tenant per
call's index modulo 100), `--concurrency` at a time, through each client in turn: redis-py's
BlockingConnectionPool (what the stores used before, and still use for TLS, Sentinel and
Cluster URLs) and proxy/storage/redis/resp.py's one multiplexed connection. Reports this process's
CPU time per call and calls per second, medians over `--repeats` alternating runs. The CPU is
the client's own (Redis runs in its own process), which is what a gateway pays per call.
Results: benchmarks/results/redis-calls.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import statistics
import sys
import time
from typing import Any

from harness import publish

from proxy.storage.limits import Bucket, SlotPool
from proxy.storage.redis.limits import RedisLimitStore
from tests.redis_server import private_redis


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def measure(store: RedisLimitStore, calls: int, concurrency: int) -> tuple[float, float]:
    free = asyncio.Semaphore(concurrency)

    async def admit(i: int) -> None:
        tenant = f"tw:{{t{i % 100}}}"
        async with free:
            admission = await store.admit(
                tenant,
                [Bucket(f"{tenant}:rpm", 10**9, 10**9 / 60)],
                [1],
                [SlotPool(f"{tenant}:slots", 10**6)],
                lease_id=f"l{i}",
                lease_until=time.time() + 60,
                now=time.time(),
            )
            assert admission.admitted

    await asyncio.gather(*(admit(i) for i in range(min(calls, 1000))))  # warm up
    began_cpu, began = cpu_s(), time.perf_counter()
    await asyncio.gather(*(admit(i) for i in range(calls)))
    return (cpu_s() - began_cpu) / calls * 1e6, calls / (time.perf_counter() - began)


async def run(url: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    runs: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.repeats):
        for client in ("redis-py", "multiplexed"):
            store = RedisLimitStore(url, multiplex=client == "multiplexed")
            try:
                cpu_us, rate = await measure(store, args.calls, args.concurrency)
            finally:
                await store.aclose()
            found = runs.setdefault(client, {"cpu_us_per_call": [], "calls_per_s": []})
            found["cpu_us_per_call"].append(cpu_us)
            found["calls_per_s"].append(rate)
    return {
        client: {name: statistics.median(values) for name, values in found.items()}
        for client, found in runs.items()
    }


def markdown(report: dict[str, Any]) -> str:
    rows = report["clients"]
    base = rows["redis-py"]["cpu_us_per_call"]
    lines = [
        f"Run {report['when']} on {report['machine']}; {report['calls']:,} admissions, "
        f"{report['concurrency']} at a time, medians of {report['repeats']} runs each.",
        "",
        "| client | CPU µs per call | calls/s | CPU against redis-py |",
        "|---|---:|---:|---:|",
    ]
    for client, row in rows.items():
        lines.append(
            f"| {client} | {row['cpu_us_per_call']:.1f} | {row['calls_per_s']:,.0f} "
            f"| {row['cpu_us_per_call'] / base:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with private_redis() as url:
        clients = asyncio.run(run(url, args))
    report = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "calls": args.calls, "concurrency": args.concurrency, "repeats": args.repeats,
        "clients": clients,
    }  # fmt: skip
    publish("redis-calls", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
