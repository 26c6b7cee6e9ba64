"""The response cache in this process: per-tenant ordered dicts, least recently used first."""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field

from proxy.storage.cache import VECTOR_PAGE, CacheEntry, VectorRows

__all__ = ["MemoryCacheStore"]


@dataclass(slots=True)
class _Stored:
    expires: float
    value: bytes
    partition: str | None
    vector_id: int
    stored: float  # when, by the caller's wall clock


@dataclass(slots=True)
class _Tenant:
    entries: OrderedDict[str, _Stored] = field(default_factory=OrderedDict)
    # Per partition, append-only (id, key, vector) rows; dropped entries are compacted away.
    partitions: dict[str, list[tuple[int, str, bytes]]] = field(default_factory=dict)
    # Per partition, its entries still held: a partition none is left in goes (each is mostly
    # a conversation's context: kept, they would pile up without bound).
    held: dict[str, int] = field(default_factory=dict)
    next_id: int = 1

    def drop(self, stored: _Stored | None) -> None:
        """`stored` left `entries`: its partition goes with its last entry."""
        partition = stored.partition if stored is not None and stored.vector_id else None
        if partition is None:
            return
        left = self.held.get(partition, 0) - 1
        if left > 0:
            self.held[partition] = left
        else:
            self.held.pop(partition, None)
            self.partitions.pop(partition, None)


class MemoryCacheStore:
    def __init__(self) -> None:
        self._tenants: dict[str, _Tenant] = {}

    async def get(self, tenant: str, key: str, *, now: float) -> bytes | None:
        space = self._tenants.get(tenant)
        found = space.entries.get(key) if space else None
        if space is None or found is None:
            return None
        # Stored after `now`: before the wall clock stepped back, by how long before is unknown.
        # It goes, or it would live a ttl plus the step (Redis expires it on its own clock).
        if found.expires <= now or found.stored > now:
            space.drop(space.entries.pop(key))
            return None
        space.entries.move_to_end(key)
        return found.value

    async def put(self, entry: CacheEntry) -> None:
        space = self._tenants.setdefault(entry.tenant, _Tenant())
        space.drop(space.entries.pop(entry.key, None))
        stored = _Stored(entry.now + entry.ttl_s, entry.value, entry.partition, 0, entry.now)
        if entry.partition is not None and entry.vector is not None:
            stored.vector_id = space.next_id
            space.next_id += 1
            space.held[entry.partition] = space.held.get(entry.partition, 0) + 1
            rows = space.partitions.setdefault(entry.partition, [])
            rows.append((stored.vector_id, entry.key, entry.vector))
            if len(rows) > 2 * entry.max_entries:
                rows[:] = [row for row in rows if self._live(space, row)]
        space.entries[entry.key] = stored
        while len(space.entries) > entry.max_entries:
            space.drop(space.entries.popitem(last=False)[1])

    async def vectors(self, tenant: str, partition: str, after: str) -> tuple[VectorRows, str]:
        space = self._tenants.get(tenant)
        rows = space.partitions.get(partition, []) if space else []
        seen = int(after.partition("-")[2])
        start = bisect.bisect_right(rows, seen, key=lambda row: row[0])
        page = rows[start : start + VECTOR_PAGE]
        if not page:
            return [], after
        return [(key, vector) for _, key, vector in page], f"0-{page[-1][0]}"

    async def forget(self, tenant: str, key: str) -> None:
        space = self._tenants.get(tenant)
        if space is not None:
            space.drop(space.entries.pop(key, None))

    def redis_engines(self) -> tuple[()]:
        return ()

    async def ping(self) -> None:
        return None

    async def aclose(self) -> None:
        self._tenants.clear()

    @staticmethod
    def _live(space: _Tenant, row: tuple[int, str, bytes]) -> bool:
        stored = space.entries.get(row[1])
        return stored is not None and stored.vector_id == row[0]
