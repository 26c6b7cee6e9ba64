"""Ended dashboard sessions: a logged-out cookie's id, kept until the cookie would expire anyway,
in this process's memory or in Redis (so a logout on one replica holds on every replica)."""

from __future__ import annotations

from typing import Protocol

from proxy.storage.redis.conn import connect, translated
from proxy.storage.redis.url import check_storage_url

__all__ = ["EndedSessions", "MemoryEndedSessions", "RedisEndedSessions", "open_ended_sessions"]


class EndedSessions(Protocol):
    async def end(self, session_id: bytes, until_wall: float) -> None:
        """Refuse `session_id` from now until `until_wall` (its cookie's own expiry)."""

    async def ended(self, session_id: bytes, now_wall: float) -> bool: ...

    async def aclose(self) -> None: ...


class MemoryEndedSessions:
    def __init__(self) -> None:
        self._until: dict[bytes, float] = {}

    async def end(self, session_id: bytes, until_wall: float) -> None:
        self._until[session_id] = until_wall

    async def ended(self, session_id: bytes, now_wall: float) -> bool:
        # Expired entries go as they are found: a cookie past its expiry is refused anyway.
        until = self._until.get(session_id)
        if until is not None and until <= now_wall:
            del self._until[session_id]
            return False
        return until is not None

    async def aclose(self) -> None:
        return None


class RedisEndedSessions:
    """One key per ended session, expiring with the cookie (`EXAT`): nothing to sweep."""

    def __init__(self, url: str, *, timeout_s: float = 1.0) -> None:
        self._client = connect(url, timeout_s=timeout_s, max_connections=4)

    async def end(self, session_id: bytes, until_wall: float) -> None:
        with translated("session storage"):
            await self._client.set(_key(session_id), b"1", exat=max(1, int(until_wall) + 1))

    async def ended(self, session_id: bytes, now_wall: float) -> bool:
        with translated("session storage"):
            return bool(await self._client.exists(_key(session_id)))

    async def aclose(self) -> None:
        await self._client.aclose()


def open_ended_sessions(url: str) -> EndedSessions:
    if check_storage_url(url) == "memory":
        return MemoryEndedSessions()
    return RedisEndedSessions(url)


def _key(session_id: bytes) -> str:
    return "tw:{sessions}:ended:" + session_id.hex()
