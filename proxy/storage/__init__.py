"""Where shared state lives: one contract, a memory and a Redis implementation."""

from proxy.storage.base import Counter, QuotaStore, Refusal, StorageError
from proxy.storage.memory import MemoryStore
from proxy.storage.redis import RedisStore

__all__ = [
    "Counter",
    "MemoryStore",
    "QuotaStore",
    "RedisStore",
    "Refusal",
    "StorageError",
    "open_store",
]


def open_store(url: str) -> QuotaStore:
    """`memory` or `redis://host:port/db` (as the policy's `storage:` key says)."""
    if url == "memory":
        return MemoryStore()
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(url)
    raise ValueError(f"unknown storage {url!r}: use memory or redis://host:port/db")
