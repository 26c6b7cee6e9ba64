"""Does a burst of new entries slow other tenants' semantic lookups? (issue 18, point 3)

One tenant's partition holds `--size` entries (qqp_dev's duplicates plus filler, as in
semantic_engines.py); its `text_b` questions are asked in a loop, first alone, then while another
tenant stores a burst of `--burst` new entries at once (`store.put` for each, the vectors written by
the store's batched background writer, as the gateway does), in the same event loop, lookups
going on between its calls. The lookup p50/p95/max while the burst is stored and written are set
beside those of the quiet loop, per engine.

    bash ../shared/tools/redis8.sh start 6412
    python benchmarks/semantic_burst.py --redis-url redis://127.0.0.1:6412/0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from redis import Redis
from semantic_cache import DATA, RESULTS, engine_inputs, qqp_rows
from semantic_engines import PARTITION, TENANT, filler, load, warmed

from proxy.cache.semantic import SemanticIndex
from proxy.cache.vectors import pack
from proxy.policy.model import CacheSpec
from proxy.storage.cache import CacheEntry
from proxy.storage.cache_redis import RedisCacheStore

OTHER = "burst"


async def burst_rows(
    engine: str, redis_url: str, cached: np.ndarray, queries: np.ndarray, size: int, burst: int
) -> dict[str, Any]:
    with Redis.from_url(redis_url) as admin:
        admin.flushdb()
    store = RedisCacheStore(redis_url)
    index = SemanticIndex(store)
    spec = CacheSpec(mode="semantic", vector_search=engine)  # type: ignore[arg-type]
    try:
        await load(store, index, np.concatenate([cached, filler(cached, size - len(cached))]), spec)
        await warmed(index, queries[0], spec)
        quiet = await _asked(index, queries, spec, rounds=2)
        graph = await index.graph(spec)
        new = filler(cached, burst, seed=11)
        began = time.perf_counter()
        writing = asyncio.ensure_future(_stored(store, new, graph))
        during: list[float] = []
        while not writing.done():
            during += await _asked(index, queries[:20], spec, rounds=1)
        await writing
        written_s = time.perf_counter() - began
    finally:
        await index.aclose()
        await store.aclose()
    return {
        "engine": engine, "size": size, "burst": burst,
        "written_s": round(written_s, 1), "quiet": _summary(quiet), "during": _summary(during),
    }  # fmt: skip


async def _stored(store: RedisCacheStore, rows: np.ndarray, graph: Any) -> None:
    """The burst: every entry stored (the entry script), its vector queued, then all written."""
    for n, row in enumerate(rows):
        entry = CacheEntry(OTHER, f"b{n}", b"", time.time(), 86_400.0, 10**7, PARTITION,
                           pack(row, "q"), graph)  # fmt: skip
        await store.put(entry)
    await store.flush_vectors()


async def _asked(
    index: SemanticIndex, queries: np.ndarray, spec: CacheSpec, rounds: int
) -> list[float]:
    took_ms: list[float] = []
    for _ in range(rounds):
        for query in queries:
            began = time.perf_counter()
            await index.nearest(TENANT, PARTITION, query, "q", -1.0, spec)
            took_ms.append((time.perf_counter() - began) * 1000)
    return took_ms


def _summary(took_ms: list[float]) -> dict[str, float]:
    return {
        "lookups": len(took_ms),
        "p50_ms": round(statistics.median(took_ms), 3),
        "p95_ms": round(statistics.quantiles(took_ms, n=20)[18], 3),
        "max_ms": round(max(took_ms), 1),
    }


def markdown(table: list[dict[str, Any]], load_avg: str) -> str:
    lines = [
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average {load_avg}.",
        "",
        "| engine | entries | burst | burst written in s | quiet p50 / p95 / max ms "
        "| during the burst p50 / p95 / max ms | lookups during |",
        "|---|---:|---:|---:|---|---|---:|",
    ]
    for row in table:
        q, d = row["quiet"], row["during"]
        lines.append(
            f"| {row['engine']} | {row['size']:,} | {row['burst']:,} | {row['written_s']} "
            f"| {q['p50_ms']} / {q['p95_ms']} / {q['max_ms']} "
            f"| {d['p50_ms']} / {d['p95_ms']} / {d['max_ms']} | {d['lookups']:,} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--data", type=Path, default=DATA / "qqp_dev.jsonl")
    parser.add_argument("--size", type=int, default=10_000)
    parser.add_argument("--burst", type=int, default=20_000)
    parser.add_argument("--engines", default="redis-search,redis-vsets")
    args = parser.parse_args()
    cached, queries, _ = engine_inputs(qqp_rows(args.data))
    load_avg = " ".join(f"{x:.2f}" for x in os.getloadavg())
    table = [
        asyncio.run(burst_rows(engine, args.redis_url, cached, queries, args.size, args.burst))
        for engine in args.engines.split(",")
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "semantic_burst.json").write_text(json.dumps(table, indent=2) + "\n")
    (RESULTS / "semantic_burst.md").write_text(markdown(table, load_avg), encoding="utf-8")
    print(markdown(table, load_avg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
