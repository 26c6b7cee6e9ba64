"""The response cache on Redis, shared by every replica: answers, per-tenant LRU, vector streams.

All of a tenant's keys start `tw:{tenant}:cache:` (the tenant is the hash tag), so one script
touches only one tenant's slot and no key of one tenant can name another's. Vectors live in a
Redis stream per partition, which replicas read from their cursor, or in an index Redis searches
itself: RediSearch's FT.SEARCH (cache_ft.py) or Redis 8's vector sets (cache_vset.py).

The LRU set's scores (an entry's last use) are whole seconds, rounded up: a tenant with fewer
than 128 entries has its set kept as a listpack, which parses a fractional score again for
every entry an insert passes (a hit in a set of 100 cost Redis about twice the CPU). So the
least recently used goes first to the second; within one second, in no order of use.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable
from typing import Any

from proxy.storage.cache import VECTOR_PAGE, CacheEntry, VectorEngine, VectorRows
from proxy.storage.joint import Lookup
from proxy.storage.redis.cache_ft import RedisSearchVectors
from proxy.storage.redis.cache_vset import RedisVectorSets
from proxy.storage.redis.conn import reply_text, translated
from proxy.storage.redis.link import Arg, LuaCall, OnLink, RedisLink, nothing
from proxy.storage.redis.resp import Multiplexed, can_multiplex
from proxy.storage.scopes import tenant_scope

__all__ = ["RedisCacheStore"]

# Bookkeeping (LRU set, vector streams) outlives the last write by this many TTLs.
_KEEP_TTLS = 2


class RedisCacheStore(OnLink):
    """Given a URL, on a link of its own; given a link, on one it shares with the other stores."""

    _what = "cache storage"

    def _opened(self) -> None:
        # auto's order, measured (docs/benchmarks.md, "semantic cache engines"): FT.SEARCH first
        self._engines: tuple[VectorEngine, ...] = (
            # Each engine's writer has a connection of its own: no lookup waits behind its writes.
            RedisSearchVectors(self._link.client, _prefix, writes=_own(self._link)),
            RedisVectorSets(self._link.client, _prefix, writes=_own(self._link)),
        )

    def call(self, step: Lookup) -> LuaCall:
        """The lookup as one operation of the link's script; its outcome goes to `step`."""
        prefix = _prefix(step.tenant)
        return LuaCall(
            "cache_get",
            [f"{prefix}x:{step.key}", f"{prefix}lru"],
            [math.ceil(step.now), step.key],
            lambda value: step.answered(value if isinstance(value, bytes) else None),
            step.failed,
            self._what,
        )

    async def get(self, tenant: str, key: str, *, now: float) -> bytes | None:
        step = Lookup(tenant, key, now=now)
        await self._link.run([self.call(step)])
        return step.answer

    def put(self, entry: CacheEntry) -> Awaitable[None]:
        prefix = _prefix(entry.tenant)
        partition = entry.partition if entry.vector is not None else None
        ttl_ms = max(1, math.ceil(entry.ttl_s * 1000))
        engine = self._engine(entry)
        keys = [
            f"{prefix}x:{entry.key}",
            f"{prefix}lru",
            f"{prefix}vec",
            f"{prefix}v:{partition or '-'}",
        ]
        args: list[Arg] = [
            entry.key, entry.value, ttl_ms, math.ceil(entry.now), entry.now - entry.ttl_s,
            entry.max_entries, prefix, partition or "",
            # the stream's copy; an engine's is sent by its writer
            entry.vector if engine is None and entry.vector else b"", ttl_ms * _KEEP_TTLS,
            engine.marker if engine is not None else "",
        ]  # fmt: skip
        stored = self._link.later("cache_put", keys, args, nothing, what=self._what)
        if partition is None or entry.vector is None or entry.graph is None or engine is None:
            return stored
        return _indexed(stored, engine, entry, partition, ttl_ms)

    async def vectors(self, tenant: str, partition: str, after: str) -> tuple[VectorRows, str]:
        stream = f"{_prefix(tenant)}v:{partition}"
        with translated(self._what):
            found: list[Any] | None = await self._link.client.xrange(
                stream, min=f"({after}", max="+", count=VECTOR_PAGE
            )
        if not found:
            return [], after
        rows = [(reply_text(fields[b"k"]), bytes(fields[b"v"])) for _, fields in found]
        return rows, reply_text(found[-1][0])

    def forget(self, tenant: str, key: str) -> Awaitable[None]:
        prefix = _prefix(tenant)
        keys = [f"{prefix}x:{key}", f"{prefix}lru", f"{prefix}vec"]
        return self._link.later("cache_forget", keys, [prefix, key], nothing, what=self._what)

    def redis_engines(self) -> tuple[VectorEngine, ...]:
        return self._engines

    def _engine(self, entry: CacheEntry) -> VectorEngine | None:
        if entry.graph is None or entry.vector is None:
            return None
        return next(e for e in self._engines if e.name == entry.graph.engine)

    async def flush_vectors(self, *, hurry: bool = False) -> None:
        """Wait until queued vector writes are sent (tests, benchmarks); `hurry`: unpaced."""
        for engine in self._engines:
            await engine.flush(hurry=hurry)

    async def aclose(self) -> None:
        try:
            # At once: each flushes for up to 2 s, and shutdown bounds the whole at 3 s.
            await asyncio.gather(*(engine.aclose() for engine in self._engines))
        finally:
            await super().aclose()


async def _indexed(
    stored: Awaitable[None], engine: VectorEngine, entry: CacheEntry, partition: str, ttl_ms: int
) -> None:
    """Once the entry is stored, its vector is queued for the engine's index (which checks
    that the entry still lives)."""
    await stored
    if entry.vector is None or entry.graph is None:
        return
    vector, question = _float32(entry.vector)
    engine.add(
        entry.tenant, partition, entry.key, vector, question,
        graph=entry.graph, ttl_ms=ttl_ms, keep_ms=ttl_ms * _KEEP_TTLS,
    )  # fmt: skip


def _float32(packed: bytes) -> tuple[bytes, str]:
    """A packed vector (vectors.pack: dimension, float16 values, question) as float32 bytes."""
    import numpy as np  # only the semantic cache's vectors come here (vectors.py says why)

    dim = int.from_bytes(packed[:2], "little")
    vector = np.frombuffer(packed, dtype=np.float16, count=dim, offset=2).astype(np.float32)
    return vector.tobytes(), packed[2 + 2 * dim :].decode()


def _own(link: RedisLink) -> Multiplexed | None:
    """A connection of its own (opened on its first write) where the URL allows one; else the
    writer goes through redis-py's pool (Sentinel, Cluster, or multiplexing off)."""
    if not (link.multiplex and can_multiplex(link.url)):
        return None
    return Multiplexed(link.url, timeout_s=link.timeout_s)


def _prefix(tenant: str) -> str:
    return f"{tenant_scope(tenant)}:cache:"
