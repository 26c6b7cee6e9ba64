"""Marks in Redis: one key each, set until a wall-clock time (`EXAT`, so nothing is swept) and
asked whether it is there; for what a process remembers by name alone (an ended session, whose a
stored object is)."""

from __future__ import annotations

from proxy.storage.redis.conn import connect, translated

__all__ = ["RedisMarks"]


class RedisMarks:
    def __init__(self, url: str, what: str, *, timeout_s: float, max_connections: int) -> None:
        self._client = connect(url, timeout_s=timeout_s, max_connections=max_connections)
        self._what = what  # how a storage error names them

    async def mark(self, key: str, until_wall: float) -> None:
        with translated(self._what):
            await self._client.set(key, b"1", exat=max(1, int(until_wall)))

    async def marked(self, key: str) -> bool:
        with translated(self._what):
            return bool(await self._client.exists(key))

    async def aclose(self) -> None:
        await self._client.aclose()
