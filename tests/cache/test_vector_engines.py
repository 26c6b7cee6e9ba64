"""One suite, every vector engine: the memory store's mirror, Redis 7's and a Redis 7 Cluster's
mirror (no search module, no vector sets: `auto` falls back), and on Redis 8 RediSearch's
FT.SEARCH (`auto`'s first choice; also on a Redis 8 cluster) and the vector sets
(`redis-vsets`); isolation, eviction, expiry, a shared index, writes off the answer's path."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
from redis.cluster import RedisCluster

from proxy.cache.semantic import SemanticIndex
from proxy.cache.vectors import pack
from proxy.policy.model import CacheSpec
from proxy.storage import CacheEntry, CacheStore, MemoryCacheStore, RedisCacheStore
from proxy.storage.cache import Graph, VectorEngine
from proxy.storage.redis.cache_vset import RedisVectorSets
from tests.redis8 import redis8_cluster_server, redis8_cluster_url, redis8_server, redis8_url

__all__ = ["redis8_cluster_server", "redis8_cluster_url", "redis8_server", "redis8_url"]

pytestmark = pytest.mark.anyio
NOW = 1_800_000_000.0
SPEC = CacheSpec(mode="semantic")


def unit_rows(n: int, dim: int = 32, seed: int = 1) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


@dataclass(frozen=True)
class Engine:
    url: str
    spec: CacheSpec
    redis: str | None  # the Redis engine expected: "search", "vsets" or None (the mirror)


ENGINES = {
    "memory": ("memory", "auto", None),
    "redis7": ("redis_url", "auto", None),
    "redis7-cluster": ("redis_cluster_url", "auto", None),
    "redis8-search": ("redis8_url", "auto", "search"),
    "redis8-vsets": ("redis8_url", "redis-vsets", "vsets"),
    "redis8-cluster-search": ("redis8_cluster_url", "auto", "search"),
}


@pytest.fixture(params=list(ENGINES))
def engine(request: pytest.FixtureRequest) -> Engine:
    fixture, vector_search, redis_engine = ENGINES[request.param]
    url = "memory" if fixture == "memory" else str(request.getfixturevalue(fixture))
    return Engine(url, CacheSpec(mode="semantic", vector_search=vector_search), redis_engine)  # type: ignore[arg-type]


@pytest.fixture
def engine_url(engine: Engine) -> str:
    return engine.url


@pytest.fixture
async def store(engine_url: str) -> AsyncIterator[CacheStore]:
    chosen: CacheStore
    chosen = (
        MemoryCacheStore()
        if engine_url == "memory"
        else RedisCacheStore(engine_url, timeout_s=10.0)
    )
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
    spec = values.pop("spec", SPEC)
    assert isinstance(spec, CacheSpec)
    entry = CacheEntry(
        str(values["tenant"]), key, b"v", float(values["now"]),  # type: ignore[arg-type]
        float(values["ttl_s"]), int(values["max_entries"]),  # type: ignore[call-overload]
        str(values["partition"]), pack(vector, question), await index.graph(spec),
    )  # fmt: skip
    await store.put(entry)
    if isinstance(store, RedisCacheStore):
        await store.flush_vectors()


def redis_vectors(url: str, engine: str | None, tenant: str, partition: str) -> int:
    """How many vectors Redis's own index holds for the partition (0 for the mirror)."""
    prefix = f"tw:{{{tenant}}}:cache:"
    if engine == "vsets":
        command: tuple[object, ...] = ("VCARD", f"{prefix}s:{partition}")
    elif engine == "search":
        tag = partition.encode().hex()
        command = ("FT.SEARCH", f"{prefix}idx32", f"@p:{{{tag}}}", "LIMIT", 0, 0)
    else:
        return 0
    if url.startswith("redis+cluster://"):
        host, port = url.removeprefix("redis+cluster://").split(",")[0].split(":")
        with RedisCluster(host=host, port=int(port), protocol=2) as cluster:
            node = cluster.get_node_from_key(prefix)  # FT.* goes to the tenant's slot's node
            found = cluster.execute_command(*command, target_nodes=node)
    else:
        with redis.Redis.from_url(url, protocol=2) as admin:
            found = admin.execute_command(*command)
    return int(found[0] if isinstance(found, list) else found)


async def test_the_engine_is_chosen_from_what_the_server_offers(
    store: CacheStore, engine: Engine
) -> None:
    index = SemanticIndex(store)
    graph = await index.graph(engine.spec)
    assert (graph.engine if graph else None) == engine.redis
    on_redis8 = engine.redis is not None
    assert await index.graph(CacheSpec(mode="semantic", vector_search="local")) is None
    for explicit, name in [
        ("redis-search", "search"),
        ("redis-vsets", "vsets"),
        ("redis", "search"),
    ]:
        chosen = await index.graph(CacheSpec(mode="semantic", vector_search=explicit))  # type: ignore[arg-type]
        # Redis 7 and the memory store have neither: the mirror
        assert chosen == (Graph(name, 16, 200) if on_redis8 else None), explicit
    await index.aclose()


async def test_nearest_finds_only_the_tenants_own_partition(
    store: CacheStore, engine: Engine
) -> None:
    index = SemanticIndex(store)
    rows = unit_rows(3)
    spec = engine.spec
    await put(store, index, "k0", rows[0], tenant="a", question="hotels in 2023", spec=spec)
    await put(store, index, "k1", rows[1], tenant="a:b", question="hotels in 2023", spec=spec)
    await put(store, index, "k2", rows[2], tenant="a", partition="other", question="hotels in 2023",
              spec=spec)  # fmt: skip
    found = await index.nearest("a", "p", rows[0], "hotels in 2023", 0.9, spec)
    assert found is not None
    assert found.key == "k0"
    assert found.similarity == pytest.approx(1.0, abs=1e-2)
    # names built to collide ("a" + "b:..." against "a:b"), another partition, another tenant
    assert await index.nearest("a", "p", rows[1], "hotels in 2023", 0.9, spec) is None
    assert await index.nearest("a:b", "p", rows[0], "hotels in 2023", 0.9, spec) is None
    assert await index.nearest("a", "b:p", rows[0], "hotels in 2023", 0.9, spec) is None
    assert await index.nearest("a", "other", rows[0], "hotels in 2023", 0.9, spec) is None
    assert await index.nearest("b", "p", rows[0], "hotels in 2023", 0.9, spec) is None
    # the guards still apply: a different number is a different question
    assert await index.nearest("a", "p", rows[0], "hotels in 2024", 0.9, spec) is None
    await index.aclose()


async def test_an_evicted_entrys_vector_is_gone(store: CacheStore, engine: Engine) -> None:
    index = SemanticIndex(store)
    rows = unit_rows(4)
    for n, row in enumerate(rows):
        await put(store, index, f"k{n}", row, now=NOW + n, max_entries=2, spec=engine.spec)
    if engine.redis:
        assert redis_vectors(engine.url, engine.redis, "t", "p") == 2
    for n, row in enumerate(rows):
        found = await index.nearest("t", "p", row, "q", 0.9, engine.spec)
        alive = found is not None and await store.get("t", found.key, now=NOW + 5) is not None
        assert alive == (n >= 2), n
    await index.aclose()


async def test_an_expired_entrys_vector_is_removed(store: CacheStore, engine: Engine) -> None:
    index = SemanticIndex(store)
    rows = unit_rows(2)
    await put(store, index, "old", rows[0], ttl_s=10.0, spec=engine.spec)
    # sweeps "old" (stale by the gateway's clock)
    await put(store, index, "new", rows[1], now=NOW + 60, ttl_s=10.0, spec=engine.spec)
    if engine.redis:
        assert redis_vectors(engine.url, engine.redis, "t", "p") == 1
    found = await index.nearest("t", "p", rows[0], "q", 0.9, engine.spec)
    assert found is None or await store.get("t", found.key, now=NOW + 60) is None
    await index.aclose()


REDIS8 = [
    pytest.param(CacheSpec(mode="semantic"), "search", id="search"),
    pytest.param(CacheSpec(mode="semantic", vector_search="redis-vsets"), "vsets", id="vsets"),
]


@pytest.mark.parametrize(("spec", "name"), REDIS8)
async def test_a_stale_hit_is_removed_from_redis_index(
    redis8_url: str, spec: CacheSpec, name: str
) -> None:
    store = RedisCacheStore(redis8_url, timeout_s=10.0)
    index = SemanticIndex(store)
    try:
        row = unit_rows(1)[0]
        await put(store, index, "k", row, spec=spec)
        with redis.Redis.from_url(redis8_url) as admin:
            admin.delete("tw:{t}:cache:x:k")  # the entry is gone, its vector is not
        found = await index.nearest("t", "p", row, "q", 0.9, spec)
        assert found is not None
        assert await store.get("t", found.key, now=NOW) is None
        index.forget("t", "p", found.key)  # what the cache stage does with a stale hit
        await store.flush_vectors()
        assert redis_vectors(redis8_url, name, "t", "p") == 0
        assert await index.nearest("t", "p", row, "q", 0.9, spec) is None
    finally:
        await index.aclose()
        await store.aclose()


@pytest.mark.parametrize(("spec", "name"), REDIS8)
async def test_replicas_share_one_redis_index_without_warm_up(
    redis8_url: str, spec: CacheSpec, name: str
) -> None:
    one, two = (
        RedisCacheStore(redis8_url, timeout_s=10.0),
        RedisCacheStore(redis8_url, timeout_s=10.0),
    )
    first, second = SemanticIndex(one), SemanticIndex(two)
    try:
        row = unit_rows(1)[0]
        await put(one, first, "k", row, question="museum hours", spec=spec)
        found = await second.nearest("t", "p", row, "museum hours", 0.9, spec)
        assert found is not None
        assert found.key == "k"
        with redis.Redis.from_url(redis8_url) as admin:
            assert admin.exists("tw:{t}:cache:v:p") == 0  # no stream for mirrors to read
        assert redis_vectors(redis8_url, name, "t", "p") == 1
    finally:
        for closing in (first, second):
            await closing.aclose()
        for store in (one, two):
            await store.aclose()


def engine_named(store: RedisCacheStore, name: str) -> VectorEngine:
    return next(e for e in store.redis_engines() if e.name == name)


@pytest.mark.parametrize(("spec", "name"), REDIS8)
async def test_storing_an_answer_does_not_wait_for_its_vector(
    redis8_url: str, spec: CacheSpec, name: str
) -> None:
    store = RedisCacheStore(redis8_url)
    index = SemanticIndex(store)
    engine = engine_named(store, name)
    graph = Graph(engine.name, 16, 200)
    try:
        rows = unit_rows(1)
        entry = CacheEntry("t", "k", b"v", NOW, 3600.0, 100, "p", pack(rows[0], "q"), graph)
        await store.put(entry)
        assert engine.pending() == 1  # put returned; its vector is still queued
        await store.flush_vectors()
        assert engine.pending() == 0
        burst = unit_rows(1500, seed=3)
        with redis.Redis.from_url(redis8_url) as admin, admin.pipeline() as pipe:
            for n in range(len(burst)):  # entries for the burst's vectors (RediSearch needs them)
                pipe.set(f"tw:{{t}}:cache:x:b{n}", b"v", px=3_600_000)
            pipe.execute()
        for n, row in enumerate(burst):
            args = ("t", "p", f"b{n}", row.tobytes(), "burst")
            engine.add(*args, graph=graph, ttl_ms=3_600_000, keep_ms=3_600_000)
        found = await index.nearest("t", "p", rows[0], "q", 0.9, spec)
        assert found is not None
        assert found.key == "k"
        assert engine.pending() > 0  # the lookup was answered while the burst was being written
        await store.flush_vectors()
        assert redis_vectors(redis8_url, name, "t", "p") == 1501
    finally:
        await index.aclose()
        await store.aclose()


async def test_vector_set_replies_read_the_same_in_resp3(redis8_url: str) -> None:
    client = aioredis.Redis.from_url(redis8_url, protocol=3)
    sets = RedisVectorSets(client, lambda tenant: f"tw:{{{tenant}}}:cache:")
    try:
        await client.set("tw:{t}:cache:x:k", b"v", px=60_000)  # its entry (none: no vector)
        row = unit_rows(1)[0]
        graph = Graph("vsets", 16, 200)
        sets.add("t", "p", "k", row.tobytes(), "museum hours", graph=graph, ttl_ms=60_000,
                 keep_ms=60_000)  # fmt: skip
        await sets.flush()
        [hit] = await sets.nearest("t", "p", row.tobytes(), count=4, ef=64)
        assert (hit.key, hit.question) == ("k", "museum hours")
        assert hit.similarity == pytest.approx(1.0, abs=1e-3)
    finally:
        await sets.aclose()
        await client.aclose()
