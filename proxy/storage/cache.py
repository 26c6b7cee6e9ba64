"""The response cache's storage contract: answers by key with TTL and per-tenant LRU, and vectors.

Every method takes the tenant, and implementations keep each tenant's entries in its own
namespace (its own dict, its own Redis hash tag): no lookup can reach another tenant's data.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = [
    "START",
    "VECTOR_PAGE",
    "CacheEntry",
    "CacheStore",
    "Graph",
    "VectorEngine",
    "VectorHit",
    "VectorRows",
]

START = "0-0"
"""The cursor before a partition's first vector."""

VECTOR_PAGE = 2_000
"""At most this many vectors per `vectors()` call (about 1.6 MB); fewer means none are left."""

VectorRows = list[tuple[str, bytes]]
"""(entry key, packed vector) in insertion order."""


@dataclass(frozen=True, slots=True)
class Graph:
    """Which of Redis's vector engines a new vector goes to, and its HNSW M and EF_CONSTRUCTION
    (they apply when the engine's index for the partition or tenant is created)."""

    engine: Literal["search", "vsets"]
    m: int
    ef_construction: int


@dataclass(slots=True)
class CacheEntry:
    """An answer to keep for `ttl_s`; with `partition` and `vector`, also findable by meaning.

    When the tenant holds more than `max_entries`, the least recently used ones go. With a
    `graph`, the vector goes to that Redis engine (FT.SEARCH or vector sets), else to the stream
    the in-process mirrors read.
    """

    tenant: str
    key: str
    value: bytes
    now: float
    ttl_s: float
    max_entries: int
    partition: str | None = None
    vector: bytes | None = None
    graph: Graph | None = None


@dataclass(frozen=True, slots=True)
class VectorHit:
    key: str
    similarity: float
    question: str


class VectorEngine(Protocol):
    """Redis's own vector search, every index in the tenant's hash tag: vector sets (one per
    partition, redis/cache_vset.py) or RediSearch (one index per tenant and dimension,
    redis/cache_ft.py)."""

    name: Literal["search", "vsets"]
    marker: str
    """What the entry's location records for a vector in this engine (cache_drop.lua)."""

    async def available(self) -> bool:
        """True where the server has this engine (asked once, then remembered)."""

    async def nearest(
        self, tenant: str, partition: str, query: bytes, *, count: int, ef: int
    ) -> list[VectorHit]:
        """Up to `count` hits for a float32 `query`, most similar first."""

    def add(
        self, tenant: str, partition: str, member: str, vector: bytes, question: str,
        *, graph: Graph, ttl_ms: int, keep_ms: int,
    ) -> None:  # fmt: skip
        """Queue a float32 vector for `member`, whose entry lives `ttl_ms`."""

    def remove(self, tenant: str, partition: str, key: str) -> None:
        """Drop a member whose entry is gone, in the background."""

    def pending(self) -> int:
        """Vectors queued for writing."""

    async def flush(self, *, hurry: bool = False) -> None:
        """Wait until every queued write has been sent (`hurry`: at full speed, unpaced)."""

    async def aclose(self) -> None:
        """Send what is queued (briefly), then stop writing."""


class CacheStore(Protocol):
    async def get(self, tenant: str, key: str, *, now: float) -> bytes | None:
        """The stored value (and mark it used at `now`), or None."""

    def put(self, entry: CacheEntry) -> Awaitable[None]:
        """Store the entry, evicting expired and least recently used ones beyond the limit.
        Sent when called, not when awaited (Redis sends the calls of one turn of the event loop
        together)."""

    async def vectors(self, tenant: str, partition: str, after: str) -> tuple[VectorRows, str]:
        """Up to VECTOR_PAGE of the partition's vectors added after `after`, and the new cursor."""

    def forget(self, tenant: str, key: str) -> Awaitable[None]:
        """Drop an entry and its vector (a lookup found it stale); sent when called."""

    def redis_engines(self) -> tuple[VectorEngine, ...]:
        """Redis's vector engines on the store's server, in `auto`'s order; none without one."""

    async def ping(self) -> None: ...

    async def aclose(self) -> None: ...
