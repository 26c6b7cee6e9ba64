"""One suite, every vector engine: the memory store's mirror, Redis 7's and a Redis 7 Cluster's
mirror (no vector sets: `auto` falls back), and Redis 8's own vector sets; isolation, eviction,
expiry, a shared index, writes off the answer's path."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis

from proxy.cache.semantic import SemanticIndex
from proxy.cache.vectors import pack
from proxy.policy.model import CacheSpec
from proxy.storage import CacheEntry, CacheStore, MemoryCacheStore, RedisCacheStore
from proxy.storage.cache_vset import RedisVectorSets
from tests.redis8 import redis8_server, redis8_url

__all__ = ["redis8_server", "redis8_url"]  # fixtures

pytestmark = pytest.mark.anyio
NOW = 1_800_000_000.0
SPEC = CacheSpec(mode="semantic")


def unit_rows(n: int, dim: int = 32, seed: int = 1) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


@pytest.fixture(params=["memory", "redis7", "redis7-cluster", "redis8"])
def engine_url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory"
    fixture = {"redis7": "redis_url", "redis7-cluster": "redis_cluster_url"}
    return str(request.getfixturevalue(fixture.get(request.param, "redis8_url")))


@pytest.fixture
async def store(engine_url: str) -> AsyncIterator[CacheStore]:
    chosen: CacheStore
    chosen = MemoryCacheStore() if engine_url == "memory" else RedisCacheStore(engine_url)
    yield chosen
    await chosen.aclose()


async def put(
    store: CacheStore, index: SemanticIndex, key: str, vector: np.ndarray, **fields: object
) -> None:
    values: dict[str, object] = {
        "tenant": "t", "partition": "p", "now": NOW, "ttl_s": 3600.0, "max_entries": 100,
        "question": "q",
    } | fields  # fmt: skip
    question = str(values.pop("question"))
    entry = CacheEntry(
        str(values["tenant"]), key, b"v", float(values["now"]),  # type: ignore[arg-type]
        float(values["ttl_s"]), int(values["max_entries"]),  # type: ignore[call-overload]
        str(values["partition"]), pack(vector, question), await index.graph(SPEC),
    )  # fmt: skip
    await store.put(entry)
    if isinstance(store, RedisCacheStore):
        await store.flush_vectors()


def vector_set_size(url: str, tenant: str, partition: str) -> int:
    with redis.Redis.from_url(url) as admin:
        return int(admin.execute_command("VCARD", f"tw:{{{tenant}}}:cache:s:{partition}"))


async def test_the_engine_is_chosen_from_what_the_server_offers(
    store: CacheStore, engine_url: str
) -> None:
    index = SemanticIndex(store)
    on_redis8 = engine_url not in ("memory",) and await store_has_sets(store)
    assert (await index.graph(SPEC) is not None) == on_redis8
    assert await index.graph(CacheSpec(mode="semantic", vector_search="local")) is None
    redis_spec = CacheSpec(mode="semantic", vector_search="redis")
    assert (await index.graph(redis_spec) is not None) == on_redis8  # Redis 7: the mirror
    await index.aclose()


async def store_has_sets(store: CacheStore) -> bool:
    sets = store.vector_set()
    return sets is not None and await sets.available()


async def test_nearest_finds_only_the_tenants_own_partition(store: CacheStore) -> None:
    index = SemanticIndex(store)
    rows = unit_rows(3)
    await put(store, index, "k0", rows[0], tenant="a", question="hotels in 2023")
    await put(store, index, "k1", rows[1], tenant="a:b", question="hotels in 2023")
    await put(store, index, "k2", rows[2], tenant="a", partition="other", question="hotels in 2023")
    found = await index.nearest("a", "p", rows[0], "hotels in 2023", 0.9, SPEC)
    assert found is not None
    assert found.key == "k0"
    assert found.similarity == pytest.approx(1.0, abs=1e-2)
    # names built to collide ("a" + "b:..." against "a:b"), another partition, another tenant
    assert await index.nearest("a", "p", rows[1], "hotels in 2023", 0.9, SPEC) is None
    assert await index.nearest("a:b", "p", rows[0], "hotels in 2023", 0.9, SPEC) is None
    assert await index.nearest("a", "b:p", rows[0], "hotels in 2023", 0.9, SPEC) is None
    assert await index.nearest("a", "other", rows[0], "hotels in 2023", 0.9, SPEC) is None
    assert await index.nearest("b", "p", rows[0], "hotels in 2023", 0.9, SPEC) is None
    # the guards still apply: a different number is a different question
    assert await index.nearest("a", "p", rows[0], "hotels in 2024", 0.9, SPEC) is None
    await index.aclose()


async def test_an_evicted_entrys_vector_is_gone(store: CacheStore, engine_url: str) -> None:
    index = SemanticIndex(store)
    rows = unit_rows(4)
    for n, row in enumerate(rows):
        await put(store, index, f"k{n}", row, now=NOW + n, max_entries=2)
    if await store_has_sets(store):
        assert vector_set_size(engine_url, "t", "p") == 2
    for n, row in enumerate(rows):
        found = await index.nearest("t", "p", row, "q", 0.9, SPEC)
        alive = found is not None and await store.get("t", found.key, now=NOW + 5) is not None
        assert alive == (n >= 2), n
    await index.aclose()


async def test_an_expired_entrys_vector_is_removed(store: CacheStore, engine_url: str) -> None:
    index = SemanticIndex(store)
    rows = unit_rows(2)
    await put(store, index, "old", rows[0], ttl_s=10.0)
    await put(store, index, "new", rows[1], now=NOW + 60, ttl_s=10.0)  # sweeps "old"
    if await store_has_sets(store):
        assert vector_set_size(engine_url, "t", "p") == 1
    found = await index.nearest("t", "p", rows[0], "q", 0.9, SPEC)
    assert found is None or await store.get("t", found.key, now=NOW + 60) is None
    await index.aclose()


async def test_a_stale_hit_is_removed_from_redis_vector_set(redis8_url: str) -> None:
    store = RedisCacheStore(redis8_url)
    index = SemanticIndex(store)
    try:
        row = unit_rows(1)[0]
        await put(store, index, "k", row)
        with redis.Redis.from_url(redis8_url) as admin:
            admin.delete("tw:{t}:cache:x:k")  # the entry expired in Redis, its vector did not
        found = await index.nearest("t", "p", row, "q", 0.9, SPEC)
        assert found is not None
        assert await store.get("t", found.key, now=NOW) is None
        index.forget("t", "p", found.key)  # what the cache stage does with a stale hit
        await store.flush_vectors()
        assert vector_set_size(redis8_url, "t", "p") == 0
    finally:
        await index.aclose()
        await store.aclose()


async def test_replicas_share_one_redis_index_without_warm_up(redis8_url: str) -> None:
    one, two = RedisCacheStore(redis8_url), RedisCacheStore(redis8_url)
    first, second = SemanticIndex(one), SemanticIndex(two)
    try:
        row = unit_rows(1)[0]
        await put(one, first, "k", row, question="museum hours")
        found = await second.nearest("t", "p", row, "museum hours", 0.9, SPEC)
        assert found is not None
        assert found.key == "k"
        with redis.Redis.from_url(redis8_url) as admin:
            assert admin.exists("tw:{t}:cache:v:p") == 0  # no stream for mirrors to read
    finally:
        for closing in (first, second):
            await closing.aclose()
        for store in (one, two):
            await store.aclose()


async def test_storing_an_answer_does_not_wait_for_its_vector(redis8_url: str) -> None:
    store = RedisCacheStore(redis8_url)
    index = SemanticIndex(store)
    sets = store.vector_set()
    try:
        rows = unit_rows(1)
        entry = CacheEntry("t", "k", b"v", NOW, 3600.0, 100, "p", pack(rows[0], "q"), (16, 200))
        await store.put(entry)
        assert sets.pending() == 1  # put returned; its vector is still queued
        await store.flush_vectors()
        assert sets.pending() == 0
        burst = unit_rows(1500, seed=3)
        for n, row in enumerate(burst):
            args = ("t", "p", f"b{n}", row.tobytes(), "burst")
            sets.add(*args, m=16, ef=200, keep_ms=3_600_000)
        found = await index.nearest("t", "p", rows[0], "q", 0.9, SPEC)
        assert found is not None
        assert found.key == "k"
        assert sets.pending() > 0  # the lookup was answered while the burst was being written
        await store.flush_vectors()
        assert vector_set_size(redis8_url, "t", "p") == 1501
    finally:
        await index.aclose()
        await store.aclose()


async def test_vector_set_replies_read_the_same_in_resp3(redis8_url: str) -> None:
    client = aioredis.Redis.from_url(redis8_url, protocol=3)
    sets = RedisVectorSets(client, lambda tenant: f"tw:{{{tenant}}}:cache:")
    try:
        row = unit_rows(1)[0]
        sets.add("t", "p", "k", row.tobytes(), "museum hours", m=16, ef=200, keep_ms=60_000)
        await sets.flush()
        [hit] = await sets.nearest("t", "p", row.tobytes(), count=4, ef=64)
        assert (hit.key, hit.question) == ("k", "museum hours")
        assert hit.similarity == pytest.approx(1.0, abs=1e-3)
    finally:
        await sets.aclose()
        await client.aclose()
