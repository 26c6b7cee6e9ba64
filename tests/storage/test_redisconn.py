"""Connecting to Redis: an unreachable Redis Cluster is a StorageError like any Redis trouble; a
refused connection is StorageUnreachable (StorageUnsent: nothing of the call ran), a call with no
answer in time StorageTimeout."""

from __future__ import annotations

import time

import pytest
import redis

from proxy.storage import (
    Counter,
    RedisCacheStore,
    RedisLimitStore,
    RedisStorage,
    RedisStore,
    SlotPool,
    StorageError,
    StorageTimeout,
    StorageUnreachable,
    StorageUnsent,
)
from tests.redis_server import RedisProcess, frozen
from tests.servers import free_port
from tests.storage.test_resp import server

__all__ = ["server"]

pytestmark = pytest.mark.anyio

DAY = Counter("tw:{a}:q:tokens:d:20261129", limit=1000, expires_at=2_000_000_000)
POOL = SlotPool("tw:{a}:rl:slots", size=1)


async def test_an_unreachable_cluster_fails_each_call_at_once_as_a_storage_error() -> None:
    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    quotas, limits, cache = RedisStore(url), RedisLimitStore(url), RedisCacheStore(url)
    began = time.monotonic()
    try:
        with pytest.raises(StorageError, match="redis"):
            await quotas.ping()
        with pytest.raises(StorageError, match="redis"):
            await limits.release("tw:{a}", [], lease_id="l")
        with pytest.raises(StorageError, match="cache storage"):
            await cache.get("a", "k", now=0.0)
    finally:
        for store in (quotas, limits, cache):
            await store.aclose()
    assert time.monotonic() - began < 1  # refused connections, not timeouts


async def test_a_refused_connection_is_unreachable_storage_on_every_path() -> None:
    """And unsent: a quota booking it carried is booked again by the next one."""
    storage = RedisStorage(f"redis://127.0.0.1:{free_port()}/0", timeout_s=5.0)
    try:
        with pytest.raises(StorageUnsent, match="redis"):
            await storage.quotas.read([DAY])  # redis-py's client
        with pytest.raises(StorageUnsent, match="redis"):
            await storage.limits.release("tw:{a}", [POOL], lease_id="l")  # the link's script
        with pytest.raises(StorageUnsent, match="cache storage"):
            await storage.cache.get("a", "k", now=0.0)
    finally:
        await storage.aclose()


async def test_a_call_with_no_answer_in_time_is_a_storage_timeout(server: RedisProcess) -> None:
    storage = RedisStorage(server.url, timeout_s=0.3)
    try:
        await storage.quotas.ping()
        with frozen(server.url, 2):
            with pytest.raises(StorageTimeout, match="redis"):
                await storage.limits.release("tw:{a}", [POOL], lease_id="l")
            with pytest.raises(StorageTimeout, match="redis"):
                await storage.quotas.read([DAY])
    finally:
        await storage.aclose()


async def test_an_error_reply_is_neither_a_timeout_nor_unreachable(redis_url: str) -> None:
    storage = RedisStorage(redis_url, timeout_s=5.0)
    with redis.Redis.from_url(redis_url) as admin:
        admin.set(DAY.key, "not a hash")
    try:
        with pytest.raises(StorageError, match="WRONGTYPE") as raised:
            await storage.quotas.settle("tw:{a}", "l", [DAY], [1])
        assert not isinstance(raised.value, StorageTimeout | StorageUnreachable)
    finally:
        await storage.aclose()
