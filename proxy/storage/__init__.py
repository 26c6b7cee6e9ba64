"""Where shared state lives: one contract per concern, a memory and a Redis implementation."""

from proxy.storage.base import Counter, QuotaStore, Refusal, StorageError
from proxy.storage.limits import Admission, Bucket, BucketState, LimitStore, SlotPool
from proxy.storage.limits_memory import MemoryLimitStore
from proxy.storage.limits_redis import RedisLimitStore
from proxy.storage.memory import MemoryStore
from proxy.storage.redis import RedisStore

__all__ = [
    "Admission",
    "Bucket",
    "BucketState",
    "Counter",
    "LimitStore",
    "MemoryLimitStore",
    "MemoryStore",
    "QuotaStore",
    "RedisLimitStore",
    "RedisStore",
    "Refusal",
    "SlotPool",
    "StorageError",
    "open_limit_store",
    "open_store",
]

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_store(url: str) -> QuotaStore:
    """Quota counters on `memory` or `redis://host:port/db` (the policy's `storage:` key)."""
    if url == "memory":
        return MemoryStore()
    if url.startswith(_REDIS_SCHEMES):
        return RedisStore(url)
    raise ValueError(f"unknown storage {url!r}: use memory or redis://host:port/db")


def open_limit_store(url: str) -> LimitStore:
    """Rate-limit buckets and concurrency slots on the same storage as the quotas."""
    if url == "memory":
        return MemoryLimitStore()
    if url.startswith(_REDIS_SCHEMES):
        return RedisLimitStore(url)
    raise ValueError(f"unknown storage {url!r}: use memory or redis://host:port/db")
