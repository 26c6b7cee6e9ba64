"""The one way the stores and the ledger connect to Redis: a blocking pool with every I/O bounded
by a timeout, to one server or to the primary Redis Sentinel names (followed across failovers)."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

from proxy.storage.redisurl import SENTINEL_SCHEME, parse_sentinel_url

__all__ = ["connect"]


def connect(
    url: str, *, timeout_s: float, max_connections: int, decode_responses: bool = False
) -> aioredis.Redis:
    """A burst beyond `max_connections` waits up to `timeout_s` for a connection instead of
    failing (redis-py's default pool raises at its 100th concurrent command)."""
    if url.startswith(SENTINEL_SCHEME):
        return _primary(
            url, timeout_s=timeout_s, max_connections=max_connections, decode=decode_responses
        )
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout_s,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        decode_responses=decode_responses,
    )
    return aioredis.Redis.from_pool(pool)


class _PrimaryPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Connections to whichever server the sentinels call primary now: a new connection asks
    them, and one still open to a demoted or lost primary is dropped on its first error. Waits
    for a free connection as BlockingConnectionPool does; closes the sentinel clients with it."""

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            await self.sentinel_manager.aclose()


def _primary(url: str, *, timeout_s: float, max_connections: int, decode: bool) -> aioredis.Redis:
    target = parse_sentinel_url(url)
    timeouts = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=timeouts)  # type: ignore[no-untyped-call]
    client: aioredis.Redis = sentinel.master_for(
        target.service,
        connection_pool_class=_PrimaryPool,
        db=target.db,
        username=target.username,
        password=target.password,
        max_connections=max_connections,
        timeout=timeout_s,
        decode_responses=decode,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )
    return client
