"""The response cache on Redis, shared by every replica: answers, per-tenant LRU, vector streams.

All of a tenant's keys start `tw:{tenant}:cache:` (the tenant is the hash tag), so one script
touches only one tenant's slot and no key of one tenant can name another's. Vectors live in a
Redis stream per partition, which replicas read from their cursor, or in an index Redis searches
itself: RediSearch's FT.SEARCH (cache_ft.py) or Redis 8's vector sets (cache_vset.py).
"""

from __future__ import annotations

import math
from importlib import resources
from typing import Any

import numpy as np

from proxy.storage.cache import VECTOR_PAGE, CacheEntry, VectorEngine, VectorRows
from proxy.storage.cache_ft import RedisSearchVectors
from proxy.storage.cache_vset import RedisVectorSets
from proxy.storage.redisconn import StoreRedis, translated
from proxy.storage.resp import Multiplexed, can_multiplex

__all__ = ["RedisCacheStore"]

# Bookkeeping (LRU set, vector streams) outlives the last write by this many TTLs.
_KEEP_TTLS = 2


def _script(name: str) -> str:
    lua = resources.files("proxy.storage") / "lua"
    prelude = (lua / "cache_drop.lua").read_text(encoding="utf-8")
    return prelude + (lua / name).read_text(encoding="utf-8")


class RedisCacheStore:
    def __init__(
        self, url: str, *, timeout_s: float = 1.0, max_connections: int = 64, multiplex: bool = True
    ) -> None:
        self._conn = StoreRedis(
            url, timeout_s=timeout_s, max_connections=max_connections, multiplex=multiplex
        )
        scripts = self._conn.scripts
        self._get = scripts.register_script(_script("cache_get.lua"))
        self._put = scripts.register_script(_script("cache_put.lua"))
        self._forget = scripts.register_script(_script("cache_forget.lua"))
        # auto's order, measured (docs/benchmarks.md, "semantic cache engines"): FT.SEARCH first.
        # Each engine's writer has a connection of its own: no lookup waits behind its writes.
        self._engines: tuple[VectorEngine, ...] = (
            RedisSearchVectors(self._conn.client, _prefix, writes=_own(url, timeout_s, multiplex)),
            RedisVectorSets(self._conn.client, _prefix, writes=_own(url, timeout_s, multiplex)),
        )

    async def get(self, tenant: str, key: str, *, now: float) -> bytes | None:
        prefix = _prefix(tenant)
        with translated("cache storage"):
            value = await self._get(keys=[f"{prefix}x:{key}", f"{prefix}lru"], args=[now, key])
        return value if isinstance(value, bytes) else None

    async def put(self, entry: CacheEntry) -> None:
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
        args: list[str | bytes | float] = [
            entry.key, entry.value, ttl_ms, entry.now, entry.now - entry.ttl_s,
            entry.max_entries, prefix, partition or "",
            # the stream's copy; an engine's is sent by its writer
            entry.vector if engine is None and entry.vector else b"", ttl_ms * _KEEP_TTLS,
            engine.marker if engine is not None else "",
        ]  # fmt: skip
        with translated("cache storage"):
            await self._put(keys=keys, args=args)
        if partition is not None and entry.vector is not None and entry.graph and engine:
            vector, question = _float32(entry.vector)
            engine.add(
                entry.tenant, partition, entry.key, vector, question,
                graph=entry.graph, ttl_ms=ttl_ms, keep_ms=ttl_ms * _KEEP_TTLS,
            )  # fmt: skip

    async def vectors(self, tenant: str, partition: str, after: str) -> tuple[VectorRows, str]:
        stream = f"{_prefix(tenant)}v:{partition}"
        with translated("cache storage"):
            found: list[Any] | None = await self._conn.client.xrange(
                stream, min=f"({after}", max="+", count=VECTOR_PAGE
            )
        if not found:
            return [], after
        rows = [(_text(fields[b"k"]), bytes(fields[b"v"])) for _, fields in found]
        return rows, _text(found[-1][0])

    async def forget(self, tenant: str, key: str) -> None:
        prefix = _prefix(tenant)
        keys = [f"{prefix}x:{key}", f"{prefix}lru", f"{prefix}vec"]
        with translated("cache storage"):
            await self._forget(keys=keys, args=[prefix, key])

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

    async def ping(self) -> None:
        with translated("cache storage"):
            await self._conn.scripts.ping()

    async def aclose(self) -> None:
        try:
            for engine in self._engines:
                await engine.aclose()
        finally:
            await self._conn.aclose()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _float32(packed: bytes) -> tuple[bytes, str]:
    """A packed vector (vectors.pack: dimension, float16 values, question) as float32 bytes."""
    dim = int.from_bytes(packed[:2], "little")
    vector = np.frombuffer(packed, dtype=np.float16, count=dim, offset=2).astype(np.float32)
    return vector.tobytes(), packed[2 + 2 * dim :].decode()


def _own(url: str, timeout_s: float, multiplex: bool) -> Multiplexed | None:
    """A connection of its own (opened on its first write) where the URL allows one; else the
    writer goes through redis-py's pool (Sentinel, Cluster, or `multiplex` off)."""
    return Multiplexed(url, timeout_s=timeout_s) if multiplex and can_multiplex(url) else None


def _prefix(tenant: str) -> str:
    return f"tw:{{{tenant}}}:cache:"
