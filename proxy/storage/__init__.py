"""Where shared state lives: one contract per concern (here), a memory and a Redis implementation
of each (memory/, redis/), and the facade the gateway opens once (`open_storage`)."""

from proxy.storage.base import (
    Counter,
    QuotaStore,
    Refusal,
    StorageError,
    StorageRefused,
    StorageTimeout,
    StorageUnreachable,
    StorageUnsent,
)
from proxy.storage.cache import CacheEntry, CacheStore
from proxy.storage.facade import RedisStorage, Storage, open_storage
from proxy.storage.limits import Admission, Bucket, BucketState, LimitStore, SlotPool
from proxy.storage.memory.cache import MemoryCacheStore
from proxy.storage.memory.limits import MemoryLimitStore
from proxy.storage.memory.quota import MemoryStore
from proxy.storage.redis.cache import RedisCacheStore
from proxy.storage.redis.limits import RedisLimitStore
from proxy.storage.redis.quota import RedisStore
from proxy.storage.redis.url import check_storage_url

__all__ = [
    "Admission",
    "Bucket",
    "BucketState",
    "CacheEntry",
    "CacheStore",
    "Counter",
    "LimitStore",
    "MemoryCacheStore",
    "MemoryLimitStore",
    "MemoryStore",
    "QuotaStore",
    "RedisCacheStore",
    "RedisLimitStore",
    "RedisStorage",
    "RedisStore",
    "Refusal",
    "SlotPool",
    "Storage",
    "StorageError",
    "StorageRefused",
    "StorageTimeout",
    "StorageUnreachable",
    "StorageUnsent",
    "open_cache_store",
    "open_limit_store",
    "open_storage",
    "open_store",
]


def open_store(url: str) -> QuotaStore:
    """Quota counters on `memory`, `redis://host:port/db`, a Sentinel-named primary
    (`redis+sentinel://host:port/service`) or a Redis Cluster (`redis+cluster://host:port,...`):
    the policy's `storage:` key."""
    return MemoryStore() if _is_memory(url) else RedisStore(url)


def open_limit_store(url: str) -> LimitStore:
    """Rate-limit buckets and concurrency slots on the same storage as the quotas."""
    return MemoryLimitStore() if _is_memory(url) else RedisLimitStore(url)


def open_cache_store(url: str) -> CacheStore:
    """The response cache on the same storage: in this process, or shared on Redis."""
    return MemoryCacheStore() if _is_memory(url) else RedisCacheStore(url)


def _is_memory(url: str) -> bool:
    return check_storage_url(url) == "memory"
