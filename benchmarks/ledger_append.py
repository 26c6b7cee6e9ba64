"""Ledger costs: µs per append on the caller, writer throughput, dashboard queries at 1M records.

    python benchmarks/ledger_append.py [--appends 200000] [--records 1000000] [--redis-url URL]

Append cost is timed with the background writer running, records built beforehand (building a
UsageRecord is the caller's cost either way and is reported separately). Throughput is the time
from the first append to the end of `flush()` for a backlog written by the writer alone. The
query part writes `--records` records through the SQLite writer (50 tenants, Zipf-like traffic,
30 days, 4 models on 2 backends), then times the queries a cost dashboard needs. Redis: a private
redis-server on a free port unless `--redis-url` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis
from harness import redis_for

from proxy.ledger import Ledger, RedisLedger, SqliteLedger, UsageQuery, UsageRecord

DAY_S = 86400.0
MODELS = [("qwen2.5-7b", "vllm-a"), ("qwen2.5-7b", "vllm-b"), ("qwen2.5-1.5b", "vllm-a")]
MODELS.append(("bge-m3", "vllm-b"))


def make_records(count: int, *, now: float, days: float, seed: int = 1) -> list[UsageRecord]:
    rng = random.Random(seed)
    tenants = [f"tenant-{i:02d}" for i in range(49)] + ["客服机器人"]
    weights = [1 / (i + 1) for i in range(len(tenants))]
    times = sorted(now - rng.uniform(0, days * DAY_S) for _ in range(count))
    chosen = rng.choices(tenants, weights, k=count)
    records = []
    for i, (ts, tenant) in enumerate(zip(times, chosen, strict=True)):
        model, backend = MODELS[i % len(MODELS)]
        status = 429 if i % 50 == 0 else 200
        records.append(
            UsageRecord(
                ts=ts,
                request_id=f"req-{i}",
                tenant=tenant,
                model=model,
                backend=backend,
                operation="chat",
                stream=True,
                status=status,
                error="rate_limit_exceeded" if status == 429 else None,
                input_tokens=rng.randint(50, 3000),
                output_tokens=rng.randint(10, 800),
                cost_nusd=rng.randint(1_000, 500_000),
                cache=rng.choice(["miss", "miss", "hit", "bypass"]),
                ttft_ms=rng.lognormvariate(5, 0.6),
                tokens_per_s=rng.uniform(30, 120),
                duration_ms=rng.uniform(200, 9000),
                shaped=("max_tokens",) if i % 7 == 0 else (),
                degraded=("shorten-under-load",) if i % 31 == 0 else (),
                client_disconnected=i % 97 == 0,
            )
        )
    return records


def build_cost_us(example: UsageRecord, count: int = 100_000) -> float:
    fields = {name: getattr(example, name) for name in UsageRecord.__dataclass_fields__}
    began = time.perf_counter()
    for _ in range(count):
        UsageRecord(**fields)
    return (time.perf_counter() - began) / count * 1e6


async def append_cost(ledger: Ledger, records: list[UsageRecord]) -> dict[str, float]:
    """ns per append (mean, and the worst 1,000-append chunk), with the writer running."""
    await ledger.start()
    chunk_ns = []
    append = ledger.append
    for start in range(0, len(records), 1000):
        chunk = records[start : start + 1000]
        began = time.perf_counter_ns()
        for record in chunk:
            append(record)
        chunk_ns.append((time.perf_counter_ns() - began) / len(chunk))
        await asyncio.sleep(0)  # let a Redis writer task run, as the event loop would
    await ledger.aclose()
    return {"mean_us": statistics.fmean(chunk_ns) / 1000, "worst_chunk_us": max(chunk_ns) / 1000}


async def throughput(ledger: Ledger, records: list[UsageRecord]) -> float:
    """Records per second the writer makes durable, from a backlog."""
    await ledger.start()
    began = time.perf_counter()
    for record in records:
        ledger.append(record)
    await ledger.flush()
    elapsed = time.perf_counter() - began
    await ledger.aclose()
    return len(records) / elapsed


async def timed(run: Callable[[], Awaitable[object]], repeats: int = 5) -> tuple[float, float]:
    """(first run ms, median of the next `repeats` ms)."""
    began = time.perf_counter()
    await run()
    first = (time.perf_counter() - began) * 1000
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        await run()
        times.append((time.perf_counter() - began) * 1000)
    return first, statistics.median(times)


async def dashboard_queries(ledger: Ledger, now: float) -> None:
    today = now - now % DAY_S
    month = now - 30 * DAY_S
    queries = {
        "one tenant: today + month totals": [
            UsageQuery("tenant-00", today, now),
            UsageQuery("tenant-00", month, now),
        ],
        "one tenant: 24 h by hour": [UsageQuery("tenant-00", now - DAY_S, now, bucket="hour")],
        "one tenant: 30 days by day and model": [
            UsageQuery("tenant-00", month, now, bucket="day", group_by="model")
        ],
        "all tenants: today + month totals (admin overview)": [
            UsageQuery(None, today, now),
            UsageQuery(None, month, now),
        ],
        "all tenants: 7 days by day": [UsageQuery(None, now - 7 * DAY_S, now, bucket="day")],
    }
    for name, batch in queries.items():

        async def run(batch: list[UsageQuery] = batch) -> object:
            return [await ledger.query(q) for q in batch]

        first, median = await timed(run)
        print(f"  {name:<52} first {first:7.1f} ms   median {median:7.1f} ms")


async def query_benchmark(writer: Ledger, reader: Ledger, count: int) -> None:
    """Write `count` records over 30 days through `writer`, then time queries on `reader`."""
    now = time.time()
    records = make_records(count, now=now, days=30)
    await writer.start()
    began = time.perf_counter()
    for start in range(0, count, 10_000):
        for record in records[start : start + 10_000]:
            writer.append(record)
        await asyncio.sleep(0)
    await writer.flush()
    elapsed = time.perf_counter() - began
    await writer.aclose()
    print(f"  wrote {count:,} records through the writer in {elapsed:.1f} s")
    del records  # a million live objects would make every GC pass in the queries slow
    gc.collect()
    await reader.start()
    await dashboard_queries(reader, now)
    await reader.aclose()


async def main(args: argparse.Namespace) -> None:
    now = time.time()
    records = make_records(args.appends, now=now, days=1)
    print(f"building a UsageRecord (the caller's side): {build_cost_us(records[0]):.2f} µs")
    with tempfile.TemporaryDirectory() as tmp, redis_for(args.redis_url) as redis_url:
        big = args.appends + 1
        stores: dict[str, Callable[[], Ledger]] = {
            "sqlite": lambda: SqliteLedger(Path(tmp) / f"{time.time_ns()}.db", buffer_records=big),
            "redis": lambda: RedisLedger(redis_url, buffer_records=big),
        }
        for name, make in stores.items():
            cost = await append_cost(make(), records)
            rate = await throughput(make(), records)
            print(
                f"{name:>6}: append {cost['mean_us']:.2f} µs mean "
                f"(worst 1,000-append chunk {cost['worst_chunk_us']:.2f} µs/append); "
                f"writer {rate:,.0f} records/s"
            )
        if not args.records:
            return
        n = args.records
        path = Path(tmp) / "million.db"
        print(f"sqlite: dashboard queries over {n:,} records")
        writer = SqliteLedger(path, buffer_records=n + 1, flush_timeout_s=3600)
        await query_benchmark(writer, SqliteLedger(path, read_only=True), n)
        print(f"  file {path.stat().st_size / 1e6:.0f} MB")
        if args.redis_queries:
            print(f"redis: dashboard queries over {n:,} records (raw stream capped at 1,000)")
            with redis.Redis.from_url(redis_url) as client:
                client.flushdb()  # drop the records of the append runs above
            big = RedisLedger(
                redis_url, buffer_records=n + 1, flush_timeout_s=3600, stream_records=1000
            )
            await query_benchmark(big, RedisLedger(redis_url, read_only=True), n)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--appends", type=int, default=200_000)
    parser.add_argument("--records", type=int, default=1_000_000, help="0: skip the query part")
    parser.add_argument("--redis-url", help="default: a private redis-server on a free port")
    parser.add_argument("--redis-queries", action="store_true", help="also time Redis queries")
    asyncio.run(main(parser.parse_args()))
