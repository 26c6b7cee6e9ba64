"""What the cache stage hands to the answer path on a miss: the key, the vector, and a byte tap."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.cache.key import CacheKey
from proxy.cache.vectors import Vector

__all__ = ["CachePlan", "Capture"]


class Capture:
    """Keeps the bytes relayed to the client, up to `limit`; past it, keeps nothing at all."""

    __slots__ = ("_limit", "_size", "chunks")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._size = 0
        self.chunks: list[bytes] | None = []

    def add(self, data: bytes) -> None:
        if self.chunks is None:
            return
        self._size += len(data)
        if self._size > self._limit:
            self.chunks = None  # too big to keep: the answer will not be stored
        else:
            self.chunks.append(data)

    def take(self) -> bytes | None:
        chunks, self.chunks = self.chunks, None
        return None if chunks is None else b"".join(chunks)


@dataclass(slots=True)
class CachePlan:
    """A cache miss that may be stored once the backend's answer is complete."""

    key: CacheKey
    capture: Capture
    partition: str | None = None
    vector: Vector | None = None
