"""Semantic cache engines: lookup latency and neighbour quality at 10k and 100k entries.

Run through `semantic_cache.py --engines` (it owns the data and the vectors). One partition holds
every labelled duplicate's `text_a` plus filler up to the size (the mean of two real question
vectors plus noise, so it lies among real questions); every `text_b` is asked through
SemanticIndex.nearest with the guards off and no threshold. "duplicate" is the fraction whose top
hit is its labelled `text_a`; "nearest" the fraction whose top hit is the exact nearest vector.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from redis import Redis

from proxy.cache.semantic import SemanticIndex
from proxy.cache.vectors import pack
from proxy.policy.model import CacheSpec, HnswSpec
from proxy.storage.cache import CacheEntry, CacheStore
from proxy.storage.memory.cache import MemoryCacheStore
from proxy.storage.redis.cache import RedisCacheStore

TENANT, PARTITION = "bench", "engines"


def filler(vectors: np.ndarray, count: int, seed: int = 7) -> np.ndarray:
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(vectors), size=(count, 2))
    rows = 0.5 * (vectors[picks[:, 0]] + vectors[picks[:, 1]])
    rows += 0.05 * rng.standard_normal(rows.shape).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    return rows.astype(np.float32)


async def load(store: CacheStore, index: SemanticIndex, rows: np.ndarray, spec: CacheSpec) -> float:
    """Seconds to hold `rows` in the engine: entries stored as the gateway stores them, and on
    Redis their vectors written by the store's batched background writer (into RediSearch's
    hashes or the vector set, as `spec.vector_search` and the server choose), unpaced."""
    began = time.perf_counter()
    graph = await index.graph(spec)
    for n, row in enumerate(rows):
        entry = CacheEntry(TENANT, f"r{n}", b"", time.time(), 86_400.0, 10**7, PARTITION,
                           pack(row, "q"), graph)  # fmt: skip
        await store.put(entry)
        if isinstance(store, RedisCacheStore) and n % 2000 == 1999:
            await store.flush_vectors(hurry=True)
    if isinstance(store, RedisCacheStore):
        await store.flush_vectors(hurry=True)
    return time.perf_counter() - began


async def lookups(
    index: SemanticIndex, queries: np.ndarray, spec: CacheSpec
) -> tuple[list[str | None], list[float]]:
    found: list[str | None] = []
    took_ms: list[float] = []
    for query in queries:
        began = time.perf_counter()
        match = await index.nearest(TENANT, PARTITION, query, "q", -1.0, spec)
        took_ms.append((time.perf_counter() - began) * 1000)
        found.append(None if match is None else match.key)
    return found, took_ms


async def engine_rows(
    engine: str, redis_url: str | None, cached: np.ndarray, queries: np.ndarray,
    truth: Sequence[int], sizes: Sequence[int], ef_runtimes: Sequence[int],
) -> list[dict[str, Any]]:  # fmt: skip
    """One row per size and EF_RUNTIME: load s, p50/p95 ms, duplicate and nearest fractions."""
    table = []
    for size in sizes:
        rows = np.concatenate([cached, filler(cached, size - len(cached))])
        exact = [int(np.argmax(rows @ q)) for q in queries]
        store: CacheStore = RedisCacheStore(redis_url) if redis_url else MemoryCacheStore()
        if redis_url:
            with Redis.from_url(redis_url) as admin:
                admin.flushdb()
        spec = CacheSpec(mode="semantic", vector_search=engine)  # type: ignore[arg-type]
        index = SemanticIndex(store)
        try:
            load_s = await load(store, index, rows, spec)
            await warmed(index, queries[0], spec)
            for ef in ef_runtimes if redis_url and engine != "local" else [0]:
                tuned = spec.model_copy(update={"hnsw": HnswSpec(ef_runtime=max(ef, 1))})
                found, took_ms = await lookups(index, queries, tuned)
                rows_found = [int(k[1:]) if k else -1 for k in found]
                table.append({
                    "engine": engine, "size": size, "ef_runtime": ef or None,
                    "load_s": round(load_s, 1),
                    "p50_ms": round(statistics.median(took_ms), 3),
                    "p95_ms": round(statistics.quantiles(took_ms, n=20)[18], 3),
                    "duplicate": round(_share(rows_found, truth), 3),
                    "nearest": round(_share(rows_found, exact), 3),
                })  # fmt: skip
        finally:
            await index.aclose()
            await store.aclose()
    return table


async def warmed(index: SemanticIndex, query: np.ndarray, spec: CacheSpec) -> None:
    """Until a lookup answers: a big mirrored partition first loads in the background."""
    for _ in range(6000):
        if await index.nearest(TENANT, PARTITION, query, "q", -1.0, spec) is not None:
            return
        await asyncio.sleep(0.05)
    raise SystemExit("the partition did not load within 5 minutes")


def _share(found: Sequence[int], expected: Sequence[int]) -> float:
    return sum(1 for f, e in zip(found, expected, strict=True) if f == e) / len(expected)


def markdown(table: list[dict[str, Any]], load: str) -> str:
    lines = [
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average {load}.",
        "",
        "| engine | entries | EF_RUNTIME | load s | p50 ms | p95 ms | top hit = true duplicate "
        "| top hit = exact nearest |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in table:
        lines.append(
            f"| {row['engine']} | {row['size']:,} | {row['ef_runtime'] or '-'} | {row['load_s']} "
            f"| {row['p50_ms']} | {row['p95_ms']} | {row['duplicate']} | {row['nearest']} |"
        )
    return "\n".join(lines) + "\n"
