"""Marks in Redis: one key each, set until a wall-clock time (`EXAT`, so nothing is swept) and
asked whether it is there; for what a process remembers by name alone (an ended session, whose a
stored object is). On the storage's one link (its connection, timeout and failover following)."""

from __future__ import annotations

from proxy.storage.redis.link import RedisLink

__all__ = ["RedisMarks"]


class RedisMarks:
    def __init__(self, link: RedisLink, what: str) -> None:
        self._link = link  # the storage's: it closes it
        self._what = what  # how a storage error names them

    async def mark(self, key: str, until_wall: float) -> None:
        await self._link.one("mark", (key,), (max(1, int(until_wall)),), what=self._what)

    async def marked(self, key: str) -> bool:
        return bool(await self._link.one("marked", (key,), (), what=self._what))
