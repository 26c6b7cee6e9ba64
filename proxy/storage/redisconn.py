"""The one way the stores connect to Redis: a blocking pool with every I/O bounded by a timeout."""

from __future__ import annotations

import redis.asyncio as aioredis

__all__ = ["connect"]


def connect(url: str, *, timeout_s: float, max_connections: int) -> aioredis.Redis:
    """A burst beyond `max_connections` waits up to `timeout_s` for a connection instead of
    failing (redis-py's default pool raises at its 100th concurrent command)."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout_s,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )
    return aioredis.Redis.from_pool(pool)
