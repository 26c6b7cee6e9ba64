"""What the cache stage leaves for its settle on a miss: the key, and the question's vector."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from proxy.cache.fold import StreamFold
from proxy.cache.key import CacheKey

if TYPE_CHECKING:
    from proxy.cache.vectors import Vector

__all__ = ["CachePlan"]


@dataclass(slots=True)
class CachePlan:
    """A cache miss that may be stored once the backend's answer is complete."""

    key: CacheKey
    partition: str | None = None
    vector: Vector | None = None
    fold: StreamFold | None = None  # a stream's answer, folded in as its chunks pass
    # What the request asked for when it was looked up: an answer from another model, or held
    # to a shorter bound (a degradation rule, a fallback), is not stored under its key.
    asked: tuple[str, int | None] = ("", None)
