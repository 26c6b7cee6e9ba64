"""RediSearch (FT.SEARCH) as the semantic cache's engine, on a real Redis 8 with the search module:
vectors expire with their entries, one index per tenant with the policy's HNSW parameters, each
in its tenant's slot on a cluster, both RESP shapes, an emptied database, and a Redis 7 without
the module falling back to the mirror."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
from redis.cluster import RedisCluster

from proxy.cache.semantic import SemanticIndex
from proxy.cache.vectors import pack
from proxy.policy.model import CacheSpec, HnswSpec
from proxy.storage import CacheEntry, RedisCacheStore
from proxy.storage.cache import Graph
from proxy.storage.redis.cache_ft import RedisSearchVectors
from tests.cache.test_vector_engines import NOW, unit_rows
from tests.redis8 import redis8_cluster_server, redis8_cluster_url, redis8_server, redis8_url

__all__ = ["redis8_cluster_server", "redis8_cluster_url", "redis8_server", "redis8_url"]

pytestmark = pytest.mark.anyio
SEARCH = CacheSpec(mode="semantic", vector_search="redis-search")


def entry(
    key: str, row: np.ndarray, *, tenant: str = "t", ttl_s: float = 3600.0, graph: Graph | None
) -> CacheEntry:
    return CacheEntry(tenant, key, b"v", NOW, ttl_s, 100, "p", pack(row, "museum hours"), graph)


@pytest.fixture
async def search(redis8_url: str) -> AsyncIterator[tuple[RedisCacheStore, SemanticIndex]]:
    store = RedisCacheStore(redis8_url, timeout_s=10.0)
    index = SemanticIndex(store)
    yield store, index
    await index.aclose()
    await store.aclose()


def admin(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, protocol=2)


async def test_a_vector_expires_with_its_entry(
    redis8_url: str, search: tuple[RedisCacheStore, SemanticIndex]
) -> None:
    store, index = search
    row = unit_rows(1)[0]
    await store.put(entry("k", row, ttl_s=1.0, graph=await index.graph(SEARCH)))
    await store.flush_vectors()
    with admin(redis8_url) as client:
        assert 0 < client.pttl("tw:{t}:cache:f:k") <= 1000  # the entry's TTL, not longer
    assert await index.nearest("t", "p", row, "museum hours", 0.9, SEARCH) is not None
    deadline = time.monotonic() + 10.0
    while await index.nearest("t", "p", row, "museum hours", 0.9, SEARCH) is not None:
        assert time.monotonic() < deadline, "the vector outlived its entry by 9 s"
        await asyncio.sleep(0.2)
    with admin(redis8_url) as client:
        assert client.exists("tw:{t}:cache:x:k", "tw:{t}:cache:f:k") == 0
        info = client.execute_command("FT.INFO", "tw:{t}:cache:idx32")
        assert int(dict(zip(info[::2], info[1::2], strict=True))[b"num_docs"]) == 0


async def test_an_entry_gone_before_its_vector_is_written_gets_no_vector(
    redis8_url: str, search: tuple[RedisCacheStore, SemanticIndex]
) -> None:
    store, index = search
    row = unit_rows(1)[0]
    await store.put(entry("k", row, graph=await index.graph(SEARCH)))
    with admin(redis8_url) as client:  # evicted while its vector was still queued
        client.delete("tw:{t}:cache:x:k")
    await store.flush_vectors()
    with admin(redis8_url) as client:
        assert client.exists("tw:{t}:cache:f:k") == 0
    assert await index.nearest("t", "p", row, "museum hours", 0.9, SEARCH) is None


async def test_one_index_per_tenant_with_the_policys_hnsw(
    redis8_url: str, search: tuple[RedisCacheStore, SemanticIndex]
) -> None:
    store, index = search
    spec = SEARCH.model_copy(update={"hnsw": HnswSpec(m=8, ef_construction=64, ef_runtime=20)})
    rows = unit_rows(4)
    for n, row in enumerate(rows):
        tenant = "a" if n < 3 else "a:b"
        await store.put(entry(f"k{n}", row, tenant=tenant, graph=await index.graph(spec)))
    await store.flush_vectors()
    with admin(redis8_url) as client:
        names = sorted(client.execute_command("FT._LIST"))
        info = client.execute_command("FT.INFO", "tw:{a}:cache:idx32")
    assert names == [b"tw:{a:b}:cache:idx32", b"tw:{a}:cache:idx32"]
    described = repr(info)
    assert "b'M', 8" in described
    assert "b'ef_construction', 64" in described
    assert "b'tw:{a}:cache:f:'" in described  # the index covers the tenant's keys only
    found = await index.nearest("a", "p", rows[2], "museum hours", 0.9, spec)
    assert found is not None
    assert found.key == "k2"
    assert await index.nearest("a", "p", rows[3], "museum hours", 0.9, spec) is None


async def test_an_emptied_database_is_a_miss_then_the_index_comes_back(
    redis8_url: str, search: tuple[RedisCacheStore, SemanticIndex]
) -> None:
    store, index = search
    rows = unit_rows(2)
    await store.put(entry("k0", rows[0], graph=await index.graph(SEARCH)))
    await store.flush_vectors()
    with admin(redis8_url) as client:
        client.flushdb()  # drops the index too
    assert await index.nearest("t", "p", rows[0], "museum hours", 0.9, SEARCH) is None
    await store.put(entry("k1", rows[1], graph=await index.graph(SEARCH)))
    await store.flush_vectors()
    found = await index.nearest("t", "p", rows[1], "museum hours", 0.9, SEARCH)
    assert found is not None
    assert found.key == "k1"


@pytest.mark.parametrize("protocol", [2, 3])
async def test_search_replies_read_the_same_in_both_protocols(
    redis8_url: str, protocol: int
) -> None:
    client = aioredis.Redis.from_url(redis8_url, protocol=protocol)
    prefix = "tw:{t}:cache:"
    engine = RedisSearchVectors(client, lambda tenant: f"tw:{{{tenant}}}:cache:")
    try:
        rows = unit_rows(2)
        graph = Graph("search", 16, 200)
        for n, row in enumerate(rows):
            await client.set(f"{prefix}x:k{n}", b"v", px=60_000)
            engine.add("t", "p", f"k{n}", row.tobytes(), f"question {n}", graph=graph,
                       ttl_ms=60_000, keep_ms=60_000)  # fmt: skip
        await engine.flush()
        hits = await engine.nearest("t", "p", rows[1].tobytes(), count=4, ef=64)
        assert [(hit.key, hit.question) for hit in hits] == [
            ("k1", "question 1"),
            ("k0", "question 0"),
        ]
        assert hits[0].similarity == pytest.approx(1.0, abs=1e-3)
        assert hits[1].similarity == pytest.approx(float(rows[0] @ rows[1]), abs=1e-3)
    finally:
        await engine.aclose()
        await client.aclose()


async def test_redis7_without_the_module_falls_back_to_the_mirror(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = RedisCacheStore(redis_url, timeout_s=10.0)
    index = SemanticIndex(store)
    try:
        row = unit_rows(1)[0]
        with caplog.at_level(logging.WARNING, logger="tokenweir.cache"):
            graph = await index.graph(SEARCH)
        assert graph is None
        assert "no such vector search" in caplog.text
        await store.put(entry("k", row, graph=graph))
        found = await index.nearest("t", "p", row, "museum hours", 0.9, SEARCH)
        assert found is not None
        assert found.key == "k"
        with admin(redis_url) as client:
            assert client.exists("tw:{t}:cache:v:p") == 1  # the mirror's stream
    finally:
        await index.aclose()
        await store.aclose()


async def test_on_a_cluster_each_tenants_index_lives_in_its_slot(redis8_cluster_url: str) -> None:
    store = RedisCacheStore(redis8_cluster_url, timeout_s=10.0)
    index = SemanticIndex(store)
    tenants = ["a", "a:b", "alpha", "zeta", "t1", "t2"]
    rows = unit_rows(len(tenants))
    try:
        for tenant, row in zip(tenants, rows, strict=True):
            await store.put(entry("k", row, tenant=tenant, graph=await index.graph(SEARCH)))
        await store.flush_vectors()
        for n, tenant in enumerate(tenants):
            found = await index.nearest(tenant, "p", rows[n], "museum hours", 0.9, SEARCH)
            assert found is not None
            assert found.similarity == pytest.approx(1.0, abs=1e-3)
            other = rows[(n + 1) % len(tenants)]  # another tenant's vector, not found here
            assert await index.nearest(tenant, "p", other, "museum hours", 0.9, SEARCH) is None
    finally:
        await index.aclose()
        await store.aclose()
    first = redis8_cluster_url.removeprefix("redis+cluster://").split(",")[0]
    with RedisCluster(host="127.0.0.1", port=int(first.split(":")[1]), protocol=2) as cluster:
        serving = {t: cluster.get_node_from_key(f"tw:{{{t}}}:").port for t in tenants}
        on_node = {
            node.port: set(cluster.execute_command("FT._LIST", target_nodes=node))
            for node in cluster.get_primaries()
        }
    for tenant in tenants:
        holders = [
            port
            for port, names in on_node.items()
            if f"tw:{{{tenant}}}:cache:idx32".encode() in names
        ]
        assert holders == [serving[tenant]], tenant
    assert len({serving[t] for t in tenants}) > 1  # the tenants are spread over the nodes


async def test_one_tenants_churn_evicts_only_its_own_vectors(
    redis8_url: str, search: tuple[RedisCacheStore, SemanticIndex]
) -> None:
    store, index = search
    rows = unit_rows(5)
    graph = await index.graph(SEARCH)
    await store.put(entry("kept", rows[0], tenant="b", graph=graph))
    for n in range(1, 5):  # tenant "a" keeps at most 2 entries
        churn = CacheEntry("a", f"k{n}", b"v", NOW + n, 3600.0, 2, "p", pack(rows[n], "q"), graph)
        await store.put(churn)
    await store.flush_vectors()
    with admin(redis8_url) as client:
        vectors = sorted(client.scan_iter(match="tw:*:cache:f:*"))
    assert vectors == [b"tw:{a}:cache:f:k3", b"tw:{a}:cache:f:k4", b"tw:{b}:cache:f:kept"]
    found = await index.nearest("b", "p", rows[0], "museum hours", 0.9, SEARCH)
    assert found is not None
    assert found.key == "kept"
