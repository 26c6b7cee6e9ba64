"""Vector search: the flat and HNSW indexes agree; the semantic index applies guards and cursors."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from proxy.cache import mirror
from proxy.cache.semantic import SemanticIndex
from proxy.cache.vectors import FlatIndex, HnswIndex, pack, unpack
from proxy.storage import CacheEntry, MemoryCacheStore
from proxy.storage.cache import VECTOR_PAGE

pytestmark = pytest.mark.anyio


def unit_rows(n: int, dim: int = 32, seed: int = 1) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def test_flat_and_hnsw_find_the_same_nearest_row() -> None:
    rows = unit_rows(2000)
    flat, hnsw = FlatIndex(32), HnswIndex(32, rows[:1000])
    flat.add(rows)
    hnsw.add(rows[1000:])
    queries = rows[::97] + 0.05 * unit_rows(len(rows[::97]), seed=2)
    agree = sum(flat.top(q, 1)[0][0] == hnsw.top(q, 1)[0][0] for q in queries)
    assert agree >= 0.95 * len(queries)
    row, similarity = flat.top(rows[5], 1)[0]
    assert row == 5
    assert similarity == pytest.approx(1.0, abs=1e-5)


def test_packed_vectors_keep_direction_and_question() -> None:
    vector = unit_rows(1)[0]
    back, question = unpack(pack(vector, "你好?"))
    assert question == "你好?"
    assert float(back @ vector) > 0.999


async def test_nearest_respects_threshold_guards_and_new_rows() -> None:
    store = MemoryCacheStore()
    index = SemanticIndex(store)
    rows = unit_rows(3)
    questions = ["flights in 2023", "cheap hotels", "museum hours"]
    for n, (row, question) in enumerate(zip(rows, questions, strict=True)):
        entry = CacheEntry("t", f"k{n}", b"v", 0.0, 60.0, 10, "p", pack(row, question))
        await store.put(entry)
    found = await index.nearest("t", "p", rows[1], "cheap hotels", 0.9)
    assert found is not None
    assert found.key == "k1"
    assert await index.nearest("t", "p", rows[0], "flights in 2024", 0.9) is None  # numbers
    assert await index.nearest("t", "q", rows[1], "cheap hotels", 0.9) is None  # partition
    assert await index.nearest("u", "p", rows[1], "cheap hotels", 0.9) is None  # tenant
    later = unit_rows(1, seed=9)[0]
    await store.put(CacheEntry("t", "k9", b"v", 0.0, 60.0, 10, "p", pack(later, "new one")))
    found = await index.nearest("t", "p", later, "new one", 0.9)
    assert found is not None
    assert found.key == "k9"


async def test_a_big_partition_loads_in_the_background_and_misses_meanwhile() -> None:
    store = MemoryCacheStore()
    rows = unit_rows(VECTOR_PAGE + 500)
    for n, row in enumerate(rows):
        await store.put(CacheEntry("t", f"k{n}", b"v", 0.0, 60.0, 10**6, "p", pack(row, "q")))
    index = SemanticIndex(store)
    assert await index.nearest("t", "p", rows[-1], "q", 0.9) is None  # still loading
    found = None
    for _ in range(500):
        await asyncio.sleep(0.01)
        found = await index.nearest("t", "p", rows[-1], "q", 0.9)
        if found is not None:
            break
    assert found is not None
    assert found.key == f"k{len(rows) - 1}"
    await index.aclose()


async def test_a_forgotten_entry_is_no_longer_offered() -> None:
    store = MemoryCacheStore()
    index = SemanticIndex(store)
    row = unit_rows(1)[0]
    await store.put(CacheEntry("t", "k", b"v", 0.0, 60.0, 10, "p", pack(row, "q")))
    assert await index.nearest("t", "p", row, "q", 0.9) is not None
    index.forget("t", "p", "k")
    index.forget("t", "p", "k")  # twice is harmless
    assert await index.nearest("t", "p", row, "q", 0.9) is None


async def test_only_the_most_recently_searched_partitions_are_mirrored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mirror, "_MAX_PARTITIONS", 3, raising=False)
    store = MemoryCacheStore()
    mirrors = mirror.Mirrors(store)
    rows = unit_rows(5)
    for n, row in enumerate(rows):
        await store.put(CacheEntry("t", f"k{n}", b"v", 0.0, 60.0, 10, f"p{n}", pack(row, "q")))
        assert [hit.key for hit in await mirrors.nearest("t", f"p{n}", row, count=1)] == [f"k{n}"]
    assert len(mirrors._partitions) == 3  # p2, p3, p4
    found = await mirrors.nearest("t", "p0", rows[0], count=1)  # read from the store again
    assert [hit.key for hit in found] == ["k0"]
