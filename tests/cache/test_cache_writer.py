"""The vector writer under a burst, on a real Redis 8, for both of Redis's engines: every vector
of a burst is written at the writer's own pace, the per-tenant entry limit still applies to the
vectors (none outlives its entry), lookups never wait behind writes Redis is holding, and
shutdown sends what is still queued."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis

from proxy.cache.semantic import SemanticIndex
from proxy.cache.vectors import pack
from proxy.policy.model import CacheSpec
from proxy.storage import CacheEntry, RedisCacheStore, StorageUnreachable
from proxy.storage.cache import Graph
from proxy.storage.redis import cache_writer
from proxy.storage.redis.cache_vset import RedisVectorSets
from proxy.storage.redis.conn import connect
from tests.cache.test_vector_engines import NOW, REDIS8, engine_named, redis_vectors, unit_rows
from tests.redis8 import redis8_server, redis8_url
from tests.redis_server import RedisProcess

__all__ = ["redis8_server", "redis8_url"]

pytestmark = pytest.mark.anyio


def burst(n: int, graph: Graph | None, *, max_entries: int = 10_000) -> list[CacheEntry]:
    rows = unit_rows(n, seed=5)
    return [
        CacheEntry("t", f"b{i}", b"v", NOW + i, 3600.0, max_entries, "p", pack(row, "q"), graph)
        for i, row in enumerate(rows)
    ]


@pytest.fixture
async def cache(redis8_url: str) -> AsyncIterator[tuple[RedisCacheStore, SemanticIndex]]:
    """A store whose calls may wait 30 s: long enough to outlast the writes Redis is holding."""
    store = RedisCacheStore(redis8_url, timeout_s=30.0)
    index = SemanticIndex(store)
    try:
        yield store, index
    finally:
        await index.aclose()
        await store.aclose()


async def until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"waited 20 s for {what}")


@contextmanager
def writes_held(url: str) -> Iterator[None]:
    """Redis holds every write command (and every command behind one on its connection) until
    the block ends; reads go on (CLIENT PAUSE ... WRITE)."""
    with redis.Redis.from_url(url) as admin:
        admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
        try:
            yield
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")


@pytest.mark.parametrize(("spec", "name"), REDIS8)
async def test_every_vector_of_a_burst_is_written(
    redis8_url: str, cache: tuple[RedisCacheStore, SemanticIndex], spec: CacheSpec, name: str
) -> None:
    store, index = cache
    entries = burst(300, await index.graph(spec))
    for entry in entries:
        await store.put(entry)
    assert engine_named(store, name).pending() > 0  # the puts did not wait for the vectors
    await store.flush_vectors()  # at the writer's pace, not hurried
    assert redis_vectors(redis8_url, name, "t", "p") == 300
    for n in (0, 150, 299):
        row = unit_rows(300, seed=5)[n]
        found = await index.nearest("t", "p", row, "q", 0.99, spec)
        assert found is not None
        assert found.key == f"b{n}"


@pytest.mark.parametrize(("spec", "name"), REDIS8)
async def test_a_burst_beyond_the_entry_limit_leaves_no_vector_without_its_entry(
    redis8_url: str, cache: tuple[RedisCacheStore, SemanticIndex], spec: CacheSpec, name: str
) -> None:
    store, index = cache
    # each put evicts the oldest entry once 40 are held, mostly before its vector is written
    for entry in burst(200, await index.graph(spec), max_entries=40):
        await store.put(entry)
    await store.flush_vectors()
    assert redis_vectors(redis8_url, name, "t", "p") == 40
    with redis.Redis.from_url(redis8_url) as admin:
        held = {key.decode() for key in admin.scan_iter("tw:{t}:cache:x:*")}
    assert held == {f"tw:{{t}}:cache:x:b{i}" for i in range(160, 200)}
    rows = unit_rows(200, seed=5)
    for n in (0, 100, 159):  # evicted: no vector of theirs is offered any more
        found = await index.nearest("t", "p", rows[n], "q", 0.99, spec)
        assert found is None or found.key != f"b{n}"


@pytest.mark.parametrize(("spec", "name"), REDIS8)
async def test_a_lookup_never_waits_behind_writes_redis_is_holding(
    redis8_url: str, cache: tuple[RedisCacheStore, SemanticIndex], spec: CacheSpec, name: str
) -> None:
    store, index = cache
    engine = engine_named(store, name)
    graph = await index.graph(spec)
    assert graph is not None
    rows = unit_rows(401, seed=5)
    await store.put(burst(1, graph)[0])
    await store.flush_vectors()
    with redis.Redis.from_url(redis8_url) as admin, admin.pipeline() as pipe:
        for n in range(1, 401):  # the burst's entries, stored before Redis holds writes
            pipe.set(f"tw:{{t}}:cache:x:b{n}", b"v", px=3_600_000)
        pipe.execute()
    with writes_held(redis8_url):
        for n in range(1, 401):
            engine.add("t", "p", f"b{n}", rows[n].tobytes(), "q", graph=graph, ttl_ms=3_600_000,
                       keep_ms=3_600_000)  # fmt: skip
        # the writer's first batch, taken from the queue and sent, is held in Redis
        await until(lambda: engine.pending() < 400, "the writer's first batch")
        held = engine.pending()
        async with asyncio.timeout(20.0):
            found = await index.nearest("t", "p", rows[0], "q", 0.99, spec)
        assert found is not None
        assert found.key == "b0"
        await asyncio.sleep(0.2)
        # answered while the writer still waits for its batch
        assert (engine.pending(), redis_vectors(redis8_url, name, "t", "p")) == (held, 1)
    await store.flush_vectors()
    assert redis_vectors(redis8_url, name, "t", "p") == 401


@pytest.mark.parametrize(("spec", "name"), REDIS8)
async def test_closing_the_store_sends_what_is_still_queued(
    redis8_url: str, cache: tuple[RedisCacheStore, SemanticIndex], spec: CacheSpec, name: str
) -> None:
    store, index = cache
    for entry in burst(120, await index.graph(spec)):
        await store.put(entry)
    assert engine_named(store, name).pending() > 0
    await store.aclose()  # at full speed, unpaced (closing again at the end changes nothing)
    assert redis_vectors(redis8_url, name, "t", "p") == 120


@pytest.mark.parametrize(("spec", "name"), REDIS8)
async def test_a_full_queue_drops_new_vectors_and_says_how_many(
    redis8_url: str,
    cache: tuple[RedisCacheStore, SemanticIndex],
    spec: CacheSpec,
    name: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store, index = cache
    engine = engine_named(store, name)
    graph = await index.graph(spec)
    assert graph is not None
    monkeypatch.setattr(cache_writer, "_QUEUE_LIMIT", 20)
    rows = unit_rows(32, seed=5)
    _entries(redis8_url, [f"tw:{{t}}:cache:x:b{n}" for n in range(32)])
    with caplog.at_level(logging.WARNING, logger="tokenweir.cache"):
        for n in range(30):  # queued at once: the writer has not run yet
            engine.add("t", "p", f"b{n}", rows[n].tobytes(), "q", graph=graph, ttl_ms=3_600_000,
                       keep_ms=3_600_000)  # fmt: skip
        assert engine.pending() == 20
        assert caplog.messages == [
            "semantic cache vector queue full (20): new vectors are dropped until it drains "
            "(their answers are still cached exactly)"
        ]
        await store.flush_vectors()
        assert redis_vectors(redis8_url, name, "t", "p") == 20
        engine.add("t", "p", "b31", rows[31].tobytes(), "q", graph=graph, ttl_ms=3_600_000,
                   keep_ms=3_600_000)  # fmt: skip
        assert caplog.messages[1].startswith("10 semantic cache vectors were dropped")
    await store.flush_vectors()
    assert redis_vectors(redis8_url, name, "t", "p") == 21
    for n, kept in ((5, True), (25, False), (31, True)):  # a dropped one is no semantic hit
        found = await index.nearest("t", "p", rows[n], "q", 0.999, spec)
        assert (found is not None and found.key == f"b{n}") is kept


def _entries(url: str, keys: list[str]) -> None:
    """Cache entries whose vectors a test queues by hand (a vector is written only beside its
    entry)."""
    with redis.Redis.from_url(url) as admin, admin.pipeline() as pipe:
        for key in keys:
            pipe.set(key, b"v", px=3_600_000)
        pipe.execute()


def _written(url: str, name: str, tenant: str) -> int:
    try:
        return redis_vectors(url, name, tenant, "p")
    except redis.ResponseError:  # RediSearch: the tenant's index is not made yet
        return 0


@pytest.mark.parametrize(("spec", "name"), REDIS8)
async def test_one_tenants_burst_neither_delays_nor_drops_another_tenants_vector(
    redis8_url: str,
    cache: tuple[RedisCacheStore, SemanticIndex],
    spec: CacheSpec,
    name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tenant t fills the queue with 30 vectors (room for 20); tenant u's one vector comes
    after. It took the place of t's newest and is written second, while t's are still queued
    (it was dropped, or written after all of t's). The order is the writer's own, recorded as
    it builds each write's commands: no poll's timing decides it."""
    store, index = cache
    engine = engine_named(store, name)
    graph = await index.graph(spec)
    assert graph is not None
    monkeypatch.setattr(cache_writer, "_QUEUE_LIMIT", 20)
    written: list[str] = []  # each write's tenant, in the order the writer sends them
    commands_of = engine._commands

    def recorded(write: Any) -> list[Any]:
        written.append("u" if "{u}" in repr(write) else "t")
        return commands_of(write)

    monkeypatch.setattr(engine, "_commands", recorded)
    rows = unit_rows(31, seed=5)
    _entries(redis8_url, [f"tw:{{t}}:cache:x:b{n}" for n in range(30)] + ["tw:{u}:cache:x:b30"])
    for n, tenant in enumerate(["t"] * 30 + ["u"]):  # queued at once: the writer has not run
        engine.add(tenant, "p", f"b{n}", rows[n].tobytes(), "q", graph=graph, ttl_ms=3_600_000,
                   keep_ms=3_600_000)  # fmt: skip
    assert engine.pending() == 20
    await store.flush_vectors()
    assert written == ["t", "u"] + ["t"] * 18  # t's newest dropped for u's, u's second
    assert _written(redis8_url, name, "u") == 1
    assert redis_vectors(redis8_url, name, "t", "p") == 19
    found = await index.nearest("u", "p", rows[30], "q", 0.999, spec)
    assert found is not None
    assert found.key == "b30"


async def test_the_engines_are_asked_for_again_after_redis_was_unreachable() -> None:
    """A probe that found Redis down says nothing of its commands: the next one asks again;
    an answer (Redis 7 knows no vector sets) is remembered."""
    server = RedisProcess()
    server.start()
    client = connect(server.url, timeout_s=2.0, max_connections=2)
    engine = RedisVectorSets(client, lambda tenant: f"tw:{{{tenant}}}:cache:")
    try:
        server.kill()
        with pytest.raises(StorageUnreachable):
            await engine.available()
        server.start()
        assert not await engine.available()
        server.kill()
        assert not await engine.available()  # remembered: not asked again
    finally:
        await client.aclose()
        server.close()


def store_connections(url: str) -> int:
    """Connections to Redis but this one and the one holding writes (CLIENT PAUSE)."""
    with redis.Redis.from_url(url) as admin:
        clients = admin.client_list()
    return sum(1 for c in clients if c["cmd"] not in ("client|list", "client|pause"))


@pytest.mark.parametrize(("spec", "name"), REDIS8)
async def test_a_shutdown_cut_short_still_closes_the_writers_connection(
    redis8_url: str, spec: CacheSpec, name: str
) -> None:
    """Shutdown bounds each step (services.bounded): a cache close cancelled while its vectors
    cannot be written still closes the writer's own connection, which would otherwise outlive
    the event loop."""
    store = RedisCacheStore(redis8_url, timeout_s=30.0)
    index = SemanticIndex(store)
    try:
        graph = await index.graph(spec)
        engine = engine_named(store, name)
        with redis.Redis.from_url(redis8_url) as admin:
            admin.set("tw:{t}:cache:x:b0", b"v", px=3_600_000)
        engine.add("t", "p", "b0", unit_rows(1, seed=5)[0].tobytes(), "q", graph=graph,
                   ttl_ms=3_600_000, keep_ms=3_600_000)  # fmt: skip
        await store.flush_vectors()
        assert store_connections(redis8_url) == 2  # the store's, and its writer's own
        with writes_held(redis8_url):
            engine.add("t", "p", "b1", unit_rows(2, seed=5)[1].tobytes(), "q", graph=graph,
                       ttl_ms=3_600_000, keep_ms=3_600_000)  # fmt: skip
            closing = asyncio.ensure_future(store.aclose())
            await asyncio.sleep(0.5)  # flushing: the write is held
            assert not closing.done()
            closing.cancel()
            await asyncio.gather(closing, return_exceptions=True)
            await until(
                lambda: not store_connections(redis8_url), "the store's connections to close"
            )
    finally:
        await index.aclose()
        await store.aclose()
