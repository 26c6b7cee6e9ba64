"""The in-process vector search: a mirror per partition of the vectors the store holds.

Each process brings a partition's mirror up to date from the store's cursor before every search.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import anyio.to_thread
import numpy as np

from proxy.cache.vectors import FLAT_MAX, FlatIndex, HnswIndex, Vector, VectorIndex, unpack
from proxy.storage.base import StorageError
from proxy.storage.cache import START, VECTOR_PAGE, CacheStore, VectorHit
from proxy.together import cancelled

__all__ = ["Mirrors"]

_log = logging.getLogger("tokenweir.cache")
# Rows decoded on the event loop per sync; a bigger catch-up runs in a worker thread.
_INLINE_ROWS = 256
# Partitions are mostly a conversation's context each, with a vector or two, and each mirror
# costs a few KB beside them: a row bound alone let a tenant's conversations fill the memory.
_MAX_PARTITIONS = 10_000
# A partition's mirror is read again once it holds twice its first rows and this many more.
_RELOAD_SLACK = 256


@dataclass(slots=True)
class _Partition:
    cursor: str = START
    index: VectorIndex | None = None
    dim: int = 0  # the index's; rows and queries of another (an embedder that changed) are skipped
    base: int | None = None  # rows when it first caught up with the store
    keys: list[str | None] = field(default_factory=list)
    questions: list[str] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Mirrors:
    """Mirrors are kept for the most recently searched partitions, up to `max_rows` in all and
    _MAX_PARTITIONS of them."""

    def __init__(self, store: CacheStore, *, max_rows: int = 1_000_000) -> None:
        self._store = store
        self._max_rows = max_rows
        self._partitions: OrderedDict[tuple[str, str], _Partition] = OrderedDict()
        self._loading: set[asyncio.Task[None]] = set()

    async def nearest(
        self, tenant: str, partition: str, query: Vector, *, count: int
    ) -> list[VectorHit]:
        """Up to `count` hits, most similar first; none while the partition is still loading
        (another request is catching it up, or it is big and loads in the background)."""
        mirror = self._mirror(tenant, partition)
        if mirror.lock.locked():
            return []
        async with mirror.lock:
            caught_up = await self._catch_up(tenant, partition, mirror, pages=1)
        if not caught_up:
            task = asyncio.create_task(self._load(tenant, partition, mirror))
            self._loading.add(task)
            task.add_done_callback(self._loading.discard)
            return []
        if mirror.base is None:
            mirror.base = len(mirror.keys)
        elif len(mirror.keys) > 2 * mirror.base + _RELOAD_SLACK:
            # The rows of entries since evicted or expired stay in a mirror: once it has doubled
            # it is read again from the store, which keeps only live ones (amortised O(1) a row).
            self._partitions[(tenant, partition)] = _Partition()
        if mirror.index is None or query.shape[0] != mirror.dim:
            return []
        return [
            VectorHit(key, similarity, mirror.questions[row])
            for row, similarity in mirror.index.top(query, count)
            if (key := mirror.keys[row]) is not None
        ]

    def forget(self, tenant: str, partition: str, key: str) -> None:
        """Stop offering `key` (its answer is gone from the store)."""
        mirror = self._partitions.get((tenant, partition))
        if mirror is None:
            return
        with contextlib.suppress(ValueError):  # already forgotten
            mirror.keys[mirror.keys.index(key)] = None

    def _mirror(self, tenant: str, partition: str) -> _Partition:
        name = (tenant, partition)
        mirror = self._partitions.get(name)
        if mirror is None:
            mirror = self._partitions[name] = _Partition()
            self._trim()
        self._partitions.move_to_end(name)
        return mirror

    def _trim(self) -> None:
        partitions = self._partitions
        rows = sum(len(p.keys) for p in partitions.values())
        while len(partitions) > 1 and (rows > self._max_rows or len(partitions) > _MAX_PARTITIONS):
            _, oldest = partitions.popitem(last=False)
            rows -= len(oldest.keys)

    async def aclose(self) -> None:
        await cancelled(list(self._loading))

    async def _load(self, tenant: str, partition: str, mirror: _Partition) -> None:
        try:
            async with mirror.lock:
                await self._catch_up(tenant, partition, mirror, pages=None)
        except StorageError as exc:
            _log.warning("could not load a semantic cache partition: %s", exc)

    async def _catch_up(
        self, tenant: str, partition: str, mirror: _Partition, *, pages: int | None
    ) -> bool:
        """Read up to `pages` pages of vectors added since the mirror's cursor (None: all).

        True when the mirror has caught up with the store."""
        read = 0
        while pages is None or read < pages:
            rows, cursor = await self._store.vectors(tenant, partition, mirror.cursor)
            read += 1
            await self._extend(mirror, rows)
            mirror.cursor = cursor
            if len(rows) < VECTOR_PAGE:
                return True
        return False

    @staticmethod
    async def _extend(mirror: _Partition, rows: list[tuple[str, bytes]]) -> None:
        if not rows:
            return
        crosses = len(mirror.keys) <= FLAT_MAX < len(mirror.keys) + len(rows)
        if len(rows) > _INLINE_ROWS or crosses:
            await anyio.to_thread.run_sync(_extend, mirror, rows)
        else:
            _extend(mirror, rows)


def _extend(mirror: _Partition, rows: list[tuple[str, bytes]]) -> None:
    decoded = [(key, *unpack(raw)) for key, raw in rows]
    if not mirror.dim:
        mirror.dim = decoded[0][1].shape[0]
    kept = [row for row in decoded if row[1].shape[0] == mirror.dim]
    if not kept:
        return
    vectors = np.stack([vector for _, vector, _ in kept])
    if mirror.index is None:
        mirror.index = FlatIndex(mirror.dim)
    if isinstance(mirror.index, FlatIndex) and len(mirror.index) + len(vectors) > FLAT_MAX:
        mirror.index = HnswIndex(mirror.dim, mirror.index.matrix)
    mirror.index.add(vectors)
    mirror.keys.extend(key for key, _, _ in kept)
    mirror.questions.extend(question for _, _, question in kept)
