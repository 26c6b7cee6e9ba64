"""The response cache's storage contract: answers by key with TTL and per-tenant LRU, and vectors.

Every method takes the tenant, and implementations keep each tenant's entries in its own
namespace (its own dict, its own Redis hash tag): no lookup can reach another tenant's data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["START", "VECTOR_PAGE", "CacheEntry", "CacheStore", "VectorRows"]

START = "0-0"
"""The cursor before a partition's first vector."""

VECTOR_PAGE = 2_000
"""At most this many vectors per `vectors()` call (about 1.6 MB); fewer means none are left."""

VectorRows = list[tuple[str, bytes]]
"""(entry key, packed vector) in insertion order."""


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """An answer to keep for `ttl_s`; with `partition` and `vector`, also findable by meaning.

    When the tenant holds more than `max_entries`, the least recently used ones go.
    """

    tenant: str
    key: str
    value: bytes
    now: float
    ttl_s: float
    max_entries: int
    partition: str | None = None
    vector: bytes | None = None


class CacheStore(Protocol):
    async def get(self, tenant: str, key: str, *, now: float) -> bytes | None:
        """The stored value (and mark it used at `now`), or None."""

    async def put(self, entry: CacheEntry) -> None:
        """Store the entry, evicting expired and least recently used ones beyond the limit."""

    async def vectors(self, tenant: str, partition: str, after: str) -> tuple[VectorRows, str]:
        """Up to VECTOR_PAGE of the partition's vectors added after `after`, and the new cursor."""

    async def forget(self, tenant: str, key: str) -> None:
        """Drop an entry and its vector (a lookup found it stale)."""

    async def ping(self) -> None: ...

    async def aclose(self) -> None: ...
