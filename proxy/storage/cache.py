"""The response cache's storage contract: answers by key with TTL and per-tenant LRU, and vectors.

Every method takes the tenant, and implementations keep each tenant's entries in its own
namespace (its own dict, its own Redis hash tag): no lookup can reach another tenant's data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "START",
    "VECTOR_PAGE",
    "CacheEntry",
    "CacheStore",
    "VectorHit",
    "VectorRows",
    "VectorSet",
]

START = "0-0"
"""The cursor before a partition's first vector."""

VECTOR_PAGE = 2_000
"""At most this many vectors per `vectors()` call (about 1.6 MB); fewer means none are left."""

VectorRows = list[tuple[str, bytes]]
"""(entry key, packed vector) in insertion order."""


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """An answer to keep for `ttl_s`; with `partition` and `vector`, also findable by meaning.

    When the tenant holds more than `max_entries`, the least recently used ones go. With
    `vector_set` (HNSW M, EF_CONSTRUCTION) the vector goes to the partition's Redis vector set,
    else to the stream the in-process mirrors read.
    """

    tenant: str
    key: str
    value: bytes
    now: float
    ttl_s: float
    max_entries: int
    partition: str | None = None
    vector: bytes | None = None
    vector_set: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class VectorHit:
    key: str
    similarity: float
    question: str


class VectorSet(Protocol):
    """Redis's own vector search, one vector set per partition in the tenant's hash tag."""

    async def available(self) -> bool:
        """True where the server has vector sets (asked once, then remembered)."""

    async def nearest(
        self, tenant: str, partition: str, query: bytes, *, count: int, ef: int
    ) -> list[VectorHit]:
        """Up to `count` hits for a float32 `query`, most similar first."""

    def remove(self, tenant: str, partition: str, key: str) -> None:
        """Drop a member whose entry is gone, in the background."""

    def pending(self) -> int:
        """Vectors queued for writing."""


class CacheStore(Protocol):
    async def get(self, tenant: str, key: str, *, now: float) -> bytes | None:
        """The stored value (and mark it used at `now`), or None."""

    async def put(self, entry: CacheEntry) -> None:
        """Store the entry, evicting expired and least recently used ones beyond the limit."""

    async def vectors(self, tenant: str, partition: str, after: str) -> tuple[VectorRows, str]:
        """Up to VECTOR_PAGE of the partition's vectors added after `after`, and the new cursor."""

    async def forget(self, tenant: str, key: str) -> None:
        """Drop an entry and its vector (a lookup found it stale)."""

    def vector_set(self) -> VectorSet | None:
        """Redis's vector search on the store's server; None where there is no server."""

    async def ping(self) -> None: ...

    async def aclose(self) -> None: ...
