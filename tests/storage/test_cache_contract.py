"""One suite, both cache stores (Redis 7, Cluster, and Redis 8 with vector sets): entries, LRU
eviction, vectors by cursor, tenant isolation."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from proxy.storage import CacheEntry, CacheStore, MemoryCacheStore, RedisCacheStore
from proxy.storage.cache import START
from tests.redis8 import redis8_server, redis8_url

__all__ = ["redis8_server", "redis8_url"]  # fixtures

pytestmark = pytest.mark.anyio
NOW = 1_800_000_000.0


@pytest.fixture(
    params=["memory", "redis", "redis-unix", "redis-sentinel", "redis-cluster", "redis8"]
)
def any_url(request: pytest.FixtureRequest) -> str:
    """`storage_url`'s stores, and Redis 8."""
    if request.param == "memory":
        return "memory"
    return str(request.getfixturevalue(f"{request.param.replace('-', '_')}_url"))


@pytest.fixture
async def store(any_url: str) -> AsyncIterator[CacheStore]:
    chosen: CacheStore
    chosen = MemoryCacheStore() if any_url == "memory" else RedisCacheStore(any_url, timeout_s=10.0)
    yield chosen
    await chosen.aclose()


def entry(key: str, *, tenant: str = "alpha", now: float = NOW, **fields: object) -> CacheEntry:
    values: dict[str, object] = {"ttl_s": 3600.0, "max_entries": 100} | fields
    return CacheEntry(tenant, key, f"value-{key}".encode(), now, **values)  # type: ignore[arg-type]


async def test_an_entry_is_found_by_its_tenant_and_key(store: CacheStore) -> None:
    await store.put(entry("k1"))
    assert await store.get("alpha", "k1", now=NOW) == b"value-k1"
    assert await store.get("alpha", "k2", now=NOW) is None


async def test_tenants_never_share_entries_even_with_colliding_names(store: CacheStore) -> None:
    await store.put(entry("b:k", tenant="a"))
    await store.put(entry("k", tenant="a:b"))
    assert await store.get("a:b", "k", now=NOW) == b"value-k"
    assert await store.get("a", "b:k", now=NOW) == b"value-b:k"
    assert await store.get("a", "k", now=NOW) is None
    assert await store.get("a:b", "b:k", now=NOW) is None


async def test_least_recently_used_entries_go_past_the_limit(store: CacheStore) -> None:
    for n, key in enumerate(["k1", "k2", "k3"]):
        await store.put(entry(key, now=NOW + n, max_entries=3))
    assert await store.get("alpha", "k1", now=NOW + 10)  # k1 is now the most recently used
    await store.put(entry("k4", now=NOW + 11, max_entries=3))
    assert await store.get("alpha", "k2", now=NOW + 12) is None
    for key in ("k1", "k3", "k4"):
        assert await store.get("alpha", key, now=NOW + 12) == f"value-{key}".encode()


async def test_one_tenants_churn_does_not_evict_another_tenants_entries(store: CacheStore) -> None:
    await store.put(entry("keep", tenant="beta", max_entries=2))
    for n in range(5):
        await store.put(entry(f"k{n}", now=NOW + n, max_entries=2))
    assert await store.get("beta", "keep", now=NOW + 10) == b"value-keep"


async def test_vectors_are_read_after_a_cursor(store: CacheStore) -> None:
    await store.put(entry("k1", partition="p", vector=b"v1"))
    await store.put(entry("k2", partition="p", vector=b"v2"))
    await store.put(entry("other", partition="q", vector=b"v3"))
    rows, cursor = await store.vectors("alpha", "p", START)
    assert rows == [("k1", b"v1"), ("k2", b"v2")]
    assert await store.vectors("alpha", "p", cursor) == ([], cursor)
    await store.put(entry("k3", partition="p", vector=b"v4"))
    rows, _ = await store.vectors("alpha", "p", cursor)
    assert rows == [("k3", b"v4")]
    assert await store.vectors("beta", "p", START) == ([], START)


async def test_forget_drops_the_entry_and_its_vector(store: CacheStore) -> None:
    await store.put(entry("k1", partition="p", vector=b"v1"))
    await store.put(entry("k2", partition="p", vector=b"v2"))
    await store.forget("alpha", "k1")
    assert await store.get("alpha", "k1", now=NOW) is None
    rows, _ = await store.vectors("alpha", "p", START)
    if isinstance(store, RedisCacheStore):
        assert rows == [("k2", b"v2")]
    else:  # the memory store compacts lazily; the index skips what get() no longer finds
        assert ("k2", b"v2") in rows


async def test_an_answer_stored_again_keeps_one_entry_and_only_its_new_vector(
    store: CacheStore,
) -> None:
    await store.put(entry("k1", max_entries=2, partition="p", vector=b"v1"))
    await store.put(entry("k2", max_entries=2, partition="p", vector=b"v2"))
    again = CacheEntry("alpha", "k1", b"new", NOW + 1, 3600.0, 2, partition="p", vector=b"v3")
    await store.put(again)
    assert await store.get("alpha", "k1", now=NOW + 2) == b"new"
    assert await store.get("alpha", "k2", now=NOW + 2) == b"value-k2"  # k1 counted once
    rows, _ = await store.vectors("alpha", "p", START)
    if isinstance(store, RedisCacheStore):
        assert rows == [("k2", b"v2"), ("k1", b"v3")]
    else:  # the memory store compacts lazily; the index skips what get() no longer finds
        assert rows[-1] == ("k1", b"v3")
    await store.put(entry("k1", now=NOW + 3, max_entries=2))  # stored again without a vector
    assert await store.get("alpha", "k1", now=NOW + 4) == b"value-k1"
    if isinstance(store, RedisCacheStore):
        assert (await store.vectors("alpha", "p", START))[0] == [("k2", b"v2")]


async def test_evicted_entries_lose_their_vectors_on_redis(redis_url: str) -> None:
    store = RedisCacheStore(redis_url, timeout_s=10.0)
    try:
        for n in range(4):
            await store.put(entry(f"k{n}", now=NOW + n, max_entries=2, partition="p", vector=b"v"))
        rows, _ = await store.vectors("alpha", "p", START)
        assert [key for key, _ in rows] == ["k2", "k3"]
    finally:
        await store.aclose()


async def test_a_partition_whose_entries_are_all_gone_has_no_vectors(store: CacheStore) -> None:
    """Partitions are mostly a conversation's context each: kept past their last entry (the
    memory store did), they pile up for as long as the process runs."""
    await store.put(entry("k1", now=NOW, max_entries=1, partition="p", vector=b"v1"))
    await store.put(entry("k2", now=NOW + 1, max_entries=1, partition="q", vector=b"v2"))
    assert await store.vectors("alpha", "p", START) == ([], START)
    await store.forget("alpha", "k2")
    assert await store.vectors("alpha", "q", START) == ([], START)
