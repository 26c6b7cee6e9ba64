"""Ended dashboard sessions: a logged-out cookie's id, kept until the cookie would expire anyway,
in this process's memory or in Redis (so a logout on one replica holds on every replica).
Either holds one entry per logout within a cookie's lifetime, no more."""

from __future__ import annotations

import heapq
from typing import Protocol

from proxy.storage.facade import Storage
from proxy.storage.redis.link import RedisLink
from proxy.storage.redis.marks import RedisMarks

__all__ = ["EndedSessions", "MemoryEndedSessions", "RedisEndedSessions", "open_ended_sessions"]


class EndedSessions(Protocol):
    async def end(self, session_id: bytes, until_wall: float, now_wall: float) -> None:
        """Refuse `session_id` from now (`now_wall`) until `until_wall` (its cookie's own
        expiry)."""

    async def ended(self, session_id: bytes, now_wall: float) -> bool: ...

    async def aclose(self) -> None: ...


class MemoryEndedSessions:
    """Each logout forgets the ended sessions whose cookies have expired since: an expired
    cookie is refused before it is looked up here, so no lookup would ever find them."""

    def __init__(self) -> None:
        self._until: dict[bytes, float] = {}
        self._expiring: list[tuple[float, bytes]] = []  # a heap: the soonest expiry first

    def __len__(self) -> int:
        return len(self._until)

    async def end(self, session_id: bytes, until_wall: float, now_wall: float) -> None:
        expiring = self._expiring
        while expiring and expiring[0][0] <= now_wall:
            until, gone = heapq.heappop(expiring)
            if self._until.get(gone) == until:
                del self._until[gone]
        if until_wall > now_wall and self._until.get(session_id) != until_wall:
            self._until[session_id] = until_wall
            heapq.heappush(expiring, (until_wall, session_id))

    async def ended(self, session_id: bytes, now_wall: float) -> bool:
        until = self._until.get(session_id)
        return until is not None and until > now_wall

    async def aclose(self) -> None:
        return None


class RedisEndedSessions:
    """One key per ended session, expiring with the cookie: nothing to sweep. On the storage's
    link, which the storage closes."""

    def __init__(self, link: RedisLink) -> None:
        self._marks = RedisMarks(link, "session storage")

    async def end(self, session_id: bytes, until_wall: float, now_wall: float) -> None:
        await self._marks.mark(_key(session_id), until_wall + 1)

    async def ended(self, session_id: bytes, now_wall: float) -> bool:
        return await self._marks.marked(_key(session_id))

    async def aclose(self) -> None:
        return None


def open_ended_sessions(storage: Storage) -> EndedSessions:
    """On `storage`'s Redis link (every replica's), or in this process's memory."""
    return MemoryEndedSessions() if storage.link is None else RedisEndedSessions(storage.link)


def _key(session_id: bytes) -> str:
    return "tw:{sessions}:ended:" + session_id.hex()
