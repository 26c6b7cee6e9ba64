"""Connecting to Redis: an unreachable Redis Cluster is a StorageError like any Redis trouble."""

from __future__ import annotations

import time

import pytest

from proxy.storage import RedisCacheStore, RedisLimitStore, RedisStore, StorageError
from tests.servers import free_port

pytestmark = pytest.mark.anyio


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
