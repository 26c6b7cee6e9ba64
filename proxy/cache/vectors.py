"""Nearest-question search over one partition's vectors: exact (numpy) when small, HNSW when large.

Vectors are unit length, so the dot product is the cosine similarity. Both indexes answer the
same `add`/`top` calls; a partition moves from the flat one to HNSW past FLAT_MAX rows.
"""

from __future__ import annotations

import struct
from typing import Protocol

# numpy is imported at their top only by the semantic cache's own modules (this one, mirror.py,
# embed_local.py), which load when the semantic cache is on or first makes a vector: a gateway
# without it never loads numpy (about 15 MB of RSS).
import numpy as np
import numpy.typing as npt

__all__ = ["FLAT_MAX", "FlatIndex", "HnswIndex", "VectorIndex", "pack", "unpack"]

Vector = npt.NDArray[np.float32]
FLAT_MAX = 20_000
"""Up to this many rows a brute-force scan takes about a millisecond; beyond, HNSW is used."""


def pack(vector: Vector, question: str) -> bytes:
    """A stored vector: its dimension, float16 values, then the question it embeds (UTF-8)."""
    header = struct.pack("<H", vector.shape[0])
    return header + vector.astype(np.float16).tobytes() + question.encode()


def unpack(raw: bytes) -> tuple[Vector, str]:
    (dim,) = struct.unpack_from("<H", raw)
    end = 2 + 2 * dim
    vector = np.frombuffer(raw, dtype=np.float16, count=dim, offset=2).astype(np.float32)
    norm = float(np.linalg.norm(vector))
    return (vector / norm if norm else vector), raw[end:].decode()


class VectorIndex(Protocol):
    def __len__(self) -> int: ...

    def add(self, vectors: Vector) -> None:
        """Append rows; row numbers continue from len(self)."""

    def top(self, query: Vector, k: int) -> list[tuple[int, float]]:
        """Up to `k` (row, similarity) pairs, most similar first."""


class FlatIndex:
    """Rows in one float32 matrix that doubles when full: adds are amortised O(row). It starts
    with room for one: most partitions (a conversation's context each) hold a vector or two,
    and room for 64 made each cost 64 vectors' memory under a bound that counts rows."""

    def __init__(self, dim: int) -> None:
        self._rows: Vector = np.zeros((1, dim), dtype=np.float32)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    @property
    def matrix(self) -> Vector:
        return self._rows[: self._n]

    def add(self, vectors: Vector) -> None:
        needed = self._n + len(vectors)
        if needed > len(self._rows):
            grown = np.zeros((max(needed, 2 * len(self._rows)), self._rows.shape[1]), np.float32)
            grown[: self._n] = self._rows[: self._n]
            self._rows = grown
        self._rows[self._n : needed] = vectors
        self._n = needed

    def top(self, query: Vector, k: int) -> list[tuple[int, float]]:
        if not self._n:
            return []
        scores = self._rows[: self._n] @ query
        k = min(k, self._n)
        best = np.argpartition(-scores, k - 1)[:k]
        best = best[np.argsort(-scores[best])]
        return [(int(row), float(scores[row])) for row in best]


class HnswIndex:
    """usearch's HNSW graph with float16 storage: approximate, ~1 ms at 100k rows on one core."""

    def __init__(self, dim: int, initial: Vector) -> None:
        from usearch.index import Index

        # expansion_add 64 (default 128) halves the build time for about the same recall;
        # expansion_search 128 (default 64) lifts recall@4 on random 384-d vectors at 30k rows
        # from 0.988 to 0.998 for +0.8 ms (benchmarks/cache_speed.py has the figures at 100k).
        self._index = Index(
            ndim=dim, metric="ip", dtype="f16", expansion_add=64, expansion_search=128
        )
        self._n = 0
        self.add(initial)

    def __len__(self) -> int:
        return self._n

    def add(self, vectors: Vector) -> None:
        if not len(vectors):
            return
        keys = np.arange(self._n, self._n + len(vectors), dtype=np.uint64)
        # A bulk load (a partition's first sync, in a worker thread) may use every core.
        self._index.add(keys, vectors, threads=0 if len(vectors) > 1000 else 1)
        self._n += len(vectors)

    def top(self, query: Vector, k: int) -> list[tuple[int, float]]:
        if not self._n:
            return []
        found = self._index.search(query, min(k, self._n))
        # usearch's "ip" distance is 1 - dot product
        pairs = zip(found.keys, found.distances, strict=True)
        return [(int(key), 1.0 - float(distance)) for key, distance in pairs]
